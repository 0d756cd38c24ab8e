"""The embedding tables stage: frozen image and text embeddings of one split, row-aligned and keyed
like the shard manifest, with the contract of :mod:`repsim.stage`.

Output (``$REPSIM_HOME/artifacts/embedding_tables/<key>/`` unless given), besides ``stage.json``:
``image.npy`` (N, D_a) float32, ``text.npy`` (N, D_b) float32 unit rows, and ``rows.parquet``
(index, key, label, caption) aligned with them, in manifest order, plus ``classes.json``.

Image side (``image.type``): ``encoder`` or ``pixels`` reuse the cached features stage
(:func:`repsim.eval.stages.extract_features`); ``table`` reads a user's Parquet (``key``,
``embedding``) or ``.npy`` (row i = manifest index i). Text side: captions embedded by a frozen
sentence-transformer; for labelled data each sample's caption is drawn, seeded by manifest index,
from its class's captions (:func:`class_captions`), so the text space is not C identical points.
The key covers the shard key, the image source's key (features stage key or file digest), the
split, the caption recipe and the text model's identity.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from repsim.align.config import AlignText, ImageSource, TableImages
from repsim.data.sharding import ShardResult
from repsim.data.spec import DataSpec
from repsim.errors import DataError, EvalError, SpecError
from repsim.eval.stages import CLASSES_FILE, extract_features, features_stage_of, load_features, split_rows
from repsim.methods.stage import file_digest
from repsim.similarity.captions import embed_captions
from repsim.similarity.stages import text_model_identity
from repsim.similarity.wordnet import lookup
from repsim.stage import Stage, StageOutput, completed_output, run_stage

STAGE_VERSION = "2"  # 2: the hypernym caption uses the first hypernym by name
IMAGE_FILE = "image.npy"
TEXT_FILE = "text.npy"
ROWS_FILE = "rows.parquet"


@dataclass(frozen=True)
class EmbeddingTables:
    """One split's tables: ``image`` (N, D_a) and ``text`` (N, D_b) float32, and per row its manifest
    ``index``, ``key``, ``label`` (-1 when unlabelled) and ``caption``; ``class_names`` in label order."""

    image: np.ndarray
    text: np.ndarray
    indices: np.ndarray
    keys: list[str]
    labels: np.ndarray
    captions: list[str]
    class_names: list[str]
    key: str

    def take(self, rows: np.ndarray) -> EmbeddingTables:
        """The tables of ``rows`` (int positions), in that order, under the same key."""
        return replace(self, image=self.image[rows], text=self.text[rows], indices=self.indices[rows],
                       keys=[self.keys[row] for row in rows], labels=self.labels[rows],
                       captions=[self.captions[row] for row in rows])


def hold_out(tables: EmbeddingTables, fraction: float, seed: int = 0) -> tuple[EmbeddingTables, EmbeddingTables]:
    """(kept, held out): a seeded random ``fraction`` of the rows held out, both in table order."""
    order = np.random.default_rng(seed).permutation(len(tables.indices))
    held = round(fraction * len(order))
    if not 0 < held < len(order):
        raise SpecError(f"data.holdout {fraction} of {len(order)} samples leaves an empty side",
                        "choose a fraction that keeps samples on both sides")
    return tables.take(np.sort(order[held:])), tables.take(np.sort(order[:held]))


def embedding_tables(shards: ShardResult, spec: DataSpec, image: ImageSource, text: AlignText, split: str,
                     device: str | torch.device | None = None, out_dir: str | Path | None = None,
                     progress: bool = True) -> StageOutput:
    """The image and text embeddings of ``split``, or the cached output at once."""
    features = None
    if image.type != "table":
        features = extract_features(shards, _encoder(image), split, image.batch_size, device, progress=progress)
    stage = embedding_tables_stage_of(shards, image, text, split, device)
    return run_stage(stage, lambda tmp: _write(shards, spec, image, text, split, features, device, progress, tmp),
                     out_dir)


def embedding_tables_stage_of(shards: ShardResult, image: ImageSource, text: AlignText, split: str,
                              device: str | torch.device | None = None) -> Stage:
    """The tables stage, keyed by the shard key, the image source's key, the split and the text recipe."""
    config = {"split": split, "image": image.model_dump(mode="json", exclude={"path", "batch_size"}),
              "text": text.model_dump(mode="json", exclude={"model"}) | {"model": text_model_identity(text.model)}}
    return Stage("embedding_tables", STAGE_VERSION, config,
                 inputs={"shards": shards.key, "image": _image_key(shards, image, split, device)})


def _encoder(image: ImageSource) -> str:
    return "pixels" if image.type == "pixels" else str(image.path)


def _image_key(shards: ShardResult, image: ImageSource, split: str, device: str | torch.device | None) -> str:
    if image.type == "table":
        return file_digest(image.path, "image.path")
    return features_stage_of(shards, _encoder(image), split, device).key


def load_tables(tables: StageOutput | str | Path) -> EmbeddingTables:
    """Read an embedding tables output (a StageOutput or its directory)."""
    path, record = completed_output(tables, "embedding_tables", DataError, "embedding tables",
                                    "run the embedding tables stage first")
    rows = pq.read_table(path / ROWS_FILE)
    classes = json.loads((path / CLASSES_FILE).read_text())
    return EmbeddingTables(np.load(path / IMAGE_FILE), np.load(path / TEXT_FILE), rows["index"].to_numpy(),
                           rows["key"].to_pylist(), rows["label"].to_numpy(), rows["caption"].to_pylist(),
                           [entry["name"] for entry in classes], record["key"])


# ---------------------------------------------------------------------------------------------
# Building

def _write(shards: ShardResult, spec: DataSpec, image: ImageSource, text: AlignText, split: str,
           features: StageOutput | None, device: str | torch.device | None, progress: bool,
           out: Path) -> dict[str, float]:
    rows = split_rows(shards.manifest, split, ["key", "caption"])
    if not len(rows):
        raise SpecError(f"the shards at {shards.path} hold no {split!r} samples", "choose a split the data spec has")
    indices = rows["index"].to_numpy()
    image_embeddings = (_user_table(image, rows) if features is None
                        else np.asarray(load_features(features).features, dtype=np.float32))
    _check_finite(image_embeddings, "image embeddings")
    captions = sample_captions(spec, text, indices, rows["label"].to_numpy(), rows["caption"].to_pylist())
    text_embeddings = embed_captions(captions, model=text.model, device=None if device is None else str(device),
                                     progress=progress)
    np.save(out / IMAGE_FILE, image_embeddings)
    np.save(out / TEXT_FILE, text_embeddings)
    table = pa.table({"index": indices, "key": rows["key"], "label": rows["label"], "caption": captions})
    pq.write_table(table, out / ROWS_FILE)
    classes = [{"name": name, "synset": synset} for name, synset in (spec.classes or {}).items()]
    (out / CLASSES_FILE).write_text(json.dumps(classes, indent=2))
    return {"samples": len(indices), "image_dim": image_embeddings.shape[1], "text_dim": text_embeddings.shape[1],
            "distinct_captions": len(set(captions))}


def _user_table(image: TableImages, rows: pa.Table) -> np.ndarray:
    """The user's embeddings of ``rows``, by manifest key (Parquet) or manifest index (``.npy``)."""
    path = image.path
    if path.suffix == ".npy":
        embeddings = np.load(path, mmap_mode="r")
        indices = rows["index"].to_numpy()
        if embeddings.ndim != 2 or len(embeddings) <= indices.max():
            raise DataError(f"{path} holds an array of shape {embeddings.shape}, but manifest index "
                            f"{indices.max()} needs row {indices.max()}", "save one row per manifest index, (N, D)")
        return np.asarray(embeddings[indices], dtype=np.float32)
    if path.suffix != ".parquet":
        raise SpecError(f"image.path {path} is neither .parquet nor .npy", "save the embeddings as one of those")
    table = pq.read_table(path, columns=["key", "embedding"])
    position = {key: row for row, key in enumerate(table["key"].to_pylist())}
    missing = [key for key in rows["key"].to_pylist() if key not in position]
    if missing:
        raise DataError(f"{path} has no embedding for {len(missing)} manifest keys (first: {missing[0]!r})",
                        "give every sample of the split a row keyed like the manifest")
    wanted = [position[key] for key in rows["key"].to_pylist()]
    return np.asarray(table["embedding"].to_pylist(), dtype=np.float32)[wanted]


def _check_finite(embeddings: np.ndarray, name: str) -> None:
    bad = np.flatnonzero(~np.isfinite(embeddings).all(axis=1))
    if len(bad):
        raise EvalError(f"{name} hold NaN or infinite values in {len(bad)} rows (first: row {bad[0]})",
                        "repair or drop those samples before aligning")


# ---------------------------------------------------------------------------------------------
# Captions

def class_captions(name: str, synset: str, templates: tuple[str, ...], lemmas: bool = True, gloss: bool = True,
                   hypernym: bool = True) -> list[str]:
    """The distinct captions of one class: each template with the class name and, if asked, each
    lemma of its synset; then each template with the name followed by the synset's gloss and by
    "a kind of <first hypernym lemma>", hypernyms ordered by name (NLTK's order varies between runs)."""
    entry = lookup(synset)
    names = [name] + ([lemma.replace("_", " ") for lemma in entry.lemma_names()] if lemmas else [])
    names = list(dict.fromkeys(names))
    captions = [template.format(name=label) for template in templates for label in names]
    suffixes = ([entry.definition()] if gloss else []) + (
        [f"a kind of {parent.lemma_names()[0].replace('_', ' ')}"
         for parent in sorted(entry.hypernyms(), key=lambda parent: parent.name())[:1]] if hypernym else [])
    captions += [f"{template.format(name=name).rstrip('.')}, {suffix}." for template in templates for suffix in suffixes]
    return list(dict.fromkeys(captions))


def sample_captions(spec: DataSpec, text: AlignText, indices: np.ndarray, labels: np.ndarray,
                    manifest_captions: list[str]) -> list[str]:
    """One caption per row: its manifest caption (``source: manifest``), or one of its class's
    captions drawn with ``default_rng(text.seed)`` at its manifest index (the same on every split)."""
    if text.source == "manifest":
        return manifest_captions
    if spec.classes is None or (labels < 0).any():
        raise SpecError("text.source is 'classes' but the data has no class for every sample",
                        "set text.source=manifest to embed the samples' own captions")
    templates = text.templates or spec.captions.templates
    per_class = [class_captions(name, synset, templates, text.lemmas, text.gloss, text.hypernym)
                 for name, synset in spec.classes.items()]
    draws = np.random.default_rng(text.seed).random(int(indices.max()) + 1)[indices]
    return [per_class[label][int(draw * len(per_class[label]))] for label, draw in zip(labels, draws)]


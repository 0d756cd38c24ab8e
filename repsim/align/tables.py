"""The cached embedding tables stage: one split's frozen image and text embeddings in manifest order,
``image.npy`` (N, D_a) and ``text.npy`` (N, D_b) float32 (memory-mapped), ``rows.parquet`` (index, key,
label, caption) and ``classes.json``. Images come from the features stage or a user's table; captions,
drawn from each sample's class captions (:func:`class_captions`) when labelled, from a sentence-transformer.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import torch

from repsim.align.config import AlignText, ImageSource, TableImages
from repsim.data.stage import ShardResult
from repsim.data.spec import DataSpec
from repsim.errors import DataError, EvalError, SpecError
from repsim.eval.stage import CLASSES_FILE, extract_features, features_stage_of, load_features, split_rows
from repsim.methods.stage import file_digest
from repsim.similarity.captions import embed_captions, load_text_model
from repsim.similarity.stage import text_model_identity
from repsim.similarity.wordnet import lookup
from repsim.stage import SERVE_COMPLETE, Reuse, Stage, StageOutput, completed_output, run_stage

STAGE_VERSION = "2"  # 2: the hypernym caption uses the first hypernym by name
COPY_ROWS = 65536  # table rows copied at a time
IMAGE_FILE = "image.npy"
TEXT_FILE = "text.npy"
ROWS_FILE = "rows.parquet"


@dataclass(frozen=True)
class EmbeddingTables:
    """One split's tables: ``image`` (N, D_a) and ``text`` (N, D_b) float32 (memory-mapped as read),
    and per row its manifest ``index``, ``key``, ``label`` (-1 when unlabelled) and ``caption``
    (pyarrow string arrays); ``class_names`` in label order."""

    image: np.ndarray
    text: np.ndarray
    indices: np.ndarray
    keys: pa.Array
    labels: np.ndarray
    captions: pa.Array
    class_names: list[str]
    key: str

    def take(self, rows: np.ndarray) -> EmbeddingTables:
        """The tables of ``rows`` (int positions), in that order, under the same key (copied into memory)."""
        return replace(self, image=self.image[rows], text=self.text[rows], indices=self.indices[rows],
                       keys=self.keys.take(rows), labels=self.labels[rows], captions=self.captions.take(rows))


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
                     progress: bool = True, reuse: Reuse = SERVE_COMPLETE) -> StageOutput:
    """The image and text embeddings of ``split``, or the cached output at once (its features too)."""
    features = (None if image.type == "table"
                else extract_features(shards, _encoder(image), split, image.batch_size, device, progress=progress,
                                     reuse=reuse))
    stage = embedding_tables_stage_of(shards, image, text, split, device)
    return run_stage(stage, lambda tmp: _write(shards, spec, image, text, split, features, device, progress, tmp),
                     out_dir, reuse=reuse)


def embedding_tables_stage_of(shards: ShardResult, image: ImageSource, text: AlignText, split: str,
                              device: str | torch.device | None = None) -> Stage:
    """The tables stage, keyed by the shard key, the image source's key, the split and the text recipe."""
    config = {"split": split, "image": image.model_dump(mode="json", exclude={"path", "batch_size"}),
              "text": text.model_dump(mode="json", exclude={"model"}) | {"model": text_model_identity(text.model)}}
    image_key = (file_digest(image.path, "image.path") if image.type == "table"
                 else features_stage_of(shards, _encoder(image), split, device).key)
    return Stage("embedding_tables", STAGE_VERSION, config, inputs={"shards": shards.key, "image": image_key})


def _encoder(image: ImageSource) -> str:
    return "pixels" if image.type == "pixels" else str(image.path)


def load_tables(tables: StageOutput | str | Path) -> EmbeddingTables:
    """Read an embedding tables output (a StageOutput or its directory)."""
    path, record = completed_output(tables, "embedding_tables", DataError, "embedding tables",
                                    "run the embedding tables stage first")
    rows = pq.read_table(path / ROWS_FILE)
    classes = json.loads((path / CLASSES_FILE).read_text())
    return EmbeddingTables(np.load(path / IMAGE_FILE, mmap_mode="r"), np.load(path / TEXT_FILE, mmap_mode="r"),
                           rows["index"].to_numpy(), rows["key"].combine_chunks(), rows["label"].to_numpy(),
                           rows["caption"].combine_chunks(), [entry["name"] for entry in classes], record["key"])


def _write(shards: ShardResult, spec: DataSpec, image: ImageSource, text: AlignText, split: str,
           features: StageOutput | None, device: str | torch.device | None, progress: bool,
           out: Path) -> dict[str, float]:
    rows = split_rows(shards.manifest, split, ["key", "caption"])
    if not len(rows):
        raise SpecError(f"the shards at {shards.path} hold no {split!r} samples", "choose a split the data spec has")
    indices = rows["index"].to_numpy()
    source, chosen = _user_table(image, rows) if features is None else (load_features(features).features, None)
    image_embeddings = _copy_rows(source, chosen, out / IMAGE_FILE, "image embeddings")
    captions = sample_captions(spec, text, indices, rows["label"].to_numpy(), rows["caption"].combine_chunks())
    encoder = load_text_model(text.model, None if device is None else str(device))
    text_embeddings = np.lib.format.open_memmap(out / TEXT_FILE, mode="w+", dtype=np.float32,
                                                shape=(len(captions), encoder.get_embedding_dimension()))
    embed_captions(captions, model=encoder, progress=progress, out=text_embeddings)
    text_embeddings.flush()
    table = pa.table({"index": indices, "key": rows["key"], "label": rows["label"], "caption": captions})
    pq.write_table(table, out / ROWS_FILE)
    classes = [{"name": name, "synset": synset} for name, synset in (spec.classes or {}).items()]
    (out / CLASSES_FILE).write_text(json.dumps(classes, indent=2))
    return {"samples": len(indices), "image_dim": image_embeddings.shape[1], "text_dim": text_embeddings.shape[1],
            "distinct_captions": pc.count_distinct(captions).as_py()}


def _copy_rows(source: np.ndarray, rows: np.ndarray | None, path: Path, name: str) -> np.ndarray:
    """``source[rows]`` (all rows when None) written to a float32 ``.npy`` at ``path`` a chunk at a time (a
    memory-mapped source is never read whole); EvalError naming the first row with a NaN or an inf."""
    count = len(source) if rows is None else len(rows)
    table = np.lib.format.open_memmap(path, mode="w+", dtype=np.float32, shape=(count, source.shape[1]))
    for start in range(0, count, COPY_ROWS):
        stop = min(start + COPY_ROWS, count)
        chunk = np.asarray(source[start:stop] if rows is None else source[rows[start:stop]], dtype=np.float32)
        bad = np.flatnonzero(~np.isfinite(chunk).all(axis=1))
        if len(bad):
            raise EvalError(f"{name} hold NaN or infinite values (first: row {start + bad[0]})",
                            "repair or drop those samples before aligning")
        table[start:stop] = chunk
    table.flush()
    return table


def _user_table(image: TableImages, rows: pa.Table) -> tuple[np.ndarray, np.ndarray | None]:
    """The user's embeddings and which of their rows ``rows`` are (None: all, in order): by manifest
    key (Parquet, read whole) or manifest index (``.npy``, memory-mapped)."""
    path = image.path
    if path.suffix == ".npy":
        embeddings = np.load(path, mmap_mode="r")
        indices = rows["index"].to_numpy()
        if embeddings.ndim != 2 or len(embeddings) <= indices.max():
            raise DataError(f"{path} holds an array of shape {embeddings.shape}, but manifest index "
                            f"{indices.max()} needs row {indices.max()}", "save one row per manifest index, (N, D)")
        return embeddings, indices
    if path.suffix != ".parquet":
        raise SpecError(f"image.path {path} is neither .parquet nor .npy", "save the embeddings as one of those")
    table = pq.read_table(path, columns=["key", "embedding"])
    position = {key: row for row, key in enumerate(table["key"].to_pylist())}
    missing = [key for key in rows["key"].to_pylist() if key not in position]
    if missing:
        raise DataError(f"{path} has no embedding for {len(missing)} manifest keys (first: {missing[0]!r})",
                        "give every sample of the split a row keyed like the manifest")
    wanted = [position[key] for key in rows["key"].to_pylist()]
    return np.asarray(table["embedding"].to_pylist(), dtype=np.float32)[wanted], None


def class_captions(name: str, synset: str, templates: tuple[str, ...], lemmas: bool = True, gloss: bool = True,
                   hypernym: bool = True) -> list[str]:
    """The distinct captions of one class: each template with the class name and, if asked, its synset's
    lemmas; then each template with the name followed by the gloss and by "a kind of <first hypernym
    lemma>" (hypernyms ordered by name: NLTK's order varies between runs)."""
    entry = lookup(synset)
    names = list(dict.fromkeys([name] + ([lemma.replace("_", " ") for lemma in entry.lemma_names()] if lemmas else [])))
    captions = [template.format(name=label) for template in templates for label in names]
    suffixes = ([entry.definition()] if gloss else []) + (
        [f"a kind of {parent.lemma_names()[0].replace('_', ' ')}"
         for parent in sorted(entry.hypernyms(), key=lambda parent: parent.name())[:1]] if hypernym else [])
    captions += [f"{template.format(name=name).rstrip('.')}, {suffix}." for template in templates for suffix in suffixes]
    return list(dict.fromkeys(captions))


def sample_captions(spec: DataSpec, text: AlignText, indices: np.ndarray, labels: np.ndarray,
                    manifest_captions: pa.Array) -> pa.Array:
    """One caption per row (pyarrow strings): its manifest caption (``source: manifest``), or one of its
    class's captions drawn with ``default_rng(text.seed)`` at its manifest index (the same on every split)."""
    if text.source == "manifest":
        return manifest_captions
    if spec.classes is None or (labels < 0).any():
        raise SpecError("text.source is 'classes' but the data has no class for every sample",
                        "set text.source=manifest to embed the samples' own captions")
    templates = text.templates or spec.captions.templates
    per_class = [class_captions(name, synset, templates, text.lemmas, text.gloss, text.hypernym)
                 for name, synset in spec.classes.items()]
    draws = np.random.default_rng(text.seed).random(int(indices.max()) + 1)[indices]
    return pa.array([per_class[label][int(draw * len(per_class[label]))] for label, draw in zip(labels, draws)],
                    pa.string())


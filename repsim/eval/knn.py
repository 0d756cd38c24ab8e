"""Weighted kNN classification on cosine similarity: each of a test sample's first k training
neighbors votes for its class with weight ``exp(similarity / temperature)``. Chunked over test and
training rows, so memory stays bounded. Ties go to the lower training row, then the lower class id.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import numpy as np
import torch

from repsim._checks import (ArrayLike, as_features, as_ks, as_labels, check_positive, check_same_rows,
                            check_same_width, check_several_classes, count_classes, resolve_device)
from repsim.errors import EvalError
from repsim.similarity.neighbors import KEY_CHUNK, QUERY_CHUNK, NeighborChunk, exact_search


def cosine_top_k(queries: ArrayLike, keys: ArrayLike, k: int, *, exclude_self: bool = False,
                 chunk_size: int = QUERY_CHUNK, key_chunk_size: int = KEY_CHUNK,
                 device: str | torch.device | None = None,
                 dtype: torch.dtype = torch.float32) -> Iterator[NeighborChunk]:
    """The k most cosine-similar keys (Nk, D) of every query (Nq, D), one :class:`NeighborChunk` per query
    chunk (inputs checked at the call); ``exclude_self``: queries and keys are one set, each row not its own."""
    queries, keys = as_features(queries, "queries"), as_features(keys, "keys")
    check_same_width(queries, "queries", keys, "keys")
    if exclude_self:
        check_same_rows(queries, "queries", keys, "keys")
    searchable = len(keys) - int(exclude_self)
    if not 1 <= k <= searchable:
        raise EvalError(f"k={k} neighbors asked of {searchable} searchable samples", f"use k between 1 and {searchable}")
    device = resolve_device(device)
    rows = torch.arange(len(keys), device=device)
    return exact_search(queries, keys, k, "cosine", (rows, rows) if exclude_self else None, chunk_size,
                        key_chunk_size, device, dtype)


def knn_rankings(train_x: ArrayLike, train_y: ArrayLike, test_x: ArrayLike, k: int | Iterable[int] = 20, *,
                 temperature: float = 0.07, num_classes: int | None = None, top: int = 5,
                 chunk_size: int = QUERY_CHUNK, train_chunk_size: int = KEY_CHUNK,
                 device: str | torch.device | None = None,
                 dtype: torch.dtype = torch.float32) -> dict[int, np.ndarray]:
    """Per k: class ids (M, min(top, C)) ranked by weighted vote, best first, of test_x (M, D) against
    train_x (N, D) with train_y (N,) in [0, C), C = ``num_classes`` or max label + 1; ``dtype``: compute precision."""
    ks = as_ks(k)
    train_x, test_x = as_features(train_x, "train_x"), as_features(test_x, "test_x")
    check_same_width(test_x, "test_x", train_x, "train_x")
    train_y = as_labels(train_y, len(train_x), "train_y", "train_x")
    check_several_classes(train_y, "train_y")
    check_positive(temperature, "temperature")
    num_classes = count_classes(train_y, num_classes, "train_y")
    check_positive(top, "top")
    top = min(top, num_classes)
    device = resolve_device(device)
    train_y = train_y.to(device)
    rankings = {k: np.empty((len(test_x), top), dtype=np.int64) for k in ks}
    for chunk in cosine_top_k(test_x, train_x, ks[-1], chunk_size=chunk_size, key_chunk_size=train_chunk_size,
                              device=device, dtype=dtype):
        neighbor_labels = train_y[chunk.indices]
        # Shifting by each row's best similarity rescales its votes by one constant: same ranking, no overflow.
        weights = torch.exp((chunk.scores - chunk.scores[:, :1]) / temperature)
        rows = slice(chunk.start, chunk.start + len(weights))
        for k in ks:
            votes = weights.new_zeros((len(weights), num_classes))
            votes.scatter_add_(1, neighbor_labels[:, :k], weights[:, :k])
            rankings[k][rows] = ranked_classes(votes, top)
    return rankings


def ranked_classes(scores: torch.Tensor, top: int = 5) -> np.ndarray:
    """Class ids (N, min(top, C)) of scores (N, C) by descending score, ties to the lower class id."""
    return scores.sort(dim=1, descending=True, stable=True).indices[:, :top].cpu().numpy()


def knn_predict(train_x: ArrayLike, train_y: ArrayLike, test_x: ArrayLike, k: int | Iterable[int] = 20,
                **options: Any) -> dict[int, np.ndarray]:
    """Per k: the predicted class (N_test,) int64; ``options`` as in :func:`knn_rankings`."""
    return {k: ranked[:, 0] for k, ranked in knn_rankings(train_x, train_y, test_x, k, top=1, **options).items()}


def knn_accuracy(train_x: ArrayLike, train_y: ArrayLike, test_x: ArrayLike, test_y: ArrayLike,
                 k: int | Iterable[int] = 20, **options: Any) -> dict[str, float]:
    """``{"knn_top1_k{k}": ..., "knn_top5_k{k}": ...}`` for each k, fractions in [0, 1] (top-5 is 1 for ≤ 5
    classes); ``options`` as in :func:`knn_rankings`."""
    test_y = as_labels(test_y, len(test_x), "test_y", "test_x")
    return knn_metrics(knn_rankings(train_x, train_y, test_x, k, top=5, **options), test_y)


def knn_metrics(rankings: dict[int, np.ndarray], labels: ArrayLike) -> dict[str, float]:
    """``{"knn_top1_k{k}", "knn_top5_k{k}"}`` of :func:`knn_rankings` against the test labels (M,)."""
    return {f"knn_top{top}_k{k}": accuracy
            for k, ranked in rankings.items() for top, accuracy in top_k_accuracy(ranked, labels).items()}


def top_k_accuracy(rankings: ArrayLike, labels: ArrayLike, tops: Sequence[int] = (1, 5)) -> dict[int, float]:
    """Per t in ``tops``: the fraction of rows whose label (N,) is among their first t ranked classes
    (rankings (N, T), best first; a t beyond T counts all T columns)."""
    rankings, labels = np.asarray(rankings), np.asarray(labels)
    hits = rankings == labels[:, None]
    return {top: float(hits[:, :top].any(axis=1).mean()) for top in tops}

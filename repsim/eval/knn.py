"""Weighted k-nearest-neighbor classification on cosine similarity.

Both sides are L2-normalised; each test sample takes its top max(k) training neighbors once and,
for every requested k, each of its first k neighbors votes for its class with weight
``exp(similarity / temperature)``. Work is chunked over test rows and over training rows (with a
running top-k merge), so memory stays bounded however large both sets are.

Ties are broken deterministically: among equally similar neighbors the lower training row comes
first, and among classes with equal votes the lower class id wins.

:func:`knn_accuracy` returns fractions in [0, 1] under the keys ``knn_top1_k{k}`` and
``knn_top5_k{k}`` for each k (top-5 is 1.0 when there are at most five classes).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from repsim.errors import EvalError
from repsim._checks import (ArrayLike, as_features, as_ks, as_labels, check_positive, check_same_rows,
                                 check_same_width, check_several_classes, count_classes, resolve_device,
                                 unit_rows)

QUERY_CHUNK = 1024
KEY_CHUNK = 32768


@dataclass(frozen=True)
class NeighborChunk:
    """The neighbors of query rows ``start .. start + B - 1``, most similar first."""

    start: int
    similarities: torch.Tensor  # (B, k) cosine similarities, descending
    indices: torch.Tensor  # (B, k) int64 key rows; equal similarities keep the lower row first


def cosine_top_k(queries: ArrayLike, keys: ArrayLike, k: int, *, exclude_self: bool = False,
                 chunk_size: int = QUERY_CHUNK, key_chunk_size: int = KEY_CHUNK,
                 device: str | torch.device | None = None,
                 dtype: torch.dtype = torch.float32) -> Iterator[NeighborChunk]:
    """The k most cosine-similar keys of every query, one :class:`NeighborChunk` per query chunk.

    queries (Nq, D), keys (Nk, D). ``exclude_self`` treats queries and keys as the same set and
    leaves each row out of its own neighbors. Inputs are checked at the call; keys are normalised
    once onto ``device``; at most ``chunk_size × key_chunk_size`` similarities exist at a time.
    """
    queries, keys = as_features(queries, "queries"), as_features(keys, "keys")
    check_same_width(queries, "queries", keys, "keys")
    if exclude_self:
        check_same_rows(queries, "queries", keys, "keys")
    searchable = len(keys) - int(exclude_self)
    if not 1 <= k <= searchable:
        raise EvalError(f"k={k} neighbors asked of {searchable} searchable samples", f"use k between 1 and {searchable}")
    device = resolve_device(device)
    return _neighbor_chunks(queries, unit_rows(keys, device, dtype), k, exclude_self, chunk_size, key_chunk_size)


def _neighbor_chunks(queries: torch.Tensor, keys: torch.Tensor, k: int, exclude_self: bool, chunk_size: int,
                      key_chunk_size: int) -> Iterator[NeighborChunk]:
    for start in range(0, len(queries), chunk_size):
        chunk = unit_rows(queries[start:start + chunk_size], keys.device, keys.dtype)
        similarities, indices = _search(chunk, keys, k, key_chunk_size, start if exclude_self else None)
        yield NeighborChunk(start, similarities, indices)


def _search(queries: torch.Tensor, keys: torch.Tensor, k: int, key_chunk_size: int,
            self_offset: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k (similarities, indices) of normalised queries (B, D) among normalised keys (N, D)."""
    best = queries.new_empty((len(queries), 0))
    best_indices = torch.empty((len(queries), 0), dtype=torch.long, device=queries.device)
    for key_start in range(0, len(keys), key_chunk_size):
        similarities = queries @ keys[key_start:key_start + key_chunk_size].T
        if self_offset is not None:
            _hide_self(similarities, self_offset - key_start)
        positions = _top_k_positions(similarities, k)
        candidates = torch.cat([best, similarities.gather(1, positions)], dim=1)
        candidate_indices = torch.cat([best_indices, positions + key_start], dim=1)
        keep = _top_k_positions(candidates, k)
        best, best_indices = candidates.gather(1, keep), candidate_indices.gather(1, keep)
    order = best.sort(dim=1, descending=True, stable=True).indices
    return best.gather(1, order), best_indices.gather(1, order)


def _hide_self(similarities: torch.Tensor, diagonal: int) -> None:
    """Set entry (r, r + diagonal) to -inf for every row r whose column falls inside the block."""
    rows = torch.arange(len(similarities), device=similarities.device)
    columns = rows + diagonal
    inside = (columns >= 0) & (columns < similarities.shape[1])
    similarities[rows[inside], columns[inside]] = float("-inf")


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


def knn_rankings(train_x: ArrayLike, train_y: ArrayLike, test_x: ArrayLike, k: int | Iterable[int] = 20, *,
                 temperature: float = 0.07, num_classes: int | None = None, top: int = 5,
                 chunk_size: int = QUERY_CHUNK, train_chunk_size: int = KEY_CHUNK,
                 device: str | torch.device | None = None,
                 dtype: torch.dtype = torch.float32) -> dict[int, np.ndarray]:
    """Per k: class ids (N_test, min(top, C)) ranked by weighted vote, best first.

    train_x (N, D), train_y (N,) ints in [0, C), test_x (M, D); C = ``num_classes`` or max label + 1.
    ``dtype`` is the compute precision (float64 reproduces float64 references exactly).
    """
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
        weights = torch.exp((chunk.similarities - chunk.similarities[:, :1]) / temperature)
        rows = slice(chunk.start, chunk.start + len(weights))
        for k in ks:
            votes = weights.new_zeros((len(weights), num_classes))
            votes.scatter_add_(1, neighbor_labels[:, :k], weights[:, :k])
            rankings[k][rows] = votes.sort(dim=1, descending=True, stable=True).indices[:, :top].cpu().numpy()
    return rankings


def knn_predict(train_x: ArrayLike, train_y: ArrayLike, test_x: ArrayLike, k: int | Iterable[int] = 20, *,
                temperature: float = 0.07, num_classes: int | None = None, chunk_size: int = QUERY_CHUNK,
                train_chunk_size: int = KEY_CHUNK, device: str | torch.device | None = None,
                dtype: torch.dtype = torch.float32) -> dict[int, np.ndarray]:
    """Per k: the predicted class (N_test,) int64; see :func:`knn_rankings`."""
    rankings = knn_rankings(train_x, train_y, test_x, k, temperature=temperature, num_classes=num_classes, top=1,
                            chunk_size=chunk_size, train_chunk_size=train_chunk_size, device=device, dtype=dtype)
    return {k: ranked[:, 0] for k, ranked in rankings.items()}


def knn_accuracy(train_x: ArrayLike, train_y: ArrayLike, test_x: ArrayLike, test_y: ArrayLike,
                 k: int | Iterable[int] = 20, *, temperature: float = 0.07, num_classes: int | None = None,
                 chunk_size: int = QUERY_CHUNK, train_chunk_size: int = KEY_CHUNK,
                 device: str | torch.device | None = None, dtype: torch.dtype = torch.float32) -> dict[str, float]:
    """``{"knn_top1_k{k}": ..., "knn_top5_k{k}": ...}`` for each k, fractions in [0, 1]."""
    test_y = as_labels(test_y, len(test_x), "test_y", "test_x")
    rankings = knn_rankings(train_x, train_y, test_x, k, temperature=temperature, num_classes=num_classes, top=5,
                            chunk_size=chunk_size, train_chunk_size=train_chunk_size, device=device, dtype=dtype)
    return {f"knn_top{top}_k{k}": accuracy
            for k, ranked in rankings.items() for top, accuracy in top_k_accuracy(ranked, test_y).items()}


def top_k_accuracy(rankings: ArrayLike, labels: ArrayLike, tops: Sequence[int] = (1, 5)) -> dict[int, float]:
    """Per t in ``tops``: the fraction of rows whose label is among their first t ranked classes.

    rankings (N, T) class ids best first; labels (N,). A t beyond T counts all T columns.
    """
    rankings, labels = np.asarray(rankings), np.asarray(labels)
    hits = rankings == labels[:, None]
    return {top: float(hits[:, :top].any(axis=1).mean()) for top in tops}

"""ASIF: cross-modal similarity without training, through relative representations (Norelli et al., 2023).

M anchor pairs (a_i, b_i) connect two frozen embedding spaces. A query of modality A becomes its
relative representation over the anchors of A: the cosine similarities to the M anchors, only the
top k kept (the rest 0), negative ones clipped to 0, raised to the power p and L2-normalised. Row i
of a representation in either modality refers to the same anchor pair, so queries of A and B compare
by the inner product of their relative representations (their cosine similarity).

``backend="exact"`` scores every anchor with torch; ``backend="faiss"`` finds each query's top k
anchors with an exact FAISS index (:func:`repsim.similarity.neighbors.knn`), for many anchors.
"""

from __future__ import annotations

from typing import Literal

import numpy as np
import torch
import torch.nn.functional as F

from repsim.errors import EvalError
from repsim._checks import (
    ArrayLike,
    as_features,
    check_same_rows,
    check_same_width,
)

Backend = Literal["exact", "faiss"]
BACKENDS = ("exact", "faiss")


def relative_representation(queries: ArrayLike, anchors: ArrayLike, k: int, p: float = 8.0,
                            backend: Backend = "exact") -> torch.Tensor:
    """Relative representations (Q, M) float32, unit rows, of queries (Q, D) over anchors (M, D)."""
    queries, anchors = as_features(queries, "queries").float(), as_features(anchors, "anchors").float()
    check_same_width(queries, "queries", anchors, "anchors")
    if not 1 <= k <= len(anchors):
        raise EvalError(f"ASIF keeps the top {k} of {len(anchors)} anchors", f"choose k from 1 to {len(anchors)}")
    if p <= 0:
        raise EvalError(f"ASIF power p is {p}", "choose a positive p (e.g. 8)")
    ids, scores = _top_anchors(queries, anchors, k, backend)
    relative = torch.zeros(len(queries), len(anchors)).scatter_(1, ids, scores.clamp(min=0) ** p)
    return F.normalize(relative, dim=1)


def _top_anchors(queries: torch.Tensor, anchors: torch.Tensor, k: int, backend: Backend) -> tuple[torch.Tensor, torch.Tensor]:
    """(Q, k) anchor ids and cosine similarities of each query's k most similar anchors."""
    if backend == "exact":
        top = (F.normalize(queries, dim=1) @ F.normalize(anchors, dim=1).T).topk(k, dim=1)
        return top.indices, top.values
    if backend == "faiss":
        from repsim.similarity.neighbors import knn

        ids, scores = knn(anchors.numpy(), k, queries=queries.numpy(), metric="cosine", exclude_self=False)
        return torch.from_numpy(np.ascontiguousarray(ids)), torch.from_numpy(np.ascontiguousarray(scores))
    raise EvalError(f"unknown ASIF backend {backend!r}", f"use one of {', '.join(BACKENDS)}")


class ASIF:
    """Anchor pairs ``anchors_a`` (M, D_a) and ``anchors_b`` (M, D_b), row i of one paired with row i
    of the other; ``k`` anchors kept per query, power ``p``, ``backend`` exact or faiss."""

    def __init__(self, anchors_a: ArrayLike, anchors_b: ArrayLike, k: int = 100, p: float = 8.0,
                 backend: Backend = "exact"):
        self.anchors_a, self.anchors_b = as_features(anchors_a, "anchors_a"), as_features(anchors_b, "anchors_b")
        check_same_rows(self.anchors_a, "anchors_a", self.anchors_b, "anchors_b")
        self.k, self.p, self.backend = k, p, backend

    def embed_a(self, queries: ArrayLike) -> torch.Tensor:
        """Queries of modality A (Q, D_a) -> relative representations (Q, M)."""
        return relative_representation(queries, self.anchors_a, self.k, self.p, self.backend)

    def embed_b(self, queries: ArrayLike) -> torch.Tensor:
        """Queries of modality B (Q, D_b) -> relative representations (Q, M)."""
        return relative_representation(queries, self.anchors_b, self.k, self.p, self.backend)

    def scores(self, queries_a: ArrayLike, queries_b: ArrayLike) -> torch.Tensor:
        """Cross-modal similarities (Q_a, Q_b) in [0, 1]."""
        return self.embed_a(queries_a) @ self.embed_b(queries_b).T

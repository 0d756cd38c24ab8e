"""ASIF: cross-modal similarity without training, through relative representations (Norelli et al., 2023).

A query becomes its relative representation over M anchors of its modality: cosine similarities to
its top k anchors (exact search, ``exact`` with torch or ``faiss``), clipped at 0, raised to the power
p and L2-normalised. Anchor i of either modality is one pair, so queries of both compare by inner product.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F

from repsim._checks import ArrayLike, as_features, check_same_rows, check_same_width
from repsim.errors import EvalError
from repsim.similarity.neighbors import nearest

Backend = Literal["exact", "faiss"]
SEARCH_BACKENDS = {"exact": "torch", "faiss": "faiss"}  # the search backend of each ASIF backend
BACKENDS = tuple(SEARCH_BACKENDS)


def relative_representation(queries: ArrayLike, anchors: ArrayLike, k: int, p: float = 8.0,
                            backend: Backend = "exact") -> torch.Tensor:
    """Relative representations (Q, M) float32, unit rows, of queries (Q, D) over anchors (M, D)."""
    queries, anchors = as_features(queries, "queries").float(), as_features(anchors, "anchors").float()
    check_same_width(queries, "queries", anchors, "anchors")
    if not 1 <= k <= len(anchors):
        raise EvalError(f"ASIF keeps the top {k} of {len(anchors)} anchors", f"choose k from 1 to {len(anchors)}")
    if p <= 0:
        raise EvalError(f"ASIF power p is {p}", "choose a positive p (e.g. 8)")
    if backend not in BACKENDS:
        raise EvalError(f"unknown ASIF backend {backend!r}", f"use one of {', '.join(BACKENDS)}")
    ids, scores = nearest(queries, anchors, k, "cosine", backend=SEARCH_BACKENDS[backend])
    relative = torch.zeros(len(queries), len(anchors)).scatter_(1, ids, scores.clamp(min=0) ** p)
    return F.normalize(relative, dim=1)


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

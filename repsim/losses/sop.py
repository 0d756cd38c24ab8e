"""Self-organizing visual prototypes (SOP): distributions over prototypes built from a memory.

An SOP is an anchor from the memory and its k nearest other entries (supports). Each of the
M ≤ K(k+1) elements has a weight w (an anchor 1 − ε, a support its cosine with the anchor, clipped
to [0, 1]; one-hot: 1); the label matrix Y (M, K) puts w on its own SOP and (1 − w) / (K − 1) on
each other. An embedding's distribution over SOPs is ``softmax(e · elementsᵀ / τ) · Y``. Non-shared
supports (an ablation) keep each entry for the anchor it scores highest with, none if it is an anchor.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from repsim.losses._pairs import at_least_float32
from repsim.losses.dino import cross_view_cross_entropy
from repsim.similarity.neighbors import BACKENDS, nearest


@dataclass(frozen=True)
class SOPs:
    """K SOPs as M elements with their label matrix factored: row m of Y is ``spread[m]`` everywhere but
    column ``sop_of[m]``, which holds ``own[m]``."""

    elements: torch.Tensor  # (M, D) unit rows: the K anchors, then the k support embeddings of each
    sop_of: torch.Tensor    # (M,) long, the SOP of each element
    own: torch.Tensor       # (M,) label mass on the element's own SOP
    spread: torch.Tensor    # (M,) label mass on each other SOP
    count: int              # K

    @property
    def labels(self) -> torch.Tensor:
        """The label matrix Y (M, K), dense."""
        labels = self.spread[:, None].expand(-1, self.count).clone()
        return labels.scatter_(1, self.sop_of[:, None], self.own[:, None])

    def distribution(self, embeddings: torch.Tensor, temperature: float) -> torch.Tensor:
        """``softmax(e · elementsᵀ / τ) · Y`` (B, K) of unit embeddings (B, D), without forming Y."""
        embeddings = at_least_float32(embeddings)
        dtype = embeddings.dtype
        probabilities = torch.softmax(embeddings @ self.elements.to(dtype).T / temperature, dim=1)
        spread = probabilities @ self.spread.to(dtype)
        own = torch.zeros(len(probabilities), self.count, dtype=dtype, device=probabilities.device)
        own.index_add_(1, self.sop_of, probabilities * (self.own - self.spread).to(dtype))
        return own + spread[:, None]


def nearest_supports(anchors: torch.Tensor, anchor_ids: torch.Tensor, memory: torch.Tensor,
                     memory_ids: torch.Tensor, k: int, backend: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """(cosine scores (K, k), memory rows (K, k)) of each unit anchor's (K, D) k nearest unit memory entries
    (N, D), nearest first, never the entry of its own id; ``backend`` ``auto``: FAISS for a memory on the CPU
    (1.3-2.2x faster there, ``benchmarks/sop_cost.py``), torch on a GPU."""
    if k >= len(memory):
        raise ValueError(f"{k} support embeddings need more than {len(memory)} memory entries")
    if backend not in ("auto", *BACKENDS):
        raise ValueError(f"unknown nearest-support backend {backend!r}; use auto, {', '.join(BACKENDS)}")
    if backend == "auto":
        backend = "faiss" if memory.device.type == "cpu" else "torch"
    rows, scores = nearest(anchors, memory, k, "ip", (anchor_ids, memory_ids), backend, use_gpu=False)
    return scores, rows


@dataclass(frozen=True)
class Supports:
    """The k support embeddings drawn for each of K anchors, flat in anchor order."""

    embeddings: torch.Tensor  # (K·k, D) unit rows
    scores: torch.Tensor      # (K·k,) cosine score with their anchor
    kept: torch.Tensor        # (K·k,) bool: part of their anchor's SOP (all, with shared supports)


def draw_supports(anchors: torch.Tensor, anchor_ids: torch.Tensor, memory: torch.Tensor, memory_ids: torch.Tensor,
                  support_size: int = 8, shared: bool = True) -> Supports:
    """The supports of ``anchors`` (K, D) among ``memory`` (N, D), ids as in :func:`nearest_supports`;
    not ``shared``: each entry kept for one anchor at most (:func:`exclusive_supports`)."""
    scores, rows = nearest_supports(anchors, anchor_ids, memory, memory_ids, support_size)
    scores, rows = scores.flatten(), rows.flatten()
    kept = (torch.ones_like(rows, dtype=torch.bool) if shared
            else exclusive_supports(scores, rows, memory_ids[rows], anchor_ids))
    return Supports(memory[rows], scores, kept)


def assemble_sops(anchors: torch.Tensor, supports: Supports, epsilon: float = 0.1, one_hot: bool = False) -> SOPs:
    """The SOPs of ``anchors`` (K, D) and their kept ``supports``."""
    count = len(anchors)
    if count < 2:
        raise ValueError(f"SOPs need at least two anchors, got {count}")
    sop_of = torch.arange(count, device=anchors.device).repeat_interleave(len(supports.kept) // count)
    elements = torch.cat([anchors, supports.embeddings[supports.kept]])
    sop_of = torch.cat([torch.arange(count, device=anchors.device), sop_of[supports.kept]])
    if one_hot:
        weights = torch.ones(len(elements), dtype=elements.dtype, device=elements.device)
    else:
        weights = torch.cat([torch.full((count,), 1 - epsilon, dtype=elements.dtype, device=elements.device),
                             supports.scores[supports.kept].clamp(0, 1)])
    return SOPs(elements, sop_of, weights, (1 - weights) / (count - 1), count)


def build_sops(anchors: torch.Tensor, anchor_ids: torch.Tensor, memory: torch.Tensor, memory_ids: torch.Tensor,
               support_size: int = 8, epsilon: float = 0.1, one_hot: bool = False,
               shared_supports: bool = True) -> SOPs:
    """The SOPs of ``anchors`` (K, D) over ``memory`` (N, D), ids as in :func:`nearest_supports`."""
    supports = draw_supports(anchors, anchor_ids, memory, memory_ids, support_size, shared_supports)
    return assemble_sops(anchors, supports, epsilon, one_hot)


def exclusive_supports(scores: torch.Tensor, rows: torch.Tensor, ids: torch.Tensor,
                       anchor_ids: torch.Tensor) -> torch.Tensor:
    """(K·k,) bool: the drawn supports (flat ``scores``, memory ``rows``, their ``ids``) kept, each memory entry
    for the anchor it scores highest with (ties: the first), none for an entry that is itself an anchor."""
    best = torch.full((int(rows.max()) + 1,), -math.inf, dtype=scores.dtype, device=scores.device)
    best = best.scatter_reduce(0, rows, scores, "amax")
    position = torch.arange(len(rows), device=rows.device)
    candidates = torch.where(scores == best[rows], position, len(rows))
    first = torch.full_like(best, len(rows), dtype=torch.long).scatter_reduce(0, rows, candidates, "amin")
    return (first[rows] == position) & ~torch.isin(ids, anchor_ids)


def safe_log(probabilities: torch.Tensor) -> torch.Tensor:
    """log of probabilities, with 0 read as the smallest positive float (a finite log)."""
    return probabilities.clamp_min(torch.finfo(probabilities.dtype).tiny).log()


def cross_entropy(target: torch.Tensor, prediction: torch.Tensor) -> torch.Tensor:
    """−Σ target · log prediction per row of two (B, K) distributions."""
    return -(target * safe_log(prediction)).sum(dim=1)


class SOPLoss(nn.Module):
    """[CLS] loss over SOPs; ``forward(student, teacher, sops)`` with lists of (B, D) unit embeddings,
    the student's views (global ones first) and the teacher's global views.

    >>> memory = torch.nn.functional.normalize(torch.randn(64, 16), dim=1)  # N = 64 teacher embeddings, D = 16
    >>> sops = build_sops(memory[:8], torch.arange(8), memory, torch.arange(64), support_size=4)  # K = 8 SOPs
    >>> views = list(torch.nn.functional.normalize(torch.randn(3, 4, 16), dim=-1))  # 3 views, B = 4
    >>> SOPLoss()(views, views[:2], sops).shape  # a scalar
    torch.Size([])
    """

    def __init__(self, student_temperature: float = 0.1, teacher_temperature: float = 0.04):
        super().__init__()
        self.student_temperature, self.teacher_temperature = student_temperature, teacher_temperature

    def forward(self, student: Sequence[torch.Tensor], teacher: Sequence[torch.Tensor], sops: SOPs) -> torch.Tensor:
        targets = [sops.distribution(view.detach(), self.teacher_temperature) for view in teacher]
        log_probs = [safe_log(sops.distribution(view, self.student_temperature)) for view in student]
        return cross_view_cross_entropy(targets, log_probs)


class MaskedSOPLoss(nn.Module):
    """MIM loss over patch SOPs; ``forward(student, teacher, mask, sops)`` with student and teacher
    patch embeddings (V, P, D) of the same V views and ``mask`` (V, P) bool, True where the student
    saw the mask token. The mean cross-entropy over masked positions (0 when none is masked).

    >>> memory = torch.nn.functional.normalize(torch.randn(64, 16), dim=1)  # N = 64 teacher embeddings, D = 16
    >>> sops = build_sops(memory[:8], torch.arange(8), memory, torch.arange(64), support_size=4)  # K = 8 SOPs
    >>> patches, mask = torch.nn.functional.normalize(torch.randn(2, 9, 16), dim=-1), torch.rand(2, 9) < 0.5
    >>> MaskedSOPLoss()(patches, patches, mask, sops).shape  # V = 2 views of P = 9 patches: a scalar
    torch.Size([])
    """

    def __init__(self, student_temperature: float = 0.1, teacher_temperature: float = 0.07):
        super().__init__()
        self.student_temperature, self.teacher_temperature = student_temperature, teacher_temperature

    def forward(self, student: torch.Tensor, teacher: torch.Tensor, mask: torch.Tensor, sops: SOPs) -> torch.Tensor:
        if student.shape != teacher.shape or student.shape[:2] != mask.shape:
            raise ValueError(f"student {tuple(student.shape)}, teacher {tuple(teacher.shape)} and mask "
                             f"{tuple(mask.shape)} must be (V, P, D), (V, P, D) and (V, P)")
        if not mask.any():
            return student.sum() * 0.0
        target = sops.distribution(teacher[mask].detach(), self.teacher_temperature)
        prediction = sops.distribution(student[mask], self.student_temperature)
        return cross_entropy(target, prediction).mean()


def mean_assignment_entropy(distributions: torch.Tensor) -> torch.Tensor:
    """Entropy of the mean of distributions (B, K) over the batch, divided by log K: 1 when the batch
    uses every SOP (or prototype) equally, 0 when all of it sits on one (collapse)."""
    mean = at_least_float32(distributions).mean(dim=0)
    entropy = -(mean * safe_log(mean)).sum()
    return entropy / math.log(distributions.shape[1])


def mean_sample_entropy(distributions: torch.Tensor) -> torch.Tensor:
    """Mean over the batch of each distribution's (B, K) entropy divided by log K: 1 when every target
    is uniform (no signal to learn from), 0 when each is one-hot."""
    distributions = at_least_float32(distributions)
    entropy = -(distributions * safe_log(distributions)).sum(dim=1)
    return entropy.mean() / math.log(distributions.shape[1])

"""DINO's self-distillation loss (Caron et al., 2021): the teacher's ``softmax((t − c) / τ_t)``, c an EMA
of its mean logits over all ranks, against the student's ``softmax(s / τ_s)``, over multi-crop view pairs.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn

from repsim.device import distributed
from repsim.losses._pairs import at_least_float32


def cross_view_cross_entropy(teacher: Sequence[torch.Tensor], student_log: Sequence[torch.Tensor]) -> torch.Tensor:
    """Mean of −Σ t·log s over the samples and the pairs (teacher view i, student view j ≠ i) of target
    distributions (B, K) per global view and log-probabilities (B, K) per student view, global ones first."""
    losses = [-(target * log_probs).sum(dim=1).mean()
              for i, target in enumerate(teacher) for j, log_probs in enumerate(student_log) if i != j]
    if not losses:
        raise ValueError("cross-view pairs need two views, or one teacher and two student views")
    return torch.stack(losses).mean()


class DINOLoss(nn.Module):
    """Cross-view cross-entropy of centred, sharpened teacher logits and student logits.

    ``forward(student, teacher)``: lists of (B, K) logits, the student's views (global ones first)
    and the teacher's global views. The centre moves after each call made in training mode; it and
    ``teacher_temperature`` (which a warm-up moves) are buffers, so a checkpoint holds them.

    >>> loss = DINOLoss(num_prototypes=16)
    >>> student, teacher = list(torch.randn(3, 4, 16)), list(torch.randn(2, 4, 16))  # views of (B, K) = (4, 16)
    >>> loss(student, teacher).shape  # a scalar
    torch.Size([])
    """

    def __init__(self, num_prototypes: int, student_temperature: float = 0.1, teacher_temperature: float = 0.04,
                 center_momentum: float = 0.9):
        super().__init__()
        self.student_temperature, self.center_momentum = student_temperature, center_momentum
        self.register_buffer("center", torch.zeros(num_prototypes))
        self.register_buffer("teacher_temperature", torch.tensor(float(teacher_temperature)))  # a schedule may move it

    def teacher_probabilities(self, teacher: torch.Tensor) -> torch.Tensor:
        """softmax((t − c) / τ_t) of teacher logits (B, K)."""
        return torch.softmax((at_least_float32(teacher) - self.center) / self.teacher_temperature, dim=1)

    def student_log_probabilities(self, student: torch.Tensor) -> torch.Tensor:
        """log softmax(s / τ_s) of student logits (B, K)."""
        return torch.log_softmax(at_least_float32(student) / self.student_temperature, dim=1)

    def forward(self, student: Sequence[torch.Tensor], teacher: Sequence[torch.Tensor]) -> torch.Tensor:
        targets = [self.teacher_probabilities(logits.detach()) for logits in teacher]
        log_probs = [self.student_log_probabilities(logits) for logits in student]
        loss = cross_view_cross_entropy(targets, log_probs)
        if self.training:
            self.update_center(torch.cat(teacher).detach())
        return loss

    @torch.no_grad()
    def update_center(self, teacher: torch.Tensor) -> None:
        """c ← m·c + (1 − m)·(mean of the teacher logits (N, K) over every rank); no change when no rank
        has any (N may be 0 on some ranks: every rank still joins the reduction)."""
        total, count = at_least_float32(teacher).sum(dim=0), torch.tensor(float(len(teacher)), device=teacher.device)
        if distributed():
            dist.all_reduce(total)
            dist.all_reduce(count)
        weight = (count > 0) * (1 - self.center_momentum)  # a tensor: no host sync
        self.center.lerp_(total / count.clamp(min=1), weight.to(self.center.dtype))

"""iBOT's masked-patch loss (Zhou et al., 2022): at every masked patch, the cross-entropy between the
teacher's centred, sharpened prototype distribution (:class:`~repsim.losses.dino.DINOLoss`'s, with its
own centre) and the student's ``softmax(s / τ_s)``, averaged over the masked patches.
"""

from __future__ import annotations

import torch

from repsim.losses.dino import DINOLoss


class IBOTPatchLoss(DINOLoss):
    """``forward(student, teacher)``: (N, K) prototype logits of the same N masked patches, the
    student's from the masked views and the teacher's from the unmasked ones. 0 when N = 0. The centre
    moves after each call made in training mode.

    >>> loss = IBOTPatchLoss(num_prototypes=16)
    >>> student, teacher = torch.randn(10, 16), torch.randn(10, 16)  # N = 10 masked patches, K = 16
    >>> loss(student, teacher).shape  # a scalar
    torch.Size([])
    """

    def forward(self, student: torch.Tensor, teacher: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        if student.shape != teacher.shape or student.ndim != 2:
            raise ValueError(f"student {tuple(student.shape)} and teacher {tuple(teacher.shape)} logits "
                             "must both be (N, K)")
        target = self.teacher_probabilities(teacher.detach())
        loss = (-(target * self.student_log_probabilities(student)).sum(dim=1).mean() if len(student)
                else student.sum() * 0.0)
        if self.training:
            self.update_center(teacher.detach())
        return loss

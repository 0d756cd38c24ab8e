"""Supervised contrastive loss, SupCon (Khosla et al., 2020), the L_out form."""

from __future__ import annotations

import torch

from repsim.losses._pairs import TemperatureLoss, gather_no_grad, view_pairs


class SupConLoss(TemperatureLoss):
    """For each view, the mean over its positives (other views of the same label) of -log p(positive).

    Shapes: z1, z2 (B, D) projections of the two views (normalised here); labels (B,) long.
    Returns a scalar. ``gather`` contrasts against every rank's views under DDP.

    >>> loss = SupConLoss(temperature=0.1)
    >>> z1, z2, labels = torch.randn(8, 128), torch.randn(8, 128), torch.randint(0, 3, (8,))  # B = 8, D = 128
    >>> loss(z1, z2, labels).shape  # a scalar
    torch.Size([])
    """

    def forward(self, z1: torch.Tensor, z2: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        pairs = view_pairs(z1, z2, self.temperature, self.gather)
        if labels.shape != (z1.shape[0],):
            raise ValueError(f"labels must be ({z1.shape[0]},); got {tuple(labels.shape)}")
        column_labels = gather_no_grad(labels, self.gather).repeat(2)
        mask = pairs.self_mask
        positives = (labels.repeat(2)[:, None] == column_labels[None, :]) & ~mask
        log_prediction = pairs.logits.log_softmax(dim=1).masked_fill(mask, 0.0)
        return -((log_prediction * positives).sum(dim=1) / positives.sum(dim=1)).mean()

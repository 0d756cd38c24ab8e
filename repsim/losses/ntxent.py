"""SimCLR's NT-Xent loss (Chen et al., 2020)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from repsim.losses._pairs import TemperatureLoss, view_pairs


class NTXentLoss(TemperatureLoss):
    """Each view must pick its sample's other view among the other 2B - 1 views.

    Shapes: z1, z2 (B, D) projections of the two views (normalised here). Returns a scalar.
    ``gather`` contrasts against every rank's views under DDP.

    >>> loss = NTXentLoss(temperature=0.1)
    >>> z1, z2 = torch.randn(8, 128), torch.randn(8, 128)  # the two views' projections, B = 8, D = 128
    >>> loss(z1, z2).shape  # a scalar
    torch.Size([])
    """

    def forward(self, z1: torch.Tensor, z2: torch.Tensor) -> torch.Tensor:
        pairs = view_pairs(z1, z2, self.temperature, self.gather)
        return F.cross_entropy(pairs.logits, pairs.positive_ids())

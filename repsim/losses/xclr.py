"""X-CLR: contrastive learning towards a soft graph of cross-sample similarities (Sobal et al., 2025)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from repsim.losses._pairs import at_least_float32, view_pairs


class XCLRLoss(nn.Module):
    """Cross-entropy between ``softmax(s / target_temperature)`` and ``softmax(z z^T / temperature)``.

    Over the 2B views, each view's pairing with itself excluded; ``s`` between views of samples i and
    j is ``similarity[i, j]``, and ``similarity[i, i] = 1`` by definition. With s = identity and
    target_temperature -> 0 this is SimCLR's NT-Xent; with s = same-label it is SupCon.

    Args:
        temperature: of the predicted distribution.
        target_temperature: of the target distribution, > 0.
        gather: under DDP, contrast against every rank's views (gradients flow across ranks); then
            ``similarity`` must cover the global batch, in rank order.

    Shapes: z1, z2 (B, D) projections of the two views (normalised here); similarity (B', B') with
    B' = world size x B when gathering, else B. Returns a scalar.
    """

    def __init__(self, temperature: float = 0.1, target_temperature: float = 0.1, gather: bool = False):
        super().__init__()
        if temperature <= 0 or target_temperature <= 0:
            raise ValueError("temperature and target_temperature must be positive")
        self.temperature, self.target_temperature, self.gather = temperature, target_temperature, gather

    def forward(self, z1: torch.Tensor, z2: torch.Tensor, similarity: torch.Tensor) -> torch.Tensor:
        pairs = view_pairs(z1, z2, self.temperature, self.gather)
        size = pairs.global_batch
        if similarity.shape != (size, size):
            raise ValueError(f"similarity must be ({size}, {size}) for this batch; got {tuple(similarity.shape)}")
        target_logits = (at_least_float32(similarity) / self.target_temperature).fill_diagonal_(
            1.0 / self.target_temperature).repeat(2, 2)
        if pairs.logits.shape[1] != pairs.logits.shape[0]:  # gathered: this rank's rows only
            target_logits = target_logits[pairs.row_ids]
        target = target_logits.scatter_(1, pairs.row_ids[:, None], float("-inf")).softmax(dim=1)
        return F.cross_entropy(pairs.logits, target)

"""X-CLR: contrastive learning towards a soft graph of cross-sample similarities (Sobal et al., 2025)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from repsim.losses._pairs import at_least_float32, view_pairs


def target_mass(similarity: torch.Tensor, target_temperature: float) -> torch.Tensor:
    """X-CLR's target distribution per view: (B, B), entry [i, j] the target probability that a view
    of sample i puts on each view of sample j (on i's other view for j = i).

    A view's target row runs over the 2B - 1 other views: ``softmax(s / target_temperature)`` with
    s[i, i] = 1. Both views of j share s[i, j], so the row's normaliser is
    ``2 Σ_j exp(s_ij / τ_s) - exp(1 / τ_s)`` and rows of the full (2B, 2B) target are [P_i, P_i]
    with the view's own entry set to 0.
    """
    scaled = (at_least_float32(similarity) / target_temperature).fill_diagonal_(1.0 / target_temperature)
    weights = (scaled - scaled.max(dim=1, keepdim=True).values).exp()
    return weights / (2 * weights.sum(dim=1, keepdim=True) - weights.diagonal()[:, None])


class XCLRLoss(nn.Module):
    """Cross-entropy between ``softmax(s / target_temperature)`` and ``softmax(z z^T / temperature)``.

    Over the 2B views, each view's pairing with itself excluded; ``s`` between views of samples i and
    j is ``similarity[i, j]``, and ``similarity[i, i] = 1`` by definition. With s = identity and
    target_temperature -> 0 this is SimCLR's NT-Xent; with s = same-label it is SupCon.

    The target is built from the (B, B) :func:`target_mass`, so only one exponential per sample pair
    is taken, not one per view pair.

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
        mass = target_mass(similarity, self.target_temperature)[pairs.row_ids % size]    # (2B, B')
        target = mass.repeat(1, 2).scatter_(1, pairs.row_ids[:, None], 0.0)               # (2B, 2B')
        return F.cross_entropy(pairs.logits, target)

"""The KoLeo regulariser (Sablayrolles et al., 2019; DINOv2): spread embeddings over the sphere."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from repsim.losses._pairs import at_least_float32


class KoLeoLoss(nn.Module):
    """−mean over the batch of log(distance to the nearest other embedding), of unit embeddings:
    the Kozachenko-Leonenko entropy estimate, up to constants; it grows as embeddings crowd together.

    Shapes: embeddings (B, D), normalised here, B ≥ 2. Returns a scalar.

    >>> KoLeoLoss()(torch.randn(8, 16)).shape  # B = 8, D = 16: a scalar
    torch.Size([])
    """

    def __init__(self, eps: float = 1e-8):
        super().__init__()
        self.eps = eps

    def forward(self, embeddings: torch.Tensor) -> torch.Tensor:
        if len(embeddings) < 2:
            raise ValueError(f"KoLeo needs at least two embeddings, got {len(embeddings)}")
        embeddings = F.normalize(at_least_float32(embeddings), dim=1)
        with torch.no_grad():
            cosines = embeddings @ embeddings.T
            others = cosines.fill_diagonal_(-torch.inf).argmax(dim=1)  # the nearest other: the largest cosine
        distances = (embeddings - embeddings[others]).norm(dim=1)
        return -(distances + self.eps).log().mean()

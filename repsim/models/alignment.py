"""Alignment networks: map one frozen embedding space into a shared d-dimensional space."""

from __future__ import annotations

from typing import Literal

import torch
from torch import nn

AlignmentKind = Literal["linear", "mlp"]


class ResidualBlock(nn.Module):
    """``x + W₂ · GELU(W₁ · LayerNorm(x))``: (..., width) -> (..., width)."""

    def __init__(self, width: int, hidden_dim: int):
        super().__init__()
        self.body = nn.Sequential(nn.LayerNorm(width), nn.Linear(width, hidden_dim), nn.GELU(),
                                  nn.Linear(hidden_dim, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.body(x)


class AlignmentNetwork(nn.Sequential):
    """(..., in_dim) -> (..., out_dim): ``linear``, one affine map, or ``mlp``, affine maps to and from
    ``hidden_dim`` around ``blocks`` :class:`ResidualBlock` (inner width 2 · hidden_dim). ``recipe`` records the arguments."""

    def __init__(self, in_dim: int, out_dim: int, kind: AlignmentKind = "linear", hidden_dim: int = 512,
                 blocks: int = 1):
        if kind == "linear":
            layers: list[nn.Module] = [nn.Linear(in_dim, out_dim)]
        elif kind == "mlp":
            layers = [nn.Linear(in_dim, hidden_dim), *(ResidualBlock(hidden_dim, 2 * hidden_dim) for _ in range(blocks)),
                      nn.Linear(hidden_dim, out_dim)]
        else:
            raise ValueError(f"unknown alignment network {kind!r}; use 'linear' or 'mlp'")
        super().__init__(*layers)
        self.recipe = {"in_dim": in_dim, "out_dim": out_dim, "kind": kind, "hidden_dim": hidden_dim, "blocks": blocks}

"""Heads on top of backbone features."""

from __future__ import annotations

from torch import nn


class ProjectionMLP(nn.Sequential):
    """SimCLR's projection head: (B, in_dim) -> (B, out_dim), ``layers`` linear maps, each but the last
    without bias (BatchNorm cancels it) and followed by BatchNorm and ReLU."""

    def __init__(self, in_dim: int, hidden_dim: int, out_dim: int, layers: int = 2):
        if layers < 1:
            raise ValueError(f"a projection needs at least one layer, not {layers}")
        widths = [in_dim] + [hidden_dim] * (layers - 1)
        hidden = [block for width_in, width_out in zip(widths, widths[1:]) for block in (
            nn.Linear(width_in, width_out, bias=False), nn.BatchNorm1d(width_out), nn.ReLU(inplace=True))]
        super().__init__(*hidden, nn.Linear(widths[-1], out_dim))
        self.out_dim = out_dim

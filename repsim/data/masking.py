"""Block-wise patch masks for masked image modelling (BEiT, Bao et al. 2022; as used by iBOT).

A random ``share`` of a batch's views is masked, each to a ratio of its patch grid drawn uniformly from
``ratio``, with blocks of at least ``min_block`` patches and aspect ratios log-uniform in [1/``max_aspect``,
``max_aspect``], placed until the ratio is reached or no block fits. Every draw uses torch's global RNG,
so restoring it from a checkpoint replays the masks exactly.
"""

from __future__ import annotations

import math

import torch

from repsim.errors import SpecError

PLACEMENT_TRIES = 10


class BlockMasking:
    """``masking(views, grid)``: (views, rows·cols) bool masks, True where a patch is masked."""

    def __init__(self, ratio: tuple[float, float] = (0.1, 0.5), share: float = 0.5, min_block: int = 4,
                 max_aspect: float = 3.0):
        low, high = ratio
        if not 0 <= low <= high < 1:
            raise SpecError(f"the mask ratio range {ratio} is not within [0, 1)",
                            "give (low, high) with 0 ≤ low ≤ high < 1")
        if not 0 <= share <= 1:
            raise SpecError(f"the masked share of views is {share}", "give a share in [0, 1]")
        self.ratio, self.share, self.min_block = (low, high), share, min_block
        self.log_aspect = (-math.log(max_aspect), math.log(max_aspect))

    def __call__(self, views: int, grid: tuple[int, int]) -> torch.Tensor:
        masks = torch.zeros(views, *grid, dtype=torch.bool)
        for view in torch.randperm(views)[:round(self.share * views)].tolist():
            target, masked = round(_uniform(*self.ratio) * grid[0] * grid[1]), 0
            while masked < target and (added := self._add_block(masks[view], target - masked)):
                masked += added
        return masks.flatten(1)

    def _add_block(self, mask: torch.Tensor, budget: int) -> int:
        """Mask one random block adding between 1 and ``budget`` new patches; the number added (0: none fit)."""
        rows, cols = mask.shape
        for _ in range(PLACEMENT_TRIES):
            area = _uniform(self.min_block, budget)
            aspect = math.exp(_uniform(*self.log_aspect))
            height, width = round(math.sqrt(area * aspect)), round(math.sqrt(area / aspect))
            if not (0 < height < rows and 0 < width < cols):
                continue
            top = int(torch.randint(rows - height + 1, ()))
            left = int(torch.randint(cols - width + 1, ()))
            block = mask[top:top + height, left:left + width]
            added = int((~block).sum())
            if 0 < added <= budget:
                block.fill_(True)
                return added
        return 0


def _uniform(low: float, high: float) -> float:
    return low + (high - low) * float(torch.rand(()))

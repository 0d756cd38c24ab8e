"""What the contrastive losses share: the 2B views against the (global) 2B' views, self excluded."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_fn
import torch.nn.functional as F
from torch import nn

from repsim.device import distributed


class TemperatureLoss(nn.Module):
    """A view-pair loss at a positive ``temperature``, over the global batch when ``gather`` (DDP)."""

    def __init__(self, temperature: float = 0.1, gather: bool = False):
        super().__init__()
        if temperature <= 0:
            raise ValueError("temperature must be positive")
        self.temperature, self.gather = temperature, gather


def gather_with_grad(x: torch.Tensor, gather: bool) -> tuple[torch.Tensor, int]:
    """All ranks' ``x`` (B, ...) concatenated in rank order (B', ...), gradients flowing back to every
    rank, and the offset of this rank's rows. Without an initialised process group: (x, 0)."""
    if not (gather and distributed()):
        return x, 0
    return torch.cat(dist_fn.all_gather(x)), dist.get_rank() * x.shape[0]


def gather_no_grad(x: torch.Tensor, gather: bool) -> torch.Tensor:
    """All ranks' ``x`` (B, ...) concatenated in rank order, without gradient (labels, sample ids)."""
    if not (gather and distributed()):
        return x
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts)


@dataclass(frozen=True)
class ViewPairs:
    """Cosine logits of this rank's 2B views ``[view1; view2]`` (rows) against the global batch's 2B'
    (columns). Row r's own column ``row_ids[r]`` holds ``torch.finfo(dtype).min``: a softmax gives it 0
    and, unlike -inf, 0 · logit stays 0."""

    logits: torch.Tensor   # (2B, 2B') = z_r . z_c / temperature, self excluded
    row_ids: torch.Tensor  # (2B,) long
    global_batch: int      # B'
    offset: int            # this rank's first sample in the global batch

    @property
    def self_mask(self) -> torch.Tensor:
        """(2B, 2B') bool, True at each row's own column."""
        return torch.zeros_like(self.logits, dtype=torch.bool).scatter_(1, self.row_ids[:, None], True)

    def positive_ids(self) -> torch.Tensor:
        """(2B,) the column of each row's other view of the same sample."""
        return (self.row_ids + self.global_batch) % (2 * self.global_batch)


def at_least_float32(x: torch.Tensor) -> torch.Tensor:
    """Losses are computed in float32 (or float64) even when the model runs in half precision."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def view_pairs(z1: torch.Tensor, z2: torch.Tensor, temperature: float, gather: bool) -> ViewPairs:
    """Normalise the projections z1, z2 (B, D) and form the logits of every view pair."""
    if z1.shape != z2.shape or z1.ndim != 2:
        raise ValueError(f"z1 and z2 must both be (B, D); got {tuple(z1.shape)} and {tuple(z2.shape)}")
    z1, z2 = F.normalize(at_least_float32(z1), dim=1), F.normalize(at_least_float32(z2), dim=1)
    all1, offset = gather_with_grad(z1, gather)
    all2, _ = gather_with_grad(z2, gather)
    batch, global_batch = z1.shape[0], all1.shape[0]
    local_ids = torch.arange(batch, device=z1.device) + offset
    row_ids = torch.cat([local_ids, local_ids + global_batch])
    # The temperature scales the (2B, D) rows rather than the (2B, 2B') product, and the own column
    # is masked in place: the product is a fresh tensor that autograd does not keep.
    logits = (torch.cat([z1, z2]) / temperature) @ torch.cat([all1, all2]).T
    logits.scatter_(1, row_ids[:, None], torch.finfo(logits.dtype).min)
    return ViewPairs(logits, row_ids, global_batch, offset)

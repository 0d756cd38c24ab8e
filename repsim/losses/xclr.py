"""X-CLR: contrastive learning towards a soft graph of cross-sample similarities (Sobal et al., 2025)."""

from __future__ import annotations

import torch
from torch import nn

from repsim.losses._pairs import at_least_float32, view_pairs


def target_mass(similarity: torch.Tensor, target_temperature: float, offset: int = 0) -> torch.Tensor:
    """X-CLR's target (R, B'): [i, j] the probability a view of sample i puts on each view of sample j
    (on i's other view for j = i), from ``similarity`` rows (R, B') of samples offset, ..., offset + R - 1.

    Over the 2B' - 1 other views the target is ``softmax(s / target_temperature)`` with s[i, i] = 1; both
    views of j share s[i, j], so with q the softmax over the B' samples the row is ``q / (2 - q[i, i])``."""
    scaled = at_least_float32(similarity) / target_temperature
    scaled.diagonal(offset).fill_(1.0 / target_temperature)
    probabilities = torch.softmax(scaled, dim=1)
    return probabilities / (2 - probabilities.diagonal(offset))[:, None]


class _SoftViewCrossEntropy(torch.autograd.Function):
    """Mean cross-entropy of softmax(logits (2B, 2B')) against the view-pair target of ``mass`` (B, B'),
    without materialising it: row (a, i) targets ``mass[i, j]`` on both views of every j but its own
    column, which lies on the diagonal at ``offset`` of block (a, a) of the (2, B, 2, B') view. The
    gradient is ``p[r] - target[r]``; none flows to ``mass``."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, mass: torch.Tensor, offset: int) -> torch.Tensor:
        batch, global_batch = mass.shape
        mass = mass.to(logits.dtype)
        log_probs = torch.log_softmax(logits, dim=1)
        blocks = log_probs.view(2, batch, 2, global_batch)
        # the own column adds nothing: sample i's folded entry is its other view alone
        folded = blocks.sum(dim=2)                                                         # (2, B, B')
        for view in (0, 1):
            folded[view].diagonal(offset).copy_(blocks[view, :, 1 - view].diagonal(offset))
        expected = folded.mul_(mass).sum(dim=2)                                            # (2, B)
        ctx.save_for_backward(log_probs, mass)
        ctx.offset = offset
        return -expected.mean()

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        log_probs, mass = ctx.saved_tensors
        batch, global_batch = mass.shape
        grad = log_probs.exp()
        blocks = grad.view(2, batch, 2, global_batch)
        blocks.sub_(mass[None, :, None, :])
        own_mass = mass.diagonal(ctx.offset)
        for view in (0, 1):                                                               # own target is 0
            blocks[view, :, view].diagonal(ctx.offset).add_(own_mass)
        return grad.mul_(grad_output / (2 * batch)), None, None


class XCLRLoss(nn.Module):
    """Cross-entropy between ``softmax(s / target_temperature)`` and ``softmax(z z^T / temperature)`` over
    the 2B views, self excluded; s between views of i and j is ``similarity[i, j]``, 1 for i = j. With s =
    identity and target_temperature -> 0 this is NT-Xent; with s = same-label, SupCon.

    Shapes: z1, z2 (B, D) projections of the two views (normalised here); similarity (B', B'), B' the
    global batch (world size x B) when ``gather`` (DDP, gradients across ranks), else B. Returns a scalar.

    >>> loss = XCLRLoss(temperature=0.1, target_temperature=0.1)
    >>> z1, z2, similarity = torch.randn(8, 128), torch.randn(8, 128), torch.rand(8, 8)  # B = 8, D = 128
    >>> loss(z1, z2, similarity).shape  # a scalar
    torch.Size([])
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
        rows = similarity.detach().narrow(0, pairs.offset, len(z1))                          # (B, B')
        mass = target_mass(rows, self.target_temperature, pairs.offset)
        return _SoftViewCrossEntropy.apply(pairs.logits, mass, pairs.offset)

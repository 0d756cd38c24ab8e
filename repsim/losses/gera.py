"""GeRA: geometrically regularised alignment of two frozen embedding spaces (Klebe et al.).

The loss is CLIP's symmetric InfoNCE on the aligned paired points plus ``alpha · (geo_A + geo_B)``;
a geometric term is the mean ``KL(P_row ‖ Q_row)`` (nats, like InfoNCE) between the rows of a kernel
over each paired point and n of its unpaired neighbors in its own modality, before (P) and after (Q)
alignment. Kernels over m = n + 1 points, entries floored at ``KERNEL_FLOOR``, rows normalised to 1:

- ``heat`` (the paper's): ``exp(-‖a - b‖² / ε)``, ε = σ · the mean distance between distinct points,
  so not scale-invariant: σ is tuned per pair of spaces;
- ``heat_squared``: ε = σ · the mean *squared* distance, invariant to uniform scaling too;
- ``cosine``: ``(1 + cos(a, b)) / 2``;
- ``knn``: 1 where b is among a's ``knn_k`` nearest (a included), else the floor; no gradient, so a
  measure of kept neighbors (about ``-log(KERNEL_FLOOR) / k`` nats per lost one), not a training signal.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from repsim.losses._pairs import at_least_float32
from repsim.losses.clip import ClipLoss

Kernel = Literal["heat", "heat_squared", "cosine", "knn"]
KERNELS: tuple[str, ...] = ("heat", "heat_squared", "cosine", "knn")
EPSILON_FLOOR = 1e-12
KERNEL_FLOOR = 1e-12


def neighborhood_kernel(points: torch.Tensor, kind: Kernel = "heat", sigma: float = 1.0,
                         knn_k: int = 5) -> torch.Tensor:
    """Row-normalised kernels (module docstring) over neighborhoods: points (B, m, D) -> (B, m, m), every
    row a strictly positive distribution; ``sigma`` scales the heat kernels' ε, ``knn_k`` counts self.

    >>> points = torch.tensor([[[0.0, 0.0], [3.0, 0.0], [0.0, 4.0]]])  # distances 3, 4 and 5: ε = 4
    >>> neighborhood_kernel(points)[0, 0]  # ∝ exp(-[0, 9, 16] / 4)
    tensor([0.8899, 0.0938, 0.0163])
    """
    if points.ndim != 3 or points.shape[1] < 2:
        raise ValueError(f"points must be (B, m, D) with m >= 2, not {tuple(points.shape)}")
    points = at_least_float32(points)
    if kind in ("heat", "heat_squared"):
        kernel = _heat(points, sigma, squared_epsilon=kind == "heat_squared")
    elif kind == "cosine":
        unit = F.normalize(points, dim=-1)
        kernel = (1 + unit @ unit.transpose(1, 2)) / 2
    elif kind == "knn":
        if not 1 <= knn_k <= points.shape[1]:
            raise ValueError(f"knn_k must be from 1 to the neighborhood size {points.shape[1]}, not {knn_k}")
        distances = torch.cdist(points, points)
        kernel = torch.zeros_like(distances).scatter_(-1, distances.topk(knn_k, dim=-1, largest=False).indices, 1.0)
    else:
        raise ValueError(f"unknown kernel {kind!r}; use one of {', '.join(KERNELS)}")
    kernel = kernel.clamp(min=KERNEL_FLOOR)
    return kernel / kernel.sum(dim=-1, keepdim=True)


def _heat(points: torch.Tensor, sigma: float, squared_epsilon: bool) -> torch.Tensor:
    """exp(-d² / ε), ε = σ · the mean over distinct pairs of d (or of d² with ``squared_epsilon``)."""
    distances = torch.cdist(points, points)
    squared = distances.square()
    m = points.shape[1]
    epsilon = sigma * (squared if squared_epsilon else distances).sum(dim=(1, 2), keepdim=True) / (m * (m - 1))
    return torch.exp(-squared / epsilon.clamp(min=EPSILON_FLOOR))


class GeometricLoss(nn.Module):
    """Mean over neighborhoods and rows of ``KL(K(inputs)_row ‖ K(aligned)_row)`` in nats, of inputs
    (B, m, D_in) and aligned (B, m, D_out), the same m points in the same order. Returns a scalar.

    >>> loss = GeometricLoss(kernel="heat", sigma=1.0)
    >>> inputs, aligned = torch.randn(4, 6, 32), torch.randn(4, 6, 8)  # B = 4 neighborhoods of m = 6 points
    >>> loss(inputs, aligned).shape  # a scalar
    torch.Size([])
    """

    def __init__(self, kernel: Kernel = "heat", sigma: float = 1.0, knn_k: int = 5):
        super().__init__()
        if kernel not in KERNELS:
            raise ValueError(f"unknown kernel {kernel!r}; use one of {', '.join(KERNELS)}")
        if sigma <= 0:
            raise ValueError("sigma must be positive")
        self.kernel, self.sigma, self.knn_k = kernel, sigma, knn_k

    def forward(self, inputs: torch.Tensor, aligned: torch.Tensor) -> torch.Tensor:
        if inputs.shape[:2] != aligned.shape[:2]:
            raise ValueError(f"inputs {tuple(inputs.shape)} and aligned {tuple(aligned.shape)} "
                             "must hold the same (B, m) neighborhoods")
        with torch.no_grad():
            target = neighborhood_kernel(inputs, self.kernel, self.sigma, self.knn_k)
        predicted = neighborhood_kernel(aligned, self.kernel, self.sigma, self.knn_k)
        return (target * (target.log() - predicted.log())).sum(dim=-1).mean()


class GeRALoss(nn.Module):
    """Symmetric InfoNCE on the paired points + ``alpha · (geo_A + geo_B)``, as scalars ``{"loss",
    "contrastive", "geo_a", "geo_b"}`` (with alpha 0 the geometric terms carry no gradient).

    x (B, m, D_a) and y (B, m, D_b) are frozen neighborhoods, fx and gy (B, m, d) their aligned images;
    row 0 is the paired point (x[:, 0] pairs with y[:, 0]). With m = 1 only InfoNCE is left.

    >>> loss = GeRALoss(alpha=1.0)
    >>> x, y, fx, gy = torch.randn(4, 6, 32), torch.randn(4, 6, 24), torch.randn(4, 6, 8), torch.randn(4, 6, 8)
    >>> loss(x, y, fx, gy)["loss"].shape  # B = 4 neighborhoods of m = 6 points: a scalar
    torch.Size([])
    """

    def __init__(self, alpha: float = 1.0, temperature: float = 0.07, learn_temperature: bool = True,
                 kernel: Kernel = "heat", sigma: float = 1.0, knn_k: int = 5):
        super().__init__()
        if alpha < 0:
            raise ValueError("alpha must be non-negative")
        self.alpha = alpha
        self.contrastive = ClipLoss(temperature, learnable=learn_temperature)
        self.geometric = GeometricLoss(kernel, sigma, knn_k)

    def forward(self, x: torch.Tensor, y: torch.Tensor, fx: torch.Tensor, gy: torch.Tensor) -> dict[str, torch.Tensor]:
        contrastive = self.contrastive(fx[:, 0], gy[:, 0])
        if x.shape[1] < 2:
            zero = contrastive.new_zeros(())
            return {"loss": contrastive, "contrastive": contrastive, "geo_a": zero, "geo_b": zero}
        with torch.set_grad_enabled(torch.is_grad_enabled() and self.alpha > 0):
            geo_a, geo_b = self.geometric(x, fx), self.geometric(y, gy)
        return {"loss": contrastive + self.alpha * (geo_a + geo_b), "contrastive": contrastive,
                "geo_a": geo_a, "geo_b": geo_b}

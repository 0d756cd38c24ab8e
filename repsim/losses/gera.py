"""GeRA: geometrically regularised alignment of two frozen embedding spaces (Klebe et al.).

Alignment networks f, g map paired embeddings x (modality A) and y (modality B) into a shared space.
The loss is CLIP's symmetric InfoNCE on the paired points plus ``alpha · (geo_A + geo_B)``, where a
geometric term compares, for each paired point, a kernel over the point and n of its neighbors among
the unpaired points of its own modality, before and after alignment.

Kernels over a neighborhood of m = n + 1 points (the paired point first), each entry floored at
``KERNEL_FLOOR`` (every kernel's largest entry, a point with itself, is 1) and each row normalised to
sum to 1, so every row is a strictly positive distribution over the neighborhood:

- ``heat`` (the paper's): ``exp(-‖a - b‖² / ε)`` with ε = σ · the mean Euclidean distance between
  the m(m - 1) ordered pairs of distinct points of that neighborhood. It is invariant to rotations
  and translations, not to scaling: ε grows like the distances, the exponent like their squares, so
  a space's scale sharpens or flattens its kernel and σ is tuned per pair of embedding spaces.
- ``heat_squared``: the same with ε = σ · the mean *squared* distance, which also makes the kernel
  invariant to uniform scaling (an ablation of the paper's ε).
- ``cosine``: ``(1 + cos(a, b)) / 2``, in [0, 1]; invariant to rotations and uniform scaling.
- ``knn``: 1 where b is among the ``knn_k`` nearest points of a in the neighborhood (a itself
  included), else 0 (the floor). It is piecewise constant, so it passes no gradient: a measure of
  how well neighborhoods are kept, not a training signal.

The geometric term of one modality is ``KL(P_row ‖ Q_row)`` between each row P of the input-space
kernel and the same row Q of the aligned-space kernel, averaged over rows and paired points — the
divergence SNE and t-SNE minimise for exactly such row-normalised neighborhood kernels. It is
measured in nats, like InfoNCE (the cross-entropy of each paired point's softmax row against its
partner), so α weighs the two terms in the same units whatever the neighborhood size m or the
embedding scale. The term itself stays small (with ``heat_squared``, about 0.002 nats for a random
linear map, which nearly preserves distances, and 0.02 after contrastive training alone), so the
useful α is large; the shipped α and σ were chosen on held-out data (``configs/gera.yaml``). A squared distance between rows,
the obvious alternative, shrinks like 1/m as the entries do, and rescaling it by m or by its value
at initialisation would only tie α to m or to the initial map. For ``knn`` each lost neighbor
costs about ``-log(KERNEL_FLOOR) / k`` nats, so the term counts neighbors lost.
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
    """Row-normalised kernels over neighborhoods: points (B, m, D) -> (B, m, m), every row a strictly
    positive distribution (entries floored at ``KERNEL_FLOOR`` before normalising).

    See the module docstring for the kernels; ``sigma`` scales the heat kernels' ε, ``knn_k`` is the
    binary kernel's neighbor count (self included, at most m).

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
        kernel = _binary_knn(points, knn_k)
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


def _binary_knn(points: torch.Tensor, k: int) -> torch.Tensor:
    if not 1 <= k <= points.shape[1]:
        raise ValueError(f"knn_k must be from 1 to the neighborhood size {points.shape[1]}, not {k}")
    nearest = torch.cdist(points, points).topk(k, dim=-1, largest=False).indices
    return torch.zeros(points.shape[:2] + points.shape[1:2], dtype=points.dtype, device=points.device).scatter_(
        -1, nearest, 1.0)


class GeometricLoss(nn.Module):
    """How much alignment distorts neighborhoods: mean over paired points and rows of
    ``KL(K(inputs)_row ‖ K(aligned)_row)``, in nats.

    Shapes: inputs (B, m, D_in) and aligned (B, m, D_out), the same m points per neighborhood in the
    same order (the paired point first). Returns a scalar.

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
    """Symmetric InfoNCE on the paired points + ``alpha · (geo_A + geo_B)``.

    Shapes: x (B, m, D_a) and y (B, m, D_b) frozen neighborhoods, fx (B, m, d) and gy (B, m, d) their
    aligned images; row 0 of each neighborhood is the paired point (x[:, 0] pairs with y[:, 0]), the
    other rows its sampled unpaired neighbors in its own modality. With m = 1 only InfoNCE is left.
    Returns ``{"loss", "contrastive", "geo_a", "geo_b"}`` scalars; with ``alpha == 0`` the geometric
    terms are still reported (when m > 1) but carry no gradient.

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

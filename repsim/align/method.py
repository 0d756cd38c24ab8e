"""Training the alignment networks with the shared :class:`~repsim.methods.trainer.Trainer`, which
:class:`PairedBatches` feeds: per modality, B paired points each followed by n neighbors sampled
afresh every step from its L nearest unpaired points, ``x`` (B, n + 1, D_a) and ``y`` (B, n + 1, D_b).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from repsim._checks import as_features
from repsim.align.config import AlignConfig, GeometryConfig
from repsim.losses.gera import GeRALoss
from repsim.methods.base import Method
from repsim.models.alignment import AlignmentNetwork

ALIGNMENT_FILE = "alignment.pt"


def sample_neighbors(rows: int, available: int, samples: int, strategy: str, generator: torch.Generator,
                      rank_exponent: float = 1.0) -> torch.Tensor:
    """(rows, samples) distinct ranks in [0, available) per row of nearest-first neighbors: ``nearest`` 0..n-1,
    ``uniform``, or ``rank``, each draw ∝ (rank + 1)^-rank_exponent among those left (Gumbel top-k)."""
    if not 1 <= samples <= available:
        raise ValueError(f"cannot sample {samples} of {available} neighbors")
    if strategy == "nearest":
        return torch.arange(samples).expand(rows, samples)
    keys = torch.rand(rows, available, generator=generator)
    if strategy == "rank":
        gumbel = -torch.log(-torch.log(keys.clamp(min=1e-20)))
        keys = gumbel - rank_exponent * torch.log1p(torch.arange(available, dtype=torch.float32))
    elif strategy != "uniform":
        raise ValueError(f"unknown neighbor sampling strategy {strategy!r}")
    return keys.topk(samples, dim=1).indices


class PairedBatches:
    """Each epoch the M ``paired`` rows (M,) in a seeded order, as ceil(M / batch_size) near-equal
    ``{"x", "y"}`` batches (module docstring) of the tables image (N, D_a) and text (N, D_b); neighbors
    per modality (M, L): table rows of the L nearest unpaired points of each paired point."""

    def __init__(self, image: np.ndarray, text: np.ndarray, paired: np.ndarray, image_neighbors: np.ndarray,
                 text_neighbors: np.ndarray, geometry: GeometryConfig, batch_size: int, seed: int = 0):
        self.image, self.text = as_features(image, "image table").float(), as_features(text, "text table").float()
        self.paired = torch.as_tensor(paired, dtype=torch.int64)
        self.neighbors = (torch.as_tensor(image_neighbors), torch.as_tensor(text_neighbors))
        self.geometry, self.seed, self.epoch = geometry, seed, 0
        self.batch_size = min(batch_size, len(self.paired))

    def __len__(self) -> int:
        return math.ceil(len(self.paired) / self.batch_size)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
        self.epoch += 1
        for batch in torch.randperm(len(self.paired), generator=generator).tensor_split(len(self)):
            yield {"x": self._neighborhoods(self.image, self.neighbors[0], batch, generator),
                   "y": self._neighborhoods(self.text, self.neighbors[1], batch, generator)}

    def _neighborhoods(self, table: torch.Tensor, neighbors: torch.Tensor, batch: torch.Tensor,
                        generator: torch.Generator) -> torch.Tensor:
        """(B, n + 1, D): each paired point of ``batch`` followed by n of its sampled neighbors."""
        geometry = self.geometry
        ranks = sample_neighbors(len(batch), neighbors.shape[1], geometry.samples, geometry.strategy, generator,
                                  geometry.rank_exponent)
        rows = torch.cat([self.paired[batch, None], neighbors[batch].gather(1, ranks)], dim=1)
        return table[rows]


class AlignmentMethod(Method):
    """f (image) and g (text) alignment networks trained with :class:`~repsim.losses.GeRALoss`."""

    def __init__(self, image_dim: int, text_dim: int, config: AlignConfig):
        super().__init__()
        model, geometry = config.model, config.geometry
        self.image_net, self.text_net = (AlignmentNetwork(dim, model.dim, model.kind, model.hidden_dim, model.blocks)
                                         for dim in (image_dim, text_dim))
        self.loss = GeRALoss(geometry.alpha, config.loss.temperature, config.loss.learn_temperature,
                             geometry.kernel, geometry.sigma, geometry.knn_k)

    @property
    def encoder(self) -> AlignmentNetwork:
        return self.image_net

    def training_step(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        x, y = batch["x"], batch["y"]
        return self.loss(x, y, self.image_net(x), self.text_net(y))


def save_alignment(method: AlignmentMethod, path: Path) -> None:
    """Write both networks' recipes and weights (loadable with weights_only)."""
    torch.save({name: {"recipe": net.recipe, "state_dict": net.state_dict()}
                for name, net in (("image", method.image_net), ("text", method.text_net))}, path)


def load_alignment(path: str | Path, device: str | torch.device = "cpu") -> tuple[AlignmentNetwork, AlignmentNetwork]:
    """(f, g) in eval mode, from an ``alignment.pt`` or an align stage directory."""
    path = Path(path)
    saved: dict[str, Any] = torch.load(path / ALIGNMENT_FILE if path.is_dir() else path, map_location="cpu",
                                       weights_only=True)
    networks = []
    for name in ("image", "text"):
        network = AlignmentNetwork(**saved[name]["recipe"])
        network.load_state_dict(saved[name]["state_dict"])
        networks.append(network.to(device).eval())
    return networks[0], networks[1]

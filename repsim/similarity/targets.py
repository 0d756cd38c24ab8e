"""What X-CLR's targets look like for a similarity source: the target probabilities of random batches.

For a batch of B samples, X-CLR's target for a view of sample i puts
:func:`~repsim.losses.xclr.target_mass` [i, j] on each view of sample j (``softmax(s / τ_s)`` over
the 2B - 1 other views). Sampling seeded random batches from the dataset and collecting the mass on
the other samples (j ≠ i) shows how sharply a source and τ_s concentrate the targets: identity puts
nothing there, labels spread it uniformly over same-class samples, graded sources (WordNet,
captions) spread it over a continuum.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import torch

from repsim.errors import SimilarityError
from repsim.losses.xclr import target_mass
from repsim.similarity.sources import SimilaritySource


def manifest_labels(manifest: str | Path) -> np.ndarray:
    """(N,) int64 labels of a shard manifest, in manifest order (-1 where a row has none)."""
    column = pq.read_table(manifest, columns=["label"]).column("label").to_numpy(zero_copy_only=False)
    return np.nan_to_num(column.astype(np.float64), nan=-1).astype(np.int64)


def sample_targets(source: SimilaritySource, labels: np.ndarray, target_temperature: float = 0.1,
                   batch_size: int = 256, batches: int = 8, seed: int = 0) -> np.ndarray:
    """X-CLR's target mass on pairs of different samples over ``batches`` seeded random batches of
    ``batch_size`` of the N samples with ``labels`` (N,): a flat float32 array of B (B - 1) values per batch."""
    count = len(labels)
    if count < 2 or target_temperature <= 0:
        raise SimilarityError(f"cannot sample targets from {count} samples at target_temperature={target_temperature}",
                              "pass at least 2 samples and a positive target temperature")
    rng = np.random.default_rng(seed)
    size = min(batch_size, count)
    values = []
    for _ in range(batches):
        indices = np.sort(rng.choice(count, size, replace=False))
        similarity = source(torch.from_numpy(indices), torch.from_numpy(labels[indices]))
        mass = target_mass(similarity, target_temperature)
        values.append(mass[~torch.eye(size, dtype=torch.bool)].float().numpy())
    return np.concatenate(values)


def target_histogram(source: SimilaritySource, labels: np.ndarray, path: str | Path, name: str,
                     target_temperature: float = 0.1, batch_size: int = 256, seed: int = 0) -> Path:
    """A PNG histogram at ``path`` of :func:`sample_targets` for the source called ``name``."""
    from repsim.plots import histogram_plot  # matplotlib loads only when a figure is drawn

    values = sample_targets(source, labels, target_temperature, batch_size, seed=seed)
    size = min(batch_size, len(labels))
    return histogram_plot(values, path, title=f"X-CLR targets, {name}, τ_s = {target_temperature:g}, B = {size}",
                          xlabel=f"target probability of a view of sample j ≠ i (uniform: 1/{2 * size - 1})")

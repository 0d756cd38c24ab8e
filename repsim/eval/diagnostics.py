"""Embedding diagnostics (effective rank, spread, alignment, uniformity), in float64 and in chunks of rows."""

from __future__ import annotations

import math
from collections.abc import Iterator

import numpy as np
import torch

from repsim.errors import EvalError
from repsim._checks import ArrayLike, as_features, check_positive, resolve_device, unit_rows

ROW_CHUNK = 65536
PAIR_CHUNK = 1024
RANKME_EPS = 1e-7


def effective_rank(embeddings: ArrayLike, *, device: str | torch.device | None = None) -> float:
    """RankMe (Garrido et al. 2023) of embeddings (N, D): exp of the entropy of p_k = σ_k / Σσ + ε, σ the
    singular values of the uncentred matrix; in [1, min(N, D)] up to ε (D for isotropic data)."""
    embeddings = as_features(embeddings, "embeddings")
    device = resolve_device(device)
    gram = sum(chunk.T @ chunk for chunk in _chunks(embeddings, device, normalise=False))
    singular_values = torch.linalg.eigvalsh(gram).clamp(min=0).sqrt()
    p = singular_values / singular_values.sum().clamp(min=torch.finfo(torch.float64).tiny) + RANKME_EPS
    return math.exp(-(p * p.log()).sum().item())


def embedding_std(embeddings: ArrayLike, *, device: str | torch.device | None = None) -> float:
    """Mean over dimensions of the (population) std of the L2-normalised embeddings (N, D): 0 at
    collapse, about 1/sqrt(D) for well-spread embeddings."""
    embeddings = as_features(embeddings, "embeddings")
    device = resolve_device(device)
    mean = sum(chunk.sum(dim=0) for chunk in _chunks(embeddings, device, normalise=True)) / len(embeddings)
    variance = sum((chunk - mean).square().sum(dim=0) for chunk in _chunks(embeddings, device, normalise=True))
    return (variance / len(embeddings)).sqrt().mean().item()


def mean_cosine(embeddings: ArrayLike, *, device: str | torch.device | None = None) -> float:
    """Mean cosine similarity between distinct rows of embeddings (N ≥ 2, D): near 1 for a narrow cone,
    near 0 for directions spread around the origin."""
    embeddings = as_features(embeddings, "embeddings")
    if len(embeddings) < 2:
        raise EvalError(f"mean_cosine needs at least 2 embeddings, got {len(embeddings)}", "pass more rows")
    total = sum(chunk.sum(dim=0) for chunk in _chunks(embeddings, resolve_device(device), normalise=True))
    return ((total.square().sum() - len(embeddings)) / (len(embeddings) * (len(embeddings) - 1))).item()


def alignment(x: ArrayLike, y: ArrayLike, alpha: float = 2) -> float:
    """Wang & Isola's alignment E ‖x̂_i − ŷ_i‖^α over positive pairs (rows of x, y (N, D)), unit-normalised."""
    x, y = as_features(x, "x"), as_features(y, "y")
    if x.shape != y.shape:
        raise EvalError(f"x has shape {tuple(x.shape)} but y has {tuple(y.shape)}", "pass row-aligned positive pairs")
    check_positive(alpha, "alpha")
    cpu = torch.device("cpu")
    distances = (unit_rows(x, cpu, torch.float64) - unit_rows(y, cpu, torch.float64)).norm(dim=1)
    return distances.pow(alpha).mean().item()


def uniformity(x: ArrayLike, t: float = 2, *, max_samples: int = 10000, seed: int = 0,
               device: str | torch.device | None = None) -> float:
    """Wang & Isola's uniformity log E_{i<j} exp(−t ‖x̂_i − x̂_j‖²) of unit-normalised rows of x (N, D),
    on a seeded subset of ``max_samples`` rows when there are more."""
    x = as_features(x, "x")
    check_positive(t, "t")
    if len(x) < 2:
        raise EvalError("uniformity needs at least two samples, got 1", "pass more samples")
    if len(x) > max_samples:
        x = x[np.sort(np.random.default_rng(seed).choice(len(x), max_samples, replace=False))]
    points = unit_rows(x, resolve_device(device), torch.float64)
    indices = torch.arange(len(points), device=points.device)
    log_sums = []
    for start in range(0, len(points), PAIR_CHUNK):
        rows = points[start:start + PAIR_CHUNK]
        squared = (2 - 2 * rows @ points.T).clamp(min=0)
        later = indices > indices[start:start + len(rows), None]
        log_sums.append(torch.logsumexp((-t * squared).masked_fill(~later, float("-inf")).flatten(), dim=0))
    pairs = len(points) * (len(points) - 1) / 2
    return (torch.logsumexp(torch.stack(log_sums), dim=0) - math.log(pairs)).item()


def embedding_diagnostics(embeddings: ArrayLike, *, device: str | torch.device | None = None) -> dict[str, float]:
    """``{"effective_rank", "embedding_std", "uniformity"}`` of embeddings (N, D)."""
    return {"effective_rank": effective_rank(embeddings, device=device),
            "embedding_std": embedding_std(embeddings, device=device),
            "uniformity": uniformity(embeddings, device=device)}


def _chunks(embeddings: torch.Tensor, device: torch.device, normalise: bool) -> Iterator[torch.Tensor]:
    """Row chunks of embeddings as float64 on ``device``, optionally L2-normalised."""
    for chunk in embeddings.split(ROW_CHUNK):
        yield unit_rows(chunk, device, torch.float64) if normalise else chunk.to(device=device, dtype=torch.float64)

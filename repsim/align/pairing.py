"""The seeded pairing of training table rows (M pairs, and per modality an independent pool of unpaired
rows, so a sample unpaired in both is not known to be one pair) and each paired row's unpaired neighbors."""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path

import numpy as np

from repsim.errors import SpecError
from repsim.similarity.neighbors import knn

NEIGHBOUR_FILES = {"image": "neighbors_image.npy", "text": "neighbors_text.npy"}


@dataclass(frozen=True)
class Pairing:
    """``paired`` (M,), ``unpaired_image`` (U_a,) and ``unpaired_text`` (U_b,): sorted int64 table rows;
    ``paired`` is disjoint from both pools. Saved as ``<field>.npy``."""

    paired: np.ndarray
    unpaired_image: np.ndarray
    unpaired_text: np.ndarray

    def save(self, folder: Path) -> None:
        for field in fields(self):
            np.save(folder / f"{field.name}.npy", getattr(self, field.name))

    @classmethod
    def load(cls, folder: Path) -> Pairing:
        return cls(*(np.load(folder / f"{field.name}.npy") for field in fields(cls)))


def draw_pairing(count: int, pairs: int, unpaired: int | None = None, seed: int = 0) -> Pairing:
    """M = ``pairs`` paired rows of ``count``, and per modality ``unpaired`` rows (default: all the
    rest) drawn independently from the rest; SpecError when the split is too small."""
    if not 2 <= pairs < count:
        raise SpecError(f"pairing.pairs is {pairs} but the training split holds {count} samples",
                        f"choose from 2 to {count - 1}, leaving unpaired points")
    order = np.random.default_rng(seed).permutation(count)
    paired, rest = np.sort(order[:pairs]), order[pairs:]
    pool = len(rest) if unpaired is None else unpaired
    if pool > len(rest):
        raise SpecError(f"pairing.unpaired is {pool} but only {len(rest)} samples are left after {pairs} pairs",
                        f"choose at most {len(rest)}, or leave it unset for all of them")
    image_pool, text_pool = (np.sort(np.random.default_rng([seed, stream]).choice(rest, pool, replace=False))
                             for stream in (1, 2))
    return Pairing(paired.astype(np.int64), image_pool.astype(np.int64), text_pool.astype(np.int64))


def neighbor_lists(embeddings: np.ndarray, paired: np.ndarray, pool: np.ndarray, count: int,
                    index: str = "flat") -> np.ndarray:
    """(M, L) int64 table rows: the ``count`` (L) nearest ``pool`` rows of each paired row by cosine, nearest first."""
    if count > len(pool):
        raise SpecError(f"neighbors.count (L = {count}) exceeds the {len(pool)} unpaired points",
                        f"choose L from 1 to {len(pool)}, or pair fewer points")
    ids, _ = knn(embeddings, count, queries=embeddings[paired], index=index, metric="cosine",
                 exclude_self=False, subset=pool)
    return ids

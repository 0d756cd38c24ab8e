"""A small real dataset for tests: the first 40 Animal-MNIST silhouettes of four classes, as an image folder."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import yaml
from PIL import Image

from repsim.data.stage import ShardResult, shard
from repsim.data.sources import animal_mnist_root, load_numpy_pickle

CLASSES = {"bear": "bear.n.01", "cat": "cat.n.01", "dog": "dog.n.01", "horse": "horse.n.01"}
ANIMAL_LABELS = {"bear": 0, "cat": 2, "dog": 4, "horse": 7}  # their labels in Animal-MNIST
PER_CLASS = 40


def animal_shards(root: Path, shard_size: int) -> tuple[Path, ShardResult]:
    """(data spec, shards) of the four classes' first PER_CLASS images, written under ``root``
    (80/20 random split, two caption templates)."""
    images = load_numpy_pickle(animal_mnist_root() / "animal_data_version_3.gz")
    labels = load_numpy_pickle(animal_mnist_root() / "animal_label_version_3.gz")
    for name, label in ANIMAL_LABELS.items():
        (root / "images" / name).mkdir(parents=True)
        for i, row in enumerate(np.flatnonzero(labels == label)[:PER_CLASS]):
            Image.fromarray(images[row]).save(root / "images" / name / f"{i:03d}.png")
    spec = root / "animals.yaml"
    spec.write_text(yaml.safe_dump({
        "name": "animals", "source": {"type": "image_folder", "root": "images"}, "classes": CLASSES,
        "captions": {"templates": ["a photo of a {name}.", "a silhouette of a {name}."]},
        "split": {"type": "random", "fractions": {"train": 0.8, "test": 0.2}}, "shard_size": shard_size}))
    return spec, shard(spec, out_dir=root / "shards", progress=False)

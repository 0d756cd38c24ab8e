"""What the SOP and GeRA reproductions share: the shipped data specs, seeded subsets of them, and the
kNN and linear-probe scores of an encoder."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import yaml

from repsim.data.stage import ShardResult
from repsim.data.spec import load_spec
from repsim.eval.stage import evaluate, read_results
from repsim.stage import repsim_home

REPO = Path(__file__).resolve().parents[1]
SPECS = {"fashion-mnist": REPO / "data_specs" / "fashion-mnist.yaml",
         "animal-mnist": REPO / "data_specs" / "animal-mnist.yaml"}
KNN_K = 20
SUITES = ("knn", "linear")


@dataclass(frozen=True)
class Score:
    """kNN and linear-probe top-1 accuracy of one encoder on the test split."""

    knn: float
    linear: float


def subset_spec(spec_path: Path, train_fraction: float, test_fraction: float) -> Path:
    """A data spec of ``spec_path``'s images split at random (stratified, seed 0) into ``train``,
    ``test`` and an unused rest, written under ``$REPSIM_HOME/specs``."""
    spec = load_spec(spec_path).model_dump(mode="json")
    rest = round(1.0 - train_fraction - test_fraction, 9)
    fractions = {"train": train_fraction, "test": test_fraction} | ({"unused": rest} if rest > 0 else {})
    name = f"{spec['name']}-train{train_fraction:g}-test{test_fraction:g}"
    spec |= {"name": name, "split": {"type": "random", "fractions": fractions, "seed": 0, "stratify": True}}
    path = repsim_home() / "specs" / f"{name}.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


def score(shards: ShardResult, encoder: str | Path, device: torch.device) -> Score:
    """kNN (k = KNN_K) and linear-probe top-1 of ``encoder`` ("pixels" or a train stage), cached."""
    suites = read_results(evaluate(shards, encoder, SUITES, KNN_K, device=device, progress=False))["suites"]
    return Score(suites["knn"][f"knn_top1_k{KNN_K}"], suites["linear"]["linear_top1"])


def mean_std(values: Sequence[float]) -> str:
    spread = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{100 * statistics.mean(values):.2f} ± {100 * spread:.2f}"

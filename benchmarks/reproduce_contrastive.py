"""Reproduce the contrastive comparison: SimCLR, SupCon, X-CLR (WordNet), X-CLR (captions) and CLIP.

Every method is trained from its shipped config (``configs/<method>.yaml``) with the same backbone,
epochs, batch size and augmentations (``--set``-style overrides), over ``--seeds`` seeds, as cached
train stages; each encoder is scored by the evaluate stage (weighted cosine kNN and a linear probe
on frozen features of the train split, tested on the test split). A τ_s sweep of X-CLR (WordNet) on
the first seed and the raw-pixel floor complete ``benchmarks/REPORT.md``.

CPU default: a seeded, stratified subset of the dataset (``--train-fraction``/``--test-fraction`` of
all its images, through a derived data spec), a standard-stem ResNet-18 and a few epochs. ``--full``:
the data spec's own split, the small-images stem and a GPU-sized schedule.

    python benchmarks/reproduce_contrastive.py [--dataset animal-mnist] [--full] [--device cuda]
    python benchmarks/reproduce_contrastive.py --dataset animal-mnist --train-fraction 0.02 \\
        --test-fraction 0.02 --epochs 1 --batch-size 64 --seeds 1 --target-temperatures 0.2 \\
        --report /tmp/REPORT.md                                    # a smoke test

Stages live under ``$REPSIM_HOME``: an interrupted run resumes, a repeated one only rewrites the report
(above its ``## Analysis`` heading, which holds the hand-written reading of the numbers).
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import yaml
from _report import write_report

from repsim.data.sharding import ShardResult, shard
from repsim.data.spec import load_spec
from repsim.eval.stages import evaluate, read_results
from repsim.methods.config import load_config
from repsim.methods.stage import train
from repsim.similarity.wordnet import class_similarity
from repsim.stage import repsim_home

REPO = Path(__file__).resolve().parents[1]
SPECS = {"fashion-mnist": REPO / "data_specs" / "fashion-mnist.yaml",
         "animal-mnist": REPO / "data_specs" / "animal-mnist.yaml"}
REPORT = REPO / "benchmarks" / "REPORT.md"
KNN_K = 20
SUITES = ("knn", "linear")
METHODS = {  # name in the report: (config file, overrides)
    "SimCLR": ("simclr.yaml", ()),
    "SupCon": ("supcon.yaml", ()),
    "X-CLR (WordNet)": ("xclr.yaml", ("method.similarity={type: wordnet}",)),
    "X-CLR (captions, templated)": ("xclr.yaml", ("method.similarity={type: captions}",)),
    "CLIP": ("clip.yaml", ()),
}
SWEPT = "X-CLR (WordNet)"


@dataclass(frozen=True)
class Schedule:
    """What every method shares: the backbone stem, the epochs and the global batch size."""

    small_images: bool
    epochs: int
    batch_size: int

    def overrides(self, spec: Path, seed: int) -> list[str]:
        return [f"data.spec={spec}", f"model.small_images={str(self.small_images).lower()}",
                f"optim.epochs={self.epochs}", f"optim.batch_size={self.batch_size}", f"optim.seed={seed}",
                "monitor.knn=false"]


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


def other_class_share(spec: Path, target_temperature: float) -> str:
    """The share (%) of a sample's X-CLR (WordNet, wup) target that lies on other classes when every
    class has as many samples in the batch, ``1 - softmax(s / τ_s)[c, c]`` over the (C, C) class
    similarity s: its mean and range over the classes."""
    synsets = list((load_spec(spec).classes or {}).values())
    similarity = torch.from_numpy(class_similarity(synsets, "wup"))
    share = 100 * (1 - torch.softmax(similarity / target_temperature, dim=1).diagonal())
    return f"{share.mean():.0f} ({share.min():.0f}–{share.max():.0f})"


def train_and_score(method: str, schedule: Schedule, spec: Path, seed: int, shards: ShardResult,
                    device: torch.device, extra: Sequence[str] = ()) -> Score:
    config_file, overrides = METHODS[method]
    config = load_config(REPO / "configs" / config_file, [*schedule.overrides(spec, seed), *overrides, *extra])
    output = train(config, shards=shards, device=device, progress=False)
    result = score(shards, output.path, device)
    print(f"{method} seed={seed} {' '.join(extra)}: {result}", flush=True)
    return result


def mean_std(values: Sequence[float]) -> str:
    spread = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{100 * statistics.mean(values):.2f} ± {100 * spread:.2f}"


def report(command: str, dataset: str, schedule: Schedule, shards: ShardResult, seeds: Sequence[int],
           pixels: Score, results: dict[str, list[Score]], sweep: dict[float, Score], spec: Path,
           minutes: float) -> str:
    stem = "small-images" if schedule.small_images else "standard"
    lines = [
        "# Contrastive methods compared", "",
        f"Command: `{command}`", "",
        (f"Data: {dataset}, {shards.splits.get('train', 0)} train / {shards.splits.get('test', 0)} test images. "
         f"Every method: its shipped config with ResNet-18 ({stem} stem), {schedule.epochs} epochs, batch "
         f"{schedule.batch_size}, the same augmentation preset; seeds {', '.join(map(str, seeds))}. "
         f"Scores: top-1 accuracy (%) on the test split of a weighted cosine kNN (k = {KNN_K}) and of a "
         f"linear probe on frozen features of the train split; mean ± standard deviation over the seeds. "
         f"Wall clock: {minutes:.1f} min."), "",
        "| method | kNN top-1 | linear top-1 |", "|---|---:|---:|",
        f"| raw pixels (floor) | {100 * pixels.knn:.2f} | {100 * pixels.linear:.2f} |",
        *[f"| {method} | {mean_std([s.knn for s in scores])} | {mean_std([s.linear for s in scores])} |"
          for method, scores in results.items()], "",
        (f"τ_s sweep of {SWEPT} (method.target_temperature), seed {seeds[0]}; the share of a sample's "
         "target on other classes at equal class counts, mean and range over the classes:"), "",
        "| τ_s | kNN top-1 | linear top-1 | target on other classes (%) |", "|---:|---:|---:|---:|",
        *[f"| {tau:g} | {100 * s.knn:.2f} | {100 * s.linear:.2f} | {other_class_share(spec, tau)} |"
          for tau, s in sorted(sweep.items())], "",
    ]
    return "\n".join(lines)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dataset", choices=sorted(SPECS), default="fashion-mnist")
    parser.add_argument("--full", action="store_true",
                        help="the spec's own split, small-images stem, 100 epochs, batch 512 (a GPU run)")
    parser.add_argument("--train-fraction", type=float, default=0.05, help="of all images (ignored with --full)")
    parser.add_argument("--test-fraction", type=float, default=0.03, help="of all images (ignored with --full)")
    parser.add_argument("--epochs", type=int)
    parser.add_argument("--batch-size", type=int)
    parser.add_argument("--seeds", type=int, default=3, help="how many seeds, 0..n-1")
    parser.add_argument("--target-temperatures", type=float, nargs="+", default=[0.05, 0.1, 0.2, 0.5])
    parser.add_argument("--device", default=None, help="default: cuda when present, else cpu")
    parser.add_argument("--report", type=Path, default=REPORT)
    args = parser.parse_args()
    if not (0 < args.train_fraction and 0 < args.test_fraction and args.train_fraction + args.test_fraction <= 1):
        parser.error("--train-fraction and --test-fraction must be positive and sum to at most 1")
    return args


def main() -> None:
    args = parse_args()
    started = time.perf_counter()
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    schedule = Schedule(small_images=args.full, epochs=args.epochs or (100 if args.full else 4),
                        batch_size=args.batch_size or (512 if args.full else 256))
    spec = SPECS[args.dataset] if args.full else subset_spec(SPECS[args.dataset], args.train_fraction,
                                                            args.test_fraction)
    shards = shard(spec, progress=False)
    seeds = list(range(args.seeds))
    pixels = score(shards, "pixels", device)
    results = {method: [train_and_score(method, schedule, spec, seed, shards, device) for seed in seeds]
               for method in METHODS}
    sweep = {tau: train_and_score(SWEPT, schedule, spec, seeds[0], shards, device,
                                  [f"method.target_temperature={tau}"]) for tau in args.target_temperatures}
    command = shlex.join(["python", "benchmarks/reproduce_contrastive.py", *sys.argv[1:]])
    text = report(command, args.dataset, schedule, shards, seeds, pixels, results, sweep, spec,
                  (time.perf_counter() - started) / 60)
    write_report(args.report, text)
    print(text)


if __name__ == "__main__":
    main()

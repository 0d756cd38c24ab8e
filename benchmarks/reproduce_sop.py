"""Reproduce the SOP comparison: SOP, SOP without MIM (λ2 = 0), SOP with fixed anchors and the
DINO- and iBOT-style baselines.

Every variant is trained from ``configs/sop.yaml``, ``configs/dino.yaml`` or ``configs/ibot.yaml`` with the same ViT,
views, epochs and batch size (``--set``-style overrides), over ``--seeds`` seeds, as cached train
stages; each encoder is scored by the evaluate stage (weighted cosine kNN and a linear probe on
frozen features of the train split, tested on the test split), and the collapse diagnostics of the
last epoch (effective rank and per-dimension std of the teacher embeddings in memory, normalised
entropy of the teacher's mean SOP or prototype assignment) are read from ``metrics.jsonl``. At the
default budget a memory fills only a few steps before training ends, so fixed anchors have little
time to act: SOP and SOP with fixed anchors are also trained over ``--collapse-epochs`` with small
memories (seed 0), and their diagnostics reported per epoch. The report goes to
``benchmarks/REPORT_SOP.md`` (a rerun keeps its ``## Analysis``).

CPU default: a seeded, stratified 1.5 % / 1.5 % train / test subset of the dataset (through a
derived data spec; about 1050 / 1050 Fashion-MNIST images), a 4-block ViT-Tiny, memories of 4096
and 1024 anchors (configs/sop.yaml), 3 epochs of batch 128: 15 runs of 21 steps and two of 42, about 55 minutes
on 2 idle cores by the step times of ``benchmarks/sop_cost.py``. ``--full``: the data spec's own
split, a 12-block ViT-Tiny, the paper's memories (65536 / 8192) and 4096 anchors, 100 epochs of
batch 512 (a GPU run).

    python benchmarks/reproduce_sop.py [--dataset animal-mnist] [--full] [--device cuda]
    python benchmarks/reproduce_sop.py --train-fraction 0.005 --test-fraction 0.005 --epochs 1 \\
        --batch-size 64 --depth 1 --seeds 1 --collapse-epochs 2 --collapse-memory 128 \\
        --report /tmp/REPORT_SOP.md                                            # a smoke test

Stages live under ``$REPSIM_HOME``: an interrupted run resumes, a repeated one only rewrites the report.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from _report import markdown, write_report

from repsim.data.sharding import ShardResult, shard
from repsim.methods.config import load_config
from repsim.methods.stage import METRICS_FILE, train
from _subsets import SPECS, Score, mean_std, score, subset_spec

REPO = Path(__file__).resolve().parents[1]
REPORT = REPO / "benchmarks" / "REPORT_SOP.md"
VARIANTS = {  # name in the report: (config file, overrides)
    "SOP": ("sop.yaml", ()),
    "SOP without MIM (λ2 = 0)": ("sop.yaml", ("method.mim_weight=0",)),
    "SOP, fixed anchors": ("sop.yaml", ("method.fixed_anchors=true",)),
    "DINO-style (learned prototypes)": ("dino.yaml", ()),
    "iBOT-style (learned prototypes, masked patches)": ("ibot.yaml", ()),
}
COLLAPSE = {"SOP": (), "SOP, fixed anchors": ("method.fixed_anchors=true",)}  # the longer-schedule pair
DIAGNOSTICS = ("effective_rank", "embedding_std", "assignment_entropy")
ENTROPIES = ("sop_entropy", "prototype_entropy")


@dataclass(frozen=True)
class Schedule:
    """What every variant shares: the ViT depth, epochs, global batch size and memory sizes."""

    depth: int
    epochs: int
    batch_size: int
    full: bool

    def overrides(self, spec: Path, seed: int, config_file: str) -> list[str]:
        shared = [f"data.spec={spec}", f"model.depth={self.depth}", f"optim.epochs={self.epochs}",
                  f"optim.batch_size={self.batch_size}", f"optim.seed={seed}", "monitor.knn=false"]
        if self.full and config_file == "sop.yaml":
            shared += ["method.cls_memory=65536", "method.patch_memory=8192", "method.num_anchors=4096"]
        return shared


@dataclass(frozen=True)
class Run:
    """The scores and last-epoch diagnostics of one trained encoder."""

    score: Score
    diagnostics: dict[str, float]


def epoch_diagnostics(output: Path) -> list[dict[str, float]]:
    """Effective rank, per-dimension std and assignment entropy of every epoch in metrics.jsonl."""
    records = [json.loads(line) for line in (output / METRICS_FILE).read_text().splitlines()]
    return [{"effective_rank": epoch.get("effective_rank", float("nan")),
             "embedding_std": epoch.get("embedding_std", float("nan")),
             "assignment_entropy": next((epoch[name] for name in ENTROPIES if name in epoch), float("nan"))}
            for epoch in records if "epoch" in epoch]


def train_and_score(variant: str, schedule: Schedule, spec: Path, seed: int, shards: ShardResult,
                    device: torch.device) -> Run:
    config_file, overrides = VARIANTS[variant]
    config = load_config(REPO / "configs" / config_file, [*schedule.overrides(spec, seed, config_file), *overrides])
    output = train(config, shards=shards, device=device, progress=False)
    run = Run(score(shards, output.path, device), epoch_diagnostics(output.path)[-1])
    print(f"{variant} seed={seed}: {run}", flush=True)
    return run


def collapse_runs(args: argparse.Namespace, schedule: Schedule, spec: Path, shards: ShardResult,
                  device: torch.device) -> tuple[dict[str, tuple[Score, list[dict[str, float]]]], int]:
    """SOP and SOP with fixed anchors (seed 0) over ``--collapse-epochs`` with memories of
    ``--collapse-memory`` entries, which fill within a few steps: the final scores and every epoch's
    diagnostics, and the number of training steps of each run."""
    longer = Schedule(schedule.depth, args.collapse_epochs, schedule.batch_size, full=False)
    small = [f"method.cls_memory={args.collapse_memory}", f"method.patch_memory={args.collapse_memory}",
             f"method.num_anchors={args.collapse_memory // 4}"]
    runs, steps = {}, 0
    for variant, overrides in COLLAPSE.items():
        config = load_config(REPO / "configs" / "sop.yaml", [*longer.overrides(spec, 0, "sop.yaml"), *small, *overrides])
        output = train(config, shards=shards, device=device, progress=False)
        runs[variant] = (score(shards, output.path, device), epoch_diagnostics(output.path))
        steps = output.metrics["steps"]
        print(f"{variant}, {args.collapse_epochs} epochs: {runs[variant]}", flush=True)
    return runs, int(steps)


def collapse_section(args: argparse.Namespace, schedule: Schedule,
                     collapse: tuple[dict[str, tuple[Score, list[dict[str, float]]]], int]) -> list[str]:
    runs, steps = collapse
    steps_to_fill = -(-args.collapse_memory // (2 * schedule.batch_size))
    header = ["epoch", *[f"{variant}: {name}" for variant in runs for name in ("effective rank", "entropy")]]
    epochs = range(min(len(diagnostics) for _, diagnostics in runs.values()))
    rows = [[str(epoch + 1), *[f"{diagnostics[epoch][name]:.{digits}f}" for _, diagnostics in runs.values()
                               for name, digits in (("effective_rank", 1), ("assignment_entropy", 3))]]
            for epoch in epochs]
    finals = "; ".join(f"{variant}: kNN {100 * final.knn:.2f}, linear {100 * final.linear:.2f}"
                       for variant, (final, _) in runs.items())
    return [
        "## Fixed anchors over a longer schedule", "",
        (f"SOP and SOP with fixed anchors, seed 0, {args.collapse_epochs} epochs ({steps} steps), "
         f"memories of {args.collapse_memory} entries (full after {steps_to_fill} step{'s' * (steps_to_fill > 1)}, "
         "when the fixed anchors "
         f"are drawn) and {args.collapse_memory // 4} anchors; the diagnostics of every epoch. Final top-1 (%): "
         f"{finals}."), "",
        markdown(header, rows), "",
    ]


def mean_of(values: Sequence[float], digits: int) -> str:
    return f"{sum(values) / len(values):.{digits}f}"


def report(command: str, dataset: str, schedule: Schedule, shards: ShardResult, seeds: Sequence[int],
           results: dict[str, list[Run]], collapse: list[str], minutes: float) -> str:
    lines = [
        "# SOP compared", "",
        f"Command: `{command}`", "",
        (f"Data: {dataset}, {shards.splits.get('train', 0)} train / {shards.splits.get('test', 0)} test images. "
         f"Every variant: configs/sop.yaml, dino.yaml or ibot.yaml with ViT-Tiny ({schedule.depth} blocks, patch 4), "
         f"multi-crop views, {schedule.epochs} epochs, batch {schedule.batch_size}; seeds "
         f"{', '.join(map(str, seeds))}. Scores: top-1 accuracy (%) on the test split of a weighted cosine kNN "
         "and of a linear probe on frozen features of the train split (the student's [CLS] feature); mean ± "
         "standard deviation over the seeds. Diagnostics of the last epoch, mean over the seeds: effective rank "
         "and per-dimension std of the teacher's unit embeddings in memory (collapse: rank → 1, std → 0) and "
         "the entropy of the teacher's mean SOP (or prototype) assignment over log K (collapse: → 0). "
         f"Wall clock: {minutes:.1f} min."), "",
        "| variant | kNN top-1 | linear top-1 | effective rank | per-dim std | assignment entropy |",
        "|---|---:|---:|---:|---:|---:|",
        *[f"| {variant} | {mean_std([r.score.knn for r in runs])} | {mean_std([r.score.linear for r in runs])} "
          f"| {mean_of([r.diagnostics['effective_rank'] for r in runs], 1)} "
          f"| {mean_of([r.diagnostics['embedding_std'] for r in runs], 4)} "
          f"| {mean_of([r.diagnostics['assignment_entropy'] for r in runs], 3)} |"
          for variant, runs in results.items()], "",
        *collapse,
    ]
    return "\n".join(lines)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dataset", choices=sorted(SPECS), default="fashion-mnist")
    parser.add_argument("--full", action="store_true",
                        help="the spec's own split, 12 blocks, the paper's memories, 100 epochs, batch 512 (a GPU run)")
    parser.add_argument("--train-fraction", type=float, default=0.015, help="of all images (ignored with --full)")
    parser.add_argument("--test-fraction", type=float, default=0.015, help="of all images (ignored with --full)")
    parser.add_argument("--depth", type=int)
    parser.add_argument("--epochs", type=int)
    parser.add_argument("--batch-size", type=int)
    parser.add_argument("--seeds", type=int, default=3, help="how many seeds, 0..n-1")
    parser.add_argument("--device", default=None, help="default: cuda when present, else cpu")
    parser.add_argument("--collapse-epochs", type=int, default=6,
                        help="epochs of the longer fixed-anchors comparison (0: skip it)")
    parser.add_argument("--collapse-memory", type=int, default=1024, help="memory size of that comparison")
    parser.add_argument("--report", type=Path, default=REPORT)
    args = parser.parse_args()
    if not (0 < args.train_fraction and 0 < args.test_fraction and args.train_fraction + args.test_fraction <= 1):
        parser.error("--train-fraction and --test-fraction must be positive and sum to at most 1")
    return args


def main() -> None:
    args = parse_args()
    started = time.perf_counter()
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    schedule = Schedule(depth=args.depth or (12 if args.full else 4), epochs=args.epochs or (100 if args.full else 3),
                        batch_size=args.batch_size or (512 if args.full else 128), full=args.full)
    spec = SPECS[args.dataset] if args.full else subset_spec(SPECS[args.dataset], args.train_fraction,
                                                            args.test_fraction)
    shards = shard(spec, progress=False)
    seeds = list(range(args.seeds))
    results = {variant: [train_and_score(variant, schedule, spec, seed, shards, device) for seed in seeds]
               for variant in VARIANTS}
    collapse = (collapse_section(args, schedule, collapse_runs(args, schedule, spec, shards, device))
                if args.collapse_epochs > 0 else [])
    command = shlex.join(["python", "benchmarks/reproduce_sop.py", *sys.argv[1:]])
    text = report(command, args.dataset, schedule, shards, seeds, results, collapse,
                  (time.perf_counter() - started) / 60)
    write_report(args.report, text)
    print(text)


if __name__ == "__main__":
    main()

"""Raw-pixel baselines: the evaluate stage's weighted cosine kNN and linear probe on the ``pixels`` encoder.

Each dataset is sharded and evaluated exactly as ``repsim eval SPEC --suite knn --suite linear``
does: features are the eval view's pixels normalised to [-1, 1], flattened. Fashion-MNIST uses its
official 60000/10000 split and Animal-MNIST the seeded, stratified 80/20 split of its data spec.
Any learned representation should beat these numbers.

    python benchmarks/raw_pixels.py [--device cuda] [--datasets fashion-mnist animal-mnist]

Prints a table (dataset, suite, top1, top5, seconds) and writes it to benchmarks/results/raw_pixels.md.
Stages are cached under ``$REPSIM_HOME``: the seconds are those of the run that computed them, so
measure on a new device with a fresh ``REPSIM_HOME``.
"""

from __future__ import annotations

import argparse
import os
import platform
from pathlib import Path

import torch

from repsim.data import shard
from repsim.eval.stage import KNN_K, evaluate, read_results
from _report import markdown, write_report

ROOT = Path(__file__).resolve().parent.parent
SPECS = {"fashion-mnist": ROOT / "data_specs" / "fashion-mnist.yaml",
         "animal-mnist": ROOT / "data_specs" / "animal-mnist.yaml"}
REPORT = ROOT / "benchmarks" / "results" / "raw_pixels.md"


def benchmark(dataset: str, device: torch.device) -> list[list[str]]:
    """Table rows for one dataset: one kNN pass over all k, then the linear probe."""
    output = evaluate(shard(SPECS[dataset]), "pixels", suites=("knn", "linear"), knn_k=KNN_K, device=device)
    results = read_results(output)
    knn, linear, seconds = results["suites"]["knn"], results["suites"]["linear"], results["seconds"]
    sizes = f"{results['samples']['train']}/{results['samples']['test']}"
    rows = [[dataset, sizes, f"knn k={k}", f"{knn[f'knn_top1_k{k}']:.4f}", f"{knn[f'knn_top5_k{k}']:.4f}",
             f"{seconds['knn']:.1f}"] for k in KNN_K]
    return rows + [[dataset, sizes, f"linear wd={linear['linear_weight_decay']:g}", f"{linear['linear_top1']:.4f}",
                    f"{linear['linear_top5']:.4f}", f"{seconds['linear']:.1f}"]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default=None, help="torch device (default: cuda when present, else cpu)")
    parser.add_argument("--datasets", nargs="+", choices=sorted(SPECS), default=list(SPECS))
    parser.add_argument("--out", type=Path, default=REPORT)
    args = parser.parse_args()
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    rows = [row for dataset in args.datasets for row in benchmark(dataset, device)]
    machine = (torch.cuda.get_device_name(device) if device.type == "cuda"
               else f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
                    f"{torch.get_num_threads()} torch threads")
    table = markdown(["dataset", "train/test", "suite", "top1", "top5", "seconds"], rows)
    report = (f"# Raw-pixel baselines\n\nDevice: {device} ({machine}); torch {torch.__version__}.\n"
              "Features: the `pixels` encoder of the evaluate stage (eval view normalised to [-1, 1], "
              "flattened), as `repsim eval SPEC --suite knn --suite linear` computes them. "
              f"kNN: cosine, vote weight exp(sim/0.07), k in {KNN_K} from one pass (its time is shown on each "
              "k row). Linear probe: standardised pixels, L-BFGS, weight decay chosen on a stratified 10% "
              "held-out slice of train, refit on all of train; its time includes the search.\n"
              f"Produced by `python benchmarks/raw_pixels.py`.\n\n{table}\n")
    write_report(args.out, report)
    print(table)


if __name__ == "__main__":
    main()

"""Reproduce GeRA's few-pairs comparison (Klebe et al., Figure 3) on Fashion-MNIST or Animal-MNIST.

Image embeddings come from a label-free encoder repsim trains itself (SimCLR, ``configs/simclr.yaml``,
a cached train stage on the CPU schedule that the SOP reproduction also uses) or a
given train stage (``--encoder``); text embeddings from all-MiniLM-L6-v2 over captions varied by
WordNet lemmas, glosses and hypernyms. For each number of pairs M and seed, GeRA
(``configs/gera.yaml``) and contrastive alignment alone (``configs/align_contrastive.yaml``) are
trained as align stages, and ASIF is scored on the same pairs; zero-shot top-1 on the test split is
reported as mean ± std over seeds. The ablations of α, of the neighbors sampled per step n and of
the neighbor-list length L, which chose the defaults of ``configs/gera.yaml``, are scored on a
validation split held out of the train split (``data.holdout``), never on the test split. Writes a
PNG and ``benchmarks/REPORT_GERA.md`` (a rerun keeps the report's ``## Analysis``).

CPU default: a seeded, stratified subset of the dataset (``--train-fraction``/``--test-fraction``).

    python benchmarks/reproduce_gera.py                                  # M ∈ {20, 50, 100, 500, 2000}, 5 seeds
    python benchmarks/reproduce_gera.py --dataset animal-mnist --train-fraction 0.35 --test-fraction 0.21 \\
        --alphas --samples --neighbor-counts --report benchmarks/REPORT_GERA_animal-mnist.md
    python benchmarks/reproduce_gera.py --image pixels --pairs 20 50 --seeds 0 --epochs 5 \\
        --alphas --samples --neighbor-counts --report /tmp/REPORT_GERA.md     # a smoke test

Stages live under ``$REPSIM_HOME``: an interrupted run resumes, a repeated one only rewrites the report.
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from _report import markdown, write_report
from matplotlib.figure import Figure
from _subsets import SPECS, subset_spec

from repsim.align.config import load_align_config
from repsim.align.stage import align
from repsim.data.sharding import shard
from repsim.methods.config import load_config
from repsim.methods.stage import train

REPO = Path(__file__).resolve().parents[1]
METHODS = ("GeRA", "contrastive", "ASIF")


def image_source(args: argparse.Namespace, spec: Path) -> str:
    """The ``image=`` override: raw pixels, a given encoder, or SimCLR trained (cached) on the same images."""
    if args.image == "pixels":
        return "image={type: pixels}"
    if args.encoder is None:
        config = load_config(REPO / "configs" / "simclr.yaml", [
            f"data.spec={spec}", "model.small_images=false", f"optim.epochs={args.simclr_epochs}",
            "optim.batch_size=256", "monitor.knn=false", "optim.num_workers=0"])
        args.encoder = train(config, progress=False).path
    return f"image={{type: encoder, path: {args.encoder}}}"


def seeded(common: Sequence[str], m: int, seed: int, *extra: str) -> list[str]:
    return [*common, f"pairing.pairs={m}", f"pairing.seed={seed}", f"optim.seed={seed}", *extra]


def zero_shot(config_file: str, overrides: Sequence[str]) -> dict[str, float]:
    """Zero-shot top-1 of the aligned space and of ASIF, from one cached align stage."""
    metrics = align(load_align_config(REPO / "configs" / config_file, overrides), progress=False).metrics
    return {"aligned": metrics["zeroshot_top1"], "ASIF": metrics["asif_zeroshot_top1"]}


def mean_std(values: Sequence[float]) -> str:
    spread = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{100 * statistics.mean(values):.1f} ± {100 * spread:.1f}"


def compare(common: list[str], pairs: Sequence[int], seeds: Sequence[int]) -> dict[str, dict[int, list[float]]]:
    """Per method and M, the zero-shot top-1 of every seed."""
    scores: dict[str, dict[int, list[float]]] = {method: {m: [] for m in pairs} for method in METHODS}
    for m in pairs:
        for seed in seeds:
            run = seeded(common, m, seed)
            gera, contrastive = zero_shot("gera.yaml", run), zero_shot("align_contrastive.yaml", run)
            for method, value in (("GeRA", gera["aligned"]), ("contrastive", contrastive["aligned"]),
                                  ("ASIF", gera["ASIF"])):
                scores[method][m].append(value)
            print(f"M={m} seed={seed}: GeRA {gera['aligned']:.3f}, contrastive {contrastive['aligned']:.3f}, "
                  f"ASIF {gera['ASIF']:.3f}", flush=True)
    return scores


def ablation(common: list[str], field: str, values: Sequence[float], args: argparse.Namespace
             ) -> dict[float, dict[int, list[float]]]:
    """GeRA's validation zero-shot top-1 per value of ``field`` and M, every ablation seed."""
    return {value: {m: [zero_shot("gera.yaml", seeded(common, m, seed, f"{field}={value}"))["aligned"]
                        for seed in args.ablation_seeds] for m in args.ablation_pairs} for value in values}


def plot(scores: dict[str, dict[int, list[float]]], dataset: str, path: Path) -> None:
    figure = Figure(figsize=(6, 4))
    axes = figure.add_subplot()
    for method, per_m in scores.items():
        ms = sorted(per_m)
        axes.errorbar(ms, [100 * statistics.mean(per_m[m]) for m in ms],
                      yerr=[100 * (statistics.stdev(per_m[m]) if len(per_m[m]) > 1 else 0.0) for m in ms],
                      marker="o", capsize=3, label=method)
    axes.set_xscale("log")
    axes.set_xlabel("paired points M")
    axes.set_ylabel("zero-shot top-1 (%)")
    axes.set_title(f"{dataset}: few-pairs alignment")
    axes.legend()
    figure.savefig(path, dpi=120, bbox_inches="tight")


def method_table(scores: dict[str, dict[int, list[float]]], label: str) -> str:
    pairs = sorted(next(iter(scores.values())))
    return markdown([label, *[f"M={m}" for m in pairs]],
                    [[f"{row:g}" if isinstance(row, float) else str(row), *[mean_std(per_m[m]) for m in pairs]]
                     for row, per_m in scores.items()])


def report(command: str, args: argparse.Namespace, scores: dict, ablations: dict[str, dict], png: Path,
           minutes: float) -> str:
    encoder = Path(args.encoder or "").resolve()
    image = ("raw pixels" if args.image == "pixels" else
             f"SimCLR encoder `{encoder.relative_to(REPO) if encoder.is_relative_to(REPO) else encoder}`")
    chosen = (f"chosen on the validation ablations below (seeds {', '.join(map(str, args.ablation_seeds))})"
              if any(ablations.values()) else "the defaults, chosen on Fashion-MNIST's validation ablations "
              "(benchmarks/REPORT_GERA.md); this run has none")
    lines = ["# GeRA: few-pairs alignment of frozen image and text embeddings", "",
             f"Command: `{command}`", "",
             (f"Image side: {image}; text side: all-MiniLM-L6-v2 over varied captions. {args.dataset} subset: "
              f"train fraction {args.train_fraction}, test fraction {args.test_fraction}; alignment "
              f"{args.epochs} epochs. Zero-shot top-1 (%), mean ± std over seeds {', '.join(map(str, args.seeds))}; "
              f"chance is 10%. Wall clock {minutes:.1f} min."), "",
             (f"GeRA runs `configs/gera.yaml`: α = {args.alpha:g}, n = {args.n} neighbors sampled per paired "
              f"point from its L = {args.neighbor_count} nearest unpaired points: {chosen}."), "",
             "## Test split", "", method_table(scores, "method"), "",
             f"![zero-shot accuracy against M]({png.name})", ""]
    for title, table in ablations.items():
        if table:
            lines += [f"## {title}", "", method_table(table, "value"), ""]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dataset", choices=sorted(SPECS), default="fashion-mnist")
    parser.add_argument("--image", choices=("simclr", "pixels"), default="simclr")
    parser.add_argument("--encoder", type=Path, help="a trained encoder (train stage dir) instead of SimCLR")
    parser.add_argument("--simclr-epochs", type=int, default=4)
    parser.add_argument("--train-fraction", type=float, default=0.05, help="of all images")
    parser.add_argument("--test-fraction", type=float, default=0.03)
    parser.add_argument("--pairs", type=int, nargs="+", default=[20, 50, 100, 500, 2000])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    parser.add_argument("--epochs", type=int, default=100, help="alignment epochs")
    parser.add_argument("--holdout", type=float, default=0.3, help="validation fraction of the train split")
    parser.add_argument("--ablation-pairs", type=int, nargs="+", default=[20, 50, 100])
    parser.add_argument("--ablation-seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--alphas", type=float, nargs="*", default=[0.0, 1.0, 10.0, 100.0, 1000.0, 10000.0])
    parser.add_argument("--samples", type=int, nargs="*", default=[4, 16, 64])
    parser.add_argument("--neighbor-counts", type=int, nargs="*", default=[50, 200, 800])
    parser.add_argument("--report", type=Path, default=REPO / "benchmarks" / "REPORT_GERA.md")
    args = parser.parse_args()
    defaults = load_align_config(REPO / "configs" / "gera.yaml")
    args.alpha, args.n, args.neighbor_count = (defaults.geometry.alpha, defaults.geometry.samples,
                                               defaults.neighbors.count)
    started = time.time()
    spec = subset_spec(SPECS[args.dataset], args.train_fraction, args.test_fraction)
    shard(spec, progress=False)
    common = [f"data.spec={spec}", image_source(args, spec), f"optim.epochs={args.epochs}"]
    validation = [*common, f"data.holdout={args.holdout}"]
    held_out = f"GeRA, validation: {args.holdout:g} of the train split held out"
    ablations = {
        f"α ablation ({held_out})": ablation(validation, "geometry.alpha", args.alphas, args),
        f"neighbors sampled n ablation ({held_out}, α = {args.alpha:g})":
            ablation(validation, "geometry.samples", args.samples, args),
        f"neighbor-list length L ablation ({held_out}, α = {args.alpha:g}, n = {args.n})":
            ablation(validation, "neighbors.count", args.neighbor_counts, args),
    }
    scores = compare(common, args.pairs, args.seeds)
    png = args.report.with_suffix(".png")
    png.parent.mkdir(parents=True, exist_ok=True)
    plot(scores, args.dataset, png)
    command = shlex.join(["python", "benchmarks/reproduce_gera.py", *sys.argv[1:]])
    write_report(args.report, report(command, args, scores, ablations, png, (time.time() - started) / 60) + "\n")
    print(f"wrote {args.report} and {png}")


if __name__ == "__main__":
    main()

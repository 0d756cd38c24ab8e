"""The record of a run of one of SOP's earlier experiments (``experiments/reproduce-sop*.yaml``: the ViT
comparison of ``reproduce-sop`` on CPU, ``reproduce-sop-full`` in the paper's setting on GPUs): SOP, its
ablations and the DINO- and iBOT-style baselines against the raw-pixel floor.

These designs predate the protocol of ``docs/benchmarks.md``: their rows are not matched and their
settings were not chosen on validation, so the report says so in its first line and gives no verdicts.
SOP's verdicts come from the matched designs (``benchmarks/sop_report.py``). This script reads the run's
result table back from MLflow, with each train stage's ``metrics.jsonl`` (the student's and the
teacher's kNN after every epoch, the collapse diagnostics), and writes the report and its plot:

    repsim run reproduce-sop
    python benchmarks/reproduce_sop.py [--experiment reproduce-sop]

A rerun rewrites the report above its ``## Analysis`` heading and keeps the analysis below it.
"""

from __future__ import annotations

import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from _report import (FinishedRun, below_floor, epochs_by_encoder, markdown, mean_over_seeds,  # noqa: E402
                     mean_std, render_finished)

NAMES = {"pixels": "raw pixels (floor)", "sop": "SOP", "sop-no-mim": "SOP without MIM (λ2 = 0)",
         "sop-fixed": "SOP, SOPs fixed after the initial selection",
         "sop-unshared": "SOP, non-shared supports", "sop-koleo": "SOP + KoLeo (λ = 0.1; an option, not the paper's)",
         "sop-horizon": "SOP, teacher horizon 0.2 % of the run (option)",
         "sop-anchor-share": "SOP, anchors 1/16 of the memory (option)",
         "sop-supports-apart": "SOP, supports only among non-anchors (option)",
         "sop-patch-bank": "SOP, the authors' patch bank (option)",
         "sop-enqueue-second": "SOP, the second global view alone enqueued (option)",
         "sop-memory-random": "SOP, memories started full of random vectors (option)",
         "sop-anchor-draws": "SOP, two anchor draws a step (option)",
         "sop-authors": "SOP, every option above (preset: authors)",
         "sop-authors-ema": "SOP, every option above but the horizon (teacher momentum 0.99)",
         "dino": "DINO-style (learned prototypes)",
         "untrained": "the untrained encoder (SOP's, before any step: the initialisation's floor)",
         "dino-koleo": "DINO-style + KoLeo (λ = 0.1)",
         "koleo-only": "KoLeo alone (SOP's student and teacher, λ1 = 0)",
         "sop-anchors-64": "SOP, 64 anchors (of 256)",
         "sop-support-2": "SOP, k = 2 supports (of 8)",
         "sop-memory-1024": "SOP, a memory of 1024 (of 4096)",
         "ibot": "iBOT-style (learned prototypes, masked patches)",
         "supcon": "SupCon on the same backbone (labels: the reference)",
         "simclr": "SimCLR on the same backbone (no labels: the contrastive reference)"}
METRICS = {"kNN top-1 (k = 20)": "knn_top1_k20", "linear top-1": "linear_top1"}
DIAGNOSTICS = {"effective rank": ("effective_rank", 1), "per-dim std": ("embedding_std", 4),
               "mean cosine": ("mean_cosine", 3), "assignment entropy": ("sop_entropy", 3),
               "target entropy": ("target_entropy", 3)}  # title: (metrics.jsonl name, digits)
ENTROPIES = ("sop_entropy", "prototype_entropy")  # SOP's and the learned prototypes' assignment entropy
MONITORS = {"student": "knn_top1_k20", "teacher": "teacher_knn_top1_k20"}


def name(encoder: str) -> str:
    return NAMES.get(encoder, encoder)


def sop_epochs(run: FinishedRun) -> dict[str, list[list[dict]]]:
    """Each trained encoder's per-epoch records, one list per seed (:func:`_report.epochs_by_encoder`), the
    assignment entropy of either kind under ``sop_entropy``; an encoder with no epoch (``max_steps: 0``) has none."""
    found = {encoder: [[record | {"sop_entropy": next((record[e] for e in ENTROPIES if e in record), float("nan"))}
                        for record in epochs] for epochs in seeds]
             for encoder, seeds in epochs_by_encoder(run).items() if all(seeds)}
    return dict(sorted(found.items(), key=lambda item: list(NAMES).index(item[0]) if item[0] in NAMES else 99))


def number(value: float, digits: int) -> str:
    """``value`` to ``digits`` places; ``-`` for NaN (a metric the encoder does not log)."""
    return "-" if math.isnan(value) else f"{value:.{digits}f}"


def scores_table(rows: list[dict], epochs: dict[str, list[list[dict]]]) -> str:
    """Scores (mean ± std over seeds) and the last epoch's diagnostics (mean over seeds) per encoder."""
    floor = next(row for row in rows if row["encoder"] == "pixels")
    lines = []
    for row in rows:
        seeds = epochs.get(row["encoder"])
        diagnostics = [number(mean_over_seeds(seeds, metric)[-1], digits) if seeds else "-"
                       for metric, digits in DIAGNOSTICS.values()]
        lines.append([name(row["encoder"]), *(mean_std(row, metric) + below_floor(row, floor, metric)
                                              for metric in METRICS.values()), *diagnostics])
    return markdown(["encoder", *METRICS, *DIAGNOSTICS], lines)


def monitor_table(epochs: dict[str, list[list[dict]]]) -> str:
    """The student's and the teacher's kNN top-1 (%) after every epoch, mean over seeds."""
    count = min(len(mean_over_seeds(seeds, MONITORS["student"])) for seeds in epochs.values())
    return markdown(["encoder", "network", *map(str, range(1, count + 1))],
                    [[name(encoder), network, *(number(100 * knn, 1) for knn in mean_over_seeds(seeds, metric))]
                     for encoder, seeds in epochs.items() for network, metric in MONITORS.items()])


def curve_table(epochs: dict[str, list[list[dict]]]) -> str:
    """Per encoder, mean over seeds: the student's kNN top-1 (%) after the first epoch, at its peak and
    at the end, the end's change over the first, and the last epoch's effective rank and target entropy."""
    lines = []
    for encoder, seeds in epochs.items():
        knn = [100 * value for value in mean_over_seeds(seeds, MONITORS["student"])]
        last = [mean_over_seeds(seeds, metric)[-1] for metric in ("effective_rank", "target_entropy")]
        lines.append([name(encoder), *(number(value, 1) for value in (knn[0], max(knn), knn[-1])),
                      f"{knn[-1] - knn[0]:+.1f}", number(last[0], 1), number(last[1], 3)])
    return markdown(["encoder", "kNN after epoch 1", "peak", "end", "end − epoch 1", "effective rank",
                     "target entropy"], lines)


def plot(run: FinishedRun, epochs: dict[str, list[list[dict]]], path: Path) -> None:
    """Each encoder's scores (mean ± std over seeds) and its student's and teacher's kNN top-1 after
    every epoch, each with the raw-pixel floor (dashed)."""
    figure, (bars, curves) = plt.subplots(1, 2, figsize=(17, 5))
    floor = next(row for row in run.rows if row["encoder"] == "pixels")
    learned = [row for row in run.rows if row["encoder"] != "pixels"]
    for offset, color, (title, metric) in zip((-0.2, 0.2), ("C0", "C1"), METRICS.items()):
        bars.bar([i + offset for i in range(len(learned))], [row[metric] for row in learned], 0.4,
                 yerr=[row[f"{metric}.std"] or 0 for row in learned], capsize=3, color=color, label=title)
        bars.axhline(floor[metric], linestyle="--", linewidth=1, color=color)
    bars.set_xticks(range(len(learned)), [name(row["encoder"]) for row in learned], rotation=20, ha="right",
                    fontsize=7)
    bars.set_ylabel("top-1 accuracy (dashed: raw pixels)")
    bars.legend(loc="lower right", fontsize=7)
    for index, (encoder, seeds) in enumerate(epochs.items()):
        for network, style in zip(MONITORS, ("-", ":")):
            knn = mean_over_seeds(seeds, MONITORS[network])
            curves.plot(range(1, len(knn) + 1), knn, style, marker=".", color=plt.cm.tab20(index % 20),
                        label=f"{name(encoder)}, {network}")
    curves.axhline(floor["knn_top1_k20"], linestyle="--", linewidth=1, color="black", label=name("pixels"))
    curves.set_xlabel("epoch")
    curves.set_ylabel("kNN top-1 (k = 20), online monitor")
    curves.legend(fontsize=6, loc="center left", bbox_to_anchor=(1.01, 0.5))  # beside: many rows
    figure.suptitle(f"{run.name}: mean over seeds")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def report(run: FinishedRun, image: Path) -> str:
    epochs = sop_epochs(run)
    seeds = max(int(row["knn_top1_k20.n"]) for row in run.rows)
    plot(run, epochs, image)
    return "\n".join([
        ("> **Not a matched design:** this experiment predates the protocol of `docs/benchmarks.md`; its rows "
         "are not matched and its settings were not chosen on validation. Read its figures as the record of "
         "this run, not as verdicts: `benchmarks/sop_report.py` writes SOP's verdicts."), "",
        "# SOP compared", "",
        f"Command: `{run.command}` ({run.wall_time}), then `python benchmarks/reproduce_sop.py "
        f"--experiment {run.name}`.", "",
        ("What every variant shares (one backbone, budget and data) and each row's own settings (its views "
         f"and teacher schedule) are in `experiments/{run.source}.yaml`. "
         "Scores: top-1 accuracy (%) on the test split of a weighted cosine "
         "kNN and of a linear probe on frozen features of the train split (the student's [CLS] feature, a ResNet's pooled one); "
         + (f"mean ± sample standard deviation over {seeds} seeds (a figure without ± is one output: the raw "
            "pixels, the same at every seed, or a row its experiment trains at one seed)" if seeds > 1 else "one seed")
         + ". Diagnostics of the last epoch, mean over the seeds: effective rank and per-dimension std of "
         "the teacher's unit embeddings in memory (collapse: rank → 1, std → 0), their mean cosine (a narrow "
         "cone: → 1), the entropy of the "
         "teacher's mean SOP (or prototype) assignment over log K (collapse: → 0) and the mean entropy of "
         "its per-sample targets over log K (targets too flat to learn from: → 1)."), "",
        scores_table(run.rows, epochs), "",
        "†: below the raw-pixel floor, so not a result yet at this budget.", "",
        "The online monitor's kNN top-1 (%) on the test split after every epoch, of the student and of the "
        "teacher, mean over the seeds:", "",
        monitor_table(epochs), "",
        "The student's curve in short, mean over the seeds (kNN top-1, %; the last epoch's diagnostics):", "",
        curve_table(epochs), "",
        f"![scores]({image.name})", ""])


def main() -> None:
    render_finished(__doc__, "reproduce-sop", report)


if __name__ == "__main__":
    main()

"""SOP's report for one dataset, under the protocol of docs/benchmarks.md: the validation grid that chose
the shared settings, the verdict on each claim, then the matched rows' scores, diagnostics and curves.

    repsim run sop-grid-resnet                 # the grid on a validation split (Animal-MNIST)
    repsim run sop-resnet                      # the matched design, the test split read once
    python benchmarks/sop_report.py animal-mnist

    repsim run sop-resnet --set data=data_specs/fashion-mnist-10k.yaml --set name=sop-resnet-fashion-mnist
    python benchmarks/sop_report.py fashion-mnist

Each writes ``benchmarks/REPORT_sop-<dataset>.md`` and its plot; a rerun keeps the analysis below
``## Analysis``.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import yaml
from _report import HERE, Claim, FinishedRun, finished_run, markdown, optional_run, verdict_table, write_report
from reproduce_sop import curve_table, monitor_table, name, plot, scores_table, sop_epochs

DATASETS = {"animal-mnist": ("sop-resnet", "sop-grid-resnet"),
            "fashion-mnist": ("sop-resnet-fashion-mnist", None)}  # the design's run, its grid's (None: Animal-MNIST's)
GRID = "sop-grid-resnet"
BASE_ROWS = ("sop", "dino")  # a grid cell's score: the mean of these rows' kNN on val
KNN, LINEAR = "knn_top1_k20", "linear_top1"

CLAIMS = [
    Claim("SOP beats learned prototypes (DINO-style) at equal compute", "paper", "sop", "dino"),
    Claim("SOP beats learned prototypes (DINO-style) at equal compute", "paper", "sop", "dino", LINEAR),
    Claim("with KoLeo on both, SOP still beats DINO-style", "factorial", "sop-koleo", "dino-koleo"),
    Claim("with KoLeo on both, SOP still beats DINO-style", "factorial", "sop-koleo", "dino-koleo", LINEAR),
    Claim("SOP's loss adds to KoLeo: SOP + KoLeo beats KoLeo alone", "control", "sop-koleo", "koleo-only"),
    Claim("KoLeo helps SOP", "option", "sop-koleo", "sop"),
    Claim("KoLeo helps DINO-style", "option", "dino-koleo", "dino"),
    Claim("SOPs re-drawn every step beat SOPs fixed after the first draw (fixed ones collapse)", "paper", "sop",
          "sop-fixed"),
    Claim("256 anchors beat 64 (fewer prototypes)", "rebuttal", "sop", "sop-anchors-64"),
    Claim("k = 8 supports beat k = 2", "rebuttal", "sop", "sop-support-2"),
    Claim("a memory of 4096 beats one of 1024", "rebuttal", "sop", "sop-memory-1024"),
    Claim("SOP beats the raw pixels", "floor", "sop", "pixels"),
    Claim("SOP + KoLeo beats the raw pixels", "floor", "sop-koleo", "pixels"),
    Claim("DINO-style beats the raw pixels", "floor", "dino", "pixels"),
]


def views(options: dict) -> str:
    """A grid cell's views in words, from its ``data.preset_options``."""
    return "multi-crop" if options.get("local_crops") else "2 global views"


def grid_cells(run: FinishedRun) -> list[dict]:
    """Each grid point: its settings, each base row's kNN on val, and their mean; best first."""
    cells: dict[str, dict] = {}
    for row in run.rows:
        if row["encoder"] in BASE_ROWS:
            cells.setdefault(row["point"], {"point": row["point"]})[row["encoder"]] = row[KNN]
    for cell in cells.values():
        cell["mean"] = statistics.mean(cell.get(encoder, float("nan")) for encoder in BASE_ROWS)
    return sorted(cells.values(), key=lambda cell: -cell["mean"])


def point_settings(point: str) -> tuple[float, dict]:
    """(lr, preset_options) of a grid point's label ``lr=0.0005 preset_options={local_crops: 4}``."""
    lr_part, _, options = point.partition(" preset_options=")
    return float(lr_part.removeprefix("lr=")), yaml.safe_load(options)


def shared_settings(source: str) -> tuple[float, dict]:
    """(lr, preset_options) every row of experiment ``source`` shares (its train section's settings)."""
    experiment = yaml.safe_load((HERE.parent / "experiments" / f"{source}.yaml").read_text())
    train = next(stage for stage in experiment["stages"] if stage["kind"] == "train")["settings"]
    return train["optim"]["lr"], train["data"]["preset_options"]


def grid_section(grid: FinishedRun, design: FinishedRun) -> str:
    """The grid's cells on val, the chosen one, and whether the design shares it."""
    cells = grid_cells(grid)
    floor = next(row[KNN] for row in grid.rows if row["encoder"] == "pixels")
    chosen = point_settings(cells[0]["point"])
    used = shared_settings(design.source)
    agreement = ("Every row of the design shares this cell." if used == chosen else
                 f"**The design does not use this cell**: it sets lr {used[0]} with {views(used[1])}.")
    lines = [[f"{lr:g}", views(options), *(f"{100 * cell.get(encoder, float('nan')):.2f}" for encoder in BASE_ROWS),
              f"{100 * cell['mean']:.2f}" + (" (chosen)" if index == 0 else "")]
             for index, cell in enumerate(cells) for lr, options in [point_settings(cell["point"])]]
    return "\n".join([
        "## The settings, chosen on validation", "",
        f"Command: `{grid.command}` ({grid.wall_time}). Trained on the grid's training split and scored "
        "by kNN top-1 (k = 20, %) on its validation split, cut from the training images; the test split is "
        f"not read. Raw pixels on val: {100 * floor:.2f}. A cell's score is the mean of SOP's and DINO-style's, "
        "so the method and the baseline choose from the same grid by the same rule. Seed 0.", "",
        markdown(["lr", "views", name("sop"), name("dino"), "mean"], lines), "",
        agreement, ""])


def report(dataset: str, image: Path) -> str:
    design_name, grid_name = DATASETS[dataset]
    design = finished_run(design_name)
    grid = optional_run(grid_name or GRID)
    epochs = sop_epochs(design)
    plot(design, epochs, image)
    return "\n".join([
        f"# SOP on {dataset}: the paper's claims in matched designs", "",
        f"Commands: `{design.command}` ({design.wall_time}), then `python benchmarks/sop_report.py {dataset}`. "
        f"The design is `experiments/{design.source}.yaml`: every row shares one backbone, budget, views, "
        "learning rate and teacher schedule and differs from another in one factor.", "",
        "## Verdicts", "",
        "Test split, read once per row. A difference within one pooled standard deviation is not shown, "
        "whichever way it points.", "",
        verdict_table(CLAIMS, design.rows, name), "",
        *([grid_section(grid, design)] if grid else []),
        "## Scores", "",
        "Top-1 accuracy (%) on the test split of a weighted cosine kNN and of a linear probe on frozen features "
        "of the train split; mean ± sample std over the seeds. Diagnostics of the last epoch, mean over the "
        "seeds: effective rank, per-dimension std and mean cosine of the teacher's embeddings in memory, "
        "assignment entropy (→ 0: collapse) and target entropy (→ 1: flat targets).", "",
        scores_table(design.rows, epochs), "",
        "†: below the raw-pixel floor.", "",
        "The online monitor's kNN top-1 (%) on the test split after every epoch, mean over the seeds:", "",
        monitor_table(epochs), "",
        curve_table(epochs), "",
        f"![scores]({image.name})", ""])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("dataset", choices=sorted(DATASETS))
    args = parser.parse_args()
    path = HERE / f"REPORT_sop-{args.dataset}.md"
    text = report(args.dataset, path.with_suffix(".png"))
    write_report(path, text)
    print(text)


if __name__ == "__main__":
    main()

"""SOP's report for one dataset, under the protocol of docs/benchmarks.md: the validation grid that chose
the shared settings, the verdict on each claim, then the matched rows' scores, diagnostics and curves.

    repsim run sop-grid-resnet                 # the grid on a validation split (Animal-MNIST)
    repsim run sop-resnet                      # the matched design, the test split read once
    repsim run sop-resnet-ablations            # fixed SOPs and the ablations, at the same settings
    repsim run sop-grid-vit                    # the same for the ViT, SOP against DINO- and iBOT-style
    repsim run sop-vit
    python benchmarks/sop_report.py animal-mnist

    repsim run sop-resnet --set data=data_specs/fashion-mnist-10k-val.yaml --set name=sop-resnet-fashion-mnist
    python benchmarks/sop_report.py fashion-mnist

Each writes ``benchmarks/REPORT_sop-<dataset>.md`` and its plots; a rerun keeps the analysis below
``## Analysis``, and the section of a design whose run this store does not hold (one run elsewhere).
"""

from __future__ import annotations

import argparse
import statistics
from dataclasses import dataclass
from pathlib import Path

import yaml
from _report import (HERE, Claim, FinishedRun, kept_section, markdown, on_both, optional_run, stage_runs, verdict_table,
                     write_report)
from reproduce_sop import curve_table, monitor_table, name, plot, scores_table, sop_epochs

@dataclass(frozen=True)
class Design:
    """A matched design: its experiment, the validation grid that chose its shared settings, the rows whose mean
    scores a grid cell, the claims its rows decide, and, for a design that takes another dataset's choice
    (Fashion-MNIST's takes Animal-MNIST's), the report whose section prints that grid."""

    experiment: str
    grid: str
    base_rows: tuple[str, ...]
    title: str
    claims: tuple[Claim, ...]
    grid_report: str = ""


KNN = "knn_top1_k20"  # what the grid chooses on


def floor_claims(rows: tuple[tuple[str, str], ...]) -> tuple[Claim, ...]:
    """Each (row, title) against both floors: the raw pixels, and its own initialisation (the untrained encoder)."""
    return (*(Claim(f"{title} beats the raw pixels", "floor", row, "pixels") for row, title in rows),
            *(Claim(f"{title} beats its own initialisation (the untrained encoder)", "floor", row, "untrained")
              for row, title in rows))


FACTORIAL_CLAIMS = (
    *on_both("SOP beats learned prototypes (DINO-style) at equal compute", "paper", "sop", "dino"),
    *on_both("with KoLeo on both, SOP still beats DINO-style", "factorial", "sop-koleo", "dino-koleo"),
    Claim("SOP's loss adds to KoLeo: SOP + KoLeo beats KoLeo alone", "control", "sop-koleo", "koleo-only"),
    Claim("KoLeo helps SOP", "option", "sop-koleo", "sop"),
    Claim("KoLeo helps DINO-style", "option", "dino-koleo", "dino"),
    *floor_claims((("sop", "SOP"), ("sop-koleo", "SOP + KoLeo"), ("dino", "DINO-style"))),
)
ABLATION_CLAIMS = (
    Claim("SOPs re-drawn every step beat SOPs fixed after the first draw (fixed ones collapse)", "paper", "sop",
          "sop-fixed"),
    Claim("256 anchors beat 64 (fewer prototypes)", "rebuttal", "sop", "sop-anchors-64"),
    Claim("k = 8 supports beat k = 2", "rebuttal", "sop", "sop-support-2"),
    Claim("a memory of 4096 beats one of 1024", "rebuttal", "sop", "sop-memory-1024"),
)
VIT_CLAIMS = (
    *on_both("SOP beats DINO-style at equal compute (ViT)", "paper", "sop", "dino"),
    *on_both("SOP beats iBOT-style at equal compute (ViT)", "paper", "sop", "ibot"),
    *floor_claims((("sop", "SOP (ViT)"), ("dino", "DINO-style (ViT)"), ("ibot", "iBOT-style (ViT)"))),
)
FACTORIAL = "ResNet-18: the factorial and its control"
DATASETS = {
    "animal-mnist": (Design("sop-resnet", "sop-grid-resnet", ("sop", "dino"), FACTORIAL, FACTORIAL_CLAIMS),
                     Design("sop-resnet-ablations", "sop-grid-resnet", ("sop", "dino"),
                            "ResNet-18: fixed SOPs and the rebuttal's ablations", ABLATION_CLAIMS),
                     Design("sop-vit", "sop-grid-vit", ("sop", "dino", "ibot"), "ViT-Tiny: SOP, DINO- and iBOT-style",
                            VIT_CLAIMS)),
    "fashion-mnist": (Design("sop-resnet-fashion-mnist", "sop-grid-resnet", ("sop", "dino"), FACTORIAL,
                             FACTORIAL_CLAIMS, grid_report="REPORT_sop-animal-mnist.md"),),
}


def views(options: dict) -> str:
    """A grid cell's views in words, from its ``data.preset_options``."""
    return "multi-crop" if options.get("local_crops") else "2 global views"


def grid_cells(run: FinishedRun, base_rows: tuple[str, ...]) -> list[dict]:
    """Each grid point: its settings, each base row's kNN on val, and their mean; best first."""
    cells: dict[str, dict] = {}
    for row in run.rows:
        if row["encoder"] in base_rows:
            cells.setdefault(row["point"], {"point": row["point"]})[row["encoder"]] = row[KNN]
    for cell in cells.values():
        cell["mean"] = statistics.mean(cell.get(encoder, float("nan")) for encoder in base_rows)
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


def monitored(run: FinishedRun) -> str:
    """The split(s) the online monitor of ``run``'s trainings scored after every epoch, as their runs logged it."""
    return ", ".join(sorted({train.data.params["config.monitor.test_split"] for train in stage_runs(run, "train")}))


def grid_section(grid: FinishedRun, design: FinishedRun, base_rows: tuple[str, ...]) -> str:
    """The grid's cells on val, the chosen one, and whether the design shares it."""
    cells = grid_cells(grid, base_rows)
    floor = next(row[KNN] for row in grid.rows if row["encoder"] == "pixels")
    untrained = next((row[KNN] for row in grid.rows if row["encoder"] == "untrained"), None)
    chosen = point_settings(cells[0]["point"])
    used = shared_settings(design.source)
    agreement = ("Every row of the design shares this cell." if used == chosen else
                 f"**The design does not use this cell**: it sets lr {used[0]} with {views(used[1])}.")
    lines = [[f"{lr:g}", views(options), *(f"{100 * cell.get(encoder, float('nan')):.2f}" for encoder in base_rows),
              f"{100 * cell['mean']:.2f}" + (" (chosen)" if index == 0 else "")]
             for index, cell in enumerate(cells) for lr, options in [point_settings(cell["point"])]]
    return "\n".join([
        "### The settings, chosen on validation", "",
        f"Command: `{grid.command}` ({grid.wall_time}). Trained on the grid's training split and scored "
        "by kNN top-1 (k = 20, %) on its validation split, cut from the training images; the test split is "
        f"not read. Raw pixels on val: {100 * floor:.2f}"
        + (f"; the untrained encoder: {100 * untrained:.2f}" if untrained is not None else "")
        + f". A cell's score is the mean of its rows' "
        f"({', '.join(map(name, base_rows))}), so the method and the baselines choose from the same grid by "
        "the same rule. Seed 0.", "",
        markdown(["lr", "views", *map(name, base_rows), "mean"], lines), "",
        agreement, ""])


def borrowed_grid_section(design: Design, run: FinishedRun) -> str:
    """Where a design that takes another dataset's grid choice got its settings, and what they are."""
    lr, options = shared_settings(run.source)
    return "\n".join([
        "### The settings, chosen on validation", "",
        f"The design shares lr {lr:g} with {views(options)}: the cell `repsim run {design.grid}` chose on "
        f"another dataset's validation split (its section in `{design.grid_report}`). No image of this "
        "dataset was read to choose a setting; its validation split feeds the online monitor only.", ""])


def settings_section(design: Design, run: FinishedRun) -> list[str]:
    """The section on how ``design``'s shared settings were chosen, where this store or another report holds it."""
    if design.grid_report:
        return [borrowed_grid_section(design, run)]
    grid = optional_run(design.grid)
    return [grid_section(grid, run, design.base_rows)] if grid else []


def design_section(design: Design, run: FinishedRun, image: Path) -> str:
    """A design's verdicts, its grid, its scores and curves, and its plot (written to ``image``)."""
    epochs = sop_epochs(run)
    plot(run, epochs, image)
    return "\n".join([
        f"## {design.title}", "",
        f"Commands: `{run.command}` ({run.wall_time}). The design is `experiments/{run.source}.yaml`: its rows "
        "share one backbone, budget, views, learning rate and teacher schedule and differ in one factor.", "",
        "### Verdicts", "",
        "Test split, read once per row. A difference within one pooled standard deviation is not shown, "
        "whichever way it points.", "",
        verdict_table(list(design.claims), run.rows, name), "",
        *settings_section(design, run),
        "### Scores", "",
        "Top-1 accuracy (%) on the test split of a weighted cosine kNN and of a linear probe on frozen features "
        "of the train split; mean ± sample std over the seeds. Diagnostics of the last epoch, mean over the "
        "seeds: effective rank, per-dimension std and mean cosine of the teacher's embeddings in memory, "
        "assignment entropy (→ 0: collapse) and target entropy (→ 1: flat targets).", "",
        scores_table(run.rows, epochs), "",
        "†: below the raw-pixel floor.", "",
        f"The online monitor's kNN top-1 (%) on the {monitored(run)} split after every epoch, mean over "
        "the seeds:", "",
        monitor_table(epochs), "",
        curve_table(epochs), "",
        f"![scores]({image.name})", ""])


def section(design: Design, path: Path) -> str | None:
    """``design``'s section of the report at ``path``: written from its run in this store, or, where the store
    has none, as the report already holds it (a design run on another machine), or None."""
    if run := optional_run(design.experiment, "the report keeps the section it holds, if any"):
        return design_section(design, run, path.with_name(f"{path.stem}-{design.experiment}.png"))
    return kept_section(path, f"## {design.title}")


def report(dataset: str, path: Path) -> str:
    sections = [text for design in DATASETS[dataset] if (text := section(design, path))]
    return "\n".join([f"# SOP on {dataset}: the paper's claims in matched designs", "",
                      f"Written by `python benchmarks/sop_report.py {dataset}` from the runs each section names, "
                      "under the protocol of `docs/benchmarks.md`.", "", *sections])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("dataset", choices=sorted(DATASETS))
    args = parser.parse_args()
    path = HERE / f"REPORT_sop-{args.dataset}.md"
    text = report(args.dataset, path)
    write_report(path, text)
    print(text)


if __name__ == "__main__":
    main()

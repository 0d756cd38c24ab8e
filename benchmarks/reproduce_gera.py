"""GeRA's few-pairs comparison's report (Klebe et al., Figure 3): zero-shot accuracy of GeRA, of
contrastive alignment alone and of ASIF against the number of pairs M, from the latest finished run of
``experiments/reproduce-gera.yaml``; with the α × σ × kernel grid scored on validation once
``experiments/tune-gera.yaml`` has run.

The experiment file says what runs (a label-free SimCLR encoder per seed as the image side, MiniLM
caption embeddings as the text side, the M × α × seed grid, unpaired pools from the rest of the train
split); ``repsim run`` runs it as cached, tracked stages, and this script reads its result table back
from MLflow and writes the report and its plot:

    repsim run reproduce-gera
    repsim run tune-gera                  # optional: the validation grid that chose α and σ
    python benchmarks/reproduce_gera.py [--experiment reproduce-gera] [--tuning tune-gera]

A rerun rewrites the report above its ``## Analysis`` heading and keeps the analysis below it.
"""

from __future__ import annotations

import statistics
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from _report import (VERDICT_RULE, Claim, FinishedRun, encoder_of, markdown, mean_std, render_finished,  # noqa: E402
                     stage_runs, verdict_table)

from repsim.align.config import load_align_config  # noqa: E402

ZERO_SHOT, ASIF = "zeroshot_top1", "asif_zeroshot_top1"
METHODS = {"GeRA": ZERO_SHOT, "contrastive alone (α = 0)": ZERO_SHOT, "ASIF": ASIF}
FLOOR = {"pixels": "raw pixels (floor)"}


def grid_point(row: dict) -> dict[str, str]:
    """``{"pairs": "20", "alpha": "0.0"}`` of a row's grid point ``pairs=20 alpha=0.0``."""
    return dict(part.split("=", 1) for part in row["point"].split())


def by_pairs(rows: list[dict]) -> dict[tuple[int, str], dict[str, dict]]:
    """For each M and image side (the encoder, or the raw pixels: the floor), its row of each method
    (ASIF's scores lie on GeRA's row)."""
    table: dict[tuple[int, str], dict[str, dict]] = {}
    for row in rows:
        if row.get(ZERO_SHOT) is None:
            continue
        point = grid_point(row)
        method = "contrastive alone (α = 0)" if float(point["alpha"]) == 0 else "GeRA"
        cell = table.setdefault((int(point["pairs"]), row["encoder"]), {})
        cell[method] = row
        if method == "GeRA":
            cell["ASIF"] = row
    return dict(sorted(table.items(), key=lambda item: (item[0][0], item[0][1] == "pixels")))


def named_rows(table: dict[tuple[int, str], dict[str, dict]]) -> list[dict]:
    """The rows of :func:`by_pairs`'s table named for the verdicts: ``gera-M``, ``contrastive-M`` and ``asif-M``
    (ASIF's scores under ``zeroshot_top1``) on the encoder's features, ``gera-pixels-M`` on the raw pixels."""
    named = []
    for (m, encoder), methods in table.items():
        if encoder == "pixels":
            named += [methods["GeRA"] | {"encoder": f"gera-pixels-{m}"}] if "GeRA" in methods else []
            continue
        for method, prefix in (("GeRA", "gera"), ("contrastive alone (α = 0)", "contrastive")):
            named += [methods[method] | {"encoder": f"{prefix}-{m}"}] if method in methods else []
        if "ASIF" in methods:
            asif = methods["ASIF"]
            named.append(asif | {"encoder": f"asif-{m}", ZERO_SHOT: asif[ASIF], f"{ZERO_SHOT}.std": asif[f"{ASIF}.std"],
                                 f"{ZERO_SHOT}.n": asif[f"{ASIF}.n"]})
    return named


def gera_claims(pairs: list[int]) -> list[Claim]:
    """The paper's claims at each M, and the floor's."""
    return [claim for m in pairs for claim in (
        Claim(f"GeRA beats contrastive alignment alone at M = {m}", "paper", f"gera-{m}", f"contrastive-{m}",
              ZERO_SHOT),
        Claim(f"GeRA beats ASIF at M = {m}", "paper", f"gera-{m}", f"asif-{m}", ZERO_SHOT),
        Claim(f"GeRA on the encoder's features beats GeRA on raw pixels at M = {m}", "floor", f"gera-{m}",
              f"gera-pixels-{m}", ZERO_SHOT))]


ROW_NAMES = {"contrastive": "contrastive alone", "gera": "GeRA", "asif": "ASIF", "gera-pixels": "GeRA on raw pixels"}


def label(encoder: str) -> str:
    """``GeRA (M = 20)`` of a named row's encoder."""
    method, _, m = encoder.rpartition("-")
    return f"{ROW_NAMES[method]} (M = {m})"


def samples(row: dict) -> str:
    """The unpaired pools' sizes N (image / text) of an align row, ``-`` for a result table logged before an
    align's scores carried them (a cached rerun of the experiment fills them in)."""
    sizes = [row.get(f"unpaired_{modality}_samples") for modality in ("image", "text")]
    return "-" if None in sizes else " / ".join(f"{size:.0f}" for size in sizes)


def side(encoder: str) -> str:
    return FLOOR.get(encoder, {"simclr": "SimCLR"}.get(encoder, encoder))


def paired_gains(run: FinishedRun) -> dict[tuple[int, str], str]:
    """GeRA's zero-shot gain over contrastive alignment alone at each M and image side, paired by seed
    (the same pairs, pools and initialisation): ``+5.4 ± 3.1 (5/5)``, the mean ± std of the per-seed
    differences in points and how many seeds GeRA won."""
    scores: dict[tuple[int, str, str], dict[bool, float]] = {}
    for align in stage_runs(run, "align"):
        params = align.data.params
        encoder = encoder_of(align.data.tags["repsim.encoder"])  # runs logged before a973897 carry their label
        cell = scores.setdefault((int(params["config.pairing.pairs"]), encoder,
                                  params["config.pairing.seed"]), {})
        cell[float(params["config.geometry.alpha"]) > 0] = align.data.metrics[ZERO_SHOT]
    differences: dict[tuple[int, str], list[float]] = {}
    for (m, encoder, _), cell in scores.items():
        if len(cell) == 2:
            differences.setdefault((m, encoder), []).append(100 * (cell[True] - cell[False]))
    return {point: f"{statistics.mean(gains):+.2f} ± {statistics.stdev(gains) if len(gains) > 1 else 0:.2f} "
                   f"({sum(gain > 0 for gain in gains)}/{len(gains)})" for point, gains in differences.items()}


def comparison_table(table: dict[tuple[int, str], dict[str, dict]], gains: dict[tuple[int, str], str]) -> str:
    return markdown(["M", "image side", "unpaired N (image / text)", *METHODS, "GeRA − α = 0, paired by seed (wins)"],
                    [[str(m), side(encoder), samples(next(iter(methods.values()))),
                      *(mean_std(methods[method], metric) if method in methods else "-"
                        for method, metric in METHODS.items()), gains.get((m, encoder), "-")]
                     for (m, encoder), methods in table.items()])


def encoder_lines(run: FinishedRun) -> list[str]:
    """The image side: each seed's train stage key, and the encoders' kNN against the pixel floor."""
    keys = sorted((int(train.data.params["config.optim.seed"]), train.data.tags["repsim.stage_key"])
                  for train in stage_runs(run, "train"))
    knn = {row["encoder"]: row for row in run.rows if row.get("knn_top1_k20") is not None}
    return [
        "Image side: SimCLR encoders trained by this run without labels, one per seed (train stage keys: "
        + ", ".join(f"seed {seed} `{key}`" for seed, key in keys) + "); their kNN top-1 (k = 20) on the test "
        "split: " + "; ".join(f"{side(encoder)} {mean_std(row, 'knn_top1_k20')}" for encoder, row in knn.items())
        + ". Text side: all-MiniLM-L6-v2 over varied captions.", ""]


def plot(run: FinishedRun, table: dict[tuple[int, str], dict[str, dict]], path: Path) -> None:
    figure, axes = plt.subplots(figsize=(6.5, 4.5))
    for encoder in dict.fromkeys(encoder for _, encoder in table):
        for (method, metric), colour in zip(METHODS.items(), ("C0", "C1", "C2")):
            points = [(m, methods[method]) for (m, side_), methods in table.items()
                      if side_ == encoder and method in methods]
            axes.errorbar([m for m, _ in points], [100 * row[metric] for _, row in points],
                          yerr=[100 * (row[f"{metric}.std"] or 0) for _, row in points], marker="o", capsize=3,
                          color=colour, linestyle=":" if encoder in FLOOR else "-",
                          label=f"{method}, {side(encoder)}")
    axes.set_xscale("log")
    pairs = sorted({m for m, _ in table})
    axes.set_xticks(pairs, [str(m) for m in pairs], minor=False)
    axes.set_xticks([], minor=True)
    axes.set_xlabel("paired points M (each carries its label)")
    axes.set_ylabel("zero-shot top-1 (%), class-prompt captions")
    axes.set_title(f"{run.name}: mean ± std over seeds")
    axes.legend(fontsize=7)
    figure.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(figure)


def tuning_section(tuning: FinishedRun) -> list[str]:
    """The validation grid's zero-shot top-1 per kernel, α and σ."""
    rows = sorted((row for row in tuning.rows if row.get(ZERO_SHOT) is not None),
                  key=lambda row: -row[ZERO_SHOT])
    points = [grid_point(row) for row in rows]
    return ["## α and σ on validation", "",
            f"Command: `{tuning.command}` ({tuning.wall_time}): GeRA scored on a validation split held "
            "out of the train split, never on the test split; best first.", "",
            markdown(["kernel", "α", "σ", "zero-shot top-1 (validation)"],
                     [[point.get("kernel", "-"), point.get("alpha", "-"), point.get("sigma", "-"),
                       mean_std(row, ZERO_SHOT)] for point, row in zip(points, rows)]), ""]


def report(run: FinishedRun, tuning: FinishedRun | None, image: Path) -> str:
    table = by_pairs(run.rows)
    gera = load_align_config("gera")
    seeds = max(int(row[f"{ZERO_SHOT}.n"]) for methods in table.values() for row in methods.values())
    plot(run, table, image)
    return "\n".join([
        "# GeRA: few-pairs alignment of frozen image and text embeddings", "",
        f"Command: `{run.command}` ({run.wall_time}), then `python benchmarks/reproduce_gera.py "
        f"--experiment {run.name}{'' if tuning else ' --tuning none'}`.", "",
        "## Verdicts", "",
        f"Zero-shot top-1 (%) on the test split; mean ± sample std (n seeds). {VERDICT_RULE}", "",
        verdict_table(gera_claims(sorted({m for m, _ in table})), named_rows(table), label), "",
        "## Scores", "",
        *encoder_lines(run),
        ("Evaluation: zero-shot top-1 (%) on the test split from class-prompt captions, in which the M pairs "
         f"carry M labels; mean ± sample standard deviation over {seeds} seeds; chance is 10 %. GeRA runs "
         f"`configs/gera.yaml`: the {gera.geometry.kernel} kernel, σ = {gera.geometry.sigma:g}, n = "
         f"{gera.geometry.samples} neighbors sampled per paired point from its L = {gera.neighbors.count} nearest "
         "unpaired points; the unpaired pools N are the rest of the train split, drawn per modality. The "
         "raw-pixel rows align the flattened pixels instead of the encoder's features: the floor."), "",
        comparison_table(table, paired_gains(run)), "",
        f"![zero-shot accuracy against M]({image.name})", "",
        *(tuning_section(tuning) if tuning else [])])


def main() -> None:
    render_finished(__doc__, "reproduce-gera", report,
                    ("--tuning", "tune-gera", "the validation grid's experiment"))


if __name__ == "__main__":
    main()

"""GeRA at few pairs, under the protocol of docs/benchmarks.md: α and the neighbourhood size L chosen per M
on a validation split held out of the train split, then GeRA against contrastive alignment alone (α = 0)
and ASIF on the test split at 10 seeds, with a verdict on each claim.

    repsim run tune-gera --set name=tune-gera-few-pairs --set 'seeds=[0, 1, 2]' --set 'sweep={
      align.settings.pairing.pairs: [20, 50], align.settings.geometry.alpha: [0.0, 100.0, 1000.0, 10000.0, 100000.0],
      align.settings.neighbors.count: [50, 200, 800, 3200]}'
    repsim run reproduce-gera --set name=gera-few-pairs --set 'seeds=[0, 1, 2, 3, 4, 5, 6, 7, 8, 9]' --set 'sweep={
      align.settings.pairing.pairs: [20, 50], align.settings.geometry.alpha: [0.0, <the chosen αs>],
      align.settings.neighbors.count: [<the chosen Ls>]}'
    python benchmarks/gera_few_pairs.py

It writes ``benchmarks/REPORT_gera-few-pairs.md``; a rerun keeps the analysis below ``## Analysis``.
"""

from __future__ import annotations

import statistics
from pathlib import Path

import matplotlib.pyplot as plt
from _report import HERE, FinishedRun, finished_run, markdown, mean_std, stage_runs, verdict_table, write_report
from reproduce_gera import ASIF, ROW_NAMES, ZERO_SHOT, gera_claims, label

TUNING, TEST = "tune-gera-few-pairs", "gera-few-pairs"
PAIRS = (20, 50)


def point(row: dict) -> dict[str, float]:
    """``{"pairs": 20.0, "alpha": 0.0, "count": 200.0}`` of a row's grid point."""
    return {key: float(value) for key, value in (part.split("=", 1) for part in row["point"].split())}


def aligned(rows: list[dict], encoder: str = "simclr") -> list[tuple[dict[str, float], dict]]:
    """(grid point, row) of each alignment of ``encoder``'s features."""
    return [(point(row), row) for row in rows if row["encoder"] == encoder and row.get(ZERO_SHOT) is not None]


def chosen(tuning: FinishedRun) -> dict[int, tuple[float, float]]:
    """Per M, the (α, L) of GeRA's best mean zero-shot top-1 on validation (α > 0)."""
    best: dict[int, tuple[float, tuple[float, float]]] = {}
    for cell, row in aligned(tuning.rows):
        m = int(cell["pairs"])
        if cell["alpha"] > 0 and row[ZERO_SHOT] > best.get(m, (-1.0, None))[0]:
            best[m] = row[ZERO_SHOT], (cell["alpha"], cell["count"])
    return {m: setting for m, (_, setting) in sorted(best.items())}


def tuning_table(tuning: FinishedRun, choice: dict[int, tuple[float, float]]) -> str:
    """Validation zero-shot top-1 per M, α and L; the chosen cells marked."""
    lines = [[f"{cell['pairs']:.0f}", f"{cell['alpha']:g}", f"{cell['count']:.0f}",
              mean_std(row, ZERO_SHOT) + (" (chosen)" if choice.get(int(cell["pairs"])) == (cell["alpha"],
                                                                                              cell["count"]) else "")]
             for cell, row in sorted(aligned(tuning.rows), key=lambda item: tuple(item[0].values()))]
    return markdown(["M", "α", "L", "zero-shot top-1 (val)"], lines)


def test_rows(run: FinishedRun, choice: dict[int, tuple[float, float]]) -> list[dict]:
    """Rows named ``gera-M``, ``contrastive-M`` (α = 0 at the chosen L), ``asif-M`` (ASIF on GeRA's pairs)
    and ``gera-pixels-M`` (the floor), each carrying its score under ``zeroshot_top1``."""
    named = []
    for encoder, prefix in (("simclr", ""), ("pixels", "pixels-")):
        for cell, row in aligned(run.rows, encoder):
            m = int(cell["pairs"])
            if m not in choice or cell["count"] != choice[m][1]:
                continue
            if cell["alpha"] == choice[m][0]:
                named.append(row | {"encoder": f"gera-{prefix}{m}"})
                if not prefix:
                    named.append(row | {"encoder": f"asif-{m}", ZERO_SHOT: row[ASIF], f"{ZERO_SHOT}.std":
                                        row[f"{ASIF}.std"], f"{ZERO_SHOT}.n": row[f"{ASIF}.n"]})
            elif cell["alpha"] == 0 and not prefix:
                named.append(row | {"encoder": f"contrastive-{m}"})
    return named


def paired_scores(run: FinishedRun, choice: dict[int, tuple[float, float]]) -> dict[int, dict[int, tuple[float, float]]]:
    """Per M and seed, (GeRA, contrastive alone) zero-shot top-1 (%) at the chosen L: the same pairs, pools and
    initialisation."""
    scores: dict[tuple[int, int], dict[float, float]] = {}
    for align in stage_runs(run, "align"):
        params = align.data.params
        m, count = int(params["config.pairing.pairs"]), float(params["config.neighbors.count"])
        if align.data.tags.get("repsim.encoder", "").startswith("pixels") or choice.get(m, (0, -1))[1] != count:
            continue
        scores.setdefault((m, int(params["config.pairing.seed"])), {})[float(params["config.geometry.alpha"])] = \
            100 * align.data.metrics[ZERO_SHOT]
    paired: dict[int, dict[int, tuple[float, float]]] = {}
    for (m, seed), by_alpha in sorted(scores.items()):
        if 0.0 in by_alpha and choice[m][0] in by_alpha:
            paired.setdefault(m, {})[seed] = by_alpha[choice[m][0]], by_alpha[0.0]
    return paired


def paired_gains(paired: dict[int, dict[int, tuple[float, float]]]) -> dict[int, str]:
    """Per M, GeRA − contrastive alone paired by seed: ``+1.2 ± 3.4 (6/10)`` (points; seeds GeRA won)."""
    gains = {m: [gera - alone for gera, alone in seeds.values()] for m, seeds in paired.items()}
    return {m: f"{statistics.mean(found):+.2f} ± {statistics.stdev(found) if len(found) > 1 else 0:.2f} "
               f"({sum(gain > 0 for gain in found)}/{len(found)})" for m, found in gains.items()}


def seeds_table(paired: dict[int, dict[int, tuple[float, float]]]) -> str:
    """GeRA, contrastive alone and their difference per M and seed."""
    return markdown(["M", "seed", "GeRA", "contrastive alone", "GeRA − contrastive"],
                    [[str(m), str(seed), f"{gera:.1f}", f"{alone:.1f}", f"{gera - alone:+.1f}"]
                     for m, seeds in paired.items() for seed, (gera, alone) in seeds.items()])


def plot(rows: list[dict], path: Path) -> None:
    """Zero-shot top-1 (mean ± std over seeds) of each verdict row, bars grouped by M."""
    by_encoder = {row["encoder"]: row for row in rows}
    figure, axes = plt.subplots(figsize=(6.5, 4.0))
    width = 0.8 / len(ROW_NAMES)
    for index, (method, title) in enumerate(ROW_NAMES.items()):
        found = [(position, by_encoder[f"{method}-{m}"]) for position, m in enumerate(PAIRS)
                 if f"{method}-{m}" in by_encoder]
        axes.bar([position + width * (index - (len(ROW_NAMES) - 1) / 2) for position, _ in found],
                 [100 * row[ZERO_SHOT] for _, row in found], width=width,
                 yerr=[100 * (row[f"{ZERO_SHOT}.std"] or 0) for _, row in found], capsize=3, label=title)
    axes.set_xticks(range(len(PAIRS)), [f"M = {m}" for m in PAIRS])
    axes.set_ylabel("zero-shot top-1 (%), test split")
    axes.set_title("GeRA at the α and L chosen on validation: mean ± std over seeds")
    axes.legend(fontsize=7)
    figure.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(figure)


def report(image: Path) -> str:
    tuning, run = finished_run(TUNING), finished_run(TEST)
    choice = chosen(tuning)
    rows, paired = test_rows(run, choice), paired_scores(run, choice)
    gains = paired_gains(paired)
    plot(rows, image)
    return "\n".join([
        "# GeRA at few pairs: α and L chosen on validation, 10 seeds", "",
        f"Commands: `{tuning.command}` ({tuning.wall_time}), `{run.command}` ({run.wall_time}), then "
        "`python benchmarks/gera_few_pairs.py`.", "",
        "## Verdicts", "",
        "Zero-shot top-1 (%) on the test split, read once per row; mean ± sample std (n seeds). A difference "
        "within one pooled standard deviation is not shown, whichever way it points.", "",
        verdict_table(gera_claims(list(PAIRS)), rows, label), "",
        "GeRA − contrastive alone, paired by seed (the same pairs, pools and initialisation): "
        + "; ".join(f"M = {m}: {gain}" for m, gain in gains.items()) + ". Per seed:", "",
        seeds_table(paired), "",
        "## α and L, chosen on validation", "",
        "GeRA scored on 30 % of the train split held out (never the test split), 3 seeds; per M, the cell of "
        "the best mean with α > 0 is chosen.", "",
        tuning_table(tuning, choice), "",
        f"![scores]({image.name})", ""])


def main() -> None:
    path = HERE / "REPORT_gera-few-pairs.md"
    text = report(path.with_suffix(".png"))
    write_report(path, text)
    print(text)


if __name__ == "__main__":
    main()

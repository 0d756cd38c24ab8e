"""An experiment's result table: one row per grid point and encoder, each metric's mean ± standard
deviation over the seeds. A stage output shared by several members counts once (``n``: distinct outputs).
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Score:
    """The metrics that one stage output (``source``: its stage key) gave one encoder of one member."""

    point: str  # the member's grid point, "" without a sweep
    encoder: str
    source: str
    metrics: dict[str, float]


@dataclass(frozen=True)
class Row:
    """One grid point and encoder: each metric's mean, sample standard deviation (0 for one value) and count."""

    point: str
    encoder: str
    mean: dict[str, float] = field(default_factory=dict)
    std: dict[str, float] = field(default_factory=dict)
    n: dict[str, int] = field(default_factory=dict)


def aggregate(scores: Iterable[Score]) -> list[Row]:
    """Rows in the order their grid point and encoder first appear; each stage output counted once."""
    values: dict[tuple[str, str], dict[str, dict[str, float]]] = {}
    for score in scores:
        metrics = values.setdefault((score.point, score.encoder), {})
        for name, value in score.metrics.items():
            metrics.setdefault(name, {})[score.source] = value
    return [Row(point, encoder, {name: statistics.fmean(v.values()) for name, v in metrics.items()},
                {name: statistics.stdev(v.values()) if len(v) > 1 else 0.0 for name, v in metrics.items()},
                {name: len(v) for name, v in metrics.items()})
            for (point, encoder), metrics in values.items()]


def headline_metrics(rows: Sequence[Row], knn_k: int | None) -> dict[str, str]:
    """The columns a comparison shows, those that some row has: {column title: metric name}."""
    columns = {f"kNN@{knn_k}": f"knn_top1_k{knn_k}", "linear probe": "linear_top1", "zero-shot": "zeroshot_top1"}
    return {title: name for title, name in columns.items() if any(name in row.mean for row in rows)}


def cell(row: Row, metric: str, counted: bool = False) -> str:
    """``0.8123`` for one value (``0.8123 (1)`` when ``counted``: beside rows over several), ``0.8123 ±
    0.0041 (3)`` over several, ``-`` when the row lacks it."""
    if metric not in row.mean:
        return "-"
    if row.n[metric] == 1:
        return f"{row.mean[metric]:.4f}" + (" (1)" if counted else "")
    return f"{row.mean[metric]:.4f} ± {row.std[metric]:.4f} ({row.n[metric]})"


def column(metric: str, statistic: str = "") -> str:
    """The result table's column of ``metric``'s ``statistic`` (``""``: the mean, ``"std"``, ``"n"``), without
    the dots that MLflow's table view leaves blank: ``linear_val_top1_wd0_01 std``."""
    return " ".join(filter(None, [metric.replace(".", "_"), statistic]))


def as_records(rows: Sequence[Row], first: Iterable[str] = ()) -> list[dict]:
    """One record per row: encoder, the grid point (with a sweep), then each metric's mean (:func:`column`), the
    metrics ``first`` (the headline ones) leading; a metric that some row averages over several outputs also
    has std and n columns (std None for a row of one). None where a row lacks the metric."""
    names = list(dict.fromkeys([*(name for name in first if any(name in row.mean for row in rows)),
                                *(name for row in rows for name in row.mean)]))
    swept = any(row.point for row in rows)
    spread = {name for name in names if any(row.n.get(name, 0) > 1 for row in rows)}

    def statistics_of(row: Row, name: str) -> dict:
        if name not in spread:
            return {column(name): row.mean.get(name)}
        several = row.n.get(name, 0) > 1
        return {column(name): row.mean.get(name), column(name, "std"): row.std[name] if several else None,
                column(name, "n"): row.n.get(name)}

    return [{"encoder": row.encoder} | ({"point": row.point} if swept else {})
            | {key: value for name in names for key, value in statistics_of(row, name).items()}
            for row in rows]


def table(rows: Sequence[Row], columns: dict[str, str], encoder: str = "encoder") -> tuple[list[str], list[list[str]]]:
    """(header, cells) of the rows' table of the ``columns`` ({title: metric name}), with any grid point; where
    some row averages several outputs, a row of one says so."""
    swept = any(row.point for row in rows)
    counted = any(count > 1 for row in rows for count in row.n.values())
    return ([*(["grid point"] if swept else []), encoder, *columns],
            [[*([row.point] if swept else []), row.encoder, *(cell(row, name, counted) for name in columns.values())]
             for row in rows])


def markdown(rows: Sequence[Row], columns: dict[str, str]) -> str:
    """The rows as a markdown table (see :func:`table`)."""
    header, cells = table(rows, columns)
    lines = ["| " + " | ".join(line) + " |" for line in [header, *cells]]
    lines.insert(1, "|" + "---|" * (len(header) - len(columns)) + "---:|" * len(columns))
    return "\n".join(lines)

"""What the benchmarks share: markdown tables, reports that keep their analysis, timing of alternated
steps, and the result table of a finished experiment run."""

from __future__ import annotations

import argparse
import ast
import json
import math
import shlex
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch


HERE = Path(__file__).resolve().parent  # benchmarks/: the reports' folder


def markdown(header: list[str], rows: list[list[str]]) -> str:
    """A markdown table of ``rows`` under ``header``."""
    lines = [header, ["---"] * len(header), *rows]
    return "\n".join("| " + " | ".join(line) + " |" for line in lines)


ANALYSIS = "## Analysis"  # a rerun rewrites a report above this heading and keeps what follows


def write_report(path: Path, text: str) -> None:
    """Write ``text`` to ``path``, keeping the hand-written analysis of an existing report there."""
    existing = path.read_text() if path.is_file() else ""
    kept = existing[existing.index(ANALYSIS):] if ANALYSIS in existing else ""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text.rstrip("\n") + "\n\n" + kept if kept else text)


def kept_section(path: Path, heading: str) -> str | None:
    """The section of the report at ``path`` under ``heading`` (a ``## `` line), up to the next ``## ``
    heading, as an earlier run wrote it; None when there is no such report or section."""
    text = path.read_text() if path.is_file() else ""
    start = text.find(f"\n{heading}\n")
    if start < 0:
        return None
    end = text.find("\n## ", start + 1)
    return text[start + 1:end if end >= 0 else len(text)].rstrip("\n") + "\n"


def synchronise(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_seconds(steps: dict[str, Callable[[], object]], device: torch.device, warmup: int,
                   repeats: int) -> dict[str, float]:
    """Median wall-clock seconds of each step, the steps alternated so that load drifts hit all alike."""
    for step in steps.values():
        for _ in range(warmup):
            step()
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(repeats):
        for name, step in steps.items():
            synchronise(device)
            started = time.perf_counter()
            step()
            synchronise(device)
            times[name].append(time.perf_counter() - started)
    return {name: statistics.median(spent) for name, spent in times.items()}


@dataclass(frozen=True)
class FinishedRun:
    """The latest finished run of an experiment: its result table, command and wall time."""

    name: str
    run_id: str  # the MLflow parent run; its stage runs are nested under it
    data: Path
    rows: list[dict]  # one per grid point and encoder: "point", "encoder", each metric, "<metric>.std", "<metric>.n"
    command: str
    minutes: float  # this invocation's wall time
    source: str  # the experiment file's name (experiments/<source>.yaml), which `--set name=...` may differ from
    stages: int
    reused: int  # stages found cached, built by earlier invocations
    stage_minutes: float  # the build time of every stage, the reused ones' included

    @property
    def wall_time(self) -> str:
        """This invocation's minutes, and the stage time in all when it reused stages built before."""
        if not self.reused:
            return f"{self.minutes:.1f} min"
        return (f"{self.minutes:.1f} min, reusing {self.reused} of its {self.stages} stages built earlier; "
                f"{self.stage_minutes:.1f} min of stage time in all")


def finished_run(name: str) -> FinishedRun:
    """The latest finished ``repsim run`` of experiment ``name`` in the tracking store (the MLflow
    server of ``MLFLOW_TRACKING_URI``, else ``$REPSIM_HOME/mlflow.db``); SystemExit if there is none."""
    from repsim.tasks.settings import use_embedded_defaults

    use_embedded_defaults()  # the embedded tracking store, unless MLFLOW_TRACKING_URI names a server
    from mlflow.tracking import MlflowClient
    from repsim.flows.experiment import RESULTS_TABLE

    client = MlflowClient()
    experiment = client.get_experiment_by_name("repsim")
    found = client.search_runs([experiment.experiment_id] if experiment else [],
                               "tags.`repsim.flow` = 'experiment' and attributes.status = 'FINISHED' "
                               f"and params.`experiment.name` = '{name}'",
                               order_by=["attributes.end_time DESC"], max_results=1)
    if not found:
        raise SystemExit(f"no finished run of experiment {name!r} in {client.tracking_uri}; "
                         f"run `repsim run {name}` first")
    run = found[0]
    with tempfile.TemporaryDirectory() as folder:
        table = json.loads(Path(client.download_artifacts(run.info.run_id, RESULTS_TABLE, folder)).read_text())
    overrides = ast.literal_eval(run.data.params.get("overrides", "[]"))
    source = run.data.params.get("source", name)
    stages = client.search_runs([experiment.experiment_id], f"tags.`mlflow.parentRunId` = '{run.info.run_id}'",
                                max_results=50000)
    return FinishedRun(name, run.info.run_id, Path(run.data.params["experiment.data"]),
                       [_complete(dict(zip(map(_column_name, table["columns"]), row))) for row in table["data"]],
                       shlex.join(["repsim", "run", source, *(arg for o in overrides for arg in ("--set", o))]),
                       (run.info.end_time - run.info.start_time) / 60000, source, len(stages),
                       sum(stage.data.tags.get("repsim.cached") == "true" for stage in stages),
                       sum(stage.data.metrics.get("seconds", 0.0) for stage in stages) / 60)


def _column_name(logged: str) -> str:
    """A result table column as the reports name it: ``<metric>.std`` and ``<metric>.n``, as runs
    logged before the table's columns lost their dots (``<metric> std``) name them too."""
    metric, _, statistic = logged.partition(" ")
    return f"{metric}.{statistic}" if statistic else metric


def _complete(row: dict) -> dict:
    """A result-table row with the columns the reports read, which a table leaves out where they say nothing:
    ``point`` ("" without a sweep), and ``<metric>.n`` (1) and ``<metric>.std`` (None) of a single value."""
    complete = {"point": "", **row}
    for name, value in row.items():
        if name not in ("point", "encoder") and "." not in name and f"{name}.n" not in row:
            complete |= {f"{name}.n": None if value is None else 1, f"{name}.std": None}
    return complete


def optional_run(name: str, absent: str = "the report leaves it out") -> FinishedRun | None:
    """The latest finished run of experiment ``name``, or None (saying so, and what the report does
    instead: ``absent``) when there is none."""
    try:
        return finished_run(name)
    except SystemExit as missing:
        print(f"{missing}; {absent}")
        return None


def render_finished(doc: str, experiment: str, render: Callable[..., str],
                    companion: tuple[str, str, str] | None = None) -> None:
    """A renderer's command line: ``render(run, [companion run,] image)`` of the finished run of
    ``experiment`` into ``benchmarks/REPORT_<experiment>.md`` and its plot. ``companion`` (flag, default
    experiment, help) names a second experiment the report reads when it has run ("none": leave it out)."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--experiment", default=experiment, help="the experiment's name (its `name:`)")
    if companion:
        parser.add_argument(companion[0], default=companion[1], help=companion[2] + "; none: leave it out")
    parser.add_argument("--report", type=Path, help="default: benchmarks/REPORT_<experiment>.md")
    args = parser.parse_args()
    path = args.report or Path(__file__).resolve().parent / f"REPORT_{args.experiment}.md"
    run = finished_run(args.experiment)
    other = getattr(args, companion[0].lstrip("-")) if companion else None
    extra = [None if other == "none" else optional_run(other)] if companion else []
    text = render(run, *extra, path.with_suffix(".png"))
    write_report(path, text)
    print(text)


def stage_runs(run: FinishedRun, stage: str) -> list:
    """The MLflow runs of ``run``'s ``stage`` stages (nested under it), each tagged with its label
    (``repsim.label``) and stage key (``repsim.stage_key``)."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient()
    experiment = client.get_run(run.run_id).info.experiment_id
    return client.search_runs([experiment], f"tags.`mlflow.parentRunId` = '{run.run_id}' "
                                            f"and tags.`repsim.stage` = '{stage}'")


def train_records(run: FinishedRun) -> list[tuple[str, list[dict]]]:
    """(label, ``metrics.jsonl`` records) of every train stage run nested under ``run``, one per run, in
    label order (``xclr-wordnet [seed=0]``; runs logged before labels carried the seed share one label).
    A cached stage's run refers to the file by its path (its ``repsim.file.metrics.jsonl`` tag)."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient()
    records = []
    with tempfile.TemporaryDirectory() as folder:
        for train in stage_runs(run, "train"):
            referred = train.data.tags.get("repsim.file.metrics.jsonl")
            path = referred or client.download_artifacts(train.info.run_id, "metrics.jsonl", folder)
            lines = Path(path).read_text()
            records.append((train.data.tags["repsim.label"], [json.loads(line) for line in lines.splitlines()]))
    return sorted(records, key=lambda item: item[0])


def encoder_of(label: str) -> str:
    """``xclr-wordnet`` of a stage run label ``xclr-wordnet [target_temperature=0.1 seed=0]``."""
    return label.partition(" [")[0]


def without_seed(label: str) -> str:
    """A stage run label without its seed: ``sop`` of ``sop [seed=0]``, ``xclr-wordnet
    [target_temperature=0.1]`` of ``xclr-wordnet [target_temperature=0.1 seed=0]``."""
    name, _, point = label.partition(" [")
    kept = [part for part in point.rstrip("]").split() if not part.startswith("seed=")]
    return f"{name} [{' '.join(kept)}]" if kept else name


def epochs_by_encoder(run: FinishedRun) -> dict[str, list[list[dict]]]:
    """The records after each epoch (the online monitor's kNN, diagnostics) of every train stage run
    nested under ``run``, grouped by label without the seed: one list of epochs per seed."""
    found: dict[str, list[list[dict]]] = {}
    for label, records in train_records(run):
        found.setdefault(without_seed(label), []).append([record for record in records if "epoch" in record])
    return found


def mean_over_seeds(seeds: list[list[dict]], metric: str) -> list[float]:
    """``metric`` after each epoch, averaged over the seeds (the epochs every seed reached)."""
    epochs = min(len(epochs) for epochs in seeds)
    return [statistics.mean(epochs[epoch].get(metric, float("nan")) for epochs in seeds) for epoch in range(epochs)]


def below_floor(row: dict, floor: dict, metric: str) -> str:
    """`` †`` when a learned encoder's mean is below the raw pixels' on ``metric``."""
    return " †" if row["encoder"] != "pixels" and row[metric] < floor[metric] else ""


def mean_std(row: dict, metric: str) -> str:
    """``81.23 ± 0.41`` (percent) over the row's outputs, ``81.23`` for one, ``-`` without the metric."""
    if row.get(metric) is None:
        return "-"
    if row[f"{metric}.n"] == 1:
        return f"{100 * row[metric]:.2f}"
    return f"{100 * row[metric]:.2f} ± {100 * row[f'{metric}.std']:.2f}"


@dataclass(frozen=True)
class Claim:
    """A claim as a comparison of two rows of a result table on one metric: row ``better`` beats row
    ``worse``. ``text`` words it; ``source`` says whose claim it is (the paper, its rebuttal, a control)."""

    text: str
    source: str
    better: str
    worse: str
    metric: str = "knn_top1_k20"


def pooled_std(first: dict, second: dict, metric: str) -> float:
    """√((s₁² + s₂²)/2) of two rows' sample standard deviations of ``metric``."""
    return math.sqrt(((first[f"{metric}.std"] or 0) ** 2 + (second[f"{metric}.std"] or 0) ** 2) / 2)


def verdict(better: dict | None, worse: dict | None, metric: str, seeds: int = 3) -> tuple[str, str]:
    """(✔ / ✗ / not shown, why) for "``better`` beats ``worse`` on ``metric``": ✔ when its mean is ahead by
    more than one pooled standard deviation, ✗ when behind by more, "not shown" within it, whichever way
    it points, and for a row not run or run at fewer than ``seeds`` seeds."""
    for row in (better, worse):
        if row is None or row.get(metric) is None:
            return "not shown", "not run"
        if row[f"{metric}.n"] < seeds and row["encoder"] != "pixels":  # the pixels are the same at every seed
            return "not shown", f"{row['encoder']} has {row[f'{metric}.n']} of the {seeds} seeds"
    difference, spread = 100 * (better[metric] - worse[metric]), 100 * pooled_std(better, worse, metric)
    said = f"{difference:+.2f} points, pooled std {spread:.2f}"
    if abs(difference) <= spread:
        return "not shown", f"{said}: within one pooled std"
    return ("✔" if difference > 0 else "✗"), said


def verdict_table(claims: list[Claim], rows: list[dict], names: Callable[[str], str]) -> str:
    """The markdown verdict table of ``claims`` against the result ``rows`` (one per encoder)."""
    by_encoder = {row["encoder"]: row for row in rows}
    lines = []
    for claim in claims:
        better, worse = by_encoder.get(claim.better), by_encoder.get(claim.worse)
        mark, why = verdict(better, worse, claim.metric)
        measured = " vs ".join(f"{names(label)} {mean_std_n(row, claim.metric)}"
                               for label, row in ((claim.better, better), (claim.worse, worse)))
        lines.append([claim.text, claim.source, METRIC_NAMES.get(claim.metric, claim.metric), measured, mark, why])
    return markdown(["claim", "whose", "measure", "measured (mean ± std, n)", "verdict", "why"], lines)


METRIC_NAMES = {"knn_top1_k20": "kNN top-1 (k = 20)", "linear_top1": "linear top-1"}
VERDICT_RULE = ("A difference within one pooled standard deviation is not shown, whichever way it points; a row "
                "with fewer than 3 seeds shows nothing.")


def on_both(text: str, source: str, better: str, worse: str) -> tuple[Claim, Claim]:
    """The claim on the kNN and on the linear probe."""
    return Claim(text, source, better, worse, "knn_top1_k20"), Claim(text, source, better, worse, "linear_top1")


def mean_std_n(row: dict | None, metric: str) -> str:
    """``81.23 ± 0.41 (3)``; ``-`` for a row not run."""
    if row is None or row.get(metric) is None:
        return "-"
    return f"{100 * row[metric]:.2f} ± {100 * (row[f'{metric}.std'] or 0):.2f} ({row[f'{metric}.n']})"

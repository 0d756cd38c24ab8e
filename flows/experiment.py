"""The experiment flow: shard the data spec, then run the experiment's sections in order, each stage a
task tracked as a nested MLflow run (served from the stage store once built); the result table goes on the
parent run and a Prefect artifact. Each section (:mod:`repsim.sections`) submits the tasks of all members
(:func:`repsim.experiment.expand`) before waiting on any, so independent stages run concurrently
(:func:`concurrency`); a request made twice is submitted once and its result shared."""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import hashlib
import logging
import os
import re
import tempfile
import time
from collections import Counter
from datetime import datetime
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prefect import flow
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.futures import PrefectFuture
from prefect.runtime import flow_run as prefect_flow_run
from prefect.task_runners import ThreadPoolTaskRunner

from repsim import stopping
from repsim.errors import RepsimError, StageError
from repsim.experiment import Experiment, Member, check_experiment, with_overrides
from repsim.layering import read_once
from repsim.results import Row, Score, aggregate, as_records, headline_metrics, markdown
from repsim.sections import ShardSection, check_stage_names, stage_kinds
from repsim.stage import SERVE_COMPLETE, Reuse, StageOutput, read_record
from repsim.tasks.cluster import cluster_running, dask_logs_above, requested_cluster, stores
from repsim.tasks.settings import api_for_workers, use_embedded_defaults
from repsim.tasks.stage_tasks import current_record, planned, produced, task_of
from repsim.tasks.tracking import StageRun, Tracker, colour_by_encoder, model_directory, show_in_runs_table

RESULTS_TABLE = "results.json"  # the result table's file among the parent run's artifacts


def concurrency() -> int:
    """How many stage tasks run at once: ``REPSIM_CONCURRENCY``, else one per GPU, else 1."""
    import torch

    return int(os.environ.get("REPSIM_CONCURRENCY") or max(1, torch.cuda.device_count()))


def task_run_name(kind: str, label: str | None) -> str:
    """The stage task's run name, "KIND LABEL", as a template Prefect formats with the task's parameters:
    braces of the label (a grid point's dict value) escaped."""
    name = f"{kind} {label}" if label else kind
    return name.replace("{", "{{").replace("}", "}}")


def _request(kind: str, params: dict[str, Any], options: dict[str, Any], out_dir: str | None) -> str:
    """A stage request as text: two requests are the same stage when their texts are equal."""
    return f"{kind}{params!r}{sorted(options.items())!r}{out_dir}"


@dataclass
class Stages:
    """The stage tasks of one flow run: each distinct request submitted once, each finished stage tracked
    once (a row of ``summaries`` with how many members submitted it)."""

    tracker: Tracker
    parent: StageRun
    cluster: str | None = None  # the Dask scheduler split stages run their pieces on
    reuse: Reuse = SERVE_COMPLETE  # which complete outputs are served
    summaries: list[dict] = field(default_factory=list)
    _submitted: dict[str, tuple[PrefectFuture, str, str | None]] = field(default_factory=dict)
    _uses: Counter[str] = field(default_factory=Counter)
    _outputs: dict[str, StageOutput] = field(default_factory=dict)

    def submit(self, kind: str, params: dict[str, Any], options: dict[str, Any] | None = None, *,
               out_dir: str | None = None, label: str | None = None, encoder: str | None = None,
               register: str | None = None) -> str:
        """Submit the stage task of ``kind`` for ``params`` (:func:`repsim.tasks.stage_tasks.stage_task`) unless
        the same request was made before; the request, for :meth:`result`. ``label``: what the stage is for, in
        the summary and its run's name; ``encoder``: the encoder it trains, reads or scores, tagged on its run."""
        options = (options or {}) | ({"cluster": self.cluster} if self.cluster and stage_kinds()[kind].split else {})
        request = _request(kind, params, options, out_dir)
        self._uses[request] += 1
        if request not in self._submitted:
            named = task_of(kind).with_options(task_run_name=task_run_name(kind, label))
            future = named.submit(params, options, out_dir, self.parent.run_id, label, encoder, register,
                                  stores() if self.cluster else None, self.reuse)
            self._submitted[request] = future, kind, label
        return request

    def result(self, request: str) -> StageOutput:
        """The output of a submitted request, once its task has finished; tracked the first time."""
        if request not in self._outputs:
            future, kind, label = self._submitted[request]
            try:
                output = self._outputs[request] = future.result()
            except concurrent.futures.CancelledError:  # a task runner's lost future: its cluster went away
                task = " ".join(filter(None, [kind, label]))
                raise StageError(f"task {task} was lost with the cluster that ran it (its scheduler stopped or is "
                                 "unreachable)", "start the scheduler again (or leave out --cluster) and rerun: the "
                                 "stages completed and the pieces done are kept") from None
            detail = ": ".join(filter(None, [label, produced(stage_kinds()[kind], read_record(output.path))]))
            self.summaries.append({"stage": kind, "detail": detail, "key": output.key, "path": str(output.path),
                                   "cached": output.cached, "members": self._uses[request]})
        return self._outputs[request]

    def log_figures(self, draw: Callable[[Path], list[Path]]) -> None:
        """The figures ``draw(folder)`` writes, logged on the parent run."""
        with tempfile.TemporaryDirectory() as folder:
            self.parent.log_artifacts(draw(Path(folder)))

    model_directory = staticmethod(model_directory)


@dataclass
class Planner:
    """Stands in for :class:`Stages` to plan a run without running it: each distinct request planned and
    found cached or not (a stage whose inputs are not built yet has no key, but is counted)."""

    reuse: Reuse = SERVE_COMPLETE
    summaries: list[dict] = field(default_factory=list)
    _outputs: dict[str, tuple[StageOutput, dict]] = field(default_factory=dict)

    def submit(self, kind: str, params: dict[str, Any], options: dict[str, Any] | None = None, *,
               out_dir: str | None = None, label: str | None = None, **_: Any) -> str:
        request = _request(kind, params, options or {}, out_dir)
        if request not in self._outputs:
            try:
                stage, out = planned(stage_kinds()[kind], params, out_dir)
            except (RepsimError, OSError):  # an input is not built yet
                stage, out = None, None
            record = current_record(stage, out, self.reuse) if stage is not None else None
            summary = {"stage": kind, "detail": label or "", "key": stage.key if stage else "", "members": 0,
                       "status": "cached" if record else "runs" if stage else "runs after its inputs"}
            self.summaries.append(summary)
            path = out if record else Path(f"<{kind} {hashlib.sha256(request.encode()).hexdigest()[:8]}, not built>")
            self._outputs[request] = StageOutput(kind, summary["key"], path, record is not None, record or {}), summary
        self._outputs[request][1]["members"] += 1
        return request

    def result(self, request: str) -> StageOutput:
        return self._outputs[request][0]

    def log_figures(self, draw: Callable[[Path], list[Path]]) -> None:
        """Nothing: a plan draws no figures."""

    model_directory = staticmethod(model_directory)


@dataclass(eq=False)
class MemberRun:
    """One member so far: its shards, caption stage and trained encoders by label, and its scores."""

    member: Member
    shards: StageOutput | None = None
    captions: StageOutput | None = None
    encoders: dict[str, StageOutput] = field(default_factory=dict)
    scores: list[Score] = field(default_factory=list)

    @property
    def experiment(self) -> Experiment:
        return self.member.experiment

    @property
    def data(self) -> Path:
        return self.experiment.data

    @property
    def name(self) -> str:
        return self.experiment.name

    def tag(self, label: str, kind: str) -> str:
        """``label`` of a ``kind`` stage with what of the member can change it (its seed and grid
        values, :meth:`Member.label_through`), for a stage that differs between members."""
        shown = self.member.label_through(kind, label)
        return f"{label} [{shown}]" if shown else label

    def score(self, encoder: str, output: StageOutput) -> None:
        """Keep what an output scores ``encoder`` by (its kind's ``scores``; none from a stage only planned)."""
        metrics = stage_kinds()[output.stage].scores(output) if output.record else {}
        if metrics:
            self.scores.append(Score(self.member.point_label, encoder, output.key, metrics))


def run_steps(stages: Stages | Planner, experiment: Experiment, members: list[Member]) -> list[MemberRun]:
    """Every member's data sharded, then each of the experiment's sections run for every member, in order."""
    runs = [MemberRun(member) for member in members]
    ShardSection.run(stages, [(run, run.experiment.section("shard")) for run in runs])
    for position, section in enumerate(experiment.stages):
        if section.kind != "shard":
            type(section).run(stages, [(run, run.experiment.stages[position]) for run in runs])
    return runs


def plan_experiment(experiment: Experiment, force: Sequence[str] = ()) -> dict[str, Any]:
    """What :func:`experiment_flow` would run, without running it: ``{"members": [labels], "stages":
    [one summary per distinct stage: stage, detail, key, status (cached, runs, runs after its inputs)]}``."""
    members = check_experiment(experiment)
    check_stage_names(force)
    planner = Planner(Reuse.forcing(force, experiment.verify))
    run_steps(planner, experiment, members)
    return {"members": [member.label for member in members], "stages": planner.summaries}


def run_members_on(deployment: str, members: list[Member], force: Sequence[str], poll_seconds: float = 5) -> None:
    """Run every member at once as a flow run of ``deployment`` (``experiment/<name>``), for the processes
    serving it to share out, and wait for all (their outputs land in the shared ``$REPSIM_HOME``).
    StageError naming the members that did not complete."""
    from prefect.client.orchestration import get_client
    from prefect.deployments import run_deployment

    started = {member.label: run_deployment(deployment, timeout=0, flow_run_name=f"{member.experiment.name} {member.label}",
                                            parameters={"experiment": member.experiment.model_dump(mode="json"),
                                                        "force": list(force), "member": member.label})
               for member in members}
    with get_client(sync_client=True) as client:
        states = {label: client.read_flow_run(run.id).state for label, run in started.items()}
        while not all(state.is_final() for state in states.values()):
            time.sleep(poll_seconds)
            states = {label: client.read_flow_run(run.id).state for label, run in started.items()}
    failed = [f"{label} ({state.name})" for label, state in states.items() if not state.is_completed()]
    if failed:
        raise StageError(f"members {', '.join(failed)} of the run on {deployment} did not complete",
                         "see their flow runs in the Prefect UI, then run again: completed stages are cached")


def publish(parent: StageRun, rows: list[Row], columns: dict[str, str], name: str) -> str:
    """The result table on the parent MLflow run (a table artifact, and each row's means as metrics)
    and on the Prefect flow run (a markdown artifact); its markdown."""
    table = markdown(rows, columns)
    records = as_records(rows, columns.values())
    parent.client.log_table(parent.run_id, data={name: [record[name] for record in records] for name in records[0]},
                            artifact_file=RESULTS_TABLE)
    points = list(dict.fromkeys(row.point for row in rows))
    for row in rows:
        prefix = f"point{points.index(row.point)}." if row.point else ""
        parent.log_metrics({f"{prefix}{row.encoder}.{metric}": value for metric, value in row.mean.items()}
                           | {f"{prefix}{row.encoder}.{metric}.std": row.std[metric]
                              for metric in row.mean if row.n[metric] > 1})
    parent.log_params({f"point{index}": point for index, point in enumerate(points) if point})
    experiment = parent.client.get_experiment(parent.client.get_run(parent.run_id).info.experiment_id)
    show_in_runs_table(parent.client, experiment, columns.values())
    colour_by_encoder(parent.client, parent.run_id, dict.fromkeys(row.encoder for row in rows))
    key = artifact_key(name)
    create_markdown_artifact(table, key=f"{key}-results", description=f"experiment {name}: mean ± std (n) over seeds")
    create_table_artifact(records, key=f"{key}-results-table", description=f"experiment {name}, every metric")
    return table


def artifact_key(name: str) -> str:
    """The Prefect artifact key of experiment ``name``: lowercase letters, digits and dashes (Prefect's rule)."""
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "experiment"


@contextlib.contextmanager
def experiment_flow_on(cluster: str | None, concurrency: int | None = None) -> Iterator[Callable[..., dict[str, Any]]]:
    """:func:`experiment_flow` as the command line calls it, for the block. With a cluster (``cluster``, else the
    experiment's or ``$DASK_SCHEDULER_ADDRESS``; a ``local:N`` one started for the block), its stage tasks run on
    the cluster's workers through prefect-dask's DaskTaskRunner, reporting to this process's Prefect API, and
    its split stages' pieces too; else its tasks run on threads, ``concurrency`` at once (default: its own)."""
    with cluster_running(requested_cluster(cluster)) as address:
        if address is None:
            yield experiment_flow if concurrency is None else experiment_flow.with_options(
                task_runner=ThreadPoolTaskRunner(max_workers=concurrency))
            return
        from prefect_dask import DaskTaskRunner

        with api_for_workers(), dask_logs_above(logging.CRITICAL):
            yield functools.partial(experiment_flow.with_options(task_runner=DaskTaskRunner(address=address)),
                                    cluster=address)


def run_name() -> str:
    """``animal-mnist 2026-12-04 23:10:05``: the experiment's name (overrides applied) and the start time,
    or the member it runs (``animal-mnist seed=1``); names the flow run and its parent MLflow run."""
    parameters = prefect_flow_run.parameters
    try:
        name = with_overrides(Experiment.model_validate(parameters["experiment"]), parameters.get("overrides") or []).name
    except (RepsimError, ValueError):  # the flow itself says what is wrong
        name = "experiment"
    return f"{name} {parameters.get('member') or f'{datetime.now():%Y-%m-%d %H:%M:%S}'}"


@flow(name="experiment", flow_run_name=run_name, task_runner=ThreadPoolTaskRunner(max_workers=concurrency()))
def experiment_flow(experiment: Experiment, overrides: list[str] | None = None, force: list[str] | None = None,
                    spread: str | None = None, member: str = "", cluster: str | None = None) -> dict[str, Any]:
    """Run ``experiment`` with ``overrides`` (``"train.settings.optim.lr=0.01"``), rebuilding the stages
    named in ``force`` (``["train"]``) even when cached. With ``spread`` (a deployment of this flow), the
    members first run as its flow runs (:func:`run_members_on`; ``member`` names such a run's member).
    Split stages run their pieces on ``cluster`` (default: the experiment's, :mod:`repsim.tasks.cluster`).

    Returns ``{"name", "stages": [one summary per distinct stage: stage, detail, key, path, cached],
    "rows": [one result row per grid point and encoder], "columns": {title: headline metric},
    "table": the rows as markdown}``; the parent MLflow run carries the table.
    """
    use_embedded_defaults()  # in a flow run the command line did not start (a work pool's), where none are set
    stopping.install()  # SIGTERM asks the stages to stop, rather than Prefect's engine to crash the run
    source = experiment.name  # the experiment file's, before a `name=` override
    with read_once():  # each settings file is read once, also in a flow run the command line did not start
        experiment = with_overrides(experiment, overrides or [])
        members = check_experiment(experiment)
        check_stage_names(force or [])
        tracker = Tracker()
        params = {"experiment": experiment.model_dump(mode="json"), "source": source, "overrides": list(overrides or []),
                  "force": list(force or []), "members": len(members), "spread": spread or "", "cluster": cluster or ""}
        parent_run = tracker.flow_run("experiment", params, prefect_flow_run.get_name())
        reuse = Reuse.forcing(force or [], experiment.verify)
        with parent_run as parent, cluster_running(requested_cluster(cluster or experiment.cluster)) as address:
            if spread:
                run_members_on(spread, members, force or [])
            stages = Stages(tracker, parent, address, reuse)
            runs = run_steps(stages, experiment, members)
            rows = aggregate(score for run in runs for score in run.scores)
            evaluate = experiment.section("evaluate")
            columns = headline_metrics(rows, evaluate.knn_k[0] if evaluate is not None else None)
            table = publish(parent, rows, columns, experiment.name) if rows else ""
        return {"name": experiment.name, "stages": stages.summaries, "rows": rows, "columns": columns, "table": table}

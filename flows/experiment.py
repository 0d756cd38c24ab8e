"""The experiment flow: shard the data spec, then run the experiment's stage sections in order
(precompute, train, evaluate, align), each stage a cached task tracked as a nested MLflow run; end
with the result table on the parent run and as a Prefect artifact.

An experiment with ``seeds`` or a ``sweep`` runs as members (:func:`repsim.experiment.expand`). Each
section runs for every member at once: its step submits the tasks of all members before it waits on
any, so that independent stages run concurrently, up to the task runner's ``max_workers``
(:func:`concurrency`). A task called twice with the same arguments (a stage that the members' overrides
do not reach) is submitted once and its future shared.

Each section kind has one step here (:data:`STEPS`). A new stage kind is a section model in
:mod:`repsim.experiment` and one step.
"""

from __future__ import annotations

import hashlib
import os
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prefect import Task, flow
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.futures import PrefectFuture
from prefect.task_runners import ThreadPoolTaskRunner

from repsim.data.sharding import MANIFEST, ShardResult
from repsim.errors import RepsimError, StageError
from repsim.eval.stages import PIXELS, RESULTS_FILE, read_results
from repsim.experiment import Experiment, Member, check_experiment, with_overrides
from repsim.results import Row, Score, aggregate, as_columns, headline_metrics, markdown
from repsim.similarity.stages import CLASSES_FILE, HEAT_MAP_FILE, SIMILARITY_FILE
from repsim.stage import StageOutput, rebuilding, verifying
from repsim.tasks.align import ARTIFACTS as ALIGN_ARTIFACTS
from repsim.tasks.align import align_task
from repsim.tasks.evaluate import evaluate_task, features_task
from repsim.tasks.precompute import embed_captions_task, neighbors_task, wordnet_task
from repsim.tasks.shard import shard_task
from repsim.tasks.stage import current_record, plan_call, track
from repsim.tasks.tracking import StageRun, Tracker, model_name
from repsim.tasks.train import ARTIFACTS as TRAIN_ARTIFACTS
from repsim.tasks.train import train_task

RESULTS_TABLE = "results.json"  # the result table's file among the parent run's artifacts


def concurrency() -> int:
    """How many stage tasks run at once: ``REPSIM_CONCURRENCY``, else one per GPU, else 1."""
    import torch

    return int(os.environ.get("REPSIM_CONCURRENCY") or max(1, torch.cuda.device_count()))


SELF_LOGGING = ("train", "align")  # tasks that log their own nested run while they run


def _call(task: Task, args: tuple, kwargs: dict[str, Any]) -> str:
    """A task call as text: two calls are the same stage when their texts are equal."""
    return f"{task.name}{args!r}{sorted(kwargs.items())!r}"


@dataclass
class Stages:
    """The stage tasks of one flow run: each distinct call submitted once, each finished stage tracked
    once (a nested MLflow run under ``parent`` and one row of ``summaries``, with how many members
    submitted it: the first one's label names it)."""

    tracker: Tracker
    parent: StageRun
    summaries: list[dict] = field(default_factory=list)
    _futures: dict[str, PrefectFuture] = field(default_factory=dict)
    _uses: Counter[str] = field(default_factory=Counter)
    _tracking: dict[Any, tuple[str, tuple[str, ...], str | None, str | None]] = field(default_factory=dict)
    _outputs: dict[Any, StageOutput] = field(default_factory=dict)

    @property
    def parent_run_id(self) -> str:
        return self.parent.run_id

    def submit(self, task: Task, *args: Any, artifacts: Sequence[str] = (), label: str | None = None,
               encoder_label: str | None = None, **kwargs: Any) -> PrefectFuture:
        """``task.submit(*args, **kwargs)``, or the future of the same call made before. ``artifacts``:
        glob patterns of output files to log; ``label``: what the stage is for, in the summary;
        ``encoder_label``: the encoder it trains, reads or scores, tagged on its MLflow run."""
        call = _call(task, args, kwargs)
        self._uses[call] += 1
        if call not in self._futures:
            named = task.with_options(task_run_name=f"{task.name} {label}" if label else task.name)
            future = self._futures[call] = named.submit(*args, **kwargs)
            self._tracking[future.task_run_id] = (call, tuple(artifacts), label, encoder_label)
        return self._futures[call]

    def result(self, future: PrefectFuture) -> StageOutput:
        """The output of a submitted task, once it has finished; tracked the first time."""
        run_id = future.task_run_id
        if run_id not in self._outputs:
            future.wait()
            self._outputs[run_id] = self._track(future.state, *self._tracking[run_id])
        return self._outputs[run_id]

    def _track(self, state: Any, call: str, artifacts: tuple[str, ...], label: str | None,
               encoder_label: str | None) -> Any:
        output = track(self.tracker, self.parent, self.summaries, state, artifacts, label,
                       self_logging=call.partition("(")[0] in SELF_LOGGING, encoder=encoder_label)
        self.summaries[-1]["members"] = self._uses[call]
        return output


@dataclass
class Planner:
    """Stands in for :class:`Stages` to plan a run without running it: each distinct call is planned,
    its output found complete (cached) or not. A stage whose inputs are not built yet has no key until
    they are; it is counted all the same."""

    parent_run_id: str = "plan"
    summaries: list[dict] = field(default_factory=list)
    _outputs: dict[str, tuple[Any, dict]] = field(default_factory=dict)

    def submit(self, task: Task, *args: Any, artifacts: Sequence[str] = (), label: str | None = None,
               encoder_label: str | None = None, **kwargs: Any) -> str:
        call = _call(task, args, kwargs)
        if call not in self._outputs:
            self._outputs[call] = self._plan(task, call, label, args, kwargs)
        self._outputs[call][1]["members"] += 1
        return call

    def result(self, call: str) -> Any:
        return self._outputs[call][0]

    def _plan(self, task: Task, call: str, label: str | None, args: tuple,
              kwargs: dict[str, Any]) -> tuple[Any, dict]:
        """The call's output (found, or a stand-in for one not built) and its summary."""
        name = task.name
        try:
            stage, out = plan_call(task, args, kwargs)
        except (RepsimError, OSError):  # an input is not built yet
            stage, out = None, None
        record = current_record(stage, out) if stage is not None else None
        summary = {"stage": name, "detail": label or "", "key": stage.key if stage else "", "members": 0,
                   "status": "cached" if record else "runs" if stage else "runs after its inputs"}
        self.summaries.append(summary)
        if record is None:
            unbuilt = Path(f"<{name} {hashlib.sha256(call.encode()).hexdigest()[:8]}, not built>")
            return StageOutput(name, stage.key if stage else "", unbuilt, False, {}), summary
        found = ShardResult.from_dir(out) if name == "shard" else StageOutput(name, stage.key, out, True, record)
        return found, summary


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

    def tag(self, label: str, kind: str) -> str:
        """``label`` of a ``kind`` stage with what of the member can change it (its seed and grid
        values, :meth:`Member.label_through`), for a stage that differs between members."""
        shown = self.member.label_through(kind, label)
        return f"{label} [{shown}]" if shown else label

    def score(self, encoder: str, output: StageOutput) -> None:
        """Keep the metrics of an evaluate or align output of ``encoder`` (none from a stage only planned)."""
        if output.stage == "evaluate" and output.record:
            metrics = {name: value for suite in read_results(output)["suites"].values() for name, value in suite.items()}
        else:
            metrics = output.metrics
        if metrics:
            self.scores.append(Score(self.member.point_label, encoder, output.key, metrics))


Members = list[tuple[MemberRun, Any]]  # each member with its section of the step's kind


def shard_step(stages: Stages, runs: list[MemberRun]) -> None:
    futures = [stages.submit(shard_task, str(run.experiment.data), artifacts=(MANIFEST,)) for run in runs]
    for run, future in zip(runs, futures):
        run.shards = stages.result(future)


def precompute_step(stages: Stages, members: Members) -> None:
    captions = {run: stages.submit(embed_captions_task, str(run.shards.path))
                for run, section in members if section.captions}
    wordnet = [stages.submit(wordnet_task, str(run.experiment.data), measure,
                             artifacts=(CLASSES_FILE, SIMILARITY_FILE, HEAT_MAP_FILE))
               for run, section in members for measure in section.wordnet]
    for run, future in captions.items():
        run.captions = stages.result(future)
    neighbors = [stages.submit(neighbors_task, str(run.captions.path), k=section.neighbors, index=section.index)
                 for run, section in members if section.neighbors]
    for future in [*wordnet, *neighbors]:
        stages.result(future)


def train_step(stages: Stages, members: Members) -> None:
    futures = [(run, method.label, stages.submit(train_task, str(method.config),
                                                 section.overrides(method, run.experiment.data),
                                                 stages.parent_run_id, section.launch,
                                                 run_name=run.tag(method.label, "train"), encoder=method.label,
                                                 model=model_name(run.experiment.name, method.label),
                                                 artifacts=TRAIN_ARTIFACTS, label=run.tag(method.label, "train"),
                                                 encoder_label=method.label))
               for run, section in members for method in section.methods]
    for run, label, future in futures:
        run.encoders[label] = stages.result(future)


def evaluate_step(stages: Stages, members: Members) -> None:
    sections = dict(members)
    encoders = [(run, label, tag, encoder) for run, section in members
                for label, tag, encoder in _encoders(run, section.pixels)]
    features = {(run, label): [stages.submit(features_task, str(run.shards.path), encoder, split, label=f"{tag} {split}",
                                             encoder_label=label)
                               for split in (sections[run].train_split, sections[run].test_split)]
                for run, label, tag, encoder in encoders}
    evaluations = {(run, label): stages.submit(
        evaluate_task, *(str(stages.result(future).path) for future in features[run, label]),
        list(sections[run].suites), list(sections[run].knn_k),
        linear_options=sections[run].linear.model_dump(exclude_defaults=True), artifacts=("*.png", RESULTS_FILE),
        label=tag, encoder_label=label) for run, label, tag, encoder in encoders}
    for (run, label), future in evaluations.items():
        run.score(label, stages.result(future))


def _encoders(run: MemberRun, pixels: bool) -> list[tuple[str, str, str]]:
    """(label, label shown with the member when it differs between members, encoder) of each encoder to evaluate."""
    trained = [(label, run.tag(label, "evaluate"), str(output.path)) for label, output in run.encoders.items()]
    return [("pixels", "pixels", PIXELS)] * pixels + trained


def align_step(stages: Stages, members: Members) -> None:
    futures = [(run, label, stages.submit(align_task, str(section.config),
                                          section.overrides(encoder, run.experiment.data),
                                          stages.parent_run_id, run_name=run.tag(label, "align"),
                                          encoder=label, artifacts=ALIGN_ARTIFACTS,
                                          label=run.tag(label, "align"), encoder_label=label))
               for run, section in members for label, encoder in _image_sides(run, section.pixels)]
    for run, label, future in futures:
        run.score(label, stages.result(future))


def _image_sides(run: MemberRun, pixels: bool) -> list[tuple[str, Path | None]]:
    """(label, train stage directory; None: the raw pixels) of each image side to align."""
    return [("pixels", None)] * pixels + [(label, output.path) for label, output in run.encoders.items()]


STEPS: dict[str, Callable[[Stages, Members], None]] = {
    "precompute": precompute_step, "train": train_step, "evaluate": evaluate_step, "align": align_step}


def run_steps(stages: Stages | Planner, experiment: Experiment, members: list[Member]) -> list[MemberRun]:
    """Every member through the shard step and the experiment's section steps, section by section."""
    runs = [MemberRun(member) for member in members]
    shard_step(stages, runs)
    for position, section in enumerate(experiment.stages):
        STEPS[section.kind](stages, [(run, run.experiment.stages[position]) for run in runs])
    return runs


def plan_experiment(experiment: Experiment, force: Sequence[str] = ()) -> dict[str, Any]:
    """What :func:`experiment_flow` would run, without running it: ``{"members": [labels], "stages":
    [one summary per distinct stage: stage, detail, key, status (cached, runs, runs after its inputs)]}``."""
    members = check_experiment(experiment)
    planner = Planner()
    with rebuilding(force), verifying(experiment.verify):
        run_steps(planner, experiment, members)
    return {"members": [member.label for member in members], "stages": planner.summaries}


def run_members_on(deployment: str, members: list[Member], force: Sequence[str], poll_seconds: float = 5) -> None:
    """Run every member as a flow run of ``deployment`` (``experiment/<name>``), all at once, so that the
    processes serving it (``repsim serve`` on several machines, or a work pool's workers) share them
    out; wait for all. Their outputs land in the ``$REPSIM_HOME`` they share with this process.
    StageError naming the members that did not complete."""
    from prefect.client.orchestration import get_client
    from prefect.deployments import run_deployment

    started = {member.label: run_deployment(deployment, timeout=0, flow_run_name=f"{member.experiment.name} {member.label}",
                                            parameters={"experiment": member.experiment.model_dump(mode="json"),
                                                        "force": list(force)})
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
    parent.client.log_table(parent.run_id, data=as_columns(rows), artifact_file=RESULTS_TABLE)
    points = list(dict.fromkeys(row.point for row in rows))
    for row in rows:
        prefix = f"point{points.index(row.point)}." if row.point else ""
        parent.log_metrics({f"{prefix}{row.encoder}.{metric}": value for metric, value in row.mean.items()}
                           | {f"{prefix}{row.encoder}.{metric}.std": row.std[metric]
                              for metric in row.mean if row.n[metric] > 1})
    parent.log_params({f"point{index}": point for index, point in enumerate(points) if point})
    create_markdown_artifact(table, key="results", description=f"experiment {name}: mean ± std (n) over seeds")
    create_table_artifact(as_columns(rows), key="results-table", description=f"experiment {name}, every metric")
    return table


@flow(name="experiment", task_runner=ThreadPoolTaskRunner(max_workers=concurrency()))
def experiment_flow(experiment: Experiment, overrides: list[str] | None = None,
                    force: list[str] | None = None, spread: str | None = None) -> dict[str, Any]:
    """Run ``experiment`` with ``overrides`` (``"train.settings.optim.lr=0.01"``), rebuilding the
    outputs of the stages named in ``force`` (e.g. ``["train"]``) even when they are cached; with
    ``experiment.verify``, cache hits are checked by the sha256 of their files (always by size). With
    ``spread`` (a deployment of this flow, ``experiment/<name>``), the members run first as flow runs
    of that deployment (:func:`run_members_on`), and this run then finds every stage cached.

    Returns ``{"name", "stages": [one summary per distinct stage: stage, detail, key, path, cached],
    "rows": [one result row per grid point and encoder], "columns": {title: headline metric},
    "table": the rows as markdown}``; the parent MLflow run carries the table.
    """
    source = experiment.name  # the experiment file's, before a `name=` override
    experiment = with_overrides(experiment, overrides or [])
    members = check_experiment(experiment)
    tracker = Tracker()
    params = {"experiment": experiment.model_dump(mode="json"), "source": source, "overrides": list(overrides or []),
              "force": list(force or []), "members": len(members), "spread": spread or ""}
    with rebuilding(force or []), verifying(experiment.verify), tracker.flow_run("experiment", params) as parent:
        if spread:
            run_members_on(spread, members, force or [])
        stages = Stages(tracker, parent)
        runs = run_steps(stages, experiment, members)
        rows = aggregate(score for run in runs for score in run.scores)
        evaluate = experiment.section("evaluate")
        columns = headline_metrics(rows, evaluate.knn_k[0] if evaluate is not None else None)
        table = publish(parent, rows, columns, experiment.name) if rows else ""
    return {"name": experiment.name, "stages": stages.summaries, "rows": rows, "columns": columns, "table": table}

"""The experiment flow: shard the data spec, then run the experiment's stage sections in order
(precompute, train, evaluate, align), each stage a cached task tracked as a nested MLflow run.

Each section kind has one step here (:data:`STEPS`): a function of the run so far and the section.
A new stage kind is a section model in :mod:`repsim.experiment` and one step.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from prefect import flow

from repsim.data.sharding import MANIFEST
from repsim.eval.stages import PIXELS, RESULTS_FILE, read_results
from repsim.experiment import (AlignSection, EvaluateSection, Experiment, PrecomputeSection, TrainSection,
                               check_experiment, with_overrides)
from repsim.similarity.stages import CLASSES_FILE, HEAT_MAP_FILE, SIMILARITY_FILE
from repsim.stage import StageOutput, rebuilding
from repsim.tasks.evaluate import evaluate_task, features_task
from repsim.tasks.precompute import embed_captions_task, neighbors_task, wordnet_task
from repsim.tasks.shard import shard_task
from repsim.tasks.stage import describe, log_stage, track
from repsim.tasks.tracking import StageRun, Tracker
from repsim.tasks.align import ARTIFACTS as ALIGN_ARTIFACTS
from repsim.tasks.align import align_task
from repsim.tasks.train import ARTIFACTS as TRAIN_ARTIFACTS
from repsim.tasks.train import train_task


@dataclass
class ExperimentRun:
    """What the steps share: the tracker, the parent MLflow run, one summary per stage, the shards,
    the caption stage, the trained encoders by label, and one result row per encoder."""

    experiment: Experiment
    tracker: Tracker
    parent: StageRun
    summaries: list[dict] = field(default_factory=list)
    shards: StageOutput | None = None
    captions: StageOutput | None = None
    encoders: dict[str, StageOutput] = field(default_factory=dict)
    results: dict[str, dict[str, float]] = field(default_factory=dict)

    def track(self, state: Any, artifacts: tuple[str, ...] = ()) -> Any:
        """Log a finished stage task as a nested run and keep its summary; its result."""
        return track(self.tracker, self.parent, self.summaries, state, artifacts)

    def track_self_logging(self, state: Any, label: str, artifacts: tuple[str, ...]) -> StageOutput:
        """Keep the summary of a task that logs its own nested run while it runs (train, align), and
        log the run here when Prefect served the task from its cache; its result."""
        output = state.result()
        if state.name == "Cached":
            log_stage(self.tracker, self.parent, output.path, state, [output.path / name for name in artifacts])
        self.summaries.append({"stage": output.stage, "detail": f"{label}: {describe(output.record)}",
                               "key": output.key, "path": str(output.path),
                               "cached": output.cached or state.name == "Cached"})
        return output

    def add_results(self, label: str, metrics: dict[str, float]) -> None:
        """Results of encoder ``label``: in its row of the result table and on the parent run."""
        self.results.setdefault(label, {}).update(metrics)
        self.parent.log_metrics({f"{label}.{name}": value for name, value in metrics.items()})


def precompute_step(run: ExperimentRun, section: PrecomputeSection) -> None:
    spec = str(run.experiment.data)
    if section.captions:
        run.captions = run.track(embed_captions_task(str(run.shards.path), return_state=True))
    for measure in section.wordnet:
        run.track(wordnet_task(spec, measure, return_state=True), (CLASSES_FILE, SIMILARITY_FILE, HEAT_MAP_FILE))
    if section.neighbors:
        run.track(neighbors_task(str(run.captions.path), k=section.neighbors, index=section.index,
                                 return_state=True))


def train_step(run: ExperimentRun, section: TrainSection) -> None:
    for method in section.methods:
        overrides = section.overrides(method, run.experiment.data)
        state = train_task(str(method.config), overrides, run.parent.run_id, section.launch, return_state=True)
        run.encoders[method.label] = run.track_self_logging(state, method.label, TRAIN_ARTIFACTS)


def evaluate_step(run: ExperimentRun, section: EvaluateSection) -> None:
    encoders = {"pixels": PIXELS} if section.pixels else {}
    encoders |= {label: str(output.path) for label, output in run.encoders.items()}
    for label, encoder in encoders.items():
        train, test = (run.track(features_task(str(run.shards.path), encoder, split, return_state=True))
                       for split in (section.train_split, section.test_split))
        evaluated = run.track(evaluate_task(str(train.path), str(test.path), list(section.suites),
                                            list(section.knn_k), linear_options=section.linear.model_dump(exclude_defaults=True),
                                            return_state=True), ("*.png", RESULTS_FILE))
        run.add_results(label, {name: value for suite in read_results(evaluated)["suites"].values()
                                for name, value in suite.items()})


def align_step(run: ExperimentRun, section: AlignSection) -> None:
    for label, encoder in run.encoders.items():
        overrides = section.overrides(encoder.path, run.experiment.data)
        state = align_task(str(section.config), overrides, run.parent.run_id, return_state=True)
        run.add_results(label, run.track_self_logging(state, label, ALIGN_ARTIFACTS).metrics)


STEPS: dict[str, Callable[[ExperimentRun, Any], None]] = {
    "precompute": precompute_step, "train": train_step, "evaluate": evaluate_step, "align": align_step}


@flow(name="experiment")
def experiment_flow(experiment: Experiment, overrides: list[str] | None = None,
                    force: list[str] | None = None) -> dict[str, Any]:
    """Run ``experiment`` with ``overrides`` (``"train.settings.optim.lr=0.01"``), rebuilding the
    outputs of the stages named in ``force`` (e.g. ``["train"]``) even when they are cached.

    Returns ``{"name", "stages": [one summary per stage: stage, detail, key, path, cached],
    "results": {encoder label: {metric: value}}}``; the parent MLflow run carries every result.
    """
    experiment = with_overrides(experiment, overrides or [])
    check_experiment(experiment)
    tracker = Tracker()
    params = {"experiment": experiment.model_dump(mode="json"), "overrides": list(overrides or []),
              "force": list(force or [])}
    with rebuilding(force or []), tracker.flow_run("experiment", params) as parent:
        run = ExperimentRun(experiment, tracker, parent)
        run.shards = run.track(shard_task(str(experiment.data), return_state=True), (MANIFEST,))
        for section in experiment.stages:
            STEPS[section.kind](run, section)
    return {"name": experiment.name, "stages": run.summaries, "results": run.results}


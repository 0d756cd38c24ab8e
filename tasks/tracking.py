"""MLflow tracking: one parent run per flow run, one nested run per stage.

Nested runs are tagged with the stage name, the stage key, the output path, whether the stage was
served from cache, and the Prefect flow-run id. Params are the stage's resolved config (flattened);
metrics are the stage's metrics; small outputs are logged as artifacts, large ones by path.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

from mlflow.entities import Metric, Param
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient
from mlflow.utils.mlflow_tags import MLFLOW_PARENT_RUN_ID, MLFLOW_RUN_NAME
from mlflow.utils.validation import MAX_PARAM_VAL_LENGTH, MAX_PARAMS_TAGS_PER_BATCH
from prefect.runtime import flow_run

from repsim.stage import read_record
from repsim.tasks.settings import mlflow_artifact_location

EXPERIMENT = "repsim"
SMALL_ARTIFACT_BYTES = 50 * 2**20


def flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}``; lists stay values."""
    flat: dict[str, Any] = {}
    for name, value in tree.items():
        dotted = f"{prefix}{name}"
        if isinstance(value, Mapping) and value:
            flat.update(flatten(value, f"{dotted}."))
        else:
            flat[dotted] = value
    return flat


def numeric_metrics(metrics: Mapping[str, Any]) -> dict[str, float]:
    return {name: float(value) for name, value in flatten(metrics).items()
            if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)}


class StageRun:
    """A nested MLflow run for one stage; a training stage logs its curves through it."""

    def __init__(self, client: MlflowClient, run_id: str):
        self.client = client
        self.run_id = run_id

    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None:
        timestamp = int(time.time() * 1000)
        batch = [Metric(name, value, timestamp, step or 0) for name, value in numeric_metrics(metrics).items()]
        if batch:
            self.client.log_batch(self.run_id, metrics=batch)

    def log_params(self, params: Mapping[str, Any]) -> None:
        items = [Param(name, str(value)[:MAX_PARAM_VAL_LENGTH]) for name, value in flatten(params).items()]
        for start in range(0, len(items), MAX_PARAMS_TAGS_PER_BATCH):
            self.client.log_batch(self.run_id, params=items[start:start + MAX_PARAMS_TAGS_PER_BATCH])

    def log_stage_output(self, path: Path, cached: bool, artifacts: Iterable[Path] = (),
                         streamed: Iterable[str] = ()) -> None:
        """A completed stage (its ``stage.json`` at ``path``): params = resolved config and input keys,
        metrics = the stage's metrics and seconds, except those ``streamed`` as curves while it ran;
        ``stage.json`` and ``artifacts`` as artifacts."""
        record = read_record(path)
        self.client.set_tag(self.run_id, "repsim.cached", str(cached).lower())
        self.log_params({"config": record["config"], "inputs": record["inputs"]})
        summary = {**record.get("metrics", {}), "seconds": record.get("seconds", 0.0)}
        self.log_metrics({name: value for name, value in summary.items() if name not in set(streamed)})
        self.log_artifacts([path / "stage.json", *artifacts])

    def log_artifacts(self, paths: Iterable[Path]) -> None:
        """Files up to SMALL_ARTIFACT_BYTES as artifacts; larger ones as a tag holding their path."""
        for path in paths:
            if not path.is_file():
                continue
            if path.stat().st_size <= SMALL_ARTIFACT_BYTES:
                self.client.log_artifact(self.run_id, str(path))
            else:
                self.client.set_tag(self.run_id, f"repsim.file.{path.name}", str(path.resolve()))


class Tracker:
    """Talks to the MLflow tracking store named by ``MLFLOW_TRACKING_URI``."""

    def __init__(self, experiment: str = EXPERIMENT):
        self.client = MlflowClient()
        self.experiment_id = self._experiment_id(experiment)

    def _experiment_id(self, name: str) -> str:
        found = self.client.get_experiment_by_name(name)
        if found is not None:
            return found.experiment_id
        try:
            return self.client.create_experiment(name, artifact_location=mlflow_artifact_location())
        except MlflowException:  # created concurrently by another process
            return self.client.get_experiment_by_name(name).experiment_id

    @contextlib.contextmanager
    def _run(self, name: str, tags: Mapping[str, str]) -> Iterator[StageRun]:
        tags = {MLFLOW_RUN_NAME: name, "prefect.flow_run_id": str(flow_run.get_id() or ""), **tags}
        run = self.client.create_run(self.experiment_id, run_name=name, tags=tags)
        status = "FAILED"
        try:
            yield StageRun(self.client, run.info.run_id)
            status = "FINISHED"
        finally:
            self.client.set_terminated(run.info.run_id, status)

    @contextlib.contextmanager
    def flow_run(self, flow_name: str, params: Mapping[str, Any]) -> Iterator[StageRun]:
        """The parent run of one flow run, with the flow's parameters as params."""
        with self._run(flow_name, {"repsim.flow": flow_name}) as run:
            run.log_params(params)
            yield run

    def stage_run(self, parent_run_id: str, stage: str, key: str, path: Path,
                  label: str | None = None) -> contextlib.AbstractContextManager[StageRun]:
        """A nested run for one stage under the parent run ``parent_run_id``, named ``<stage> <label>``
        (``train simclr``, ``features pixels test``) when the stage is for something in particular."""
        tags = {MLFLOW_PARENT_RUN_ID: parent_run_id, "repsim.stage": stage, "repsim.stage_key": key,
                "repsim.output": str(path)} | ({"repsim.label": label} if label else {})
        return self._run(f"{stage} {label}" if label else stage, tags)

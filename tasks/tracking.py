"""MLflow tracking: one parent run per flow run, one nested run per stage, tagged with the stage, its key,
output path, cache hit and Prefect flow-run id; params are the stage's resolved config, metrics its
metrics, outputs its artifacts. A trained encoder is registered as an MLflow model once per stage key
(:meth:`StageRun.log_encoder`), whose weights are the stage's ``encoder.pt`` itself: hard-linked where the
artifact store is a local folder on the same disk, so the bytes are stored once. ``models:/NAME/VERSION``
resolves to a directory (:func:`model_directory`).
"""

from __future__ import annotations

import contextlib
import filecmp
import importlib.metadata
import json
import math
import os
import shutil
import tempfile
import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from itertools import chain
from pathlib import Path
from types import SimpleNamespace
from typing import Any
from urllib.parse import urlparse

from mlflow.entities import Experiment, Metric, Param
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient
from mlflow.utils.mlflow_tags import MLFLOW_PARENT_RUN_ID, MLFLOW_RUN_NOTE
from mlflow.utils.validation import MAX_PARAM_VAL_LENGTH
from prefect.runtime import flow_run

from repsim.errors import RepsimError
from repsim.layering import flatten
from repsim.models.backbones import ENCODER_FILE, EXPORTING
from repsim.pieces import link_or_copy
from repsim.stage import STAGE_FILE, artifacts_root, read_record, repsim_home
from repsim.tasks.settings import mlflow_artifact_location

EXPERIMENT = "repsim"
EXPERIMENT_KIND = {"mlflow.experimentKind": "custom_model_development"}  # the UI opens on the runs, not on traces
SMALL_ARTIFACT_BYTES = 50 * 2**20
MODEL_FILES = (ENCODER_FILE, STAGE_FILE)  # what repsim loads and keys a registered encoder from
MODEL_WEIGHTS = Path("data") / "model.pt2"  # mlflow.pytorch's file of an exported program: the stage's encoder.pt
MODEL_URI = "models:/"
RUNS_VIEW = "repsim-runs"  # the key of the saved view the printed links open
RUN_NAME_COLUMN, RUN_NAME_WIDTH = "attributes.`Run Name`", 420  # px: ~45 characters of a nested run's name
RUN_COLOR = "mlflow.runColor"  # the tag MLflow's charts colour a run by
ENCODER_COLOURS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
                   "#bcbd22", "#17becf")  # matplotlib's tab10
RUN_COLUMNS = ("tags.`repsim.encoder`", "tags.`repsim.cached`")  # the runs table's, after the name (MLflow's ids)


@dataclass
class StageRun:
    """A nested MLflow run for one stage; a training stage streams its curves through :meth:`log_metrics`."""

    client: MlflowClient
    run_id: str
    streamed: set[str] = field(default_factory=set)  # the metrics logged by step as the stage ran

    def log_metrics(self, metrics: Mapping[str, Any], step: int | None = None, model_id: str | None = None) -> None:
        """``metrics`` at ``step`` (None: a summary, at 0), also as results of the logged model ``model_id``."""
        timestamp = int(time.time() * 1000)
        batch = [Metric(name, float(value), timestamp, step or 0, model_id=model_id)
                 for name, value in flatten(metrics).items()
                 if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)]
        if step is not None:
            self.streamed.update(metrics)
        if batch:  # every metric streamed already: no request to the store
            self.client.log_batch(self.run_id, metrics=batch)

    def log_params(self, params: Mapping[str, Any]) -> None:
        self.client.log_batch(self.run_id, params=[Param(name, str(value)[:MAX_PARAM_VAL_LENGTH])
                                                   for name, value in flatten(params).items()])

    def log_stage_output(self, path: Path, cached: bool, artifacts: Iterable[str] = (),
                         facts: Iterable[str] = ()) -> None:
        """A completed stage at ``path``: its config and input keys, and the ``facts`` among its metrics, as
        params; its other metrics and seconds (but those :attr:`streamed`), ``stage.json`` and the files
        matching the ``artifacts`` patterns; a ``cached`` one :meth:`refer_to_build`."""
        record = read_record(path)
        self.client.set_tag(self.run_id, "repsim.cached", str(cached).lower())
        metrics = record.get("metrics", {})
        found = {name: metrics[name] for name in facts if name in metrics}
        self.log_params({"config": record["config"], "inputs": record["inputs"]} | ({"stage": found} if found else {}))
        summary = {name: value for name, value in metrics.items() if name not in found} | {
            "seconds": record.get("seconds", 0.0)}
        files = [path / STAGE_FILE, *sorted(file for pattern in artifacts for file in path.glob(pattern))]
        if cached:
            self.refer_to_build(record["key"], summary, files)
            return
        summary = {name: value for name, value in summary.items() if name not in self.streamed}
        timings = {name: value for name, value in summary.items() if name.startswith("seconds")}
        self.log_metrics(timings)
        self.log_metrics({name: value for name, value in summary.items() if name not in timings},
                         model_id=self.logged_model(scored_encoder(record)))  # an evaluation: the model's results
        self.log_artifacts(files)

    def logged_model(self, train_key: str | None) -> str | None:
        """The id of the logged model of the encoder that the train stage ``train_key`` trained, if any."""
        if train_key is None:
            return None
        experiment = self.client.get_run(self.run_id).info.experiment_id
        found = self.client.search_logged_models([experiment], f"tags.`repsim.stage_key` = '{train_key}'",
                                                 max_results=1)
        return found[0].model_id if found else None

    def refer_to_build(self, key: str, summary: Mapping[str, float], files: Iterable[Path]) -> None:
        """A cached stage's run: ``repsim.file.<name>`` tags with the files' paths, ``repsim.built_by`` naming the
        run that built it, and that run's metric histories (without one, ``summary``); its description (the
        run page's overview) links that run and lists the files, which it holds no copy of."""
        experiment = self.client.get_run(self.run_id).info.experiment_id
        built = self.client.search_runs([experiment], f"tags.`repsim.stage_key` = '{key}' and tags.`repsim.cached` = "
                                        "'false' and attributes.status = 'FINISHED'",
                                        order_by=["attributes.start_time DESC"], max_results=1)
        files = list(filter(Path.is_file, files))
        for file in files:
            self.tag_path(file)
        builder = (f"built by run [{built[0].info.run_name}]({run_link(experiment, built[0].info.run_id)})"
                   if built else "built before it was tracked")
        self.client.set_tag(self.run_id, MLFLOW_RUN_NOTE, f"Served from the cache, {builder}. Its files, not "
                            "copied into this run:\n\n" + "\n".join(f"- `{file.resolve()}`" for file in files))
        if not built:
            self.log_metrics(summary)
            return
        self.client.set_tag(self.run_id, "repsim.built_by", built[0].info.run_id)
        for name in built[0].data.metrics:
            self.client.log_batch(self.run_id, metrics=self.client.get_metric_history(built[0].info.run_id, name))

    def tag_path(self, file: Path) -> None:
        """A ``repsim.file.<name>`` tag holding the path of ``file``, in place of a copy."""
        self.client.set_tag(self.run_id, f"repsim.file.{file.name}", str(file.resolve()))

    def log_artifacts(self, paths: Iterable[Path]) -> None:
        """Every file as an artifact; with an embedded store (not a server), files over SMALL_ARTIFACT_BYTES
        only :meth:`tag_path`, since they already lie on its disk."""
        embedded = not self.client.tracking_uri.startswith(("http://", "https://"))
        for path in filter(Path.is_file, paths):
            if embedded and path.stat().st_size > SMALL_ARTIFACT_BYTES:
                self.tag_path(path)
            else:
                self.client.log_artifact(self.run_id, str(path))

    def log_encoder(self, train_dir: Path, registered: str) -> str:
        """The encoder of the train stage at ``train_dir`` as an MLflow model of this run (a signature, an input
        example, ``stage.json``, and the stage's ``encoder.pt`` as its weights), registered under ``registered``
        with its lineage as tags, once per stage key. Returns the version."""
        import mlflow
        import torch
        from mlflow.models import infer_signature

        from repsim.models.backbones import load_encoder

        record = read_record(train_dir)
        for version in self.client.search_model_versions(f"name = '{registered}'"):
            if version.tags.get("repsim.stage_key") == record["key"]:
                return version.version
        encoder = load_encoder(train_dir)
        metrics, data = record.get("metrics", {}), record["config"].get("data", {})  # (C, H, W) of its images:
        size = int(encoder.recipe.get("image_size") or metrics.get("image_size") or data.get("image_size") or 224)
        channels = int(encoder.recipe.get("in_channels") or metrics.get("channels") or 3)
        example = torch.zeros(1, channels, size, size)
        with torch.no_grad():
            signature = infer_signature(example.numpy(), encoder(example).numpy())
        with EXPORTING:  # MLflow saves the model with torch.export too
            # a logged model belongs to the active experiment, not to its run's: make that this run's
            mlflow.set_experiment(experiment_id=self.client.get_run(self.run_id).info.experiment_id)
            logged = mlflow.models.Model.log(
                None, _flavor_with_weights(train_dir / ENCODER_FILE), name=registered, run_id=self.run_id,
                pytorch_model=encoder, serialization_format="pt2", signature=signature, input_example=example.numpy(),
                extra_files=[str(train_dir / STAGE_FILE)], tags={"repsim.stage_key": record["key"]},
                step=-1,  # a step the train run has not: its training metrics are not the model's (evaluations are)
                pip_requirements=[f"{name}=={importlib.metadata.version(name)}" for name in ("torch", "repsim")])
        if (folder := _local_folder(logged.artifact_path)) is not None:
            share_file(train_dir / ENCODER_FILE, folder / MODEL_WEIGHTS)
        lineage = {"repsim.stage_key": record["key"], "repsim.output": str(train_dir.resolve()),
                   "repsim.method": record["config"]["method"]["name"], "repsim.run_id": self.run_id,
                   **{f"repsim.input.{name}": key for name, key in record["inputs"].items()}}
        return mlflow.register_model(logged.model_uri, registered, tags=lineage).version


def scored_encoder(record: Mapping[str, Any]) -> str | None:
    """The train stage key of the encoder an evaluate stage scored (its features' input), else None."""
    if record["stage"] != "evaluate":
        return None
    features = read_record(artifacts_root() / "features" / record["inputs"]["train"])
    return features["inputs"].get("encoder") if features else None


def _flavor_with_weights(archive: Path) -> SimpleNamespace:
    """``mlflow.pytorch`` as a flavor for ``Model.log`` whose saved model holds ``archive`` (an encoder's
    ``torch.export`` archive, :func:`repsim.models.save_encoder`) as its weights, in place of MLflow's own export."""
    import mlflow.pytorch

    def save_model(path: str, **kwargs: Any) -> None:
        mlflow.pytorch.save_model(path=path, **kwargs)
        shutil.copyfile(archive, Path(path) / MODEL_WEIGHTS)

    return SimpleNamespace(__name__=mlflow.pytorch.__name__, save_model=save_model)


def _local_folder(uri: str) -> Path | None:
    """The folder an artifact URI names on this machine's disk, or None (a server, a bucket)."""
    parsed = urlparse(uri)
    return Path(parsed.path) if parsed.scheme in ("", "file") else None


def share_file(source: Path, copy: Path) -> None:
    """Make ``copy``, a byte-identical copy of ``source``, a hard link to it (stored once); left as it is
    where it is absent, differs, or lies on another file system."""
    if not copy.is_file() or copy.stat().st_size != source.stat().st_size:
        return
    if os.path.samefile(source, copy) or not filecmp.cmp(source, copy, shallow=False):
        return
    linked = copy.with_name(copy.name + ".link")
    try:
        os.link(source, linked)
    except OSError:  # another file system, or one without hard links
        return
    os.replace(linked, copy)


class Tracker:
    """Talks to the MLflow tracking store named by ``MLFLOW_TRACKING_URI``."""

    def __init__(self):
        self.client = MlflowClient()
        found = self.client.get_experiment_by_name(EXPERIMENT)
        if found is None:
            with contextlib.suppress(MlflowException):  # created concurrently by another process
                self.client.create_experiment(EXPERIMENT, artifact_location=mlflow_artifact_location(),
                                              tags=EXPERIMENT_KIND)
            found = self.client.get_experiment_by_name(EXPERIMENT)
        for tag, value in EXPERIMENT_KIND.items():  # also on one made before
            if found.tags.get(tag) != value:
                self.client.set_experiment_tag(found.experiment_id, tag, value)
        self.experiment_id = found.experiment_id
        show_in_runs_table(self.client, found, ())

    @contextlib.contextmanager
    def _run(self, name: str, tags: Mapping[str, str]) -> Iterator[StageRun]:
        tags = {"prefect.flow_run_id": str(flow_run.get_id() or ""), **tags}
        run = self.client.create_run(self.experiment_id, run_name=name, tags=tags)  # also tagged mlflow.runName
        try:
            yield StageRun(self.client, run.info.run_id)
        except BaseException:
            with contextlib.suppress(MlflowException):  # the run's own error says more than a store that fails too
                self.client.set_terminated(run.info.run_id, "FAILED")
            raise
        self.client.set_terminated(run.info.run_id, "FINISHED")

    @contextlib.contextmanager
    def flow_run(self, flow_name: str, params: Mapping[str, Any], name: str | None = None) -> Iterator[StageRun]:
        """The parent run of one flow run (named ``name``, default the flow's), its parameters as params."""
        with self._run(name or flow_name, {"repsim.flow": flow_name}) as run:
            run.log_params(params)
            yield run

    def stage_run(self, parent_run_id: str, stage: str, key: str, config: Mapping[str, Any], path: Path,
                  label: str | None = None, encoder: str | None = None) -> contextlib.AbstractContextManager[StageRun]:
        """A nested run for one stage under ``parent_run_id``, named ``<stage> <label>`` (``train simclr``), tagged
        with its experiment's name (``repsim.experiment``: the same names recur in every experiment), ``encoder``
        (the label of the encoder the stage is about) and, for a train stage, its method."""
        experiment = self.client.get_run(parent_run_id).data.params.get("experiment.name")
        tags = {MLFLOW_PARENT_RUN_ID: parent_run_id, "repsim.stage": stage, "repsim.stage_key": key,
                "repsim.output": str(path)} | ({"repsim.label": label} if label else {}) | (
            {"repsim.experiment": experiment} if experiment else {})
        tags |= ({"repsim.encoder": encoder} if encoder else {}) | (
            {"repsim.method": config["method"]["name"]} if stage == "train" else {})
        return self._run(f"{stage} {label}" if label else stage, tags)


def colour_by_encoder(client: MlflowClient, parent_run_id: str, encoders: Iterable[str]) -> None:
    """Give the stage runs under ``parent_run_id`` their encoder's chart colour (``mlflow.runColor``): the
    ``encoders``, in order, take ENCODER_COLOURS in turn, so two encoders of one run never share one."""
    colours = {encoder: ENCODER_COLOURS[index % len(ENCODER_COLOURS)] for index, encoder in enumerate(encoders)}
    experiment = client.get_run(parent_run_id).info.experiment_id
    for run in client.search_runs([experiment], f"tags.`{MLFLOW_PARENT_RUN_ID}` = '{parent_run_id}'",
                                  max_results=50000):
        colour = colours.get(run.data.tags.get("repsim.encoder", ""))
        if colour is not None and run.data.tags.get(RUN_COLOR) != colour:
            client.set_tag(run.info.run_id, RUN_COLOR, colour)


def run_link(experiment_id: str, run_id: str) -> str:
    """A run's page in the MLflow UI, relative to it, in the model-training view."""
    return f"#/experiments/{experiment_id}/runs/{run_id}?workflowType=machine_learning"


def runs_page(tracking_uri: str, experiment_id: str) -> str:
    """The MLflow UI's runs page of an experiment, in the model-training view and :func:`runs_view`."""
    return (f"{tracking_uri.rstrip('/')}/#/experiments/{experiment_id}/runs?workflowType=machine_learning"
            f"&viewStateShareKey={RUNS_VIEW}")


def runs_view(created_ms: int, metrics: Iterable[str] = ()) -> dict[str, str]:
    """The experiment tag of MLflow's saved view "stage names": the Run Name column RUN_NAME_WIDTH px wide
    (not 190), so a stage run's name shows whole, then the ``metrics`` (an evaluate run's kNN, linear and
    zero-shot results), each run's encoder and whether it was cached."""
    columns = [*(f"metrics.`{name}`" for name in metrics), *RUN_COLUMNS]  # the results first: no scrolling to them
    state = {"selectedColumns": columns, "columnOrder": [RUN_NAME_COLUMN, *columns],
             "columnWidths": {RUN_NAME_COLUMN: RUN_NAME_WIDTH}}
    envelope = {"name": "stage names", "createdAt": created_ms, "state": json.dumps(state)}
    return {f"mlflow.sharedViewState.{RUNS_VIEW}": json.dumps(envelope)}


def show_in_runs_table(client: MlflowClient, experiment: Experiment, metrics: Iterable[str]) -> None:
    """Add the ``metrics`` to the columns of :func:`runs_view` on ``experiment``, keeping those an earlier run
    added."""
    [(tag, _)] = runs_view(0).items()
    shown = json.loads(json.loads(experiment.tags[tag])["state"]).get("selectedColumns", []) \
        if tag in experiment.tags else []
    known = [column.removeprefix("metrics.`").removesuffix("`") for column in shown if column.startswith("metrics.")]
    value = runs_view(experiment.creation_time, dict.fromkeys([*known, *metrics]))[tag]
    if experiment.tags.get(tag) != value:
        client.set_experiment_tag(experiment.experiment_id, tag, value)


def model_directory(uri: str) -> Path:
    """The directory repsim evaluates for ``models:/NAME/VERSION``: the encoder's ``encoder.pt`` and train
    ``stage.json``, downloaded once into ``$REPSIM_HOME/models/NAME/VERSION``."""
    name, _, version = uri.removeprefix(MODEL_URI).partition("/")
    if not name or not version:
        raise RepsimError(f"{uri} names no model version", "write models:/NAME/VERSION, e.g. models:/animal-mnist-xclr/1")
    target = repsim_home() / "models" / name / version
    if all((target / file).is_file() for file in MODEL_FILES):
        return target
    import mlflow

    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        with tempfile.TemporaryDirectory(dir=target.parent) as folder:
            model = _local_folder(MlflowClient().get_model_version_download_uri(name, version))
            if model is None or not model.is_dir():
                model = Path(mlflow.artifacts.download_artifacts(artifact_uri=uri, dst_path=folder))
            staged = Path(folder) / "staged"
            staged.mkdir()
            # models registered before the weights were the stage's archive carry an encoder.pt of their own
            weights = next(chain(model.rglob(ENCODER_FILE), model.glob(str(MODEL_WEIGHTS))))
            link_or_copy(weights, staged / ENCODER_FILE)
            link_or_copy(next(model.rglob(STAGE_FILE)), staged / STAGE_FILE)
            shutil.rmtree(target, ignore_errors=True)
            staged.rename(target)  # whole or not at all
    except (MlflowException, StopIteration) as err:
        raise RepsimError(f"cannot fetch {uri} ({str(err).splitlines()[0] if str(err) else 'no encoder.pt'})",
                          "check the model's name and version in the MLflow UI's Models page") from None
    return target


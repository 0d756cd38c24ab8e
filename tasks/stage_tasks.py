"""Every stage task, made by :func:`stage_task` from the stage's :class:`repsim.stage.StageKind`.
Prefect's cache key is the stage key, and a built output's result is stored under it at once. Each task
runs in a nested MLflow run (a task served from Prefect's cache did not: the flow logs it, :func:`log_stage`)
and logs one summary line; only transient failures (a connection) are retried."""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import requests
from prefect import Task, task
from prefect.client.schemas.objects import TaskRun
from prefect.context import TaskRunContext
from prefect.logging import get_run_logger
from prefect.logging.loggers import task_run_logger
from prefect.results import get_result_store
from prefect.runtime import task_run
from prefect.states import State

from repsim.align.alignment import ALIGN
from repsim.data.sharding import SHARD
from repsim.errors import RepsimError
from repsim.eval.evaluation import EVALUATE, FEATURES
from repsim.methods.training import TRAIN
from repsim.similarity.precompute import CAPTIONS, NEIGHBORS, WORDNET
from repsim.stage import Stage, StageKind, StageOutput, is_current, read_record
from repsim.tasks.cluster import check_stores, executor
from repsim.tasks.settings import use_embedded_defaults
from repsim.tasks.tracking import StageRun, Tracker

RETRY_DELAYS_S = [5, 30]  # waits before the retries of a transient failure
TRANSIENT = (ConnectionError, TimeoutError, httpx.TransportError, requests.ConnectionError,  # a server that did
             requests.Timeout)  # not answer, or dropped the connection (Prefect's client, MLflow's)


def planned(kind: StageKind, params: Mapping[str, Any], out_dir: str | None = None) -> tuple[Stage, Path]:
    """(stage, output directory) of a ``kind`` task asked for ``params``, without building it."""
    stage = kind.plan(**params)
    return stage, stage.output_dir(out_dir)


def stage_cache_key(kind: StageKind) -> Callable[[TaskRunContext | None, dict[str, Any]], str | None]:
    """A Prefect ``cache_key_fn`` for ``kind``: the stage key and output directory once that directory is
    complete and intact; None (no cache) before, while it is rebuilt (:func:`repsim.stage.rebuilding`) or
    once damaged, so such an output is built again, never served stale or for another directory."""
    return lambda _, parameters: cache_key(*planned(kind, parameters["params"], parameters.get("out_dir")))


def cache_key(stage: Stage, out: Path) -> str | None:
    """The Prefect cache key of ``stage`` built into ``out`` (:func:`stage_cache_key`)."""
    where = hashlib.sha256(str(out.resolve()).encode()).hexdigest()[:12]
    return f"{stage.name}-{stage.key}-{where}" if current_record(stage, out) is not None else None


def stage_task(kind: StageKind) -> Task:
    """The Prefect task of ``kind``: it builds the stage of ``params`` (``options`` do not change it) into
    ``out_dir`` (default: its own) in a nested run under ``parent_run_id`` named ``<stage> <label>``, tagged
    with ``encoder`` (default ``label``); with ``register``, registers the encoder as that MLflow model. A split
    stage runs its pieces on the Dask scheduler at the option ``cluster`` (:mod:`repsim.tasks.cluster`)."""
    def run(params: dict[str, Any], options: dict[str, Any] | None = None, out_dir: str | None = None,
            parent_run_id: str = "", label: str | None = None, encoder: str | None = None,
            register: str | None = None, stores: dict[str, str] | None = None) -> StageOutput:
        use_embedded_defaults()  # on a cluster's worker, whose process the command line did not start
        if stores is not None:  # sent to a cluster's worker: it must keep outputs and runs where the flow does
            check_stores(stores)
        stage, out = planned(kind, params, out_dir)
        options = dict(options or {})
        cluster, gpu = options.pop("cluster", None), wants_gpu(kind, {**params, **options}.get("device"))
        with Tracker().stage_run(parent_run_id, kind.name, stage.key, stage.config, out, label,
                                 encoder or label) as tracked, executor(cluster, gpu) as pieces_on:
            extra = {"log": tracked.log_metrics} if kind.streams else {}
            extra |= {"executor": pieces_on} if kind.split else {}
            output = kind.build(**params, **options, out_dir=out_dir, **extra)
            tracked.log_stage_output(output.path, output.cached, kind.artifacts, kind.facts)
            if register:
                tracked.log_encoder(output.path, register)
        key = cache_key(stage, out)
        if key is not None:
            get_result_store().write(output, key=key)
        get_run_logger().info(summary_line(output, task_run.get_name()))
        return output

    return task(name=kind.name, cache_key_fn=stage_cache_key(kind), persist_result=True, retries=len(RETRY_DELAYS_S),
                retry_delay_seconds=RETRY_DELAYS_S, retry_condition_fn=retry_if_transient,
                on_completion=[summarize_if_cached])(run)


def wants_gpu(kind: StageKind, device: Any) -> bool | None:
    """Whether the pieces of a ``kind`` stage on ``device`` must run on GPU workers (True), should where the
    cluster has some (None: the device is left to choose), or need not (False)."""
    if not kind.gpu or (device is not None and str(device) == "cpu"):
        return False
    return None if device is None or str(device) == "auto" else True


def summarize_if_cached(task: Task, run: TaskRun, state: State) -> None:
    """Prefect's ``on_completion`` hook: the summary line in the log of a task run served from
    Prefect's cache, whose body (which logs it otherwise) did not run."""
    if from_prefect_cache(state):
        task_run_logger(run, task).info(summary_line(replace(state.result(), cached=True), run.name))


def transient(error: BaseException | None) -> bool:
    """Whether ``error``, or an error it was raised from, is a connection that failed or timed out
    (worth retrying); never a RepsimError, which says what to fix and would fail again."""
    while error is not None and not isinstance(error, RepsimError):
        if isinstance(error, TRANSIENT):
            return True
        error = error.__cause__ or error.__context__
    return False


def retry_if_transient(_: Task, __: Any, state: State) -> bool:
    """Prefect's ``retry_condition_fn``: retry a failed stage task only after a :func:`transient` error."""
    return transient(state.result(raise_on_failure=False))


def summary_line(output: StageOutput, name: str | None = None) -> str:
    """``train simclr: xclr, 186 steps, last epoch's loss 4.120; built in 95.2 s -> /path``: what the stage task
    ``name`` (default: the stage's name) did."""
    record = read_record(output.path)
    how = "found complete in the cache" if output.cached else f"built in {record.get('seconds', 0):.1f} s"
    return f"{name or record['stage']}: {produced(record)}; {how} -> {output.path}"


def current_record(stage: Stage, out: Path) -> dict[str, Any] | None:
    """The ``stage.json`` record of ``out`` if it is a complete output of ``stage`` not to be rebuilt:
    its files match the record (their hashes too, inside :func:`repsim.stage.verifying`)."""
    record = read_record(out) if out.is_dir() else None
    return record if record is not None and record.get("key") == stage.key and is_current(out, record) else None


def from_prefect_cache(state: State) -> bool:
    """Whether Prefect served the task run ``state`` from its cache, so the task did not run."""
    return state.name == "Cached"


def log_stage(tracker: Tracker, parent: StageRun, kind: StageKind, path: Path, label: str | None = None,
              encoder: str | None = None) -> None:
    """Log the stage output at ``path``, served from Prefect's cache, as a nested run under ``parent``."""
    record = read_record(path)
    with tracker.stage_run(parent.run_id, record["stage"], record["key"], record["config"], path, label,
                           encoder or label) as run:
        run.log_stage_output(path, True, kind.artifacts, kind.facts)


PRODUCED: dict[str, Callable[[dict, dict], str]] = {  # one line on what a stage produced: (config, metrics) -> line
    "captions": lambda _, metrics: f"{metrics['samples']} x {metrics['dim']}, {metrics['unique_captions']} distinct captions",
    "wordnet": lambda config, metrics: f"{config['measure']}, {metrics['classes']} classes",
    "neighbors": lambda config, metrics: f"{config['index']} k={config['k']}" + (
        f", recall {metrics['recall_tie_aware']:.3f}" if "recall_tie_aware" in metrics else ""),
    "features": lambda config, metrics: f"{config['split']}: {metrics['samples']} x {metrics['dim']}",
    "evaluate": lambda config, _: ", ".join(config["suites"]),
    "train": lambda config, metrics: (f"{config['method']['name']}, {metrics['steps']} steps, last epoch's loss "
                                      f"{metrics['loss']:.3f}"),
    "align": lambda _, metrics: ", ".join(f"{name} {metrics[name]:.3f}" for name in ("zeroshot_top1", "i2t_r1")
                                          if name in metrics),
}


def produced(record: dict) -> str:
    """One line on what a stage produced, for summary tables."""
    describe = PRODUCED.get(record["stage"], lambda _, metrics: f"{metrics['samples']} samples")
    return describe(record["config"], record["metrics"])


KINDS = {kind.name: kind for kind in (SHARD, CAPTIONS, WORDNET, NEIGHBORS, FEATURES, EVALUATE, TRAIN, ALIGN)}
TASKS = {name: stage_task(kind) for name, kind in KINDS.items()}

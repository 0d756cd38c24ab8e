"""Every stage task, made by :func:`stage_task` from the stage's :class:`repsim.stage.StageKind`.
The stage store is the one truth for "done": Prefect caches nothing, and a task whose output the store
holds complete ends in Prefect's *Cached* state. Each task runs in a nested MLflow run and logs one summary
line; only transient failures (a connection) are retried."""

from __future__ import annotations

import functools
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import httpx
import requests
from prefect import Task, task
from prefect.cache_policies import NO_CACHE
from prefect.logging import get_run_logger
from prefect.runtime import task_run
from prefect.states import Completed, State

from repsim.errors import RepsimError
from repsim.sections import stage_kinds
from repsim.stage import SERVE_COMPLETE, Reuse, Stage, StageKind, StageOutput, read_record
from repsim.tasks.cluster import check_stores, executor
from repsim.tasks.settings import use_embedded_defaults
from repsim.tasks.tracking import Tracker

RETRY_DELAYS_S = [5, 30]  # waits before the retries of a transient failure
TRANSIENT = (ConnectionError, TimeoutError, httpx.TransportError, requests.ConnectionError,  # a server that did
             requests.Timeout)  # not answer, or dropped the connection (Prefect's client, MLflow's)


def planned(kind: StageKind, params: Mapping[str, Any], out_dir: str | None = None) -> tuple[Stage, Path]:
    """(stage, output directory) of a ``kind`` task asked for ``params``, without building it."""
    stage = kind.plan(**params)
    return stage, stage.output_dir(out_dir)


def stage_task(kind: StageKind) -> Task:
    """The Prefect task of ``kind``: it builds the stage of ``params`` (``options`` do not change it) into
    ``out_dir`` (default: its own) in a nested run under ``parent_run_id`` named ``<stage> <label>``, tagged
    with ``encoder`` (default ``label``); with ``register``, registers the encoder as that MLflow model. A split
    stage runs its pieces on the Dask scheduler at the option ``cluster`` (:mod:`repsim.tasks.cluster`). An
    output the store holds complete and ``reuse`` serves is not built again, and the task run ends *Cached*."""
    def run(params: dict[str, Any], options: dict[str, Any] | None = None, out_dir: str | None = None,
            parent_run_id: str = "", label: str | None = None, encoder: str | None = None,
            register: str | None = None, stores: dict[str, str] | None = None,
            reuse: Reuse = SERVE_COMPLETE) -> StageOutput | State:
        use_embedded_defaults()  # on a cluster's worker, whose process the command line did not start
        if stores is not None:  # sent to a cluster's worker: it must keep outputs and runs where the flow does
            check_stores(stores)
        stage, out = planned(kind, params, out_dir)
        options = dict(options or {})
        cluster, gpu = options.pop("cluster", None), wants_gpu(kind, {**params, **options}.get("device"))
        if cluster is not None and current_record(stage, out, reuse) is not None:  # a complete output needs no workers
            cluster = None
        with Tracker().stage_run(parent_run_id, kind.name, stage.key, stage.config, out, label,
                                 encoder or label) as tracked, executor(cluster, gpu) as pieces_on:
            extra = {"log": tracked.log_metrics} if kind.streams else {}
            extra |= {"executor": pieces_on} if kind.split else {}
            output = kind.build(**params, **options, out_dir=out_dir, reuse=reuse, **extra)
            tracked.log_stage_output(output.path, output.cached, kind.artifacts, kind.facts)
            if register:
                tracked.log_encoder(output.path, register)
        get_run_logger().info(summary_line(output, kind, task_run.get_name()))
        return Completed(name="Cached", data=output) if output.cached else output

    return task(name=kind.name, cache_policy=NO_CACHE, persist_result=False, retries=len(RETRY_DELAYS_S),
                retry_delay_seconds=RETRY_DELAYS_S, retry_condition_fn=retry_if_transient)(run)


def wants_gpu(kind: StageKind, device: Any) -> bool | None:
    """Whether the pieces of a ``kind`` stage on ``device`` must run on GPU workers (True), should where the
    cluster has some (None: the device is left to choose), or need not (False)."""
    if not kind.gpu or (device is not None and str(device) == "cpu"):
        return False
    return None if device is None or str(device) == "auto" else True


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


def summary_line(output: StageOutput, kind: StageKind, name: str | None = None) -> str:
    """``train simclr: xclr, 186 steps, last epoch's loss 4.120; built in 95.2 s -> /path``: what the ``kind``
    stage task ``name`` (default: the stage's name) did."""
    record = read_record(output.path)
    how = "found complete in the cache" if output.cached else f"built in {record.get('seconds', 0):.1f} s"
    return f"{name or record['stage']}: {produced(kind, record)}; {how} -> {output.path}"


def current_record(stage: Stage, out: Path, reuse: Reuse) -> dict[str, Any] | None:
    """The ``stage.json`` record of ``out`` if it is a complete output of ``stage`` that ``reuse`` serves."""
    record = read_record(out) if out.is_dir() else None
    return record if record is not None and record.get("key") == stage.key and reuse.serves(out, record) else None


def produced(kind: StageKind, record: dict) -> str:
    """One line on what a ``kind`` stage produced, for summary tables (the kind's ``describe``), from its record;
    the kind comes with the task, since a cluster's worker knows only the sections of the packages it imported."""
    return kind.describe(record["config"], record["metrics"])


@functools.cache
def task_of(name: str) -> Task:
    """The stage task of the stage kind ``name``, made once."""
    return stage_task(stage_kinds()[name])

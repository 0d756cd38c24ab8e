"""The Dask cluster a run's split stages spread their pieces over (:mod:`repsim.pieces`).

A run names it with ``--cluster``, the experiment's ``cluster:`` or ``DASK_SCHEDULER_ADDRESS``:
``tcp://host:8786`` connects to a running scheduler (``dask scheduler``, dask-jobqueue, dask-kubernetes),
``local:N`` starts a LocalCluster of N worker processes on this machine for the run. Without one, every piece
runs in its stage's process. Workers must see ``$REPSIM_HOME`` at the same path (one machine, or a shared file
system), since pieces write there.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
from collections.abc import Iterator
from concurrent.futures import Executor

from repsim.errors import SpecError, StageError, first_line
from repsim.experiment import CLUSTER_PATTERN
from repsim.stage import repsim_home

ADDRESS_ENV = "DASK_SCHEDULER_ADDRESS"
GPU = "GPU"  # the worker resource a piece that wants a GPU asks for
LOCAL = re.compile(r"^local:([1-9][0-9]*)$")
CONNECT_TIMEOUT_S = 30  # a scheduler that does not answer within it is reported unreachable
FIX = "give --cluster tcp://HOST:PORT (a running dask scheduler) or local:N (N worker processes here)"


def requested_cluster(cluster: str | None) -> str | None:
    """The cluster a run asked for: ``cluster`` (the option or the experiment's key), else ``$DASK_SCHEDULER_ADDRESS``,
    else None; SpecError when it is neither a scheduler address nor ``local:N``."""
    named = f"cluster {cluster}" if cluster else f"{ADDRESS_ENV}={os.environ.get(ADDRESS_ENV)}"
    cluster = cluster or os.environ.get(ADDRESS_ENV) or None
    if cluster is not None and not re.match(CLUSTER_PATTERN, cluster):
        raise SpecError(f"{named} is neither a Dask scheduler address nor local:N", FIX)
    return cluster


@contextlib.contextmanager
def dask_logs_above(level: int) -> Iterator[None]:
    """Dask's own log records below ``level`` dropped for the block (its loggers set their levels one by one):
    a lost scheduler gets Dask's reconnection tracebacks, then repsim's one line."""
    import distributed  # noqa: F401  (configures its loggers)

    loggers = [logging.getLogger(name) for name in list(logging.root.manager.loggerDict)
               if name == "distributed" or name.startswith("distributed.")]
    previous = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(max(level, logger.level))
    try:
        yield
    finally:
        for logger, was in zip(loggers, previous):
            logger.setLevel(was)


@contextlib.contextmanager
def cluster_running(cluster: str | None) -> Iterator[str | None]:
    """The scheduler address of ``cluster`` (:func:`requested_cluster`) for the block; for ``local:N``, a
    LocalCluster of N single-threaded worker processes started for it and stopped after."""
    local = LOCAL.match(cluster or "")
    if local is None:
        yield cluster
        return
    from distributed import LocalCluster

    with dask_logs_above(logging.WARNING), LocalCluster(n_workers=int(local.group(1)), threads_per_worker=1, processes=True,
                                               dashboard_address=None, silence_logs=logging.WARNING) as started:
        yield started.scheduler_address


@contextlib.contextmanager
def executor(address: str | None, gpu: bool | None = False) -> Iterator[Executor | None]:
    """An executor over the workers of the scheduler at ``address`` for the block (None without an address).
    ``gpu``: True sends every piece to workers that offer the resource ``GPU`` (``dask worker --resources
    GPU=1``; StageError if none does), None there when some worker offers it and anywhere otherwise, False
    anywhere. StageError, in one line, when the scheduler cannot be reached."""
    if address is None:
        yield None
        return
    with dask_logs_above(logging.CRITICAL), _client(address) as client:  # a lost scheduler: Dask's tracebacks, then a StageError
        offered = gpu is not False and any(GPU in worker.get("resources", {})
                                           for worker in client.scheduler_info(n_workers=-1)["workers"].values())
        if gpu and not offered:
            raise StageError(f"no worker of the Dask cluster at {address} offers the resource {GPU}, and the stage "
                             "asks for a GPU", f"start GPU workers with 'dask worker --resources {GPU}=1' (one per GPU), "
                             "or run the stage with device cpu")
        yield client.get_executor(resources={GPU: 1} if offered else None)


def stores() -> dict[str, str]:
    """Where this process keeps stage outputs and tracks runs: its ``$REPSIM_HOME`` and MLflow tracking URI."""
    return {"REPSIM_HOME": str(repsim_home()), "MLFLOW_TRACKING_URI": os.environ.get("MLFLOW_TRACKING_URI", "")}


def check_stores(expected: dict[str, str]) -> None:
    """StageError, in one line, unless this process (a stage task on a cluster's worker) keeps outputs and runs
    where the flow that sent the task does (``expected``, the flow's :func:`stores`)."""
    differ = [f"{name}={value}, not the run's {expected[name]}" for name, value in stores().items()
              if value != expected[name]]
    if differ:
        raise StageError(f"a Dask worker of this run has {'; '.join(differ)}",
                         "start the workers with the run's REPSIM_HOME (on a file system they share) and its "
                         "MLFLOW_TRACKING_URI and PREFECT_API_URL")


def _client(address: str) -> contextlib.AbstractContextManager:
    """A client of the scheduler at ``address``; in a stage task that runs on one of its workers (the flow's task
    runner is Dask's), that worker's client, which frees the task's thread for the pieces while it waits."""
    from distributed import Client, get_worker, worker_client

    try:
        get_worker()
    except ValueError:  # not on a worker
        pass
    else:
        return worker_client(separate_thread=True)
    try:
        return Client(address, timeout=CONNECT_TIMEOUT_S, set_as_default=False)
    except (OSError, TimeoutError) as err:
        raise StageError(f"cannot reach the Dask scheduler at {address} ({first_line(err)})",
                         f"start it (dask scheduler), or {FIX}, or leave the cluster out to run here") from None

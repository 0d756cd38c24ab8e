"""Where torch work runs by default, and how a training process splits its CPU cores between torch's
intra-op threads and DataLoader workers (:func:`cpu_plan`), never giving out more than there are:
threads that outnumber the cores spin and wait on each other.
"""

from __future__ import annotations

import contextlib
import os
import queue
import sys
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from pydantic import Field, model_validator

from repsim.layering import Strict

MAX_GPU_WORKERS = 8
SMALL_CPU = 4  # cores up to which a CPU-only process reads its own data


def resolve_device(device: str | torch.device | None = None) -> torch.device:
    """``device`` as a torch device; None: this process's GPU (``LOCAL_RANK``) if CUDA is present, else the CPU."""
    if device is not None:
        return torch.device(device)
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def cores_per_process() -> int:
    """The cores this process may run on, shared evenly with the other ranks on this machine."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, cores // int(os.environ.get("LOCAL_WORLD_SIZE", "1")))


@dataclass(frozen=True)
class CpuPlan:
    """torch intra-op ``threads`` and DataLoader ``workers`` for one training process."""

    threads: int
    workers: int


def cpu_plan(device: torch.device, workers: int | None = None, threads: int | None = None,
             cores: int | None = None) -> CpuPlan:
    """The split of ``cores`` (default :func:`cores_per_process`) for training on ``device``; a given ``workers``
    or ``threads`` is kept, and the threads default to the cores the workers leave. The workers default, on a GPU,
    to up to 8, keeping a core for the process; on a CPU to 0 up to 4 cores (the main process reads between
    steps), else a quarter of them."""
    cores = cores or cores_per_process()
    if workers is None and device.type == "cuda":
        workers = min(MAX_GPU_WORKERS, cores - 1)
    elif workers is None:
        workers = 0 if cores <= SMALL_CPU else cores // 4
    return CpuPlan(threads or max(1, cores - workers), workers)


def rank_and_world() -> tuple[int, int]:
    """(rank, world size) of the initialised torch.distributed process group, else (0, 1)."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


def distributed() -> bool:
    """Whether this process is one rank of several (an initialised process group of world size > 1)."""
    return rank_and_world()[1] > 1


@contextlib.contextmanager
def torch_threads(threads: int) -> Iterator[None]:
    """Run the block with ``threads`` torch intra-op threads, then restore the previous number."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


_free_gpus: queue.Queue[int] | None = None
_free_gpus_lock = threading.Lock()


@contextlib.contextmanager
def gpu_slot() -> Iterator[torch.device | None]:
    """A GPU of this machine for the block alone, among stages that run at once in this process
    (waits while every GPU is taken); None without CUDA, where each stage takes its default device."""
    global _free_gpus
    if not torch.cuda.device_count():
        yield None
        return
    with _free_gpus_lock:
        if _free_gpus is None:
            _free_gpus = queue.Queue()
            for index in range(torch.cuda.device_count()):
                _free_gpus.put(index)
        free = _free_gpus
    index = free.get()
    try:
        yield torch.device("cuda", index)
    finally:
        free.put(index)


class TorchrunLaunch(Strict):
    """How the train stage starts: in the flow's process, or with torchrun over several processes/nodes
    (with ``nnodes > 1`` every node runs the same :meth:`command`, meeting at ``rdzv_endpoint``)."""

    nproc_per_node: int = Field(1, ge=1)
    nnodes: int = Field(1, ge=1)
    rdzv_endpoint: str | None = Field(None, description="host:port of the c10d rendezvous (nnodes > 1)")
    rdzv_id: str = "repsim"
    max_restarts: int = Field(0, ge=0, description="times each node's torchrun agent restarts its workers after a "
                              "failure (theirs, or another node's: all meet again at the rendezvous and resume from "
                              "the checkpoint)")

    @model_validator(mode="after")
    def _rendezvous_for_several_nodes(self) -> TorchrunLaunch:
        if self.nnodes > 1 and not self.rdzv_endpoint:
            raise ValueError("several nodes meet at a rendezvous; set rdzv_endpoint: host:port")
        return self

    @property
    def distributed(self) -> bool:
        return self.nproc_per_node > 1 or self.nnodes > 1

    @property
    def environment(self) -> dict[str, str]:
        """The variables :meth:`command` needs on every node. With several nodes, each round of the rendezvous
        names the ranks' store anew: torch (2.5 on) otherwise names it in the first round only, and a node that
        joins later (started again after it was lost) waits for it until it times out."""
        return {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"} if self.nnodes > 1 else {}

    def command(self, config: str | Path, overrides: Sequence[str] = (), options: Sequence[str] = ()) -> list[str]:
        """The torchrun command that trains ``config`` with ``overrides`` directly on every rank, with the
        command line's ``options`` (``--rebuild``)."""
        if self.nnodes == 1:
            rendezvous = ["--standalone"]
        else:
            rendezvous = [f"--nnodes={self.nnodes}", "--rdzv_backend=c10d",
                          f"--rdzv_endpoint={self.rdzv_endpoint}", f"--rdzv_id={self.rdzv_id}"]
        sets = [arg for override in overrides for arg in ("--set", override)]
        return [sys.executable, "-m", "torch.distributed.run", *rendezvous,
                f"--nproc_per_node={self.nproc_per_node}", f"--max_restarts={self.max_restarts}",
                "-m", "repsim.flows.cli", "train", str(config), *sets, "--direct", *options]

"""Throughput of the shard loader against its ceiling: the same transforms on images already in memory.

For each number of DataLoader workers, ``make_loader(..., "simclr")`` over the first ``--images``
training images is timed against the same views and collation applied to the same images held as
uint8 tensors (a map-style dataset of batches, so the ceiling pays no reading, decoding or
per-sample seeding). A per-image breakdown of the loader's own stages (tar reading, decoding,
seeding, augmentation) follows. The table goes to ``benchmarks/results/loader.md``.

    python benchmarks/loader.py [--spec data_specs/animal-mnist.yaml] [--images 8000] [--rounds 2]

Shards come from ``$REPSIM_HOME`` (sharded there if missing) or a temporary home when it is unset.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import resource
import shlex
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from itertools import islice
from pathlib import Path
from typing import TypeVar

import torch
from torch.utils.data import DataLoader, Dataset

from repsim.data.loader import (
    READ_MODES,
    ShardLoader,
    derive_seed,
    make_batch,
    make_loader,
    read_image,
    read_parts,
    seeded_rng,
)
from repsim.data.sharding import shard

RESULTS = Path(__file__).parent / "results" / "loader.md"
T = TypeVar("T")


class InMemoryBatches(Dataset):
    """Batch ``b``: the views of images ``b·B … (b+1)·B - 1`` of a uint8 N×C×H×W tensor, collated."""

    def __init__(self, images: torch.Tensor, views: Callable, batch_size: int):
        self.images, self.views, self.batch_size = images, views, batch_size

    def __len__(self) -> int:
        return len(self.images) // self.batch_size

    def __getitem__(self, batch: int) -> dict:
        indices = range(batch * self.batch_size, (batch + 1) * self.batch_size)
        return make_batch([self.views(self.images[i]) for i in indices], [0] * len(indices), list(indices))


@dataclass(frozen=True)
class Throughput:
    """Images per wall-clock second, and CPU microseconds per image summed over all processes."""

    images_per_second: float
    cpu_micros: float


def cpu_seconds() -> float:
    """User + system CPU time of this process and of its finished children (DataLoader workers)."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def throughput(batches: Callable[[], Iterable[dict]], limit: int) -> Throughput:
    """Consume up to ``limit`` images' worth of batches, start-up and worker shutdown included."""
    started, started_cpu, seen = time.perf_counter(), cpu_seconds(), 0
    iterator = iter(batches())
    for batch in iterator:
        seen += len(batch["index"])
        if seen >= limit:
            break
    del iterator  # joins the workers, so their CPU time is counted
    return Throughput(seen / (time.perf_counter() - started), (cpu_seconds() - started_cpu) / seen * 1e6)


def load_images(loader: ShardLoader, limit: int) -> torch.Tensor:
    """The first ``limit`` training images as one uint8 N×C×H×W tensor."""
    samples = islice(read_parts(loader.stream.parts), limit)
    mode = READ_MODES[loader.stream.channels]
    return torch.stack([read_image(sample, mode) for sample in samples])


def stage_breakdown(loader: ShardLoader, limit: int) -> dict[str, float]:
    """Microseconds per image of each loader stage, run one after the other in this process."""
    stream = loader.stream

    def seed_only(index: int) -> None:
        with seeded_rng(derive_seed(stream.seed, stream.epoch, index)):
            pass

    samples, read = timed(lambda: list(islice(read_parts(stream.parts), limit)))
    images, decode = timed(lambda: [read_image(sample, READ_MODES[stream.channels]) for sample in samples])
    _, seed = timed(lambda: [seed_only(index) for index in range(len(images))])
    _, augment = timed(lambda: [stream.views(image) for image in images])
    seconds = {"read tar members": read, "decode image": decode, "seed the sample's RNG": seed,
               "augment (simclr, 2 views)": augment}
    return {stage: spent / len(images) * 1e6 for stage, spent in seconds.items()}


def timed(work: Callable[[], T]) -> tuple[T, float]:
    """``work()`` and the wall-clock seconds it took."""
    started = time.perf_counter()
    result = work()
    return result, time.perf_counter() - started


@contextlib.contextmanager
def artifact_home() -> Iterator[None]:
    """Use ``$REPSIM_HOME`` if set, else a temporary one for the duration."""
    if "REPSIM_HOME" in os.environ:
        yield
        return
    with tempfile.TemporaryDirectory(prefix="repsim-bench-") as home:
        os.environ["REPSIM_HOME"] = home
        try:
            yield
        finally:
            del os.environ["REPSIM_HOME"]


def measure(shards: Path, workers: int, images: int, batch_size: int, rounds: int) -> tuple[Throughput, Throughput]:
    """(loader, in-memory), each the best of ``rounds`` alternating runs (fastest wall clock, least CPU)."""
    def loader() -> ShardLoader:
        return make_loader(shards, "simclr", batch_size, num_workers=workers)

    memory = InMemoryBatches(load_images(loader(), images), loader().stream.views, batch_size)
    runs: tuple[list[Throughput], list[Throughput]] = ([], [])
    for _ in range(rounds):
        runs[0].append(throughput(loader, images))
        runs[1].append(throughput(lambda: DataLoader(memory, batch_size=None, num_workers=workers), images))
    return tuple(Throughput(max(run.images_per_second for run in path), min(run.cpu_micros for run in path))
                 for path in runs)


def report(command: str, spec: str, images: int, batch_size: int,
           rows: list[tuple[int, Throughput, Throughput]], breakdown: dict[str, float]) -> str:
    lines = [
        "# Shard loader throughput", "",
        f"Command: `{command}`", "",
        (f"Data: {spec}, train split, first {images} images; `simclr` preset (2 views), batch size {batch_size}; "
        f"torch {torch.__version__}, {os.cpu_count()} CPU cores, {platform.processor() or platform.machine()}; "
        "augmentations on one torch thread in every process. "
        "In-memory: the same views and collation on the same images held as uint8 tensors (the ceiling). "
        "Best of the rounds, DataLoader start-up included. The machine is shared, so wall-clock rates "
        "vary from run to run; CPU time per image (all processes, workers included) is the steadier "
        "measure of the loader's own cost."), "",
        "| workers | loader img/s | in-memory img/s | ratio | loader CPU µs/img | in-memory CPU µs/img | CPU ratio |",
        "|---:|---:|---:|---:|---:|---:|---:|",
        *[f"| {workers} | {loaded.images_per_second:,.0f} | {memory.images_per_second:,.0f} "
          f"| {loaded.images_per_second / memory.images_per_second:.2f} | {loaded.cpu_micros:,.0f} "
          f"| {memory.cpu_micros:,.0f} | {memory.cpu_micros / loaded.cpu_micros:.2f} |"
          for workers, loaded, memory in rows],
        "", "Where the loader's time goes (one process, per image):", "",
        "| stage | µs/image |", "|---|---:|",
        *[f"| {stage} | {micros:,.1f} |" for stage, micros in breakdown.items()], "",
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--spec", default=str(Path(__file__).parents[1] / "data_specs" / "animal-mnist.yaml"))
    parser.add_argument("--images", type=int, default=8000)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--workers", type=int, nargs="+", default=[0, 2])
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(1)  # as the loader's augmentations and DataLoader workers run
    with artifact_home():
        shards = shard(args.spec, progress=False).path
        rows = []
        for workers in args.workers:
            loaded, memory = measure(shards, workers, args.images, args.batch_size, args.rounds)
            rows.append((workers, loaded, memory))
            print(f"workers={workers}: loader {loaded}, in-memory {memory}", flush=True)
        breakdown = stage_breakdown(make_loader(shards, "simclr", args.batch_size), min(args.images, 2000))
    command = shlex.join(["python", "benchmarks/loader.py", *sys.argv[1:]])
    text = report(command, Path(args.spec).name, args.images, args.batch_size, rows, breakdown)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(text)
    print(text)


if __name__ == "__main__":
    main()

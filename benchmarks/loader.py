"""Throughput of the shard loader against its ceiling: the same transforms on images already in memory.

For each number of DataLoader workers, one epoch of ``make_loader(..., "simclr")`` is timed against
the same views and collation applied to the same images held as uint8 tensors (a map-style dataset
of batches, so the ceiling pays no reading, decoding or per-sample seeding). A per-image breakdown of
the loader's own stages (tar reading, decoding, seeding, augmentation) follows. The table goes to
``benchmarks/results/loader.md``.

    python benchmarks/loader.py [--spec data_specs/animal-mnist.yaml] [--images 8000] [--rounds 2]

Shards come from ``$REPSIM_HOME`` (sharded there if missing) or a temporary home when it is unset.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import shlex
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from itertools import islice
from pathlib import Path

import torch
from torch.utils.data import DataLoader, Dataset
from repsim.data.loader import (READ_MODES, ShardLoader, collate, derive_seed, make_loader, read_image, read_parts,
                                seeded_rng)
from repsim.data.sharding import shard

RESULTS = Path(__file__).parent / "results" / "loader.md"


class InMemoryBatches(Dataset):
    """Batch ``b``: the views of images ``b·B … (b+1)·B - 1`` of a uint8 N×C×H×W tensor, collated."""

    def __init__(self, images: torch.Tensor, views: Callable, batch_size: int):
        self.images, self.views, self.batch_size = images, views, batch_size

    def __len__(self) -> int:
        return len(self.images) // self.batch_size

    def __getitem__(self, batch: int) -> dict:
        start = batch * self.batch_size
        return collate([(self.views(image), 0, start + k, None)
                        for k, image in enumerate(self.images[start:start + self.batch_size])])


def images_per_second(batches: Iterator[dict], limit: int) -> float:
    """Consume up to ``limit`` images' worth of batches; images per second including start-up."""
    started, seen = time.perf_counter(), 0
    for batch in batches:
        seen += len(batch["index"])
        if seen >= limit:
            break
    return seen / (time.perf_counter() - started)


def load_images(loader: ShardLoader, limit: int) -> torch.Tensor:
    """The first ``limit`` training images as one uint8 N×C×H×W tensor."""
    samples = islice(read_parts(loader.stream.parts), limit)
    mode = READ_MODES[loader.stream.channels]
    return torch.stack([read_image(sample, mode) for sample in samples])


def stage_breakdown(loader: ShardLoader, limit: int) -> dict[str, float]:
    """Microseconds per image of each loader stage, run one after the other in this process."""
    stream, timings = loader.stream, {}
    started = time.perf_counter()
    samples = list(islice(read_parts(stream.parts), limit))
    timings["read tar members"] = time.perf_counter() - started
    started = time.perf_counter()
    images = [read_image(sample, READ_MODES[stream.channels]) for sample in samples]
    timings["decode image"] = time.perf_counter() - started
    started = time.perf_counter()
    for index in range(len(images)):
        with seeded_rng(derive_seed(stream.seed, stream.epoch, index)):
            pass
    timings["seed the sample's RNG"] = time.perf_counter() - started
    started = time.perf_counter()
    for image in images:
        stream.views(image)
    timings["augment (simclr, 2 views)"] = time.perf_counter() - started
    return {stage: seconds / len(images) * 1e6 for stage, seconds in timings.items()}


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


def measure(shards: Path, workers: int, images: int, batch_size: int, rounds: int) -> tuple[float, float]:
    """(loader img/s, in-memory img/s), each the best of ``rounds`` alternating runs."""
    def loader() -> ShardLoader:
        return make_loader(shards, "simclr", batch_size, num_workers=workers)

    memory = InMemoryBatches(load_images(loader(), images), loader().stream.views, batch_size)
    loader_rates, memory_rates = [], []
    for _ in range(rounds):
        loader_rates.append(images_per_second(iter(loader()), images))
        memory_rates.append(images_per_second(iter(DataLoader(memory, batch_size=None, num_workers=workers)), images))
    return max(loader_rates), max(memory_rates)


def report(command: str, spec: str, images: int, batch_size: int, rows: list[tuple[int, float, float]],
           breakdown: dict[str, float]) -> str:
    lines = [
        "# Shard loader throughput", "",
        f"Command: `{command}`", "",
        f"Data: {spec}, train split, first {images} images; `simclr` preset (2 views), batch size {batch_size}; "
        f"torch {torch.__version__}, {os.cpu_count()} CPU cores, {platform.processor() or platform.machine()}; "
        f"main-process torch threads: {torch.get_num_threads()} (DataLoader workers use 1). "
        "In-memory: the same views and collation on the same images held as uint8 tensors (the ceiling). "
        "Best of the rounds; each figure includes DataLoader start-up.", "",
        "| workers | loader img/s | in-memory img/s | ratio |", "|---:|---:|---:|---:|",
        *[f"| {workers} | {loaded:,.0f} | {memory:,.0f} | {loaded / memory:.2f} |" for workers, loaded, memory in rows],
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
    parser.add_argument("--threads", type=int, default=1, help="torch threads in the main process")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    with artifact_home():
        shards = shard(args.spec, progress=False).path
        rows = []
        for workers in args.workers:
            loaded, memory = measure(shards, workers, args.images, args.batch_size, args.rounds)
            rows.append((workers, loaded, memory))
            print(f"workers={workers}: loader {loaded:,.0f} img/s, in-memory {memory:,.0f} img/s, "
                  f"ratio {loaded / memory:.2f}", flush=True)
        breakdown = stage_breakdown(make_loader(shards, "simclr", args.batch_size), min(args.images, 2000))
    command = shlex.join(["python", "benchmarks/loader.py", *sys.argv[1:]])
    text = report(command, Path(args.spec).name, args.images, args.batch_size, rows, breakdown)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(text)
    print(text)


if __name__ == "__main__":
    main()

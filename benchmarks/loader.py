"""Throughput of the shard loader's two augmentation pipelines, each against its in-memory ceiling.

For each number of DataLoader workers, ``make_loader(..., "simclr", augment=...)`` over the first
``--images`` training images is timed with the per-image torchvision pipeline in the workers
(``augment="sample"``) and with the batched kornia one on the CPU, in the main process
(``augment="batch"``), alternating the two. Each is timed against the same views made from the same
images held as uint8 tensors (a map-style dataset of batches, so the ceiling pays no reading,
decoding or per-sample seeding). A per-image breakdown of the loader's own stages (tar reading,
decoding, seeding, augmentation per image and per batch) follows. The tables go to
``benchmarks/results/loader.md``.

    python benchmarks/loader.py [--spec data_specs/animal-mnist.yaml] [--images 8000] [--rounds 2]

With ``--s3`` it times instead, side by side, the loader reading the shards from local disk and
reading them in place from S3 (moto's server, started on 127.0.0.1 in its own process, the shards
uploaded to it with ``repsim.data.remote.upload``), and reports the ratio in ``benchmarks/results/loader_s3.md``.

Shards come from ``$REPSIM_HOME`` (sharded there if missing) or a temporary home when it is unset.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import platform
import resource
import shlex
import socket
import subprocess
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

from repsim.data.batch_augment import BatchViews, make_batch_views
from repsim.data.loader import (
    READ_MODES,
    ShardLoader,
    derive_seed,
    make_batch,
    make_loader,
    peek_image,
    read_image,
    read_parts,
    seeded_rng,
    targets,
)
from repsim.data.manifest import MANIFEST
from repsim.data.remote import upload
from repsim.data.stage import ShardResult, shard

RESULTS = Path(__file__).parent / "results" / "loader.md"
S3_RESULTS = Path(__file__).parent / "results" / "loader_s3.md"
PIPELINES = {"sample": "per image (torchvision v2)", "batch": "batched (kornia, CPU)"}
T = TypeVar("T")


class InMemoryBatches(Dataset):
    """Batch ``b`` of images ``b·B … (b+1)·B - 1`` of a uint8 N×C×H×W tensor: their views made per image
    and collated, or, without ``views``, the images themselves (as the workers yield them per batch)."""

    def __init__(self, images: torch.Tensor, views: Callable | None, batch_size: int):
        self.images, self.views, self.batch_size = images, views, batch_size

    def __len__(self) -> int:
        return len(self.images) // self.batch_size

    def __getitem__(self, batch: int) -> dict:
        indices = range(batch * self.batch_size, (batch + 1) * self.batch_size)
        if self.views is None:
            return {"images": self.images[indices.start:indices.stop], **targets([0] * len(indices), list(indices))}
        return make_batch([self.views(self.images[i]) for i in indices], [0] * len(indices), list(indices))


def with_batch_views(batches: Iterable[dict], views: BatchViews) -> Iterator[dict]:
    """Each batch's views made in this process, seeded by its position, as the loader's batch mode does."""
    for position, batch in enumerate(batches):
        yield {"views": views(batch.pop("images"), seed=position), **batch}


@dataclass(frozen=True)
class Throughput:
    """Views per wall-clock second, and CPU microseconds per view summed over all processes."""

    views_per_second: float
    cpu_micros: float


def cpu_seconds() -> float:
    """User + system CPU time of this process and of its finished children (DataLoader workers)."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def throughput(batches: Callable[[], Iterable[dict]], limit: int) -> Throughput:
    """Consume up to ``limit`` images' worth of batches, start-up and worker shutdown included."""
    started, started_cpu, images, views = time.perf_counter(), cpu_seconds(), 0, 0
    iterator = iter(batches())
    for batch in iterator:
        images += len(batch["index"])
        views += len(batch["index"]) * len(batch["views"])
        if images >= limit:
            break
    del iterator  # joins the workers (and closes the generator around them), so their CPU time is counted
    return Throughput(views / (time.perf_counter() - started), (cpu_seconds() - started_cpu) / views * 1e6)


def load_images(loader: ShardLoader, limit: int) -> torch.Tensor:
    """The first ``limit`` training images as one uint8 N×C×H×W tensor."""
    samples = islice(read_parts(loader.stream.parts), limit)
    mode = READ_MODES[loader.stream.channels]
    return torch.stack([read_image(sample, mode) for sample in samples])


def stage_breakdown(loader: ShardLoader, batch_size: int, limit: int) -> dict[str, float]:
    """Microseconds per image of each loader stage, run one after the other in this process."""
    stream = loader.stream

    def seed_only(index: int) -> None:
        with seeded_rng(derive_seed(stream.seed, stream.epoch, index)):
            pass

    samples, read = timed(lambda: list(islice(read_parts(stream.parts), limit)))
    images, decode = timed(lambda: [read_image(sample, READ_MODES[stream.channels]) for sample in samples])
    _, seed = timed(lambda: [seed_only(index) for index in range(len(images))])
    _, augment = timed(lambda: [stream.views(image) for image in images])
    batches = torch.stack(images).split(batch_size)
    batch_views = make_batch_views("simclr", batches[0].shape[-1], stream.channels)
    _, augment_batched = timed(lambda: [batch_views(batch, seed=seed) for seed, batch in enumerate(batches)])
    seconds = {"read tar members": read, "decode image": decode, "seed the sample's RNG": seed,
               "augment per image (simclr, 2 views)": augment,
               f"augment per batch of {batch_size} (simclr, 2 views, kornia on the CPU)": augment_batched}
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


def measure(shards: Path, workers: int, images: int, batch_size: int,
            rounds: int) -> dict[str, tuple[Throughput, Throughput]]:
    """Per pipeline (see PIPELINES), (loader, in-memory): each the best of ``rounds`` runs (fastest wall
    clock, least CPU), the four alternating within a round."""
    per_image = make_loader(shards, "simclr", batch_size)
    pixels = load_images(per_image, images)
    batch_views = make_batch_views("simclr", pixels.shape[-1], pixels.shape[1])

    def in_memory(views: Callable | None) -> DataLoader:
        return DataLoader(InMemoryBatches(pixels, views, batch_size), batch_size=None, num_workers=workers)

    paths = {
        ("sample", "loader"): lambda: make_loader(shards, "simclr", batch_size, num_workers=workers),
        ("batch", "loader"): lambda: make_loader(shards, "simclr", batch_size, num_workers=workers, augment="batch"),
        ("sample", "memory"): lambda: in_memory(per_image.stream.views),
        ("batch", "memory"): lambda: with_batch_views(in_memory(None), batch_views),
    }
    best = best_of(paths, images, rounds)
    return {pipeline: (best[pipeline, "loader"], best[pipeline, "memory"]) for pipeline in PIPELINES}


def best_of(paths: dict[tuple[str, str], Callable], images: int, rounds: int) -> dict[tuple[str, str], Throughput]:
    """Each path's best throughput over ``rounds`` rounds, the paths alternating within a round."""
    runs: dict[tuple[str, str], list[Throughput]] = {path: [] for path in paths}
    for _ in range(rounds):
        for path, batches in paths.items():
            runs[path].append(throughput(batches, images))
    return {path: Throughput(max(run.views_per_second for run in found), min(run.cpu_micros for run in found))
            for path, found in runs.items()}


def report(command: str, spec: str, images: int, batch_size: int,
           rows: list[tuple[int, dict[str, tuple[Throughput, Throughput]]]], breakdown: dict[str, float]) -> str:
    lines = [
        "# Shard loader throughput", "",
        f"Command: `{command}`", "",
        (f"Data: {spec}, train split, first {images} images; `simclr` preset (2 views), batch size {batch_size}; "
        f"torch {torch.__version__}, {os.cpu_count()} CPU cores, {platform.processor() or platform.machine()}; "
        "augmentations on one torch thread in every process. Per image: torchvision v2 in the DataLoader "
        "workers (`augment=\"sample\"`); batched: kornia on the CPU in the main process, the workers only "
        "reading and decoding (`augment=\"batch\"`). In-memory: the same views and collation on the same "
        "images held as uint8 tensors (the ceiling). Best of the rounds, the four runs alternating within a "
        "round, DataLoader start-up included. The machine is shared, so wall-clock rates vary from run to "
        "run; CPU time per view (all processes, workers included) is the steadier measure of the cost."), "",
        "| workers | pipeline | loader views/s | in-memory views/s | ratio | loader CPU µs/view "
        "| in-memory CPU µs/view | CPU ratio |",
        "|---:|---|---:|---:|---:|---:|---:|---:|",
        *[f"| {workers} | {PIPELINES[pipeline]} | {loaded.views_per_second:,.0f} | {memory.views_per_second:,.0f} "
          f"| {loaded.views_per_second / memory.views_per_second:.2f} | {loaded.cpu_micros:,.0f} "
          f"| {memory.cpu_micros:,.0f} | {memory.cpu_micros / loaded.cpu_micros:.2f} |"
          for workers, pipelines in rows for pipeline, (loaded, memory) in pipelines.items()],
        "", "Batched over per image, in the loader:", "",
        "| workers | views/s | CPU per view |", "|---:|---:|---:|",
        *[f"| {workers} | {speedup(pipelines, 'views_per_second'):.1f}× "
          f"| {1 / speedup(pipelines, 'cpu_micros'):.1f}× less |" for workers, pipelines in rows],
        "", "Where the loader's time goes (one process, per image):", "",
        "| stage | µs/image |", "|---|---:|",
        *[f"| {stage} | {micros:,.1f} |" for stage, micros in breakdown.items()], "",
    ]
    return "\n".join(lines)


def speedup(pipelines: dict[str, tuple[Throughput, Throughput]], field: str) -> float:
    """The loader's ``field`` with batched views over the one with per-image views."""
    return getattr(pipelines["batch"][0], field) / getattr(pipelines["sample"][0], field)


# ---------------------------------------------------------------------------------------------
# Local disk against S3

@contextlib.contextmanager
def local_s3() -> Iterator[None]:
    """moto's S3 server on a free port of 127.0.0.1, in its own process, with boto pointed at it."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    os.environ.update(AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench", AWS_DEFAULT_REGION="us-east-1",
                      AWS_ENDPOINT_URL=f"http://127.0.0.1:{port}")
    try:
        for _ in range(100):
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=0.1):
                break
            time.sleep(0.1)
        yield
    finally:
        server.terminate()
        server.wait()


def in_bucket(shards: ShardResult, folder: Path) -> Path:
    """The in-place shard output of ``shards`` uploaded to a new bucket of the local S3 server."""
    import s3fs
    import yaml

    s3fs.S3FileSystem().mkdir("bench")
    upload(shards.path, "s3://bench/shards/", last=MANIFEST)
    names = ",".join(path.stem for split in shards.shards.values() for path in split)
    spec = folder / "in-bucket.yaml"
    spec.write_text(yaml.safe_dump({"name": "in-bucket", "source": {
        "type": "webdataset", "urls": f"s3://bench/shards/{{{names}}}.tar", "manifest": f"s3://bench/shards/{MANIFEST}"}}))
    return shard(spec, progress=False).path


def measure_s3(local: Path, remote: Path, workers: int, images: int, batch_size: int,
               rounds: int) -> dict[str, tuple[Throughput, Throughput]]:
    """Per pipeline (see PIPELINES), (local disk, S3): each the best of ``rounds`` runs, the four alternating.
    The loaders are given the image size and channels, as the train stage gives them."""
    channels, size = peek_image(str(sorted(local.glob("train-*.tar"))[0]))
    paths = {(pipeline, where): functools.partial(make_loader, shards, "simclr", batch_size, num_workers=workers,
                                                  augment=pipeline, image_size=size, channels=channels)
             for pipeline in PIPELINES for where, shards in (("local", local), ("s3", remote))}
    best = best_of(paths, images, rounds)
    return {pipeline: (best[pipeline, "local"], best[pipeline, "s3"]) for pipeline in PIPELINES}


def report_s3(command: str, spec: str, images: int, batch_size: int,
              rows: list[tuple[int, dict[str, tuple[Throughput, Throughput]]]]) -> str:
    lines = [
        "# Shard loader throughput: local disk against S3", "",
        f"Command: `{command}`", "",
        (f"Data: {spec}, train split, first {images} images; `simclr` preset (2 views), batch size {batch_size}; "
         f"torch {torch.__version__}, {os.cpu_count()} CPU cores. The same `make_loader` over the same shards, read "
         "from local disk and read in place from S3 (moto's server on 127.0.0.1, in its own process, sharing the "
         "machine's cores), each pipeline as in `loader.md`. Best of the rounds, the four runs alternating within a "
         "round, DataLoader start-up included; the loaders are given the image size and channels, as the train stage "
         "gives them."), "",
        "| workers | pipeline | local views/s | S3 views/s | S3 / local | local CPU µs/view | S3 CPU µs/view |",
        "|---:|---|---:|---:|---:|---:|---:|",
        *[f"| {workers} | {PIPELINES[pipeline]} | {local.views_per_second:,.0f} | {remote.views_per_second:,.0f} "
          f"| {remote.views_per_second / local.views_per_second:.2f} | {local.cpu_micros:,.0f} | {remote.cpu_micros:,.0f} |"
          for workers, pipelines in rows for pipeline, (local, remote) in pipelines.items()], "",
    ]
    return "\n".join(lines)


def compare_s3(args: argparse.Namespace, shards: ShardResult) -> str:
    """The local-disk against S3 report (:func:`report_s3`) of ``shards``."""
    with local_s3(), tempfile.TemporaryDirectory() as folder:
        remote = in_bucket(shards, Path(folder))
        rows = []
        for workers in args.workers:
            rows.append((workers, measure_s3(shards.path, remote, workers, args.images, args.batch_size, args.rounds)))
            print(f"workers={workers}: {rows[-1][1]}", flush=True)
    return report_s3(shlex.join(["python", "benchmarks/loader.py", *sys.argv[1:]]), Path(args.spec).name,
                     args.images, args.batch_size, rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--spec", default=str(Path(__file__).parents[1] / "data_specs" / "animal-mnist.yaml"))
    parser.add_argument("--images", type=int, default=8000)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--workers", type=int, nargs="+", default=[0, 2])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--s3", action="store_true", help="time local disk against S3 instead (see above)")
    args = parser.parse_args()
    torch.set_num_threads(1)  # as the loader's augmentations and DataLoader workers run
    with artifact_home():
        if args.s3:
            text = compare_s3(args, shard(args.spec, progress=False))
            S3_RESULTS.parent.mkdir(parents=True, exist_ok=True)
            S3_RESULTS.write_text(text)
            print(text)
            return
        shards = shard(args.spec, progress=False).path
        rows = []
        for workers in args.workers:
            pipelines = measure(shards, workers, args.images, args.batch_size, args.rounds)
            rows.append((workers, pipelines))
            print(f"workers={workers}: {pipelines}", flush=True)
        breakdown = stage_breakdown(make_loader(shards, "simclr", args.batch_size), args.batch_size,
                                    min(args.images, 2000))
    command = shlex.join(["python", "benchmarks/loader.py", *sys.argv[1:]])
    text = report(command, Path(args.spec).name, args.images, args.batch_size, rows, breakdown)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(text)
    print(text)


if __name__ == "__main__":
    main()

"""How each stage's time and memory grow with the number of samples N, from 10 thousand to a million.

A deterministic synthetic dataset stands in for a large one, at each N (cached between runs under
``--data-dir``): 16×16 grayscale images of 100 classes (a class template plus noise) in WebDataset
tars as img2dataset writes them (``png`` + ``txt`` + ``json`` with the class name), captions naming
the class with a distinct phrase each (``--caption-cap`` distinct ones at every N, 10,000 by default:
MiniLM embeds about 300 captions/s on 2 cores, so 1M distinct captions would take an hour; the
model's time is extrapolated from its rate at the smallest N, where every caption is distinct), and,
for the neighbor search, N distinct 384-d unit vectors clustered like sentence embeddings. The test
split is a fixed 2,000 samples, as a benchmark's validation set is, so that the evaluation grows with
the training split alone.

Each stage runs through the library in a subprocess of its own, its output rebuilt even when cached:

- ``shard``: the source tars re-sharded (decode, re-encode, hash, manifest);
- ``captions``: caption embeddings (all-MiniLM-L6-v2) of every manifest row;
- ``neighbors``: the 10 nearest other points of each of the N vectors, with the index the
  neighbor stage chooses at that N (``index="auto"``);
- ``train``: SimCLR on a 2-block ViT-Tiny (4 px patches) for ``--train-steps`` steps of batch 128;
- ``features``: that encoder's features of the train and test splits;
- ``evaluate``: kNN (k = 10, 20, 200) and the linear probe on those features;
- ``align``: the embedding tables of both splits (the features and each sample's caption embedded)
  and a GeRA alignment from 100 pairs with every other training sample in the unpaired pools.

For each stage and N the report gives the wall time of the stage call, the process start-up before
it (imports, reading configs), time per sample, the marginal time per sample between two sizes (the
fixed costs cancel), peak RSS (the subprocess's high-water mark, ``VmHWM``: its ``ru_maxrss`` without
the parent's, which Linux carries into a forked child; it counts the pages of memory-mapped files
read), peak anonymous memory (what the stage allocated itself, sampled every 20 ms) and the bytes
its outputs take.

    python benchmarks/scaling.py                       # N = 10k, 100k, 1M: about 45 min on 2 cores
    python benchmarks/scaling.py --max-n 100000        # 10k and 100k: minutes, a quick check
    python benchmarks/scaling.py --stages shard,evaluate --sizes 10000,50000

With ``--workers 1,2`` it times instead the stages that split into pieces (``shard``, ``features``) at each N on 1 and 2
Dask workers (a LocalCluster of single-threaded processes started before the clock starts) beside the same
stage in one process, and the scheduling overhead per piece (a piece that does nothing, 200 times), into
``benchmarks/results/scaling_workers.md``:

    python benchmarks/scaling.py --workers 1,2 --sizes 100000

Flags: ``--sizes`` (comma-separated N), ``--max-n`` (drop larger sizes), ``--stages`` (a subset, in
pipeline order; a stage's inputs are built first if missing), ``--caption-cap``, ``--train-steps``,
``--data-dir`` (generated data and a ``REPSIM_HOME`` per size; default ``.repsim/scaling``: about 7 GB
at 1M), ``--report`` (default ``benchmarks/results/scaling.md``, with its log-log plot and the
figures as JSON beside it) and ``--render`` (write the report again from those figures). The report
also times re-encoding one JPEG as the shard stage does at 16 to 512 px, the part of sharding that
grows with the pixels.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import platform
import shlex
import subprocess
import sys
import tarfile
import threading
import time
from pathlib import Path

import numpy as np

from _report import markdown, write_report
from neighbors import clustered_points

ROOT = Path(__file__).resolve().parents[1]
STAGES = ("shard", "captions", "neighbors", "train", "features", "evaluate", "align")
SPLIT_STAGES = ("shard", "features")  # the stages whose build takes an executor for its pieces
OVERHEAD_PIECES = 200
SIZES = (10_000, 100_000, 1_000_000)
CLASSES = 100
IMAGE_SIDE = 16
TEST_SAMPLES = 2_000
SOURCE_TAR_SAMPLES = 10_000
POINT_CHUNK = 100_000
NEIGHBORS_K = 10
CODEC_SIDES = (16, 64, 256, 512)
ADJECTIVES = ("small", "large", "dark", "bright", "old", "young", "striped", "spotted", "sleeping", "running",
              "wet", "dusty", "curious", "quiet", "noisy", "hungry", "tiny", "giant", "pale", "shiny")
PLACES = ("in a field", "on a beach", "in the snow", "by a river", "in a forest", "on a road", "in a garden",
          "on a hill", "in a city", "at night", "in the rain", "under a tree", "near a fence", "in a barn",
          "on the grass", "by the sea", "in a park", "on a rock", "in the fog", "at dawn")


# ---------------------------------------------------------------------------------------------
# The synthetic data

def class_name(label: int) -> str:
    return f"kind{label:03d}"


def caption(sample: int, caption_cap: int) -> str:
    """A caption naming the sample's class (``sample % 100``) with one of ``caption_cap`` phrases."""
    phrase = sample % caption_cap
    adjective, place = ADJECTIVES[phrase % 20], PLACES[(phrase // 20) % 20]
    return f"a {adjective} {class_name(sample % CLASSES)} {place}, photo {phrase // 400}."


def write_source(folder: Path, count: int, caption_cap: int) -> str:
    """``count`` samples as source tars in ``folder``; returns their brace pattern."""
    from PIL import Image

    templates = np.random.default_rng(0).integers(0, 256, (CLASSES, IMAGE_SIDE, IMAGE_SIDE))
    tars = -(-count // SOURCE_TAR_SAMPLES)
    for number in range(tars):
        rng = np.random.default_rng([1, number])
        first, last = number * SOURCE_TAR_SAMPLES, min(count, (number + 1) * SOURCE_TAR_SAMPLES)
        noise = rng.integers(-64, 65, (last - first, IMAGE_SIDE, IMAGE_SIDE))
        with tarfile.open(folder / f"src-{number:05d}.tar", "w") as tar:
            for offset, sample in enumerate(range(first, last)):
                pixels = np.clip(templates[sample % CLASSES] + noise[offset], 0, 255).astype(np.uint8)
                png = io.BytesIO()
                Image.fromarray(pixels).save(png, format="PNG")
                members = {"png": png.getvalue(), "txt": caption(sample, caption_cap).encode(),
                           "json": json.dumps({"label": class_name(sample % CLASSES)}).encode()}
                for extension, data in members.items():
                    info = tarfile.TarInfo(f"{sample:07d}.{extension}")
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
    return str(folder / f"src-{{00000..{tars - 1:05d}}}.tar")


def write_spec(folder: Path, count: int, urls: str) -> Path:
    test = TEST_SAMPLES
    classes = "\n".join(f"  {class_name(label)}: entity.n.01" for label in range(CLASSES))
    spec = folder / "spec.yaml"
    spec.write_text(f"name: scaling-{count}\nsource:\n  type: webdataset\n  urls: {urls}\n  image_ext: png\n"
                    f"  label_field: label\nclasses:\n{classes}\n"
                    f"split:\n  type: random\n  fractions: {{train: {(count - test) / count!r}, test: {test / count!r}}}\n"
                    "  stratify: false\nshard_size: 10000\n")
    return spec


def write_points(path: Path, count: int) -> None:
    """(count, 384) float16 distinct clustered unit rows, written a chunk at a time."""
    points = np.lib.format.open_memmap(path, mode="w+", dtype=np.float16, shape=(count, 384))
    for chunk, start in enumerate(range(0, count, POINT_CHUNK)):
        rows = min(POINT_CHUNK, count - start)
        points[start:start + rows] = clustered_points(rows, 1000, seed=chunk)
    points.flush()


def dataset(data_dir: Path, count: int, caption_cap: int) -> Path:
    """The folder of the synthetic data of ``count`` samples, generated once."""
    folder = data_dir / f"n{count}-c{caption_cap}"
    if not (folder / "done").is_file():
        folder.mkdir(parents=True, exist_ok=True)
        print(f"generating {count:,} samples in {folder}", flush=True)
        write_spec(folder, count, write_source(folder, count, caption_cap))
        write_points(folder / "points.npy", count)
        (folder / "done").write_text("")
    return folder


# ---------------------------------------------------------------------------------------------
# One stage in a subprocess

def peak_anonymous_memory() -> tuple[threading.Event, list[int]]:
    """Start sampling this process's RssAnon every 20 ms; set the event to stop. The list holds the peak (bytes)."""
    stop, peak = threading.Event(), [0]

    def sample() -> None:
        while not stop.wait(0.02):
            peak[0] = max(peak[0], status_bytes("RssAnon"))
    threading.Thread(target=sample, daemon=True).start()
    return stop, peak


def status_bytes(field: str) -> int:
    """A memory figure of this process from /proc/self/status (``VmHWM``, ``RssAnon``, ...), in bytes."""
    line = next(line for line in Path("/proc/self/status").read_text().splitlines() if line.startswith(f"{field}:"))
    return int(line.split()[1]) * 1024


def folder_bytes(paths: list[Path]) -> int:
    return sum(file.stat().st_size for path in paths for file in path.rglob("*") if file.is_file())


def run_child(stage: str, folder: Path, train_steps: int, result: Path, workers: int = 0) -> None:
    """Run ``stage`` on the data in ``folder`` (its inputs first, cached) and write its figures to ``result``;
    with ``workers``, its pieces on a LocalCluster of that many worker processes."""
    with contextlib.ExitStack() as cluster:
        executor = cluster.enter_context(local_executor(workers)) if workers else None
        _measure_child(stage, folder, train_steps, result, executor)


@contextlib.contextmanager
def local_executor(workers: int):
    """A Dask LocalCluster's executor over ``workers`` single-threaded processes, its workers up."""
    from distributed import Client, LocalCluster

    with LocalCluster(n_workers=workers, threads_per_worker=1, dashboard_address=None) as cluster, \
            Client(cluster) as client:
        client.wait_for_workers(workers)
        yield client.get_executor()


def nothing(argument: int, folder: Path) -> int:
    return argument


def piece_overhead(executor) -> float:
    """Seconds a piece that does nothing takes through ``executor``, on average over OVERHEAD_PIECES pieces."""
    import tempfile

    from repsim.pieces import Piece, run_pieces

    with tempfile.TemporaryDirectory() as folder:
        began = time.perf_counter()
        run_pieces(nothing, [Piece(str(i), i) for i in range(OVERHEAD_PIECES)], Path(folder), executor, progress=False)
        return (time.perf_counter() - began) / OVERHEAD_PIECES


def _measure_child(stage: str, folder: Path, train_steps: int, result: Path, executor) -> None:
    started = time.perf_counter()
    from repsim.stage import Reuse, artifacts_root, read_record

    rebuild = Reuse.forcing([stage, *(["embedding_tables"] if stage == "align" else [])])
    inputs, measured = stage_calls(stage, folder, train_steps, executor, rebuild)
    upstream = inputs()
    stop, peak = peak_anonymous_memory()
    began = time.perf_counter()
    outputs = measured(upstream)
    seconds = time.perf_counter() - began
    stop.set()
    folders = [output.path for output in outputs]
    records = [read_record(folder) for folder in folders]
    if stage == "align":  # the embedding tables it built are its outputs too
        folders += [artifacts_root() / "embedding_tables" / key for key in outputs[0].record["inputs"].values()]
    overhead = piece_overhead(executor) if stage in SPLIT_STAGES else None
    result.write_text(json.dumps({"seconds": seconds, "startup": began - started, "anonymous": peak[0],
                                  "rss": status_bytes("VmHWM"), "bytes": folder_bytes(folders),
                                  "detail": detail(stage, records), "metrics": records[0]["metrics"],
                                  "piece_overhead": overhead}))


def detail(stage: str, records: list[dict]) -> str:
    """What a row of the report says besides the figures: the index chosen, the caption count, ..."""
    metrics = {name: value for record in records for name, value in record.get("metrics", {}).items()}
    if stage == "captions":
        return f"{metrics['unique_captions']:,} distinct captions"
    if stage == "neighbors":
        index = records[0]["config"]["index"]
        return index + (f", recall@{NEIGHBORS_K} {metrics['recall']:.3f}" if "recall" in metrics else " (exact)")
    if stage == "train":
        return f"{metrics['steps']} steps of batch 128"
    if stage == "evaluate":
        return (f"kNN {metrics['seconds_knn']:.1f} s (top-1 {metrics['knn_top1_k20']:.3f}), linear "
                f"{metrics['seconds_linear']:.1f} s (top-1 {metrics['linear_top1']:.3f})")
    if stage == "align":
        return f"{metrics['paired_samples']} pairs, unpaired pools of {metrics['unpaired_image_samples']:,}"
    return ""


def stage_calls(stage: str, folder: Path, train_steps: int, executor=None, reuse=None):
    """(build the stage's inputs, run the stage on them -> its outputs) for ``stage`` (its pieces on ``executor``;
    what it may serve complete: ``reuse``, default all)."""
    from repsim.align.config import load_align_config
    from repsim.align.stage import align
    from repsim.data import load_spec, shard
    from repsim.eval.stage import evaluate_features, extract_features
    from repsim.methods.config import load_config
    from repsim.methods.stage import train
    from repsim.similarity.stage import embed_captions_stage, neighbors_stage
    from repsim.stage import SERVE_COMPLETE

    reuse = reuse or SERVE_COMPLETE

    spec = folder / "spec.yaml"
    config = load_config("simclr", [f"data.spec={spec}", "model.backbone=vit_tiny", "model.depth=2",
                                    "model.patch_size=4", "data.image_size=16", "optim.batch_size=128",
                                    f"optim.max_steps={train_steps}", "monitor.knn=false",
                                    "model.projection_hidden_dim=512"])

    def shards(pieces_on=None, served=SERVE_COMPLETE):
        return shard(load_spec(spec), progress=False, executor=pieces_on, reuse=served)

    def encoder():
        return train(config, shards=shards(), progress=False).path

    def features(pieces_on=None, served=SERVE_COMPLETE):
        return [extract_features(shards(), encoder(), split, progress=False, executor=pieces_on, reuse=served)
                for split in ("train", "test")]

    def align_config():
        return load_align_config("gera", [f"data.spec={spec}", "image.type=encoder", f"image.path={encoder()}",
                                          "text.source=manifest", "optim.epochs=5", "neighbors.count=50"])

    calls = {
        "shard": (lambda: None, lambda _: [shards(executor, reuse)]),
        "captions": (shards, lambda built: [embed_captions_stage(built, progress=False, reuse=reuse)]),
        "neighbors": (lambda: folder / "points.npy", lambda points: [
            neighbors_stage(points, NEIGHBORS_K, index="auto", progress=False, reuse=reuse)]),
        "train": (shards, lambda built: [train(config, shards=built, progress=False, reuse=reuse)]),
        "features": (encoder, lambda _: features(executor, reuse)),
        "evaluate": (features, lambda built: [evaluate_features(*built, ("knn", "linear"), reuse=reuse)]),
        "align": (align_config, lambda built: [align(built, progress=False, reuse=reuse)]),
    }
    return calls[stage]


# ---------------------------------------------------------------------------------------------
# The parent: every stage at every size, then the report

def measure(stage: str, folder: Path, count: int, args: argparse.Namespace, workers: int = 0) -> dict:
    result = folder / f"{stage}.json"
    command = [sys.executable, __file__, "--child", stage, "--folder", str(folder), "--workers", str(workers),
               "--train-steps", str(args.train_steps), "--result", str(result)]
    env = {**os.environ, "REPSIM_HOME": str(folder / "home"), "PYTHONPATH": str(Path(__file__).parent)}
    started = time.perf_counter()
    status = subprocess.run(command, env=env).returncode
    wall = time.perf_counter() - started
    if status != 0:
        raise SystemExit(f"stage {stage} at N = {count:,} failed (status {status}); rerun: {shlex.join(command)}")
    row = {"stage": stage, "n": count, "workers": workers, "wall": wall, **json.loads(result.read_text())}
    print(f"{stage:>9} N={count:>9,} workers={workers}: {row['seconds']:8.1f} s (+{row['startup']:.1f} s start-up), "
          f"RSS {row['rss'] / 2**20:,.0f} MiB, anonymous {row['anonymous'] / 2**20:,.0f} MiB, "
          f"{row['bytes'] / 2**20:,.1f} MiB written", flush=True)
    return row


def exponent(rows: list[dict], field: str) -> float | None:
    """The log-log slope of ``field`` between the two largest sizes."""
    if len(rows) < 2 or min(rows[-2][field], rows[-1][field]) <= 0:
        return None
    return float(np.log(rows[-1][field] / rows[-2][field]) / np.log(rows[-1]["n"] / rows[-2]["n"]))


def report(rows: list[dict], args: argparse.Namespace, minutes: float, codec: dict[int, float]) -> str:
    header = ["stage", "N", "stage s", "start-up s", "µs/sample", "marginal µs/sample", "peak RSS MiB",
              "peak anon MiB", "written MiB", "detail"]
    table, growth = [], []
    for stage in args.stages:
        mine = [row for row in rows if row["stage"] == stage]
        previous = None
        for row in mine:
            marginal = "" if previous is None else \
                f"{1e6 * (row['seconds'] - previous['seconds']) / (row['n'] - previous['n']):.1f}"
            table.append([stage, f"{row['n']:,}", f"{row['seconds']:.1f}", f"{row['startup']:.1f}",
                          f"{1e6 * row['seconds'] / row['n']:.1f}", marginal, f"{row['rss'] / 2**20:,.0f}",
                          f"{row['anonymous'] / 2**20:,.0f}", f"{row['bytes'] / 2**20:,.1f}", row["detail"]])
            previous = row
        if len(mine) >= 3:
            first, middle, last = mine[-3:]
            ratio = ((last["seconds"] - middle["seconds"]) / (last["n"] - middle["n"])) / \
                    ((middle["seconds"] - first["seconds"]) / (middle["n"] - first["n"]))
            growth.append([stage, f"{last['seconds'] / middle['seconds']:.2f}", f"{exponent(mine, 'seconds'):.2f}",
                           f"{ratio:.2f}", f"{last['rss'] / middle['rss']:.2f}",
                           f"{last['anonymous'] / middle['anonymous']:.2f}"])
    sizes = ", ".join(f"{n:,}" for n in args.sizes)
    text = [f"# Stage cost against N\n\nCommand: `{shlex.join(['python', 'benchmarks/scaling.py', *args.argv])}`",
            f"\nN = {sizes}; captions capped at {args.caption_cap:,} distinct; {args.train_steps} training steps; "
            f"{os.cpu_count()} CPU cores, {platform.machine()}, Python {platform.python_version()}. "
            f"Total wall time {minutes:.1f} min (data generation included).\n",
            markdown(header, table)]
    if growth:
        text += ["\nGrowth between the two largest sizes (time ratio and exponent: the stage time at the largest "
                 "N over the one before, and the log-log slope between them; marginal ratio: the marginal time "
                 "per sample of the last interval over the one before, which the fixed costs leave out; memory "
                 "ratios: the largest N over the one before):\n",
                 markdown(["stage", "time ratio", "time exponent", "marginal ratio", "RSS ratio", "anon ratio"],
                          growth)]
    captions = [row for row in rows if row["stage"] == "captions"]
    if captions:
        rate = captions[0]["metrics"]["unique_captions"] / captions[0]["seconds"]
        text.append(f"\nCaption model: {rate:,.0f} distinct captions/s at N = {captions[0]['n']:,} (stage time "
                    f"included), so 1M distinct captions would take {1e6 / rate / 60:,.0f} min and 10M "
                    f"{1e7 / rate / 3600:,.1f} h on this machine.")
    text.append("\nRe-encoding one image as the shard stage does (decode a JPEG, encode it at quality 95), by side: "
                + ", ".join(f"{side} px {1e3 * seconds:.2f} ms" for side, seconds in codec.items()) + ".")
    text.append(f"\n![stage time and memory against N]({args.report.with_suffix('.png').name})\n")
    return "\n".join(text)


def codec_seconds(sides: tuple[int, ...] = CODEC_SIDES, count: int = 40) -> dict[int, float]:
    """Seconds per image to decode a JPEG of each side and encode it again as the shard stage does
    (:func:`repsim.data.stage.encode_image`, JPEG quality 95): the part of sharding that grows with
    pixels, which 16 px images leave out. The images are smooth colour gradients with noise, like photos."""
    from PIL import Image

    from repsim.data.stage import encode_image

    rng, seconds = np.random.default_rng(0), {}
    for side in sides:
        y, x = np.mgrid[0:side, 0:side] / side
        gradient = np.stack([x, y, (x + y) / 2], axis=-1) * 200
        images = []
        for _ in range(count):
            buffer = io.BytesIO()
            pixels = np.clip(gradient + rng.normal(0, 20, gradient.shape), 0, 255).astype(np.uint8)
            Image.fromarray(pixels).save(buffer, format="JPEG", quality=90)
            images.append(buffer.getvalue())
        started = time.perf_counter()
        for image in images:
            encode_image(image, "jpg", 95)
        seconds[side] = (time.perf_counter() - started) / count
    return seconds


def plot(rows: list[dict], stages: list[str], path: Path) -> None:
    from matplotlib.figure import Figure

    figure = Figure(figsize=(11, 4.5))
    time_axes, memory_axes = figure.subplots(1, 2)
    for stage in stages:
        mine = [row for row in rows if row["stage"] == stage]
        sizes = [row["n"] for row in mine]
        time_axes.plot(sizes, [row["seconds"] for row in mine], "o-", label=stage)
        memory_axes.plot(sizes, [row["anonymous"] / 2**20 for row in mine], "o-", label=stage)
    sizes = np.array(sorted({row["n"] for row in rows}), dtype=float)
    time_axes.plot(sizes, sizes / sizes[-1] * max(row["seconds"] for row in rows), "k:", label="∝ N")
    for axes, label in ((time_axes, "stage wall time (s)"), (memory_axes, "peak anonymous memory (MiB)")):
        axes.set(xscale="log", yscale="log", xlabel="samples N", ylabel=label)
        axes.grid(True, which="both", alpha=0.3)
    time_axes.legend(fontsize="small")
    figure.suptitle("repsim stages against N (2 CPU cores)")
    figure.savefig(path, dpi=110, bbox_inches="tight")


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default=",".join(map(str, SIZES)), help="comma-separated N")
    parser.add_argument("--max-n", type=int, help="leave out sizes above this N")
    parser.add_argument("--stages", default=",".join(STAGES), help=f"comma-separated subset of {', '.join(STAGES)}")
    parser.add_argument("--caption-cap", type=int, default=10_000, help="distinct captions at every N")
    parser.add_argument("--train-steps", type=int, default=30, help="training steps of the train stage")
    parser.add_argument("--data-dir", type=Path, default=ROOT / ".repsim" / "scaling")
    parser.add_argument("--report", type=Path, default=ROOT / "benchmarks" / "results" / "scaling.md")
    parser.add_argument("--render", action="store_true",
                        help="render the report again from the figures of the last run (its .json), measuring nothing")
    parser.add_argument("--workers", help="comma-separated Dask worker counts: time the split stages on each, "
                        "beside one process")
    parser.add_argument("--child", choices=STAGES, help=argparse.SUPPRESS)
    parser.add_argument("--folder", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.argv = argv
    args.sizes = [n for n in map(int, args.sizes.split(",")) if args.max_n is None or n <= args.max_n]
    args.stages = [stage for stage in STAGES if stage in args.stages.split(",")]
    if args.workers and not args.child:
        args.workers = [int(count) for count in args.workers.split(",")]
        args.stages = [stage for stage in args.stages if stage in SPLIT_STAGES]
        args.report = args.report.with_name(f"{args.report.stem}_workers.md")
    elif args.child:
        args.workers = int(args.workers or 0)
    return args


def main(argv: list[str]) -> None:
    args = parse_args(argv)
    if args.child:
        run_child(args.child, args.folder, args.train_steps, args.result, args.workers)
        return
    if args.workers:
        workers_main(args)
        return
    figures = args.report.with_suffix(".json")
    if args.render:
        saved = json.loads(figures.read_text())
        rows, minutes, args.argv = saved["rows"], saved["minutes"], saved["argv"]
        args.sizes = sorted({row["n"] for row in rows})
        args.stages = [stage for stage in STAGES if any(row["stage"] == stage for row in rows)]
    else:
        started = time.perf_counter()
        rows = []
        for count in args.sizes:
            folder = dataset(args.data_dir, count, args.caption_cap)
            rows += [measure(stage, folder, count, args) for stage in args.stages]
        minutes = (time.perf_counter() - started) / 60
        figures.write_text(json.dumps({"argv": args.argv, "minutes": minutes, "rows": rows}, indent=1))
    text = report(rows, args, minutes, codec_seconds())
    plot(rows, args.stages, args.report.with_suffix(".png"))
    write_report(args.report, text)
    print(text)


def workers_main(args: argparse.Namespace) -> None:
    """Each split stage at each N in one process and on each worker count, side by side in one run."""
    started, rows = time.perf_counter(), []
    for count in args.sizes:
        folder = dataset(args.data_dir, count, args.caption_cap)
        rows += [measure(stage, folder, count, args, workers) for stage in args.stages for workers in [0, *args.workers]]
    minutes = (time.perf_counter() - started) / 60
    args.report.with_suffix(".json").write_text(json.dumps({"argv": args.argv, "minutes": minutes, "rows": rows},
                                                            indent=1))
    table = []
    for row in rows:
        alone = next(other for other in rows if (other["stage"], other["n"], other["workers"]) == (row["stage"], row["n"], 0))
        one = next((other for other in rows if (other["stage"], other["n"], other["workers"]) == (row["stage"], row["n"], 1)),
                   alone)
        table.append([row["stage"], f"{row['n']:,}", str(row["workers"] or "none (one process)"), f"{row['seconds']:.1f}",
                      f"{alone['seconds'] / row['seconds']:.2f}", f"{one['seconds'] / row['seconds']:.2f}",
                      f"{1e3 * row['piece_overhead']:.2f}", str(row["metrics"]["pieces"])])
    text = [f"# Split stages on Dask workers\n\nCommand: `{shlex.join(['python', 'benchmarks/scaling.py', *args.argv])}`",
            f"\n{os.cpu_count()} CPU cores, {platform.machine()}, Python {platform.python_version()}; workers are "
            f"single-threaded processes of a LocalCluster started before the clock. Total wall time {minutes:.1f} min.\n",
            markdown(["stage", "N", "workers", "stage s", "speed-up over one process", "speed-up over 1 worker",
                      "ms a piece that does nothing", "pieces"], table)]
    write_report(args.report, "\n".join(text) + "\n")
    print("\n".join(text))


if __name__ == "__main__":
    main(sys.argv[1:])

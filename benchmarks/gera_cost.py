"""What GeRA's regulariser and ASIF's FAISS backend cost, as ratios measured side by side in one run.

1. Alignment training time per epoch against the neighbors sampled per paired point n (M paired
   points of random 512-d image and 384-d text tables, L = max n nearest lists), relative to n = 1.
2. ASIF relative representations of Q queries over M anchors: exact torch scoring vs the FAISS
   top-k search, per M.

Writes ``benchmarks/results/gera_cost.md``.

    python benchmarks/gera_cost.py [--pairs 2000] [--samples 1 4 16 64 256] [--anchors 1000 10000 50000]
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from pathlib import Path

import numpy as np
import torch
from _report import markdown, write_report

from repsim.align.config import AlignConfig
from repsim.align.method import AlignmentMethod, PairedBatches
from repsim.align.asif import relative_representation
from repsim.methods.trainer import Trainer

RESULTS = Path(__file__).resolve().parent / "results" / "gera_cost.md"
IMAGE_DIM, TEXT_DIM = 512, 384


def seconds_per_epoch(samples: int, pairs: int, available: int, epochs: int) -> float:
    """Mean wall time of one training epoch of GeRA with ``samples`` neighbors per paired point."""
    rng = np.random.default_rng(0)
    image, text = rng.standard_normal((4 * pairs, IMAGE_DIM), np.float32), rng.standard_normal((4 * pairs, TEXT_DIM), np.float32)
    neighbors = rng.integers(pairs, 4 * pairs, (pairs, available))
    config = AlignConfig.model_validate({
        "data": {"spec": "unused.yaml"}, "image": {"type": "pixels"}, "neighbors": {"count": available},
        "geometry": {"samples": samples}, "optim": {"epochs": epochs, "batch_size": 256, "precision": "fp32"}})
    batches = PairedBatches(image, text, np.arange(pairs), neighbors, neighbors, config.geometry, 256)
    trainer = Trainer(AlignmentMethod(IMAGE_DIM, TEXT_DIM, config), config.optim, batches, device="cpu", progress=False)
    started = time.perf_counter()
    trainer.fit()
    return (time.perf_counter() - started) / epochs


def asif_seconds(anchors: int, queries: int, k: int) -> dict[str, float]:
    rng = np.random.default_rng(1)
    anchor_points = rng.standard_normal((anchors, TEXT_DIM)).astype(np.float32)
    query_points = rng.standard_normal((queries, TEXT_DIM)).astype(np.float32)
    times = {}
    for backend in ("exact", "faiss"):
        started = time.perf_counter()
        relative_representation(query_points, anchor_points, k, backend=backend)
        times[backend] = time.perf_counter() - started
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", type=int, default=2000)
    parser.add_argument("--samples", type=int, nargs="+", default=[1, 4, 16, 64, 256])
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--anchors", type=int, nargs="+", default=[1000, 10000, 50000])
    parser.add_argument("--queries", type=int, default=2000)
    parser.add_argument("--k", type=int, default=100)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    per_epoch = {n: seconds_per_epoch(n, args.pairs, max(args.samples), args.epochs) for n in args.samples}
    base = per_epoch[min(per_epoch)]
    training = markdown(["neighbors n", "s / epoch", f"ratio to n={min(per_epoch)}"],
                        [[str(n), f"{s:.3f}", f"{s / base:.2f}"] for n, s in per_epoch.items()])
    asif = {m: asif_seconds(m, args.queries, min(args.k, m)) for m in args.anchors}
    queries = markdown(["anchors M", "exact s", "FAISS s", "exact / FAISS"],
                       [[str(m), f"{t['exact']:.3f}", f"{t['faiss']:.3f}", f"{t['exact'] / t['faiss']:.2f}"]
                        for m, t in asif.items()])
    text = "\n".join([
        "# GeRA and ASIF cost", "", f"Command: `{shlex.join(['python', *sys.argv])}`", "",
        (f"CPU, {args.threads} torch thread(s). Training: M = {args.pairs} paired points, batches of 256, "
         f"L = {max(args.samples)}, heat kernel, {args.epochs} epochs each (the first includes warm-up)."), "",
        training, "", f"ASIF: {args.queries} queries (384-d), top k = {args.k} anchors, p = 8.", "", queries, ""])
    write_report(args.out, text)
    print(text)


if __name__ == "__main__":
    main()

"""Exact all-pairs neighbours on one GPU: every one of N points searched for its k nearest others by
inner product, with a FAISS flat index, and the time extrapolated to 6M points against a 5-minute goal.

Points: N standard-normal rows of D float32, L2-normalised (so the inner product is the cosine), made
with a seeded generator on ``--device``. Backends (``--backends``):

- ``faiss``: ``repsim.similarity.neighbors.build_index(kind="flat", metric="ip", use_gpu=...)``, a
  FAISS flat inner-product index (copied to the GPU with ``index_cpu_to_all_gpus`` on cuda), searched
  with the points themselves, ``--chunk`` rows at a time, for k + 1 results, each row's own id then
  dropped by ``neighbors.drop_self``: the loop of ``neighbors.knn``, with its parts timed apart.
  ``--float16`` stores the GPU index in float16.
- ``torch``: the same exact search in torch on ``--device``: each ``--torch-chunk`` of queries times
  all points (float32 matrix product, TF32 off), ``topk(k + 1)``, copied to the host, ``drop_self``.
  It measures the GPU when the installed FAISS has none.

Times: build (index from host rows, or upload of the points), search (the FAISS or torch search and
the copy of the results to the host) and drop self (on the host), after one warm-up chunk.
``--max-seconds`` stops the search after that long and extrapolates linearly to all N queries: every
query chunk searches all N points, so each costs the same. Extrapolation to ``--target-n`` (6M):
the search is all-pairs, N queries × N points, so it grows with N² (× (6M / N)²); the build and
drop-self steps touch each point once and grow with N (× 6M / N). The recall column compares the
first ``--check`` points' k neighbours with an exact float64 search on the device.

    python benchmarks/faiss_gpu.py --backends faiss torch --max-seconds 30   # an H200: 1M × 768, k = 800, ~2 min
    python benchmarks/faiss_gpu.py --device cpu --n 20000 --dim 64 --k 50 --backends faiss torch   # seconds

Writes the table to ``--out`` (default benchmarks/results/faiss_gpu.md) after each backend, and prints it.
"""

from __future__ import annotations

import argparse
import platform
import shlex
import sys
import time
from pathlib import Path

import numpy as np
import torch

from repsim.similarity.neighbors import CHUNK_ROWS, GPU_MAX_K, build_index, drop_self, recall_at_k

ROOT = Path(__file__).resolve().parent.parent
REPORT = ROOT / "benchmarks" / "results" / "faiss_gpu.md"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--n", type=int, default=1_000_000, help="points, each also a query")
    parser.add_argument("--dim", type=int, default=768)
    parser.add_argument("--k", type=int, default=800, help="neighbours per point, itself excluded")
    parser.add_argument("--backends", nargs="+", choices=("faiss", "torch"), default=["faiss"])
    parser.add_argument("--chunk", type=int, default=CHUNK_ROWS, help="queries per FAISS search call")
    parser.add_argument("--torch-chunk", type=int, default=4096, help="queries per torch matrix product")
    parser.add_argument("--float16", action="store_true", help="store the FAISS GPU index in float16")
    parser.add_argument("--max-seconds", type=float, default=120.0,
                        help="stop each backend's search after this long and extrapolate to all N queries")
    parser.add_argument("--check", type=int, default=200, help="points whose neighbours are checked in float64")
    parser.add_argument("--target-n", type=int, default=6_000_000)
    parser.add_argument("--goal-minutes", type=float, default=5.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=REPORT)
    args = parser.parse_args()
    if not 1 <= args.k < args.n:
        parser.error(f"--k must be between 1 and N - 1 = {args.n - 1}")
    args.check = max(1, min(args.check, args.n))
    return args


def random_points(n: int, dim: int, device: torch.device, seed: int) -> torch.Tensor:
    """(n, dim) float32 unit rows on ``device``."""
    generator = torch.Generator(device=device).manual_seed(seed)
    points = torch.randn(n, dim, device=device, generator=generator)
    return torch.nn.functional.normalize(points, dim=1)


def synchronise(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def exact_neighbours(points: torch.Tensor, rows: int, k: int) -> np.ndarray:
    """(rows, k) ids of the first ``rows`` points' nearest others, from float64 inner products."""
    scores = points[:rows].double() @ points.double().T
    scores[torch.arange(rows), torch.arange(rows)] = -torch.inf
    return scores.topk(k, dim=1).indices.cpu().numpy()


def search_all(search, n: int, chunk: int, k: int, max_seconds: float, check: int, label: str) -> dict:
    """Run ``search(start, stop) -> (ids, scores)`` over query chunks after a warm-up of 1,024 queries,
    drop each row's own id, stop after ``max_seconds``; returns the timings and the first ``check``
    rows' ids."""
    search(0, min(chunk, 1024, n))
    searched = dropped = 0.0
    done, first_ids, shown = 0, [], 0.0
    started = time.perf_counter()
    for start in range(0, n, chunk):
        stop = min(start + chunk, n)
        tick = time.perf_counter()
        ids, scores = search(start, stop)
        tock = time.perf_counter()
        ids, scores = drop_self(ids, scores, np.arange(start, stop))
        searched += tock - tick
        dropped += time.perf_counter() - tock
        if sum(map(len, first_ids)) < check:
            first_ids.append(ids)
        done, elapsed = stop, time.perf_counter() - started
        if elapsed - shown > 5 or done == n or elapsed > max_seconds:
            print(f"{label}: {done:,} / {n:,} queries, {elapsed:.1f} s", flush=True)
            shown = elapsed
        if elapsed > max_seconds and done < n:
            break
    scale = n / done
    return {"search": searched * scale, "drop": dropped * scale, "queries": done,
            "first_ids": np.concatenate(first_ids)[:check, :k]}


def run_faiss(points: np.ndarray, args: argparse.Namespace, device: torch.device) -> dict:
    use_gpu = device.type == "cuda"
    if use_gpu:
        import faiss

        if faiss.get_num_gpus() == 0:
            raise RuntimeError(f"the installed FAISS ({faiss.__version__}) has no GPU support")
        if args.k + 1 > GPU_MAX_K:
            raise RuntimeError(f"FAISS GPU search returns at most {GPU_MAX_K} neighbours")
    started = time.perf_counter()
    index = build_index(points, "flat", metric="ip", use_gpu=use_gpu, gpu_float16=args.float16, chunk_size=args.chunk)
    build = time.perf_counter() - started
    timings = search_all(lambda start, stop: index.search(points[start:stop], args.k + 1)[::-1],
                         len(points), args.chunk, args.k, args.max_seconds, args.check, "faiss")
    return {"build": build, **timings}


def run_torch(points: np.ndarray, args: argparse.Namespace, device: torch.device) -> dict:
    torch.backends.cuda.matmul.allow_tf32 = False
    synchronise(device)
    started = time.perf_counter()
    base = torch.from_numpy(points).to(device)
    synchronise(device)
    build = time.perf_counter() - started

    def search(start: int, stop: int) -> tuple[np.ndarray, np.ndarray]:
        scores, ids = (base[start:stop] @ base.T).topk(args.k + 1, dim=1)
        return ids.cpu().numpy(), scores.cpu().numpy()

    timings = search_all(search, len(points), args.torch_chunk, args.k, args.max_seconds, args.check, "torch")
    base.resize_(0)  # the GPU memory goes back before the next backend runs
    return {"build": build, **timings}


def seconds(value: float) -> str:
    return f"{value:,.1f} s" if value < 600 else f"{value / 60:,.1f} min"


def report(args: argparse.Namespace, device: torch.device, results: dict[str, dict], exact: np.ndarray) -> str:
    growth = args.target_n / args.n
    header = ["backend", "index", "build", "search (queries timed)", "drop self", f"total, N = {args.n:,}",
              f"N = {args.target_n / 1e6:g}M (extrapolated)", f"< {args.goal_minutes:g} min",
              f"recall@{args.k} vs float64"]
    lines = [header, ["---"] * len(header)]
    for name in sorted(results, key=("faiss", "torch").index):
        result = results[name]
        index = ("GPU flat IP" + (", float16" if args.float16 else "") if device.type == "cuda" else "CPU flat IP") \
            if name == "faiss" else f"torch matmul + topk on {device.type}"
        if "error" in result:
            lines.append([name, index, "—", f"failed: {result['error']}", "—", "—", "—", "—", "—"])
            continue
        total = result["build"] + result["search"] + result["drop"]
        target = (result["build"] + result["drop"]) * growth + result["search"] * growth ** 2
        timed = f"{result['queries']:,} of {args.n:,}" if result["queries"] < args.n else "all"
        checked = min(len(exact), len(result["first_ids"]))
        recall = recall_at_k(result["first_ids"][:checked], exact[:checked])
        lines.append([name, index, seconds(result["build"]), f"{seconds(result['search'])} ({timed})",
                      seconds(result["drop"]), seconds(total), seconds(target),
                      "yes" if target < args.goal_minutes * 60 else "no", f"{recall:.4f}"])
    table = "\n".join("| " + " | ".join(line) + " |" for line in lines)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "CPU"
    versions = f"torch {torch.__version__}"
    if "faiss" in results:
        try:
            import faiss

            versions += f", faiss {faiss.__version__} ({faiss.get_num_gpus()} GPU(s) visible to FAISS)"
        except ImportError:
            versions += ", no FAISS"
    command = shlex.join(["python", "benchmarks/faiss_gpu.py", *sys.argv[1:]])
    return (f"# Exact all-pairs neighbours: N = {args.n:,} × D = {args.dim}, k = {args.k}\n\n"
            f"`{command}` on {name}, {versions}.\n\n{table}\n\n"
            f"Every point is a query against all N points (k + 1 found, its own id dropped). Search times "
            f"measured on fewer than N queries are scaled linearly to N. Extrapolation to "
            f"{args.target_n:,} points: search × (target / N)² = × {growth ** 2:,.0f} (all pairs), build and "
            f"drop self × target / N = × {growth:,.0f} (one pass over the points); the 6M lists themselves are "
            f"{args.target_n * args.k * 12 / 1e9:,.1f} GB of int64 ids and float32 scores.\n")


def main() -> None:
    args = parse_args()
    device = torch.device(args.device)
    started = time.perf_counter()
    on_device = random_points(args.n, args.dim, device, args.seed)
    points = on_device.cpu().numpy()
    print(f"{args.n:,} × {args.dim} points in {time.perf_counter() - started:.1f} s", flush=True)
    exact = exact_neighbours(on_device, min(args.check, args.n), args.k)
    del on_device
    if device.type == "cuda":
        torch.cuda.empty_cache()
    results = {}
    for name in args.backends:
        try:
            results[name] = (run_faiss if name == "faiss" else run_torch)(points, args, device)
        except Exception as error:  # a failing backend is a row of the table; the others still run
            print(f"{name}: {type(error).__name__}: {error}", flush=True)
            results[name] = {"error": f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"}
        if device.type == "cuda":
            torch.cuda.empty_cache()
        text = report(args, device, results, exact)  # after each backend: a later crash keeps the rows so far
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()

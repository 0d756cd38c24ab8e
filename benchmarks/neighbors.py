"""Neighbor search and caption embedding speed: FAISS exact vs torch brute force, IVF and HNSW, de-duplication.

Points are synthetic clustered unit vectors of MiniLM's width (384): a mixture of ``--clusters``
Gaussians in a 32-d latent space, mapped to 384 dims by a fixed random matrix, plus a little
isotropic noise, then L2-normalised (low intrinsic dimension, like sentence embeddings, without
their exact ties). A seeded subset of ``--queries`` points is searched against all ``--points``
by inner product (cosine), k = 10:

- FAISS flat (exact) and chunked ``torch.topk`` over query-by-database similarity blocks;
- IVF-Flat, IVF-PQ (alone and re-ranked exactly, as ``knn`` does) and HNSW with the library
  defaults: build time, search time, recall@10 against flat, and the index's bytes per vector,
  extrapolated to the 10M x 384 case of the ``repsim.similarity.neighbors`` docstring.

Captions: ``--captions`` Animal-MNIST template captions (``DataSpec.caption_for``: 30 distinct
texts) and as many distinct texts made by numbering them ("a photo of a dog, number 17."), both
embedded by ``embed_captions`` with all-MiniLM-L6-v2, which encodes each distinct text once.

    python benchmarks/neighbors.py                                      # defaults, minutes on 2 cores
    python benchmarks/neighbors.py --points 200000 --queries 5000       # full size, ~7 min on 2 CPUs

Prints the tables and writes them to benchmarks/results/neighbors.md.
"""

from __future__ import annotations

import argparse
import os
import platform
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from repsim.data.spec import load_spec
from repsim.similarity.captions import embed_captions, load_text_model
import faiss

from repsim.similarity.neighbors import IVFPQ_RERANK, build_index, default_nlist, recall_at_k, rerank_exactly
from _report import markdown, write_report

ROOT = Path(__file__).resolve().parent.parent
CAPTION_SPEC = ROOT / "data_specs" / "animal-mnist.yaml"
REPORT = ROOT / "benchmarks" / "results" / "neighbors.md"
DIM, LATENT_DIM, K = 384, 32, 10


def clustered_points(n: int, clusters: int, seed: int) -> np.ndarray:
    """(n, 384) float32 unit rows: a Gaussian mixture in 32 latent dims, linearly mapped to 384 dims."""
    rng = np.random.default_rng(seed)
    centres = rng.normal(size=(clusters, LATENT_DIM)).astype(np.float32)
    latent = centres[rng.integers(clusters, size=n)] + 0.5 * rng.normal(size=(n, LATENT_DIM)).astype(np.float32)
    mapping = rng.normal(size=(LATENT_DIM, DIM)).astype(np.float32) / np.sqrt(LATENT_DIM)
    x = latent @ mapping + 0.05 * rng.normal(size=(n, DIM)).astype(np.float32)
    return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)


def timed(run: Callable[..., object], *args, **options) -> tuple[object, float]:
    """``run(*args, **options)`` and the seconds it took."""
    started = time.perf_counter()
    result = run(*args, **options)
    return result, time.perf_counter() - started


def torch_top_k(x: np.ndarray, queries: np.ndarray, chunk: int) -> np.ndarray:
    """(Q, K) ids of the largest inner products, ``chunk`` queries at a time."""
    database = torch.from_numpy(x)
    return torch.cat([torch.topk(torch.from_numpy(queries[start:start + chunk]) @ database.T, K, dim=1).indices
                      for start in range(0, len(queries), chunk)]).numpy()


def search_rows(x: np.ndarray, queries: np.ndarray, chunk: int) -> list[list[str]]:
    """One row per method: build s, search s, queries/s, search speed vs flat, recall@10 vs flat,
    index bytes per vector and the index size for 10M vectors."""
    results = {}
    for kind in ("flat", "ivf", "ivfpq", "hnsw"):
        index, build = timed(build_index, x, kind, metric="ip", use_gpu=False)
        (_, ids), search = timed(index.search, queries, K)
        results[kind] = (ids, build, search, len(faiss.serialize_index(index)) / len(x))
        if kind == "ivfpq":
            def search_and_rerank(index: faiss.Index = index) -> np.ndarray:
                return rerank_exactly(x, queries, index.search(queries, K * IVFPQ_RERANK)[1], "ip", K)[0]
            ids, search = timed(search_and_rerank)
            results[f"ivfpq + exact re-rank of {IVFPQ_RERANK}k"] = (ids, build, search, results[kind][3])
    ids, search = timed(torch_top_k, x, queries, chunk)
    results["torch topk"] = (ids, 0.0, search, x.itemsize * x.shape[1])
    exact, flat_search = results["flat"][0], results["flat"][2]
    return [[name, f"{build:.2f}", f"{search:.2f}", f"{len(queries) / search:,.0f}", f"{flat_search / search:.2f}",
             f"{recall_at_k(ids, exact):.4f}", f"{per_vector:,.0f}", f"{per_vector * 1e7 / 2 ** 30:.1f}"]
            for name, (ids, build, search, per_vector) in results.items()]


def template_captions(n: int) -> list[str]:
    """``n`` Animal-MNIST captions as its data spec writes them, classes and templates rotating."""
    spec = load_spec(CAPTION_SPEC)
    return [spec.caption_for(index % len(spec.class_names), index // len(spec.class_names)) for index in range(n)]


def caption_rows(n: int, device: str) -> list[list[str]]:
    """Captions/s of embed_captions on template captions (few distinct) and on numbered, all-distinct ones."""
    model = load_text_model(device=device)
    templated = template_captions(n)
    numbered = [f"{caption[:-1]}, number {index}." for index, caption in enumerate(templated)]
    embed_captions(templated[:64], model=model)  # warm-up
    rows, baseline = [], None
    for name, texts in (("numbered (all distinct)", numbered), ("templated (de-duplicated)", templated)):
        _, seconds = timed(embed_captions, texts, model=model)
        baseline = baseline or seconds
        rows.append([name, f"{len(texts):,}", f"{len(set(texts)):,}", f"{seconds:.2f}", f"{len(texts) / seconds:,.0f}",
                     f"{baseline / seconds:.1f}"])
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--points", type=int, default=100_000, help="database size (spec: 200000)")
    parser.add_argument("--queries", type=int, default=2_000, help="seeded subset of the points searched")
    parser.add_argument("--clusters", type=int, default=1_000)
    parser.add_argument("--captions", type=int, default=10_000)
    parser.add_argument("--chunk", type=int, default=256, help="queries per torch similarity block")
    parser.add_argument("--device", default="cpu", help="torch device of the text model")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=REPORT)
    args = parser.parse_args()
    x = clustered_points(args.points, args.clusters, args.seed)
    queries = x[np.sort(np.random.default_rng(args.seed).choice(args.points, args.queries, replace=False))]
    search = markdown(["method", "build s", "search s", "queries/s", "speed vs flat", "recall@10 vs flat",
                       "index B/vector", "GiB at 10M"],
                      search_rows(x, queries, args.chunk))
    captions = markdown(["captions", "texts", "distinct", "seconds", "captions/s", "speed vs all distinct"],
                        caption_rows(args.captions, args.device))
    command = "python benchmarks/neighbors.py " + " ".join(
        f"--{name} {getattr(args, name)}" for name in ("points", "queries", "clusters", "captions", "chunk", "device"))
    report = (f"# Neighbor search and caption embedding\n\n"
              f"Machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
              f"{torch.get_num_threads()} torch threads; torch {torch.__version__}; FAISS on the CPU.\n"
              f"Produced by `{command}`.\n\n"
              f"Search: {args.queries:,} seeded queries against {args.points:,} x {DIM} synthetic clustered unit "
              f"vectors ({args.clusters:,} Gaussian clusters in {LATENT_DIM} latent dims, randomly mapped to {DIM}), "
              f"inner product, k = {K}. IVF-Flat and IVF-PQ: nlist {default_nlist(args.points)} and nprobe nlist / 8 "
              f"(defaults); IVF-PQ codes: {DIM // 8} one-byte sub-quantisers (default D / 8); "
              f"HNSW: M 32, efConstruction 80, efSearch 128 (defaults). Torch: `torch.topk` over "
              f"{args.chunk}-query similarity blocks, no index to build.\n\n{search}\n\n"
              f"Captions: all-MiniLM-L6-v2 on {args.device} through `embed_captions`; templated = Animal-MNIST's "
              f"spec captions, numbered = the same with \", number i\" appended.\n\n{captions}\n")
    write_report(args.out, report)
    print(report)


if __name__ == "__main__":
    main()

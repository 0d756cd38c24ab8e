"""The caption and neighbor stages in pieces: any number of workers writes the bytes of one process under the same
key, a stage stopped after k pieces resumes with the rest, and a query's neighbors do not depend on the queries
searched with it."""

from __future__ import annotations

import concurrent.futures
import json
import multiprocessing
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from repsim.data import shard
from repsim.pieces import PIECE_FILE
from repsim.similarity import stage as precompute
from repsim.similarity import neighbors as neighbors_module
from repsim.similarity.captions import embed_captions
from repsim.similarity.neighbors import (INDEX_FILE, knn, load_neighbors, open_lists, require_faiss, search_queries,
                                         searcher)
from repsim.similarity.stage import (EMBEDDINGS_FILE, embed_captions_stage, embed_captions_stage_of, neighbors_stage,
                                          neighbors_stage_of)

CLASSES = {"cat": "cat.n.01", "dog": "dog.n.01", "bear": "bear.n.01"}
TEMPLATES = ["a photo of a {name}.", "a blurry drawing of a small {name}.", "{name}"]


@pytest.fixture(scope="module")
def pool():
    """Two worker processes for the module, started clean (spawn): a forked child of a process that ran OpenMP
    (FAISS, torch) may hang in its next parallel region."""
    with concurrent.futures.ProcessPoolExecutor(2, mp_context=multiprocessing.get_context("spawn")) as workers:
        yield workers


@pytest.fixture
def one_faiss_thread():
    """FAISS on one thread, so an index built twice (once a run) is the same index: HNSW inserts in parallel."""
    faiss = require_faiss()
    threads = faiss.omp_get_max_threads()
    faiss.omp_set_num_threads(1)
    yield
    faiss.omp_set_num_threads(threads)


@pytest.fixture
def zoo_shards(make_image_folder, write_spec):
    """12 samples whose template captions take up to 9 distinct texts."""
    root = make_image_folder({name: 4 for name in CLASSES})
    return shard(write_spec({"name": "zoo", "source": {"type": "image_folder", "root": str(root)}, "classes": CLASSES,
                             "captions": {"templates": TEMPLATES},
                             "split": {"type": "random", "fractions": {"train": 0.5, "test": 0.5}}}), progress=False)


def output_bytes(path: Path) -> dict[str, bytes]:
    return {file.name: file.read_bytes() for file in sorted(path.iterdir()) if file.name != "stage.json"}


def metrics(path: Path) -> dict:
    return json.loads((path / "stage.json").read_text())["metrics"]


class Stopping:
    """A stage's piece function that builds ``limit`` pieces (None: all), then stops the stage; ``built`` lists them."""

    def __init__(self, real, limit: int | None):
        self.real, self.limit, self.built = real, limit, []

    def __call__(self, argument, folder: Path):
        if len(self.built) == self.limit:
            raise KeyboardInterrupt
        self.built.append(argument)
        return self.real(argument, folder)


def must_not_build(*args, **options):
    raise AssertionError("the index saved for the kept pieces was built again")


# ---------------------------------------------------------------------------------------------
# Captions

@pytest.mark.slow
def test_caption_pieces_on_two_workers_write_the_bytes_of_one_process_and_of_one_call(zoo_shards, pool, tmp_path,
                                                                                     monkeypatch):
    monkeypatch.setattr(precompute, "CAPTION_PIECE_TEXTS", 2)
    alone = embed_captions_stage(zoo_shards, batch_size=2, device="cpu", out_dir=tmp_path / "alone", progress=False)
    spread = embed_captions_stage(zoo_shards, batch_size=2, device="cpu", out_dir=tmp_path / "spread", progress=False,
                                  executor=pool)
    assert alone.key == spread.key == embed_captions_stage_of(zoo_shards).key
    assert output_bytes(alone.path) == output_bytes(spread.path)
    captions = pq.read_table(zoo_shards.manifest, columns=["caption"])["caption"]
    distinct = len(set(captions.to_pylist()))
    assert (metrics(alone.path)["unique_captions"], metrics(alone.path)["pieces"]) == (distinct, -(-distinct // 2)) \
        and distinct > 6
    one_call = embed_captions(captions, batch_size=2, device="cpu").astype(np.float16)
    np.testing.assert_array_equal(np.load(alone.path / EMBEDDINGS_FILE), one_call)


def test_a_caption_stage_stopped_after_k_pieces_resumes_with_the_rest(zoo_shards, repsim_home, tmp_path, monkeypatch):
    monkeypatch.setattr(precompute, "CAPTION_PIECE_TEXTS", 2)
    clean = embed_captions_stage(zoo_shards, device="cpu", out_dir=tmp_path / "clean", progress=False)
    piece = Stopping(precompute.embed_caption_piece, 2)
    monkeypatch.setattr(precompute, "embed_caption_piece", piece)
    with pytest.raises(KeyboardInterrupt):
        embed_captions_stage(zoo_shards, device="cpu", progress=False)
    scratch = repsim_home / "scratch" / "captions" / clean.key
    assert len(list(scratch.glob(f"*/{PIECE_FILE}"))) == 2

    piece.built.clear()
    piece.limit = None
    resumed = embed_captions_stage(zoo_shards, device="cpu", progress=False)
    pieces = metrics(clean.path)["pieces"]
    assert (len(piece.built), metrics(resumed.path)["pieces"], metrics(resumed.path)["pieces_kept"]) == \
        (pieces - 2, pieces, 2) and pieces > 3
    assert resumed.key == clean.key and output_bytes(resumed.path) == output_bytes(clean.path)
    assert not scratch.exists()


# ---------------------------------------------------------------------------------------------
# Neighbors

@pytest.fixture
def points_file(tmp_path) -> Path:
    points = np.random.default_rng(0).normal(size=(500, 16)).astype(np.float32)
    np.save(tmp_path / "points.npy", points)
    return tmp_path / "points.npy"


@pytest.mark.parametrize("kind", ["flat", "ivf", "hnsw"])
def test_neighbor_pieces_on_two_workers_write_the_bytes_of_one_process_and_one_call(points_file, pool, tmp_path,
                                                                                   monkeypatch, one_faiss_thread,
                                                                                   kind):
    monkeypatch.setattr(precompute, "QUERY_PIECE_ROWS", 64)
    options = {"k": 5, "index": kind, "recall_queries": 100, "progress": False}
    alone = neighbors_stage(points_file, out_dir=tmp_path / "alone", **options)
    spread = neighbors_stage(points_file, out_dir=tmp_path / "spread", executor=pool, **options)
    assert alone.key == spread.key == neighbors_stage_of(points_file, 5, kind, recall_queries=100).key
    assert output_bytes(alone.path) == output_bytes(spread.path)
    for listed, one_call in zip(load_neighbors(alone.path), knn(np.load(points_file), 5, index=kind)):
        np.testing.assert_array_equal(listed, one_call)
    found, spread_found = metrics(alone.path), metrics(spread.path)
    assert found["pieces"] == 8 and found.get("recall") == spread_found.get("recall")
    assert ("recall" in found) == (kind != "flat")


def test_a_neighbor_stage_stopped_after_k_pieces_resumes_with_its_saved_index(points_file, repsim_home, tmp_path,
                                                                             monkeypatch, one_faiss_thread):
    monkeypatch.setattr(precompute, "QUERY_PIECE_ROWS", 64)
    clean = neighbors_stage(points_file, k=5, index="ivf", out_dir=tmp_path / "clean", progress=False)
    piece = Stopping(precompute.search_neighbor_piece, 3)
    monkeypatch.setattr(precompute, "search_neighbor_piece", piece)
    with pytest.raises(KeyboardInterrupt):
        neighbors_stage(points_file, k=5, index="ivf", progress=False)
    scratch = repsim_home / "scratch" / "neighbors" / clean.key
    assert len(list(scratch.glob(f"*/{PIECE_FILE}"))) == 3 and (scratch / INDEX_FILE).is_file()

    piece.built.clear()
    piece.limit = None
    monkeypatch.setattr(neighbors_module, "build_index", must_not_build)
    resumed = neighbors_stage(points_file, k=5, index="ivf", progress=False)
    assert (len(piece.built), metrics(resumed.path)["pieces"], metrics(resumed.path)["pieces_kept"]) == (5, 8, 3)
    assert resumed.key == clean.key and output_bytes(resumed.path) == output_bytes(clean.path)
    assert not scratch.exists()


@pytest.mark.parametrize("kind", ["flat", "ivf", "hnsw", "ivfpq"])
def test_a_query_finds_the_same_neighbors_alone_or_among_others(kind):
    points = np.random.default_rng(1).normal(size=(5000 if kind == "ivfpq" else 600, 16)).astype(np.float32)
    search = searcher(points, kind, use_gpu=False)
    found = []
    for chunk_size in (300, 100, 7, 1):
        ids, scores = open_lists(300, 5)
        search_queries(search, points[:300], 5, ids, scores, own=np.arange(300), chunk_size=chunk_size)
        found.append((ids, scores))
    for ids, scores in found[1:]:
        np.testing.assert_array_equal(ids, found[0][0])
        np.testing.assert_array_equal(scores, found[0][1])

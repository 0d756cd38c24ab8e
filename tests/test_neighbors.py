"""The neighbor engine: the exact torch search and FAISS lists equal brute force, self is excluded,
approximate recall is high."""

from pathlib import Path

import numpy as np
import pytest
import torch

from bounded import memory_mapped
from repsim.data.sources import read_idx
from repsim.errors import SimilarityError
from repsim.similarity.neighbors import (IDS_FILE, build_index, default_nlist, default_pq_m, exact_search, knn,
                                         load_neighbors, nearest, recall_at_k, require_faiss)


FASHION_TRAIN_IMAGES = Path("/usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz")


def points(n: int, dim: int = 16, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).normal(size=(n, dim)).astype(np.float32)


def unit(x: np.ndarray) -> np.ndarray:
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def brute_force(x: np.ndarray, queries: np.ndarray, metric: str) -> np.ndarray:
    """(Q, N) float64 distances: squared L2, or negated inner product / cosine, so smaller is nearer."""
    x, queries = x.astype(np.float64), queries.astype(np.float64)
    if metric == "cosine":
        x, queries = unit(x), unit(queries)
    if metric in ("ip", "cosine"):
        return -queries @ x.T
    return (queries ** 2).sum(1)[:, None] - 2 * queries @ x.T + (x ** 2).sum(1)[None, :]


def assert_same_neighbors(ids, distances, reference, k):
    """``ids`` are a valid top-k of ``reference`` rows: their distances equal the k smallest, so
    ties may be broken either way."""
    picked = np.take_along_axis(reference, ids, axis=1)
    np.testing.assert_allclose(picked, np.sort(reference, axis=1)[:, :k], rtol=1e-4, atol=1e-3)
    assert np.all(np.diff(picked, axis=1) >= -1e-3)
    assert all(len(set(row)) == k for row in ids)


@pytest.mark.parametrize("metric", ["l2", "ip", "cosine"])
def test_flat_search_equals_brute_force(metric):
    x, queries = points(400), points(50, seed=1)
    ids, scores = knn(x, 7, queries=queries, metric=metric)
    assert ids.shape == scores.shape == (50, 7) and ids.dtype == np.int64 and scores.dtype == np.float32
    reference = brute_force(x, queries, metric)
    assert_same_neighbors(ids, scores, reference, 7)
    sign = 1 if metric == "l2" else -1
    np.testing.assert_allclose(sign * scores, np.sort(reference, axis=1)[:, :7], rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("metric", ["l2", "cosine"])
def test_exact_search_holds_one_chunk_of_candidates_at_a_time(tmp_path, monkeypatch, metric):
    base = memory_mapped(points(3000), tmp_path / "base.npy")
    candidates, queries = np.arange(0, 3000, 3), points(40, seed=1)
    faiss, added = require_faiss(), []

    class RecordingFlat(faiss.IndexFlat):
        def add(self, x):
            added.append(len(x))
            super().add(x)
    monkeypatch.setattr(faiss, "IndexFlat", RecordingFlat)
    ids, scores = knn(base, 5, queries=queries, metric=metric, subset=candidates, chunk_size=300, use_gpu=False)
    assert max(added) == 300 and sum(added) == len(candidates)  # one scan, never the whole pool
    assert set(ids.ravel()) <= set(candidates)
    reference = brute_force(np.asarray(base), queries, metric)
    reference[:, np.setdiff1d(np.arange(3000), candidates)] = np.inf
    assert_same_neighbors(ids, scores, reference, 5)


def brute_force_top_k(keys: np.ndarray, queries: np.ndarray, k: int, metric: str, query_ids=None, key_ids=None):
    """(Q, k) rows and scores of the k nearest keys by float64 brute force, equal distances to the lower row."""
    distances = brute_force(keys, queries, metric)
    if query_ids is not None:
        distances[query_ids[:, None] == key_ids[None, :]] = np.inf
    rows = np.lexsort((np.broadcast_to(np.arange(len(keys)), distances.shape), distances), axis=1)[:, :k]
    picked = np.take_along_axis(distances, rows, axis=1)
    return rows, picked if metric == "l2" else -picked


@pytest.mark.parametrize("metric", ["l2", "ip", "cosine"])
def test_exact_search_equals_brute_force_with_ties_excluded_ids_and_chunks(metric):
    rng = np.random.default_rng(0)
    signs = rng.choice([-1.0, 1.0], size=(72, 16))  # ±1 scaled by powers of two: every score exact, many tied
    keys, fresh = np.split(signs * rng.choice([1.0, 2.0, 4.0], size=(72, 1)), [70])
    keys[[20, 41, 65]] = keys[5]
    key_ids = rng.permutation(70) + 100
    queries = np.concatenate([keys[::3], fresh])
    query_ids = np.concatenate([key_ids[::3], [-1, -2]])  # the last two are no key: nothing is left out
    chunks = list(exact_search(queries, torch.from_numpy(keys), 6, metric, (query_ids, key_ids), chunk_size=4,
                               key_chunk_size=9))
    rows, scores = brute_force_top_k(keys, queries, 6, metric, query_ids, key_ids)
    assert [chunk.start for chunk in chunks] == list(range(0, len(queries), 4))
    np.testing.assert_array_equal(torch.cat([chunk.indices for chunk in chunks]).numpy(), rows)
    found = torch.cat([chunk.scores for chunk in chunks])
    assert found.dtype == torch.float64
    np.testing.assert_allclose(found.numpy(), scores, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("metric", ["l2", "ip", "cosine"])
@pytest.mark.parametrize("backend", ["torch", "faiss"])
def test_nearest_equals_brute_force_by_either_backend(metric, backend):
    keys, queries = points(300), points(30, seed=1)
    key_ids, query_ids = np.arange(300) * 2, np.arange(30) * 20  # query i has key 10 i's id
    ids, scores = nearest(torch.from_numpy(queries), torch.from_numpy(keys), 7, metric, (query_ids, key_ids),
                          backend)
    expected_ids, expected_scores = brute_force_top_k(keys, queries, 7, metric, query_ids, key_ids)
    assert ids.dtype == torch.int64 and scores.dtype == torch.float32 and ids.shape == (30, 7)
    np.testing.assert_array_equal(ids.numpy(), expected_ids)
    np.testing.assert_allclose(scores.numpy(), expected_scores, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("metric", ["l2", "ip", "cosine"])
def test_flat_faiss_lists_equal_the_exact_engine(metric):
    x = points(500)
    ids, scores = knn(x, 8, metric=metric, chunk_size=128)
    rows = np.arange(500)
    exact_ids, exact_scores = nearest(x, x, 8, metric, (rows, rows))
    np.testing.assert_array_equal(ids, exact_ids.numpy())
    np.testing.assert_allclose(scores, exact_scores.numpy(), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("call, message", [
    (lambda x: nearest(x, x, 50), "cannot find 50 neighbors among 40 points; choose k from 1 to 40"),
    (lambda x: nearest(x, x, 40, exclude=(np.arange(40), np.arange(40))),
     "cannot find 40 neighbors among 39 other points; choose k from 1 to 39"),
    (lambda x: nearest(x, x, 3, exclude=(np.arange(40), np.arange(39))),
     "exclude holds ids of shapes \\(40,\\) and \\(39,\\) for 40 queries and 40 keys; pass one id"),
    (lambda x: nearest(x[:, :8], x, 3), "queries have 8 dimensions but the base points have 16"),
    (lambda x: nearest(x, x, 3, metric="hamming"), "unknown metric 'hamming'; metric is one of cosine, ip, l2"),
    (lambda x: nearest(x, x, 3, backend="annoy"), "unknown search backend 'annoy'; use one of torch, faiss"),
])
def test_unusable_exact_searches_are_a_one_line_error(call, message):
    with pytest.raises(SimilarityError, match=message) as err:
        call(points(40))
    assert "\n" not in str(err.value)


def test_subset_restricts_the_candidates_and_ids_index_the_base():
    x, queries = points(500), points(40, seed=1)
    subset = np.random.default_rng(2).choice(500, 120, replace=False)
    ids, _ = knn(x, 6, queries=queries, subset=subset, metric="l2", chunk_size=16)
    assert np.isin(ids, subset).all()
    reference = np.full((40, 500), np.inf)
    reference[:, subset] = brute_force(x[subset], queries, "l2")
    assert_same_neighbors(ids, None, reference, 6)
    own, _ = knn(x, 4, subset=subset, metric="l2")  # queries default to the subset, each without itself
    assert own.shape == (120, 4) and np.isin(own, subset).all() and not np.any(own == subset[:, None])


@pytest.mark.parametrize("metric", ["cosine", "l2"])
def test_ivfpq_candidates_are_re_ranked_by_exact_scores(metric):
    x, queries = points(5000, dim=32), points(40, dim=32, seed=1)
    ids, scores = knn(x, 5, queries=queries, index="ivfpq", metric=metric, nlist=16, nprobe=16,
                      rerank=100)
    reference = brute_force(x, queries, metric)
    sign = 1 if metric == "l2" else -1
    np.testing.assert_allclose(sign * scores, np.take_along_axis(reference, ids, axis=1), rtol=1e-4, atol=1e-4)
    exact, _ = knn(x, 5, queries=queries, metric=metric)
    assert recall_at_k(ids, exact) >= 0.9


def test_subset_must_be_distinct_rows_of_the_base():
    for subset, message in [(np.array([1, 1, 2]), "lists some rows twice"), (np.array([0, 50]), "outside 0..49"),
                            (np.array([0.5, 1.0]), "1-d array of row numbers")]:
        with pytest.raises(SimilarityError, match=message):
            knn(points(50), 1, subset=subset)


def test_memory_mapped_half_precision_base_and_output_give_the_in_memory_lists(tmp_path):
    x = points(700, dim=32).astype(np.float16)
    np.save(tmp_path / "points.npy", x)
    mapped = np.load(tmp_path / "points.npy", mmap_mode="r")
    ids, scores = knn(mapped, 5, chunk_size=128, out=tmp_path / "lists")
    expected_ids, expected_scores = knn(x.astype(np.float32), 5)
    assert isinstance(ids, np.memmap) and (tmp_path / "lists" / IDS_FILE).is_file()
    np.testing.assert_allclose(scores, expected_scores, rtol=1e-5, atol=1e-5)
    assert (ids == expected_ids).mean() > 0.99  # ties aside
    loaded_ids, loaded_scores = load_neighbors(tmp_path / "lists")
    assert np.array_equal(loaded_ids, ids) and np.array_equal(loaded_scores, scores)
    assert loaded_ids.dtype == np.int64 and loaded_scores.dtype == np.float32
    with pytest.raises(SimilarityError, match="holds no neighbor list"):
        load_neighbors(tmp_path / "elsewhere")


def test_exclude_self_drops_each_points_own_id():
    x = points(300)
    ids, _ = knn(x, 5, metric="l2", chunk_size=64)
    assert not np.any(ids == np.arange(300)[:, None])
    reference = brute_force(x, x, "l2")
    np.fill_diagonal(reference, np.inf)
    assert_same_neighbors(ids, None, reference, 5)
    with_self, _ = knn(x, 5, metric="l2", exclude_self=False)
    assert np.array_equal(with_self[:, 0], np.arange(300))


def test_exact_duplicates_stay_neighbors_of_each_other():
    base = points(50)
    x = np.concatenate([base, base[:10], base[:10], base[:10]])  # points 0..9 appear four times
    ids, distances = knn(x, 3, metric="l2")
    for row in list(range(10)) + list(range(50, 80)):
        original = row if row < 50 else (row - 50) % 10
        assert set(ids[row]) == {original, original + 50, original + 60, original + 70} - {row}
        np.testing.assert_allclose(distances[row], 0, atol=1e-4)
    assert not np.any(ids == np.arange(80)[:, None])


def test_a_point_with_more_copies_than_k_lists_only_other_copies():
    x = np.concatenate([np.repeat(points(1), 6, axis=0), points(20, seed=1)])
    ids, distances = knn(x, 2, metric="l2")
    for row in range(6):
        assert set(ids[row]) <= set(range(6)) - {row} and len(set(ids[row])) == 2
        np.testing.assert_allclose(distances[row], 0, atol=1e-4)


@pytest.mark.parametrize("kind, options", [("hnsw", {"m": 16, "ef_search": 64}),
                                           ("ivf", {"nlist": 32, "nprobe": 12})])
def test_approximate_indexes_recall_most_exact_neighbors(kind, options):
    x = points(4000)
    exact, _ = knn(x, 10)
    approx, _ = knn(x, 10, index=kind, **options)
    assert recall_at_k(approx, exact) > 0.9


def test_recall_at_k_on_a_constructed_case():
    exact = np.array([[1, 2, 3], [4, 5, 6]])
    approx = np.array([[3, 9, 1], [6, 5, -1]])
    assert recall_at_k(approx, exact) == pytest.approx(4 / 6)
    assert recall_at_k(approx, exact, k=1) == pytest.approx(0 / 2)
    assert recall_at_k(approx, exact, k=2) == pytest.approx(1 / 4)
    assert recall_at_k(exact, exact) == 1.0
    with pytest.raises(SimilarityError, match="differ in shape"):
        recall_at_k(approx[:1], exact)


def test_index_kinds_and_parameters():
    x = points(2000)
    assert build_index(x, "ivf").nlist == default_nlist(2000) == 45
    assert default_nlist(1000) == 25  # at least 39 points per list
    assert build_index(x, "ivf", nlist=8, nprobe=3).nprobe == 3
    assert build_index(x, "hnsw", m=8, ef_search=20).hnsw.efSearch == 20
    assert build_index(x, "flat", metric="ip").ntotal == 2000
    assert build_index(x, "flat", rows=np.arange(0, 2000, 4)).ntotal == 500
    assert default_pq_m(384) == 48 and default_pq_m(768) == 96 and default_pq_m(100) == 10
    x = points(5000, dim=32)
    assert build_index(x, "ivfpq", nlist=16).pq.M == 4
    assert build_index(x, "ivfpq", nlist=16, pq_m=8).pq.M == 8
    with pytest.raises(SimilarityError, match="pq_m=5 does not divide the dimension 32; choose pq_m = 4"):
        build_index(x, "ivfpq", pq_m=5)
    with pytest.raises(SimilarityError, match="IVF-PQ index needs thousands of points"):
        build_index(points(500), "ivfpq")
    with pytest.raises(SimilarityError, match="index is one of flat, ivf, ivfpq, hnsw"):
        build_index(x, "lsh")
    with pytest.raises(SimilarityError, match="no GPU HNSW"):
        build_index(x, "hnsw", use_gpu=True)


def test_too_many_neighbors_is_an_error():
    with pytest.raises(SimilarityError, match="cannot find 10 neighbors among 9 other points; choose k from 1 to 9"):
        knn(points(10), 10)
    with pytest.raises(SimilarityError, match="cannot find 11 neighbors among 10 points"):
        knn(points(10), 11, queries=points(3, seed=1))
    with pytest.raises(SimilarityError, match="cannot find 4 neighbors among 3 points"):
        knn(points(10), 4, queries=points(3, seed=1), subset=np.arange(3))
    with pytest.raises(SimilarityError, match="cannot find 0 neighbors"):
        knn(points(10), 0)
    assert knn(points(10), 10, queries=points(3, seed=1))[0].shape == (3, 10)
    assert knn(points(10), 10, exclude_self=False)[0].shape == (10, 10)


def with_value(x: np.ndarray, row: int, value: float) -> np.ndarray:
    x = x.copy()
    x[row, 3] = value
    return x


BAD_POINTS = {
    "nan": (with_value(points(50), 7, np.nan), "points hold NaN or infinite values \\(first in row 7\\)"),
    "inf": (with_value(points(50), 9, -np.inf), "NaN or infinite values \\(first in row 9\\)"),
    "one-dimensional": (points(50)[0], "points must be a non-empty \\(N, D\\) array, not \\(16,\\)"),
    "three-dimensional": (points(50).reshape(5, 10, 16), "not \\(5, 10, 16\\)"),
    "empty": (points(50)[:0], "non-empty \\(N, D\\) array, not \\(0, 16\\)"),
    "integers": (np.ones((50, 4), dtype=np.int64), "must hold floats, not int64"),
}


@pytest.mark.parametrize("case", BAD_POINTS, ids=str)
def test_unusable_points_are_a_one_line_error(case):
    x, message = BAD_POINTS[case]
    for search in (lambda: build_index(x, "ivf"), lambda: knn(x, 3, index="hnsw")):
        with pytest.raises(SimilarityError, match=message) as err:
            search()
        assert "\n" not in str(err.value)


def test_unusable_queries_are_a_one_line_error():
    x = points(50)
    with pytest.raises(SimilarityError, match="queries have 8 dimensions but the base points have 16; embed"):
        knn(x, 3, queries=points(4, dim=8))
    with pytest.raises(SimilarityError, match="queries hold NaN or infinite values \\(first in row 2\\)"):
        knn(x, 3, queries=with_value(points(4), 2, np.nan))
    with pytest.raises(SimilarityError, match="queries must be a non-empty \\(N, D\\) array"):
        knn(x, 3, queries=points(4)[0])


@pytest.fixture(scope="module")
def fashion_embeddings() -> np.ndarray:
    """20000 Fashion-MNIST training images as unit rows of a fixed random projection to 96 dims."""
    if not FASHION_TRAIN_IMAGES.is_file():
        pytest.skip("Fashion-MNIST is not installed (apt-get install dataset-fashion-mnist)")
    pixels = read_idx(FASHION_TRAIN_IMAGES)[:20000].reshape(20000, -1).astype(np.float32)
    projection = np.random.default_rng(0).normal(size=(pixels.shape[1], 96)).astype(np.float32)
    x = pixels @ projection
    return x / np.linalg.norm(x, axis=1, keepdims=True)


@pytest.mark.slow
@pytest.mark.parametrize("kind, floor", [("ivf", 0.95), ("hnsw", 0.95), ("ivfpq", 0.8)])
def test_default_approximate_indexes_reach_their_recall_on_image_embeddings(fashion_embeddings, kind, floor):
    """IVF-Flat and HNSW defaults find ≥ 95 % of the exact 10 nearest; IVF-PQ, whose 12 one-byte codes
    compress each 96-d row 32-fold, finds 80 % after re-ranking 100 candidates exactly."""
    exact, _ = knn(fashion_embeddings, 10)
    approx, _ = knn(fashion_embeddings, 10, index=kind)
    assert recall_at_k(approx, exact) >= floor


@pytest.mark.slow
@pytest.mark.parametrize("metric", ["l2", "ip"])
def test_flat_search_equals_torch_topk_on_image_embeddings(fashion_embeddings, metric):
    """Same neighbors as ``torch.topk`` over the full similarity matrix; where the k-th and
    (k+1)-th similarities tie, either id may be listed, so only the similarities are compared there."""
    k, x = 10, fashion_embeddings
    queries = x[np.random.default_rng(1).choice(len(x), 2000, replace=False)]
    ids, _ = knn(x, k, queries=queries, metric=metric)
    database, query_rows = torch.from_numpy(x).double(), torch.from_numpy(queries).double()
    similarity = query_rows @ database.T
    if metric == "l2":  # minus squared distance, up to a per-query constant
        similarity = 2 * similarity - (database ** 2).sum(1)
    top = torch.topk(similarity, k + 1, dim=1)
    picked = torch.gather(similarity, 1, torch.from_numpy(ids))
    torch.testing.assert_close(picked, top.values[:, :k], rtol=0, atol=1e-5)
    clear_cut = (top.values[:, k - 1] - top.values[:, k] > 1e-5).numpy()
    assert clear_cut.mean() > 0.9
    torch_sets = np.sort(top.indices[:, :k].numpy()[clear_cut], axis=1)
    assert np.array_equal(np.sort(ids[clear_cut], axis=1), torch_sets)

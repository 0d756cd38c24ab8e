"""FAISS neighbour lists: exact search equals brute force, self is excluded, approximate recall is high."""

from pathlib import Path

import numpy as np
import pytest
import torch

from repsim.data.sources import read_idx
from repsim.errors import SimilarityError
from repsim.similarity.neighbours import (build_index, default_nlist, load_neighbours, nearest_neighbours,
                                          recall_at_k, save_neighbours)


FASHION_TRAIN_IMAGES = Path("/usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz")


def points(n: int, dim: int = 16, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).normal(size=(n, dim)).astype(np.float32)


def brute_force(x: np.ndarray, queries: np.ndarray, metric: str) -> np.ndarray:
    """(Q, N) float64 distances: squared L2, or negated inner product, so smaller is nearer."""
    x, queries = x.astype(np.float64), queries.astype(np.float64)
    if metric == "ip":
        return -queries @ x.T
    return (queries ** 2).sum(1)[:, None] - 2 * queries @ x.T + (x ** 2).sum(1)[None, :]


def assert_same_neighbours(ids, distances, reference, k):
    """``ids`` are a valid top-k of ``reference`` rows: their distances equal the k smallest, so
    ties may be broken either way."""
    picked = np.take_along_axis(reference, ids, axis=1)
    np.testing.assert_allclose(picked, np.sort(reference, axis=1)[:, :k], rtol=1e-4, atol=1e-3)
    assert np.all(np.diff(picked, axis=1) >= -1e-3)
    assert all(len(set(row)) == k for row in ids)


@pytest.mark.parametrize("metric", ["l2", "ip"])
def test_flat_search_equals_brute_force(metric):
    x, queries = points(400), points(50, seed=1)
    ids, distances = nearest_neighbours(x, 7, metric=metric, query=queries)
    assert ids.shape == distances.shape == (50, 7) and ids.dtype == np.int64 and distances.dtype == np.float32
    reference = brute_force(x, queries, metric)
    assert_same_neighbours(ids, distances, reference, 7)
    sign = -1 if metric == "ip" else 1
    np.testing.assert_allclose(sign * distances, np.sort(reference, axis=1)[:, :7], rtol=1e-4, atol=1e-3)


def test_exclude_self_drops_each_points_own_id():
    x = points(300)
    ids, _ = nearest_neighbours(x, 5, batch_size=64)
    assert not np.any(ids == np.arange(300)[:, None])
    reference = brute_force(x, x, "l2")
    np.fill_diagonal(reference, np.inf)
    assert_same_neighbours(ids, None, reference, 5)
    with_self, _ = nearest_neighbours(x, 5, exclude_self=False)
    assert np.array_equal(with_self[:, 0], np.arange(300))


def test_exact_duplicates_stay_neighbours_of_each_other():
    base = points(50)
    x = np.concatenate([base, base[:10], base[:10], base[:10]])  # points 0..9 appear four times
    ids, distances = nearest_neighbours(x, 3)
    for row in list(range(10)) + list(range(50, 80)):
        original = row if row < 50 else (row - 50) % 10
        assert set(ids[row]) == {original, original + 50, original + 60, original + 70} - {row}
        np.testing.assert_allclose(distances[row], 0, atol=1e-4)
    assert not np.any(ids == np.arange(80)[:, None])


def test_a_point_with_more_copies_than_k_lists_only_other_copies():
    x = np.concatenate([np.repeat(points(1), 6, axis=0), points(20, seed=1)])
    ids, distances = nearest_neighbours(x, 2)
    for row in range(6):
        assert set(ids[row]) <= set(range(6)) - {row} and len(set(ids[row])) == 2
        np.testing.assert_allclose(distances[row], 0, atol=1e-4)


@pytest.mark.parametrize("kind, options", [("hnsw", {"m": 16, "ef_search": 64}),
                                           ("ivf", {"nlist": 32, "nprobe": 12})])
def test_approximate_indexes_recall_most_exact_neighbours(kind, options):
    x = points(4000)
    exact, _ = nearest_neighbours(x, 10)
    approx, _ = nearest_neighbours(x, 10, kind=kind, **options)
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
    with pytest.raises(SimilarityError, match="kind is one of flat, ivf, hnsw"):
        build_index(x, "lsh")
    with pytest.raises(SimilarityError, match="no GPU HNSW"):
        build_index(x, "hnsw", use_gpu=True)


def test_too_many_neighbours_is_an_error():
    with pytest.raises(SimilarityError, match="cannot find 10 neighbours among 9 other points; choose k from 1 to 9"):
        nearest_neighbours(points(10), 10)
    with pytest.raises(SimilarityError, match="cannot find 11 neighbours among 10 points"):
        nearest_neighbours(points(10), 11, query=points(3, seed=1))
    with pytest.raises(SimilarityError, match="cannot find 0 neighbours"):
        nearest_neighbours(points(10), 0)
    assert nearest_neighbours(points(10), 10, query=points(3, seed=1))[0].shape == (3, 10)
    assert nearest_neighbours(points(10), 10, exclude_self=False)[0].shape == (10, 10)


def with_value(x: np.ndarray, row: int, value: float) -> np.ndarray:
    x = x.copy()
    x[row, 3] = value
    return x


BAD_POINTS = {
    "nan": (with_value(points(50), 7, np.nan), "vectors hold NaN or infinite values in 1 rows \\(first: row 7\\)"),
    "inf": (with_value(points(50), 9, -np.inf), "NaN or infinite values in 1 rows \\(first: row 9\\)"),
    "one-dimensional": (points(50)[0], "vectors must be \\(N, D\\), not \\(16,\\)"),
    "three-dimensional": (points(50).reshape(5, 10, 16), "must be \\(N, D\\), not \\(5, 10, 16\\)"),
}


@pytest.mark.parametrize("case", BAD_POINTS, ids=str)
def test_unusable_points_are_a_one_line_error(case):
    x, message = BAD_POINTS[case]
    for search in (lambda: build_index(x, "ivf"), lambda: nearest_neighbours(x, 3, kind="hnsw")):
        with pytest.raises(SimilarityError, match=message) as err:
            search()
        assert "\n" not in str(err.value)


def test_unusable_queries_are_a_one_line_error():
    x = points(50)
    with pytest.raises(SimilarityError, match="queries have 8 dimensions but the indexed points have 16; embed"):
        nearest_neighbours(x, 3, query=points(4, dim=8))
    with pytest.raises(SimilarityError, match="queries hold NaN or infinite values in 1 rows \\(first: row 2\\)"):
        nearest_neighbours(x, 3, query=with_value(points(4), 2, np.nan))
    with pytest.raises(SimilarityError, match="queries must be \\(N, D\\)"):
        nearest_neighbours(x, 3, query=points(4)[0])


def test_neighbour_lists_round_trip_through_npy(tmp_path):
    ids, distances = nearest_neighbours(points(100), 4)
    save_neighbours(tmp_path / "knn", ids, distances)
    loaded_ids, loaded_distances = load_neighbours(tmp_path / "knn")
    assert np.array_equal(loaded_ids, ids) and np.array_equal(loaded_distances, distances)
    assert loaded_ids.dtype == np.int64 and loaded_distances.dtype == np.float32
    with pytest.raises(SimilarityError, match="holds no neighbour list"):
        load_neighbours(tmp_path / "elsewhere")


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
@pytest.mark.parametrize("kind", ["ivf", "hnsw"])
def test_default_approximate_indexes_reach_recall_095_on_image_embeddings(fashion_embeddings, kind):
    exact, _ = nearest_neighbours(fashion_embeddings, 10, metric="ip")
    approx, _ = nearest_neighbours(fashion_embeddings, 10, kind=kind, metric="ip")
    assert recall_at_k(approx, exact) >= 0.95


@pytest.mark.slow
@pytest.mark.parametrize("metric", ["l2", "ip"])
def test_flat_search_equals_torch_topk_on_image_embeddings(fashion_embeddings, metric):
    """Same neighbours as ``torch.topk`` over the full similarity matrix; where the k-th and
    (k+1)-th similarities tie, either id may be listed, so only the similarities are compared there."""
    k, x = 10, fashion_embeddings
    queries = x[np.random.default_rng(1).choice(len(x), 2000, replace=False)]
    ids, _ = nearest_neighbours(x, k, metric=metric, query=queries)
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

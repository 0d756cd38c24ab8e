"""Weighted cosine kNN: equivalence with scikit-learn, chunking invariance, ties and bad input."""

import gzip
from pathlib import Path

import numpy as np
import pytest
import torch
from sklearn.neighbors import KNeighborsClassifier

from bounded import largest_allocation, memory_mapped
from repsim.errors import EvalError, RepsimError
from repsim.eval import cosine_top_k, knn_accuracy, knn_predict, knn_rankings, top_k_accuracy

FASHION = Path("/usr/share/datasets/fashion-mnist")
T = 0.07


def _read_idx(path: Path) -> np.ndarray:
    """A gzip'd uint8 IDX file: magic (0, 0, 8, ndim), ndim big-endian uint32 sizes, then the data."""
    data = gzip.decompress(path.read_bytes())
    assert data[:3] == b"\x00\x00\x08", f"{path} is not a uint8 IDX file"
    shape = np.frombuffer(data, ">u4", count=data[3], offset=4)
    return np.frombuffer(data, np.uint8, offset=4 + 4 * data[3]).reshape(shape)


def _fashion(split: str, count: int) -> tuple[np.ndarray, np.ndarray]:
    """The first ``count`` Fashion-MNIST images of a split as raw pixels (count, 784) float64, with labels."""
    images = _read_idx(FASHION / f"{split}-images-idx3-ubyte.gz")[:count]
    labels = _read_idx(FASHION / f"{split}-labels-idx1-ubyte.gz")[:count]
    return images.reshape(count, -1).astype(np.float64), labels.astype(np.int64)


@pytest.fixture(scope="module")
def fashion():
    if not FASHION.is_dir():
        pytest.skip("Fashion-MNIST IDX files are not installed (apt-get install dataset-fashion-mnist)")
    return (*_fashion("train", 5000), *_fashion("t10k", 1000))


def _sklearn_knn(train_x, train_y, k):
    weights = lambda distance: np.exp((1 - distance) / T)  # noqa: E731  1 - cosine distance = similarity
    return KNeighborsClassifier(n_neighbors=k, metric="cosine", weights=weights, algorithm="brute").fit(train_x, train_y)


@pytest.mark.parametrize("k", [1, 10, 20, 200])
def test_predictions_and_top5_rankings_equal_sklearn_on_fashion_mnist(fashion, k):
    train_x, train_y, test_x, _ = fashion
    reference = _sklearn_knn(train_x, train_y, k)
    ours = knn_rankings(train_x, train_y, test_x, k, temperature=T, dtype=torch.float64, device="cpu")[k]
    np.testing.assert_array_equal(ours[:, 0], reference.predict(test_x))
    # predict_proba is the normalised vote; a stable sort breaks vote ties to the lower class, as ours does.
    np.testing.assert_array_equal(ours, np.argsort(-reference.predict_proba(test_x), axis=1, kind="stable")[:, :5])


def test_accuracy_is_the_fraction_of_correct_rankings(fashion):
    train_x, train_y, test_x, test_y = fashion
    metrics = knn_accuracy(train_x, train_y, test_x, test_y, k=(10, 20), dtype=torch.float64, device="cpu")
    assert set(metrics) == {"knn_top1_k10", "knn_top5_k10", "knn_top1_k20", "knn_top5_k20"}
    rankings = knn_rankings(train_x, train_y, test_x, 20, dtype=torch.float64, device="cpu")[20]
    assert metrics["knn_top1_k20"] == np.mean(rankings[:, 0] == test_y)
    assert metrics["knn_top5_k20"] == np.mean((rankings == test_y[:, None]).any(axis=1))
    assert 0.75 < metrics["knn_top1_k20"] < metrics["knn_top5_k20"] <= 1  # raw pixels: about 0.8 on this slice


@pytest.mark.parametrize(("chunk_size", "train_chunk_size"), [(1, 5000), (32, 1234), (60, 150), (13, 97)])
def test_chunking_changes_nothing(fashion, chunk_size, train_chunk_size):
    train_x, train_y, test_x, _ = fashion
    test_x = test_x[:60]
    whole = knn_rankings(train_x, train_y, test_x, (10, 200), dtype=torch.float64, device="cpu",
                         chunk_size=len(test_x), train_chunk_size=len(train_x))
    chunked = knn_rankings(train_x, train_y, test_x, (10, 200), dtype=torch.float64, device="cpu",
                           chunk_size=chunk_size, train_chunk_size=train_chunk_size)
    for k in whole:
        np.testing.assert_array_equal(chunked[k], whole[k])


def test_memory_mapped_training_features_are_read_a_chunk_at_a_time(fashion, tmp_path, monkeypatch):
    train_x, train_y, test_x, _ = fashion
    monkeypatch.setattr("repsim._checks.CHECK_ROWS", 500)
    train = memory_mapped(np.asarray(train_x, dtype=np.float32), tmp_path / "train.npy")
    test_x = test_x[:100]
    expected = knn_rankings(train_x, train_y, test_x, 20, device="cpu")
    found = {}
    largest = largest_allocation(lambda: found.update(
        knn_rankings(train, train_y, test_x, 20, device="cpu", chunk_size=50, train_chunk_size=500)))
    assert largest <= train.nbytes / 8  # no normalised copy of the training features
    np.testing.assert_array_equal(found[20], expected[20])


def test_several_k_in_one_pass_equal_separate_calls(fashion):
    train_x, train_y, test_x, _ = fashion
    together = knn_predict(train_x, train_y, test_x, (200, 1, 20), dtype=torch.float64, device="cpu")
    assert list(together) == [1, 20, 200]
    for k, predictions in together.items():
        alone = knn_predict(train_x, train_y, test_x, k, dtype=torch.float64, device="cpu")
        np.testing.assert_array_equal(predictions, alone[k])


def test_neighbors_equal_a_brute_force_ranking_excluding_self():
    rng = np.random.default_rng(0)
    points = np.round(rng.normal(size=(60, 3)), 1)  # coarse values: exact ties in similarity occur
    points[10] = points[3]
    unit = points / np.linalg.norm(points, axis=1, keepdims=True)
    similarity = unit @ unit.T
    np.fill_diagonal(similarity, -np.inf)
    expected = np.lexsort((np.broadcast_to(np.arange(60), (60, 60)), -similarity), axis=1)[:, :9]
    chunks = list(cosine_top_k(points, points, 9, exclude_self=True, chunk_size=7, key_chunk_size=11,
                               dtype=torch.float64, device="cpu"))
    np.testing.assert_array_equal(torch.cat([c.indices for c in chunks]).numpy(), expected)
    np.testing.assert_allclose(torch.cat([c.scores for c in chunks]).numpy(),
                               np.take_along_axis(similarity, expected, axis=1))


def test_rankings_equal_a_numpy_vote_over_brute_force_neighbors_with_ties():
    """The weighted vote of brute-force neighbors, ties to the lower training row and then to the lower class."""
    rng = np.random.default_rng(1)
    signs = rng.choice([-1.0, 1.0], size=(110, 16))  # ±1 rows of norm 4: exact, often tied similarities
    train_x, test_x = signs[:80], np.concatenate([signs[:6], signs[80:]])  # six test rows are training rows
    train_x[40:46] = train_x[:6]  # duplicates with other labels: tied neighbors and, at small k, tied votes
    train_y = rng.integers(0, 4, size=80)
    similarity = test_x @ train_x.T / 16
    order = np.lexsort((np.broadcast_to(np.arange(80), similarity.shape), -similarity), axis=1)
    for k in (1, 2, 7, 30):
        near = order[:, :k]
        nearest_similarity = np.take_along_axis(similarity, near, axis=1)
        votes = np.zeros((len(test_x), 4))
        np.add.at(votes, (np.arange(len(test_x))[:, None], train_y[near]), np.exp((nearest_similarity - 1) / T))
        expected = np.argsort(-votes, axis=1, kind="stable")[:, :4]
        ours = knn_rankings(train_x, train_y, test_x, k, temperature=T, chunk_size=7, train_chunk_size=9,
                            dtype=torch.float64, device="cpu")[k]
        np.testing.assert_array_equal(ours, expected)


def test_ties_go_to_the_lower_training_row_and_the_lower_class():
    train_x = np.array([[1.0, 0.0], [2.0, 0.0], [0.0, 1.0], [0.0, 3.0]])
    train_y = np.array([2, 1, 0, 3])
    query = np.array([[1.0, 0.0], [1.0, 1.0]])
    for train_chunk_size in (1, 2, 4):
        predictions = knn_predict(train_x, train_y, query, (1, 2, 4), train_chunk_size=train_chunk_size, device="cpu")
        assert predictions[1].tolist() == [2, 2]  # equally similar rows: row 0 (class 2) comes first
        assert predictions[2].tolist() == [1, 1]  # rows 0 and 1: classes 2 and 1 tie on votes, the lower wins
        assert predictions[4].tolist() == [1, 0]  # query 1 is equally similar to all four rows: class 0 wins


def test_huge_similarity_over_temperature_does_not_overflow():
    train_x = np.array([[1.0, 0.0], [0.9, 0.1], [0.0, 1.0]])
    predictions = knn_rankings(train_x, [0, 1, 1], [[1.0, 0.05]], 3, temperature=1e-3, device="cpu")
    assert predictions[3].tolist() == [[0, 1]]


def test_top_k_accuracy_counts_hits_within_the_first_columns():
    rankings = np.array([[0, 1, 2], [2, 0, 1], [1, 2, 0]])
    assert top_k_accuracy(rankings, np.array([0, 0, 0]), (1, 2, 3, 9)) == {1: 1 / 3, 2: 2 / 3, 3: 1.0, 9: 1.0}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_gpu_equals_cpu(fashion):
    train_x, train_y, test_x, test_y = fashion
    options = {"k": (10, 200), "dtype": torch.float64, "train_chunk_size": 1234, "chunk_size": 300}
    cpu = knn_rankings(train_x, train_y, test_x, device="cpu", **options)
    gpu = knn_rankings(train_x, train_y, test_x, device="cuda", **options)
    for k in cpu:
        np.testing.assert_array_equal(gpu[k], cpu[k])


GOOD = (np.eye(3), np.array([0, 1, 1]), np.eye(3)[:2], np.array([0, 1]))


@pytest.mark.parametrize(("replace", "message"), [
    ({1: np.array([0, 1])}, "train_y has 2 labels but train_x has 3 rows"),
    ({3: np.array([0, 1, 1])}, "test_y has 3 labels but test_x has 2 rows"),
    ({2: np.array([[np.nan, 0, 0], [1, 0, 0]])}, "test_x has 1 rows with NaN or inf values (first: row 0)"),
    ({0: np.array([[1, 0, 0], [0, np.inf, 0], [0, 0, 1]])}, "train_x has 1 rows with NaN or inf"),
    ({1: np.array([1, 1, 1])}, "train_y holds a single class"),
    ({2: np.zeros((0, 3)), 3: np.zeros(0, dtype=int)}, "test_x is empty"),
    ({0: np.zeros((0, 3)), 1: np.zeros(0, dtype=int)}, "train_x is empty"),
    ({2: np.zeros((2, 3, 1))}, "test_x has shape (2, 3, 1), expected (samples, dims)"),
    ({2: np.eye(2)}, "test_x has 2 dims but train_x has 3"),
    ({1: np.array([0.0, 1.0, 1.0])}, "train_y has dtype torch.float64"),
    ({1: np.array([0, -1, 1])}, "train_y has negative class id -1"),
])
def test_bad_input_fails_with_one_line(replace, message):
    args = [replace.get(i, value) for i, value in enumerate(GOOD)]
    with pytest.raises(EvalError) as caught:
        knn_accuracy(*args, k=1, device="cpu")
    assert message in str(caught.value)
    assert "\n" not in str(caught.value) and "; " in str(caught.value)
    assert isinstance(caught.value, RepsimError)


def test_k_beyond_the_training_set_fails():
    with pytest.raises(EvalError, match="k=4 neighbors asked of 3 searchable samples"):
        knn_predict(*GOOD[:3], k=4, device="cpu")
    with pytest.raises(EvalError, match="k=0 is not a positive int"):
        knn_predict(*GOOD[:3], k=0, device="cpu")

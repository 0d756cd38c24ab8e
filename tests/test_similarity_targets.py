"""Similarity sources: each (B, B) target equals its dense reference, on the caller's device."""

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from repsim.errors import SimilarityError
from repsim.similarity.targets import (ClassMatrixSource, EmbeddingSource, GraphSource, IdentitySource,
                                       LabelSource, load_class_matrix, validate_class_matrix)

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
CLASSES = ["cat", "dog", "sneaker"]
CLASS_MATRIX = np.array([[1.0, 0.8, 0.1], [0.8, 1.0, 0.2], [0.1, 0.2, 1.0]])


def batch(n: int, size: int, device: str, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, n, (size,), generator=generator).to(device)


def assert_target(similarity: torch.Tensor, size: int, device: str) -> None:
    assert similarity.shape == (size, size) and similarity.dtype == torch.float32
    assert similarity.device.type == device
    assert torch.all(similarity.diagonal() == 1)


@pytest.mark.parametrize("device", DEVICES)
def test_class_matrix_source_indexes_rows_and_columns_by_label(device):
    labels = batch(3, 16, device)
    similarity = ClassMatrixSource(CLASS_MATRIX)(batch(1000, 16, device), labels)
    assert_target(similarity, 16, device)
    expected = CLASS_MATRIX[labels.cpu().numpy()][:, labels.cpu().numpy()]
    np.testing.assert_allclose(similarity.cpu().numpy(), expected, atol=1e-7)


@pytest.mark.parametrize("device", DEVICES)
def test_label_source_is_the_supcon_pattern_and_the_identity_class_matrix(device):
    labels = torch.tensor([0, 2, 0, 1, 2], device=device)
    similarity = LabelSource()(torch.arange(5, device=device), labels)
    assert_target(similarity, 5, device)
    assert similarity.cpu().tolist() == [[1, 0, 1, 0, 0], [0, 1, 0, 0, 1], [1, 0, 1, 0, 0],
                                         [0, 0, 0, 1, 0], [0, 1, 0, 0, 1]]
    assert torch.equal(similarity, ClassMatrixSource(np.eye(3))(torch.arange(5, device=device), labels))


@pytest.mark.parametrize("device", DEVICES)
def test_identity_source_is_simclr(device):
    similarity = IdentitySource()(batch(100, 6, device), batch(3, 6, device))
    assert_target(similarity, 6, device)
    assert torch.equal(similarity, torch.eye(6, device=device))


def unit_rows(n: int, dim: int, seed: int = 0) -> np.ndarray:
    rows = np.random.default_rng(seed).normal(size=(n, dim))
    return rows / np.linalg.norm(rows, axis=1, keepdims=True)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("resident", [False, True])
def test_embedding_source_is_the_batch_gram_matrix(device, resident):
    embeddings = unit_rows(500, 16).astype(np.float32)
    indices = batch(500, 32, device)
    similarity = EmbeddingSource(embeddings, resident=resident)(indices, batch(3, 32, device))
    assert_target(similarity, 32, device)
    rows = embeddings[indices.cpu().numpy()].astype(np.float64)
    expected = rows @ rows.T
    np.fill_diagonal(expected, 1.0)
    np.testing.assert_allclose(similarity.cpu().numpy(), expected, atol=1e-5)
    assert similarity.abs().max() <= 1


def test_a_sample_drawn_twice_is_exactly_one_with_itself():
    indices = torch.tensor([3, 5, 3])
    similarity = EmbeddingSource(unit_rows(10, 4).astype(np.float16))(indices, torch.zeros(3, dtype=torch.long))
    assert similarity[0, 2] == similarity[2, 0] == 1.0 and similarity[0, 1] < 1


def test_embedding_source_reads_only_the_batch_rows_of_a_large_memmap(tmp_path):
    n, dim = 200_000, 64
    stored = np.lib.format.open_memmap(tmp_path / "captions.npy", mode="w+", dtype=np.float16, shape=(n, dim))
    for start in range(0, n, 50_000):
        stored[start:start + 50_000] = unit_rows(50_000, dim, seed=start)
    stored.flush()
    source = EmbeddingSource.from_npy(tmp_path / "captions.npy")
    indices = batch(n, 64, "cpu")
    similarity = source(indices, torch.zeros(64, dtype=torch.long))  # N x N float32 would need 160 GB
    rows = np.asarray(stored[indices.numpy()], dtype=np.float64)
    rows /= np.linalg.norm(rows, axis=1, keepdims=True)
    expected = rows @ rows.T
    np.fill_diagonal(expected, 1.0)
    np.testing.assert_allclose(similarity.numpy(), expected, atol=1e-5)


def test_embedding_source_names_a_missing_file(tmp_path):
    with pytest.raises(SimilarityError, match="do not exist"):
        EmbeddingSource.from_npy(tmp_path / "absent.npy")


def random_graph(n: int, pairs: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Distinct unordered pairs (i < j) with similarities in (0, 1]."""
    rng = np.random.default_rng(seed)
    i, j = np.triu_indices(n, k=1)
    chosen = rng.choice(len(i), size=pairs, replace=False)
    return i[chosen], j[chosen], rng.uniform(0.05, 1.0, pairs)


def dense_graph(n, i, j, s) -> np.ndarray:
    dense = np.zeros((n, n))
    dense[i, j] = s
    dense[j, i] = s
    np.fill_diagonal(dense, 1.0)
    return dense


@pytest.mark.parametrize("device", DEVICES)
def test_graph_source_equals_the_dense_symmetric_graph(device):
    n = 60
    i, j, s = random_graph(n, 300)
    flipped = np.arange(len(i)) % 2 == 1  # half the pairs listed as (j, i)
    i_listed, j_listed = np.where(flipped, j, i), np.where(flipped, i, j)
    source = GraphSource(np.append(i_listed, 7), np.append(j_listed, 7), np.append(s, 0.3), n)
    assert source.num_pairs == 300
    indices = torch.cat([torch.arange(n), batch(n, 20, "cpu")]).to(device)
    similarity = source(indices, torch.zeros_like(indices))
    assert_target(similarity, n + 20, device)
    expected = dense_graph(n, i, j, s)[indices.cpu().numpy()][:, indices.cpu().numpy()]
    np.fill_diagonal(expected, 1.0)
    np.testing.assert_allclose(similarity.cpu().numpy(), expected, atol=1e-7)


def test_graph_without_pairs_is_the_identity():
    empty = np.array([], dtype=np.int64)
    similarity = GraphSource(empty, empty, np.array([]), 10)(torch.arange(4), torch.zeros(4, dtype=torch.long))
    assert torch.equal(similarity, torch.eye(4))


def test_graph_pair_listed_twice_must_agree():
    assert GraphSource([1, 2], [2, 1], [0.5, 0.5], 4).num_pairs == 1
    with pytest.raises(SimilarityError, match="twice with different similarities"):
        GraphSource([1, 2], [2, 1], [0.5, 0.6], 4)


@pytest.mark.parametrize("i, j, s, message", [
    ([0, 2], [1, 9], [0.5, 0.5], r"graph row 1: \(i, j\) = \(2, 9\) falls outside 0..3"),
    ([0, 1], [1, 3], [0.5, 1.5], r"graph row 1: s\(i = 1, j = 3\) = 1.5 is outside \[0, 1\]"),
    ([0, 1], [1, 2], [-0.1, 0.5], r"graph row 0: s\(i = 0, j = 1\) = -0.1 is outside \[0, 1\]"),
    ([0], [1], [float("nan")], r"graph row 0: s\(i = 0, j = 1\) is missing or not a number"),
    ([0, 1], [1], [0.5], r"shapes \(2,\), \(1,\), \(1,\)"),
    ([0], [1], [[0.5]], r"shapes \(1,\), \(1,\), \(1, 1\)"),
])
def test_graph_rejects_bad_pairs_naming_the_row(i, j, s, message):
    with pytest.raises(SimilarityError, match=message):
        GraphSource(i, j, s, 4)


def test_graph_file_with_a_non_numeric_similarity_names_its_row(tmp_path):
    path = tmp_path / "graph.csv"
    path.write_text("key_i,key_j,s\na,b,0.5\nb,c,high\n")
    with pytest.raises(SimilarityError, match=r"graph row 1: s\(i = 1, j = 2\) is missing or not a number"):
        GraphSource.from_parquet(path, ["a", "b", "c"])


def test_graph_from_parquet_maps_keys_to_indices(tmp_path):
    keys = [f"sample-{k:03d}" for k in range(30)]
    i, j, s = random_graph(30, 40, seed=1)
    path = tmp_path / "graph.parquet"
    pq.write_table(pa.table({"key_i": [keys[k] for k in i], "key_j": [keys[k] for k in j], "s": s}), path)
    source = GraphSource.from_parquet(path, keys)
    similarity = source(torch.arange(30), torch.zeros(30, dtype=torch.long))
    np.testing.assert_allclose(similarity.numpy(), dense_graph(30, i, j, s), atol=1e-7)


def test_graph_from_parquet_names_unknown_keys_and_missing_columns(tmp_path):
    path = tmp_path / "graph.parquet"
    pq.write_table(pa.table({"key_i": ["a", "zz"], "key_j": ["b", "a"], "s": [0.5, 0.2]}), path)
    with pytest.raises(SimilarityError, match="1 sample key.*zz"):
        GraphSource.from_parquet(path, ["a", "b", "c"])
    pq.write_table(pa.table({"key_i": ["a"], "s": [0.5]}), path)
    with pytest.raises(SimilarityError, match="lacks column.*key_j"):
        GraphSource.from_parquet(path, ["a", "b"])


def write_class_csv(path, rows, columns, values):
    lines = [",".join(["class", *columns])]
    lines += [",".join([row, *map(str, line)]) for row, line in zip(rows, values)]
    path.write_text("\n".join(lines) + "\n")
    return path


def test_class_matrix_csv_is_reordered_to_the_spec_order(tmp_path):
    shuffled = ["sneaker", "cat", "dog"]
    order = [CLASSES.index(name) for name in shuffled]
    path = write_class_csv(tmp_path / "m.csv", shuffled, shuffled, CLASS_MATRIX[order][:, order])
    np.testing.assert_allclose(load_class_matrix(path, CLASSES), CLASS_MATRIX)
    columns_only_shuffled = write_class_csv(tmp_path / "c.csv", CLASSES, shuffled, CLASS_MATRIX[:, order])
    np.testing.assert_allclose(load_class_matrix(columns_only_shuffled, CLASSES), CLASS_MATRIX)


def test_class_matrix_parquet(tmp_path):
    path = tmp_path / "m.parquet"
    pq.write_table(pa.table({"class": CLASSES, **{name: CLASS_MATRIX[:, k] for k, name in enumerate(CLASSES)}}),
                   path)
    matrix = load_class_matrix(path, CLASSES)
    np.testing.assert_allclose(matrix, CLASS_MATRIX)
    assert torch.equal(ClassMatrixSource(matrix)(torch.arange(3), torch.arange(3)),
                       torch.tensor(CLASS_MATRIX, dtype=torch.float32))


@pytest.mark.parametrize("rows, columns, message", [
    (["cat", "dog"], ["cat", "dog"], "missing: sneaker"),
    (["cat", "dog", "sneaker", "horse"], CLASSES + ["horse"], "not in the data spec: horse"),
    (["cat", "dog", "dog"], CLASSES, "repeated: dog"),
])
def test_class_matrix_with_wrong_classes_is_a_one_line_error(tmp_path, rows, columns, message):
    values = np.eye(len(rows), len(columns))
    with pytest.raises(SimilarityError, match=message) as err:
        load_class_matrix(write_class_csv(tmp_path / "m.csv", rows, columns, values), CLASSES)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("change, message", [((0, 1, 0.5), r"not symmetric: \(cat, dog\)"),
                                             ((2, 0, 1.2), r"\(sneaker, cat\) = 1.2 is outside \[0, 1\]"),
                                             ((1, 1, 0.9), "dog with itself is 0.9")])
def test_class_matrix_must_be_symmetric_unit_range_unit_diagonal(change, message):
    row, column, value = change
    matrix = CLASS_MATRIX.copy()
    matrix[row, column] = value
    with pytest.raises(SimilarityError, match=message):
        validate_class_matrix(matrix, CLASSES)


@pytest.mark.parametrize("entry, message", [
    ("high", r"class similarity \(dog, sneaker\) is missing or not a number"),
    ("", r"class similarity \(dog, sneaker\) is missing or not a number"),
    ("nan", r"class similarity \(dog, sneaker\) is missing or not a number"),
    ("-0.2", r"class similarity \(dog, sneaker\) = -0.2 is outside \[0, 1\]"),
])
def test_a_bad_class_matrix_entry_is_one_line_naming_its_row_and_column(tmp_path, entry, message):
    values = CLASS_MATRIX.tolist()
    values[1][2] = entry
    with pytest.raises(SimilarityError, match=message) as err:
        load_class_matrix(write_class_csv(tmp_path / "m.csv", CLASSES, CLASSES, values), CLASSES)
    assert "\n" not in str(err.value)


def test_a_class_matrix_row_missing_a_column_is_one_line(tmp_path):
    values = [row[:2] if name == "dog" else row for name, row in zip(CLASSES, CLASS_MATRIX.tolist())]
    with pytest.raises(SimilarityError, match=r"m.csv is not a readable table \(.*Expected 4 columns, got 3: dog,"):
        load_class_matrix(write_class_csv(tmp_path / "m.csv", CLASSES, CLASSES, values), CLASSES)


def test_validation_makes_near_symmetry_exact():
    matrix = CLASS_MATRIX.copy()
    matrix[0, 1] += 1e-8
    matrix[2, 2] -= 1e-8
    checked = validate_class_matrix(matrix)
    assert np.array_equal(checked, checked.T) and np.all(np.diag(checked) == 1)


@pytest.mark.parametrize("device", DEVICES)
def test_tables_move_to_a_device_once(device):
    source, indices = ClassMatrixSource(np.eye(3)), torch.arange(3, device=device)
    source(indices, indices)
    first = source._matrix
    assert first.device.type == device
    source(indices, indices)
    assert source._matrix is first


def test_a_class_matrix_that_is_not_utf8_or_not_a_file_is_one_line(tmp_path):
    latin = tmp_path / "matrix.csv"
    latin.write_bytes("class,café\ncafé,1\n".encode("latin-1"))
    with pytest.raises(SimilarityError, match=r"matrix\.csv is not a readable table") as raised:
        load_class_matrix(latin, ["café"])
    assert "\n" not in str(raised.value)
    (tmp_path / "folder.csv").mkdir()
    with pytest.raises(SimilarityError, match=r"folder\.csv is not a file; check the path"):
        load_class_matrix(tmp_path / "folder.csv", ["café"])

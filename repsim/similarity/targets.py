"""Target similarities: ``source(indices, labels)`` with (B,) int64 tensors gives the batch's (B, B) float32
target on the device of ``indices``, diagonal exactly 1. Sources keep their tables on the host until first
called, then move them to the calling device once.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch

from repsim.errors import SimilarityError

TOLERANCE = 1e-6
GRAPH_COLUMNS = ("key_i", "key_j", "s")


class SimilaritySource(ABC):
    """Maps a batch to its target similarity: (B,) int64 sample indices and class ids -> (B, B) float32 on
    ``indices.device``, diagonal 1."""

    @abstractmethod
    def __call__(self, indices: torch.Tensor, labels: torch.Tensor) -> torch.Tensor: ...


class ClassMatrixSource(SimilaritySource):
    """``matrix[labels][:, labels]`` for a (C, C) class similarity (symmetric, in [0, 1], diagonal 1)."""

    def __init__(self, matrix: np.ndarray | torch.Tensor, class_names: Sequence[str] | None = None):
        checked = validate_class_matrix(torch.as_tensor(matrix).detach().cpu().double().numpy(), class_names)
        self.num_classes = len(checked)
        self._matrix = torch.from_numpy(checked).float()

    def __call__(self, indices: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        labels, self._matrix = labels.to(indices.device), self._matrix.to(indices.device)
        return self._matrix[labels[:, None], labels[None, :]]


class LabelSource(SimilaritySource):
    """1 where two samples share a label, else 0: the same as ``ClassMatrixSource(eye(C))``, computed
    by comparing labels, so it needs no class count."""

    def __call__(self, indices: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        labels = labels.to(indices.device)
        return (labels[:, None] == labels[None, :]).float()


class IdentitySource(SimilaritySource):
    """The (B, B) identity: every batch place is similar only to itself, as in SimCLR."""

    def __call__(self, indices: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return torch.eye(len(indices), device=indices.device)


class EmbeddingSource(SimilaritySource):
    """Cosine similarity ``E_b E_bᵀ`` of the batch's rows of ``embeddings`` (N, D), e.g. a memory-mapped
    float16 ``.npy``: rows re-normalised, products clamped to [-1, 1], a sample with itself exactly 1.
    Raw cosines, as X-CLR uses them (its ``softmax(s / τ_s)`` is shift-invariant). ``resident=True``
    copies the table to the device once (N x D device memory); else rows are gathered on the host."""

    def __init__(self, embeddings: np.ndarray, resident: bool = False):
        if embeddings.ndim != 2:
            raise SimilarityError(f"sample embeddings must be (N, D), not {tuple(embeddings.shape)}",
                                  "store one embedding row per sample")
        self.num_samples = len(embeddings)
        self._embeddings = torch.from_numpy(np.array(embeddings)) if resident else embeddings

    @classmethod
    def from_npy(cls, path: str | Path, resident: bool = False) -> EmbeddingSource:
        """Open an (N, D) ``.npy`` memory-mapped (nothing is read until a batch asks for rows)."""
        if not Path(path).is_file():
            raise SimilarityError(f"sample embeddings {path} do not exist", "run the caption embedding stage")
        return cls(np.load(path, mmap_mode="r"), resident=resident)

    def __call__(self, indices: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        if isinstance(self._embeddings, torch.Tensor):
            self._embeddings = self._embeddings.to(indices.device)
            rows = self._embeddings[indices]
        else:
            rows = torch.from_numpy(self._embeddings[indices.cpu().numpy()]).to(indices.device)
        rows = torch.nn.functional.normalize(rows.float(), dim=1)
        return _one_for_same_sample(indices, (rows @ rows.T).clamp_(-1.0, 1.0))


class GraphSource(SimilaritySource):
    """A sparse symmetric sample graph: s(i, j) for listed pairs, 0 for other pairs, 1 for a sample with
    itself. Pairs are stored both ways as sorted codes ``i * N + j``, looked up with one ``searchsorted``."""

    def __init__(self, i: np.ndarray, j: np.ndarray, s: np.ndarray, num_samples: int):
        i, j = np.asarray(i, dtype=np.int64), np.asarray(j, dtype=np.int64)
        s = np.asarray(s, dtype=np.float64)
        _check_graph(i, j, s, num_samples)
        apart = i != j  # self pairs are 1 by definition
        codes = np.concatenate([i[apart] * num_samples + j[apart], j[apart] * num_samples + i[apart]])
        values = np.concatenate([s[apart], s[apart]])
        codes, first, group = np.unique(codes, return_index=True, return_inverse=True)  # sorted
        if not np.allclose(values, values[first][group], atol=TOLERANCE, rtol=0):
            raise SimilarityError("the graph lists a pair twice with different similarities",
                                  "keep one s per unordered pair (i, j)")
        values = values[first]
        # A last code above every real one (N * N) with value 0 keeps each lookup inside the table.
        self.num_samples = num_samples
        self.num_pairs = len(codes) // 2
        self._codes = torch.from_numpy(np.append(codes, num_samples * num_samples))
        self._values = torch.from_numpy(np.append(values, 0.0)).float()

    @classmethod
    def from_parquet(cls, path: str | Path, keys: Sequence[str]) -> GraphSource:
        """Read a graph with columns ``key_i, key_j, s``; ``keys`` (N,) gives each sample's key in
        index order (e.g. the manifest's key column)."""
        table = _read_table(Path(path))
        absent = [name for name in GRAPH_COLUMNS if name not in table.column_names]
        if absent:
            raise SimilarityError(f"{path} lacks column(s) {', '.join(absent)}",
                                  f"a sample graph has columns {', '.join(GRAPH_COLUMNS)}")
        key_set = pc.cast(pa.array(keys), pa.string())
        if pc.count_distinct(key_set).as_py() != len(key_set):
            raise SimilarityError("the sample keys given for the graph repeat", "pass each sample's key once")
        i, j = (_key_indices(table[column], key_set, path) for column in ("key_i", "key_j"))
        return cls(i, j, _numbers(table["s"]), len(key_set))

    def __call__(self, indices: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        self._codes, self._values = self._codes.to(indices.device), self._values.to(indices.device)
        query = indices[:, None] * self.num_samples + indices[None, :]
        found = torch.searchsorted(self._codes, query)
        return _one_for_same_sample(indices, torch.where(self._codes[found] == query, self._values[found], 0.0))


def _one_for_same_sample(indices: torch.Tensor, similarity: torch.Tensor) -> torch.Tensor:
    """(B, B) ``similarity`` with 1 wherever row and column hold the same sample (the diagonal, and
    both places of a sample drawn twice)."""
    return torch.where(indices[:, None] == indices[None, :], 1.0, similarity)


def _check_graph(i: np.ndarray, j: np.ndarray, s: np.ndarray, num_samples: int) -> None:
    """SimilarityError naming the first bad pair (row, i, j) of a graph given as columns i, j, s."""
    if not (i.ndim == j.ndim == s.ndim == 1 and len(i) == len(j) == len(s)):
        raise SimilarityError(f"graph columns i, j, s have shapes {i.shape}, {j.shape}, {s.shape}",
                              "give one i, j and s per pair, as three 1-D columns")
    outside = (np.minimum(i, j) < 0) | (np.maximum(i, j) >= num_samples)
    if outside.any():
        row = int(np.argmax(outside))
        raise SimilarityError(f"graph row {row}: (i, j) = ({i[row]}, {j[row]}) falls outside 0..{num_samples - 1}",
                              "index pairs by sample position")
    unfit = ~((s >= 0) & (s <= 1))
    if unfit.any():
        row = int(np.argmax(unfit))
        raise SimilarityError(f"graph row {row}: s(i = {i[row]}, j = {j[row]}) {_unfit(s[row])}",
                              "give every pair a number in [0, 1]; pairs left out count as 0")


def _unfit(value: float) -> str:
    """Why a similarity outside [0, 1] is refused, for messages."""
    return "is missing or not a number" if np.isnan(value) else f"= {value} is outside [0, 1]"


def _numbers(column: pa.ChunkedArray) -> np.ndarray:
    """A table column as float64; entries that are missing or not numbers become NaN, which the checks
    then refuse by row and column."""
    if pa.types.is_integer(column.type) or pa.types.is_floating(column.type):
        return column.to_numpy(zero_copy_only=False).astype(np.float64)
    return np.array([_float_or_nan(value) for value in column.to_pylist()], dtype=np.float64)


def _float_or_nan(value: object) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        return np.nan


def _key_indices(column: pa.ChunkedArray, key_set: pa.Array, path: str | Path) -> np.ndarray:
    """(P,) int64 position of each key of ``column`` in ``key_set``; unknown keys are an error."""
    found = pc.index_in(pc.cast(column, pa.string()), value_set=key_set)
    if found.null_count:
        unknown = pc.filter(column, pc.is_null(found)).unique().to_pylist()
        raise SimilarityError(f"{path} names {len(unknown)} sample key(s) not in the dataset, e.g. "
                              f"{', '.join(map(str, unknown[:5]))}", "build the graph from the dataset's keys")
    return found.to_numpy().astype(np.int64)


def _read_table(path: Path) -> pa.Table:
    import pyarrow.csv
    import pyarrow.parquet

    if not path.is_file():
        raise SimilarityError(f"{path} {'is not a file' if path.exists() else 'does not exist'}", "check the path")
    readers = {".csv": pyarrow.csv.read_csv, ".parquet": pyarrow.parquet.read_table, ".pq": pyarrow.parquet.read_table}
    if path.suffix not in readers:
        raise SimilarityError(f"{path} is neither .csv nor .parquet", "save it as CSV or Parquet")
    try:
        if path.suffix == ".csv":
            path.read_bytes().decode("utf-8")  # pyarrow decodes names only when they are read
        return readers[path.suffix](path)
    except (pa.ArrowInvalid, OSError, UnicodeDecodeError) as err:
        raise SimilarityError(f"{path} is not a readable table ({err})",
                              "give every row the same columns, in valid CSV or Parquet") from None


def load_class_matrix(path: str | Path, class_names: Sequence[str]) -> np.ndarray:
    """A user's (C, C) float64 class similarity from a CSV or Parquet table, in ``class_names`` order: the
    first column names each row's class, the others are named by class (checked by :func:`validate_class_matrix`)."""
    table = _read_table(Path(path))
    rows = [str(name) for name in table.column(0).to_pylist()]
    for axis, names in (("rows", rows), ("columns", table.column_names[1:])):
        repeated = sorted(name for name, count in Counter(names).items() if count > 1)
        missing = [name for name in class_names if name not in names]
        unknown = sorted(set(names) - set(class_names))
        problems = [f"{label}: {', '.join(found)}" for label, found in
                    (("repeated", repeated), ("missing", missing), ("not in the data spec", unknown)) if found]
        if problems:
            raise SimilarityError(f"the {axis} of {path} do not match the dataset's classes "
                                  f"({'; '.join(problems)})",
                                  "give one row and one column per class, named as in the data spec")
    position = {name: k for k, name in enumerate(rows)}
    order = [position[name] for name in class_names]
    matrix = np.stack([_numbers(table[name])[order] for name in class_names], axis=1)
    return validate_class_matrix(matrix, class_names)


def validate_class_matrix(matrix: np.ndarray, class_names: Sequence[str] | None = None) -> np.ndarray:
    """Check a (C, C) class similarity (numbers in [0, 1], symmetric with a unit diagonal to within 1e-6;
    errors name the classes) and return it exactly symmetric with an exact unit diagonal."""
    matrix = np.asarray(matrix, dtype=np.float64)
    names = list(class_names) if class_names is not None else [str(k) for k in range(len(matrix))]
    if matrix.ndim != 2 or matrix.shape[0] != matrix.shape[1] or len(names) != len(matrix):
        raise SimilarityError(f"a class similarity must be C x C for {len(names)} classes, "
                              f"not {matrix.shape}", "give one row and one column per class")
    unfit = ~((matrix >= 0) & (matrix <= 1))
    if unfit.any():
        r, c = np.argwhere(unfit)[0]
        raise SimilarityError(f"class similarity ({names[r]}, {names[c]}) {_unfit(matrix[r, c])}",
                              "give every pair of classes a number in [0, 1]")
    asymmetry = np.abs(matrix - matrix.T)
    if asymmetry.max(initial=0) > TOLERANCE:
        r, c = np.unravel_index(asymmetry.argmax(), asymmetry.shape)
        raise SimilarityError(f"class similarity is not symmetric: ({names[r]}, {names[c]}) = {matrix[r, c]} "
                              f"but ({names[c]}, {names[r]}) = {matrix[c, r]}", "make s(a, b) equal s(b, a)")
    not_one = np.abs(np.diag(matrix) - 1) > TOLERANCE
    if not_one.any():
        k = int(np.argmax(not_one))
        raise SimilarityError(f"class similarity of {names[k]} with itself is {matrix[k, k]}, not 1",
                              "put 1 on the diagonal")
    symmetric = (matrix + matrix.T) / 2
    np.fill_diagonal(symmetric, 1.0)
    return symmetric

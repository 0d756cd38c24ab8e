"""Input validation, device choice and normalisation shared by the evaluation functions, the figures and
ASIF; every check raises a one-line :class:`~repsim.errors.EvalError` naming the argument and the fix.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable

import numpy as np
import torch
import torch.nn.functional as F

from repsim.device import resolve_device  # noqa: F401  (the eval modules' one device rule)
from repsim.errors import EvalError

ArrayLike = np.ndarray | torch.Tensor
CHECK_ROWS = 65536  # rows checked at a time, so that a memory-mapped array is never copied whole


def _tensor(values: ArrayLike, name: str) -> torch.Tensor:
    if isinstance(values, torch.Tensor):
        return values.detach()
    array = np.asarray(values)
    if array.dtype.kind not in "biuf":
        raise EvalError(f"{name} has dtype {array.dtype}", "pass a numeric array")
    if array.dtype.kind == "u" and array.dtype.itemsize > 1:  # torch lacks most ops on uint16/32/64
        array = array.astype(np.int64)
    with warnings.catch_warnings():  # read-only arrays (np.frombuffer, memmaps) are only ever read here
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return torch.as_tensor(array)


def as_features(values: ArrayLike, name: str) -> torch.Tensor:
    """``values`` as a tensor (N, D) with N >= 1, D >= 1 and only finite entries (no copy if possible,
    checked :data:`CHECK_ROWS` rows at a time)."""
    features = _tensor(values, name)
    if features.ndim != 2:
        raise EvalError(f"{name} has shape {tuple(features.shape)}, expected (samples, dims)",
                        "pass a 2-D array with one row per sample (flatten images first)")
    if features.shape[0] == 0 or features.shape[1] == 0:
        raise EvalError(f"{name} is empty (shape {tuple(features.shape)})", "pass at least one sample with one dimension")
    if features.dtype == torch.bool or features.is_complex():
        raise EvalError(f"{name} has dtype {features.dtype}", "pass real-valued features")
    if features.is_floating_point():
        bad_rows = torch.cat([(~torch.isfinite(chunk)).any(dim=1) for chunk in features.split(CHECK_ROWS)]
                             ).nonzero().flatten()
        if len(bad_rows):
            raise EvalError(f"{name} has {len(bad_rows)} rows with NaN or inf values (first: row {bad_rows[0].item()})",
                            "fix or drop those samples before evaluating")
    return features


def as_labels(values: ArrayLike, count: int, name: str, rows_of: str) -> torch.Tensor:
    """``values`` as int64 class ids (N,) with N == ``count`` (the rows of ``rows_of``), all >= 0."""
    labels = _tensor(values, name)
    if labels.ndim != 1:
        raise EvalError(f"{name} has shape {tuple(labels.shape)}, expected (samples,)", "pass one class id per sample")
    if labels.is_floating_point() or labels.is_complex() or labels.dtype == torch.bool:
        raise EvalError(f"{name} has dtype {labels.dtype}", "pass integer class ids 0..C-1")
    if len(labels) != count:
        raise EvalError(f"{name} has {len(labels)} labels but {rows_of} has {count} rows", "pass one label per row")
    if len(labels) and labels.min() < 0:
        raise EvalError(f"{name} has negative class id {labels.min().item()}", "use class ids 0..C-1")
    return labels.long().cpu()


def check_same_width(first: torch.Tensor, first_name: str, second: torch.Tensor, second_name: str) -> None:
    if first.shape[1] != second.shape[1]:
        raise EvalError(f"{first_name} has {first.shape[1]} dims but {second_name} has {second.shape[1]}",
                        "compare features from the same encoder")


def check_same_rows(first: torch.Tensor, first_name: str, second: torch.Tensor, second_name: str) -> None:
    if first.shape[0] != second.shape[0]:
        raise EvalError(f"{first_name} has {first.shape[0]} rows but {second_name} has {second.shape[0]}",
                        "pass row-aligned pairs (row i of one matches row i of the other)")


def check_several_classes(labels: torch.Tensor, name: str) -> None:
    if len(torch.unique(labels)) < 2:
        raise EvalError(f"{name} holds a single class", "evaluate on data with at least two classes")


def count_classes(labels: torch.Tensor, num_classes: int | None, name: str) -> int:
    """``num_classes``, or max label + 1 when it is None; labels must be below it."""
    largest = int(labels.max()) + 1
    if num_classes is None:
        return largest
    if largest > num_classes:
        raise EvalError(f"{name} has class id {largest - 1} but num_classes={num_classes}",
                        "raise num_classes or leave it unset")
    return num_classes


def as_ks(ks: int | Iterable[int], name: str = "k") -> tuple[int, ...]:
    """One or several positive ints as a sorted tuple without duplicates."""
    values = (ks,) if isinstance(ks, (int, np.integer)) else tuple(ks)
    if not values or any(not isinstance(k, (int, np.integer)) or k < 1 for k in values):
        raise EvalError(f"{name}={ks!r} is not a positive int or a non-empty sequence of them", f"pass e.g. {name}=20")
    return tuple(sorted({int(k) for k in values}))


def check_positive(value: float, name: str) -> None:
    if not value > 0:
        raise EvalError(f"{name}={value!r} must be positive", f"pass a {name} > 0")


def unit_rows(features: torch.Tensor, device: torch.device, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``features`` (N, D) on ``device`` as ``dtype`` with every row L2-normalised (zero rows stay zero)."""
    return F.normalize(features.to(device=device, dtype=dtype), dim=1)

"""Linear probe: agreement with scikit-learn's LogisticRegression, weight-decay selection, split, bad input.

Data: scikit-learn's bundled 8×8 digits (1797 real images, offline). Both sides minimise
mean cross-entropy + wd/2·‖W‖², which is LogisticRegression with C = 1 / (wd · n_train).
"""

import numpy as np
import pytest
import torch
from sklearn.datasets import load_digits
from sklearn.linear_model import LogisticRegression

from bounded import largest_allocation, memory_mapped
from repsim.errors import EvalError
from repsim.eval import linear, linear_probe, stratified_split


@pytest.fixture(scope="module")
def digits():
    x, y = load_digits(return_X_y=True)
    train, test = stratified_split(y, 0.3, seed=1)
    return x[train], y[train], x[test], y[test]


def _standardise(train_x, *others):
    mean, std = train_x.mean(axis=0), train_x.std(axis=0)
    std[std == 0] = 1
    return [(x - mean) / std for x in (train_x, *others)]


def _sklearn_top1(fit_x, fit_y, eval_x, eval_y, weight_decay):
    model = LogisticRegression(C=1 / (weight_decay * len(fit_x)), max_iter=5000, tol=1e-8)
    return model.fit(fit_x, fit_y).score(eval_x, eval_y)


@pytest.mark.parametrize("weight_decay", [1e-3, 1e-2, 1e-1])
def test_top1_matches_sklearn_logistic_regression(digits, weight_decay):
    train_x, train_y, test_x, test_y = digits
    ours = linear_probe(train_x, train_y, test_x, test_y, (weight_decay,), device="cpu")
    assert set(ours) == {"linear_top1", "linear_top5", "linear_weight_decay"}
    assert ours["linear_weight_decay"] == weight_decay
    fit_x, eval_x = _standardise(train_x, test_x)
    reference = _sklearn_top1(fit_x, train_y, eval_x, test_y, weight_decay)
    assert abs(ours["linear_top1"] - reference) <= 0.01
    assert ours["linear_top1"] <= ours["linear_top5"] <= 1


def test_weight_decay_is_chosen_on_a_stratified_held_out_slice(digits):
    train_x, train_y, test_x, test_y = digits
    decays = (1e-4, 1e-2, 1.0)
    ours = linear_probe(train_x, train_y, test_x, test_y, decays, val_fraction=0.2, seed=3, device="cpu")
    kept, held_out = stratified_split(train_y, 0.2, seed=3)
    standardised, = _standardise(train_x)  # standardised with all training rows, as the probe does
    for wd in decays:
        reference = _sklearn_top1(standardised[kept], train_y[kept], standardised[held_out], train_y[held_out], wd)
        assert abs(ours[f"linear_val_top1_wd{wd:g}"] - reference) <= 0.01
    best = max(decays, key=lambda wd: (ours[f"linear_val_top1_wd{wd:g}"], wd))
    assert ours["linear_weight_decay"] == best
    refit = linear_probe(train_x, train_y, test_x, test_y, (best,), device="cpu")
    assert abs(ours["linear_top1"] - refit["linear_top1"]) <= 0.01


def test_adam_reaches_the_lbfgs_accuracy(digits):
    lbfgs = linear_probe(*digits, (1e-2,), solver="lbfgs", device="cpu")
    adam = linear_probe(*digits, (1e-2,), solver="adam", epochs=30, batch_size=64, device="cpu")
    assert abs(adam["linear_top1"] - lbfgs["linear_top1"]) <= 0.02


def test_features_are_read_a_chunk_at_a_time_with_the_same_result(digits, tmp_path, monkeypatch):
    train_x, train_y, test_x, test_y = digits
    features = memory_mapped(np.tile(train_x, (4, 1)).astype(np.float32), tmp_path / "train.npy")  # (5032, 64)
    labels = np.tile(train_y, 4)
    whole = linear_probe(features, labels, test_x, test_y, (1e-3, 1e-2), max_iter=20, device="cpu")
    monkeypatch.setattr(linear, "CHUNK_ROWS", 256)
    monkeypatch.setattr("repsim._checks.CHECK_ROWS", 256)
    chunked = {}
    largest = largest_allocation(lambda: chunked.update(
        linear_probe(features, labels, test_x, test_y, (1e-3, 1e-2), max_iter=20, device="cpu")))
    assert largest <= features.nbytes / 8  # no copy of the standardised features, nor of their 90 % fit slice
    assert chunked["linear_weight_decay"] == whole["linear_weight_decay"]
    assert abs(chunked["linear_top1"] - whole["linear_top1"]) <= 0.01


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("solver", ["lbfgs", "adam"])
def test_gpu_matches_cpu(digits, solver):
    options = {"weight_decays": (1e-2,), "solver": solver, "batch_size": 64}
    cpu = linear_probe(*digits, device="cpu", **options)
    gpu = linear_probe(*digits, device="cuda", **options)
    assert abs(gpu["linear_top1"] - cpu["linear_top1"]) <= 0.01


def test_stratified_split_holds_out_each_class_in_proportion():
    labels = np.repeat([0, 1, 2, 3], [50, 20, 7, 1])
    kept, held_out = stratified_split(labels, 0.2, seed=5)
    assert np.array_equal(np.sort(np.concatenate([kept, held_out])), np.arange(len(labels)))
    assert np.bincount(labels[held_out], minlength=4).tolist() == [10, 4, 1, 0]  # a lone sample is never held out
    again, _ = stratified_split(labels, 0.2, seed=5)
    other, _ = stratified_split(labels, 0.2, seed=6)
    assert np.array_equal(kept, again) and not np.array_equal(kept, other)


GOOD = (np.eye(4), np.array([0, 1, 0, 1]), np.eye(4)[:2], np.array([0, 1]))


@pytest.mark.parametrize(("replace", "options", "message"), [
    ({1: np.array([0, 1, 0])}, {}, "train_y has 3 labels but train_x has 4 rows"),
    ({2: np.array([[0, 0, 0, np.nan], [1, 0, 0, 0]])}, {}, "test_x has 1 rows with NaN or inf"),
    ({1: np.array([2, 2, 2, 2])}, {}, "train_y holds a single class"),
    ({2: np.zeros((0, 4)), 3: np.zeros(0, dtype=int)}, {}, "test_x is empty"),
    ({2: np.eye(3)}, {}, "train_x has 4 dims but test_x has 3"),
    ({}, {"weight_decays": (1e-3, 1e-2)}, "val_fraction=0.1 of 4 training rows holds out nothing"),
    ({}, {"weight_decays": ()}, "weight_decays=() is empty or negative"),
    ({}, {"solver": "sgd"}, "solver='sgd' is unknown"),
])
def test_bad_input_fails_with_one_line(replace, options, message):
    args = [replace.get(i, value) for i, value in enumerate(GOOD)]
    options = {"weight_decays": (1e-3,)} | options
    with pytest.raises(EvalError) as caught:
        linear_probe(*args, device="cpu", **options)
    assert message in str(caught.value) and "\n" not in str(caught.value)

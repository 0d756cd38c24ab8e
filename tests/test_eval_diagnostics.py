"""Embedding diagnostics against closed forms and direct formulas; the PNG figures."""

import math

import numpy as np
import pytest
import torch

from repsim.errors import EvalError
from repsim.eval import alignment, diagnostics, effective_rank, embedding_diagnostics, embedding_std, uniformity
from repsim.eval.diagnostics import mean_cosine
from repsim.plots import confusion_matrix_plot, histogram_plot, tsne_plot

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _unit(x):
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def _orthonormal_columns(rows, dims, seed=0):
    return np.linalg.qr(np.random.default_rng(seed).normal(size=(rows, dims)))[0]


def test_effective_rank_of_isotropic_low_rank_and_random_matrices(monkeypatch):
    monkeypatch.setattr(diagnostics, "ROW_CHUNK", 37)  # exercise the chunked Gram accumulation
    isotropic = 3.0 * _orthonormal_columns(200, 16)
    assert effective_rank(isotropic, device="cpu") == pytest.approx(16, rel=1e-4)
    rank_one = np.outer(np.arange(1.0, 201.0), np.ones(16))
    assert effective_rank(rank_one, device="cpu") == pytest.approx(1, abs=1e-4)
    rank_four = _orthonormal_columns(200, 4) @ _orthonormal_columns(16, 4, seed=1).T
    assert effective_rank(rank_four, device="cpu") == pytest.approx(4, rel=1e-4)
    anisotropic = np.random.default_rng(2).normal(size=(200, 16)) * np.geomspace(1, 0.01, 16)
    singular = np.linalg.svd(anisotropic, compute_uv=False)
    p = singular / singular.sum() + diagnostics.RANKME_EPS
    assert effective_rank(anisotropic, device="cpu") == pytest.approx(math.exp(-np.sum(p * np.log(p))), rel=1e-9)


def test_embedding_std_is_zero_under_collapse_and_about_one_over_sqrt_d_when_spread(monkeypatch):
    monkeypatch.setattr(diagnostics, "ROW_CHUNK", 999)
    assert embedding_std(np.tile([3.0, -1.0, 2.0], (50, 1)), device="cpu") == pytest.approx(0, abs=1e-12)
    spread = np.random.default_rng(0).normal(size=(20000, 64))
    assert embedding_std(spread, device="cpu") == pytest.approx(1 / 8, rel=0.02)
    assert embedding_std(spread, device="cpu") == pytest.approx(_unit(spread).std(axis=0).mean(), rel=1e-9)


def test_mean_cosine_equals_the_mean_over_distinct_pairs_in_chunks(monkeypatch):
    monkeypatch.setattr(diagnostics, "ROW_CHUNK", 7)
    rows = np.random.default_rng(0).normal(size=(50, 16)) + 3.0  # a shared offset: a cone
    cosines = _unit(rows) @ _unit(rows).T
    expected = (cosines.sum() - np.trace(cosines)) / (50 * 49)
    assert mean_cosine(rows, device="cpu") == pytest.approx(expected, rel=1e-12) and expected > 0.85
    assert mean_cosine(np.tile([1.0, 2.0], (5, 1)), device="cpu") == pytest.approx(1.0)
    assert mean_cosine(np.array([[1.0, 0.0], [-1.0, 0.0]]), device="cpu") == pytest.approx(-1.0)


def test_alignment_equals_the_direct_formula():
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(30, 5)), rng.normal(size=(30, 5))
    for alpha in (1, 2, 3):
        expected = np.mean(np.linalg.norm(_unit(x) - _unit(y), axis=1) ** alpha)
        assert alignment(x, y, alpha) == pytest.approx(expected, rel=1e-12)
    assert alignment(x, 2 * x) == pytest.approx(0, abs=1e-12)


def test_uniformity_equals_the_direct_formula(monkeypatch):
    monkeypatch.setattr(diagnostics, "PAIR_CHUNK", 7)
    points = _unit(np.random.default_rng(0).normal(size=(60, 4)))
    i, j = np.triu_indices(60, k=1)
    squared = np.sum((points[i] - points[j]) ** 2, axis=1)
    for t in (1, 2):
        assert uniformity(points, t, device="cpu") == pytest.approx(np.log(np.mean(np.exp(-t * squared))), rel=1e-9)
    collapsed = np.ones((10, 4))
    assert uniformity(collapsed, device="cpu") == pytest.approx(0, abs=1e-12)  # the maximum: all pairs coincide


def test_uniformity_subsamples_with_the_seed():
    points = np.random.default_rng(1).normal(size=(500, 3))
    subset = np.sort(np.random.default_rng(4).choice(500, 100, replace=False))
    assert uniformity(points, max_samples=100, seed=4, device="cpu") == pytest.approx(
        uniformity(points[subset], device="cpu"), rel=1e-12)


def test_embedding_diagnostics_bundles_the_label_free_measures():
    points = np.random.default_rng(0).normal(size=(100, 8))
    assert embedding_diagnostics(points, device="cpu") == {
        "effective_rank": effective_rank(points, device="cpu"), "embedding_std": embedding_std(points, device="cpu"),
        "uniformity": uniformity(points, device="cpu")}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_gpu_matches_cpu():
    points = np.random.default_rng(5).normal(size=(3000, 32)) * np.geomspace(1, 0.1, 32)
    for measure in (effective_rank, embedding_std, uniformity):
        assert measure(points, device="cuda") == pytest.approx(measure(points, device="cpu"), rel=1e-9)


@pytest.mark.parametrize(("call", "message"), [
    (lambda: effective_rank(np.array([[1.0, np.nan]])), "embeddings has 1 rows with NaN"),
    (lambda: embedding_std(np.ones(5)), "embeddings has shape (5,), expected (samples, dims)"),
    (lambda: alignment(np.ones((3, 2)), np.ones((2, 2))), "x has shape (3, 2) but y has (2, 2)"),
    (lambda: uniformity(np.ones((1, 2))), "uniformity needs at least two samples"),
    (lambda: histogram_plot([1.0, np.inf], "unused.png"), "1 not finite"),
    (lambda: confusion_matrix_plot([0, 1], [1], "unused.png"), "predictions has 1 labels but labels has 2 rows"),
])
def test_bad_input_fails_with_one_line(call, message):
    with pytest.raises(EvalError) as caught:
        call()
    assert message in str(caught.value) and "\n" not in str(caught.value)


def test_figures_are_written_as_png(tmp_path):
    rng = np.random.default_rng(0)
    labels = np.repeat(np.arange(3), 100)
    features = rng.normal(size=(300, 60)) + 4 * np.eye(3, 60)[labels]
    paths = [
        tsne_plot(features, labels, tmp_path / "tsne" / "test.png", class_names=["a", "b", "c"], max_points=150),
        confusion_matrix_plot(labels, (labels + (rng.random(300) < 0.2)) % 3, tmp_path / "confusion.png"),
        histogram_plot(rng.normal(size=(20, 20)), tmp_path / "hist.png", title="target similarities"),
    ]
    for path in paths:
        assert path.read_bytes()[:8] == PNG_MAGIC

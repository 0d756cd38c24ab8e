"""ASIF: relative representations over anchors, exact and FAISS-backed."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from repsim.align.asif import ASIF, relative_representation
from repsim.errors import EvalError


def toy_pairs(count: int = 40, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Two unrelated random spaces (16-d and 24-d) holding ``count`` paired points."""
    rng = np.random.default_rng(seed)
    return rng.standard_normal((count, 16)).astype(np.float32), rng.standard_normal((count, 24)).astype(np.float32)


def test_relative_representation_keeps_the_top_k_similarities_to_the_power_p():
    anchors = np.eye(4, dtype=np.float32)
    query = np.array([[0.8, 0.6, -0.1, 0.05]], dtype=np.float32)
    cosines = query / np.linalg.norm(query)
    expected = np.array([[cosines[0, 0] ** 3, cosines[0, 1] ** 3, 0.0, 0.0]])
    expected /= np.linalg.norm(expected)
    relative = relative_representation(query, anchors, k=2, p=3)
    np.testing.assert_allclose(relative.numpy(), expected, rtol=1e-5)


@pytest.mark.parametrize("backend", ["exact", "faiss"])
def test_queries_equal_to_the_anchors_retrieve_their_partners_exactly(backend):
    images, texts = toy_pairs()
    asif = ASIF(images, texts, k=8, p=4, backend=backend)
    scores = asif.scores(images, texts)
    assert scores.shape == (40, 40)
    assert (scores.argmax(dim=1) == torch.arange(40)).all()
    assert (scores.argmax(dim=0) == torch.arange(40)).all()


@pytest.mark.parametrize("backend", ["exact", "faiss"])
def test_relative_representations_equal_brute_force(backend):
    images, _ = toy_pairs(200)
    queries = np.random.default_rng(1).standard_normal((50, 16)).astype(np.float32)
    unit = lambda x: x.astype(np.float64) / np.linalg.norm(x, axis=1, keepdims=True)  # noqa: E731
    cosines = unit(queries) @ unit(images).T
    top = np.argsort(-cosines, axis=1)[:, :20]
    expected = np.zeros_like(cosines)
    np.put_along_axis(expected, top, np.take_along_axis(cosines, top, axis=1).clip(min=0) ** 8, axis=1)
    expected /= np.linalg.norm(expected, axis=1, keepdims=True)
    relative = relative_representation(queries, images, k=20, p=8, backend=backend)
    np.testing.assert_allclose(relative.numpy(), expected, rtol=1e-4, atol=1e-6)


def test_exact_and_faiss_agree():
    images, _ = toy_pairs(200)
    queries = np.random.default_rng(1).standard_normal((50, 16)).astype(np.float32)
    exact, faiss = (relative_representation(queries, images, k=20, p=8, backend=backend) for backend in ("exact", "faiss"))
    torch.testing.assert_close(exact, faiss, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("call, message", [
    (lambda a, b: relative_representation(a[:, :8], a, k=5), "queries has 8 dims but anchors has 16"),
    (lambda a, b: relative_representation(a, a, k=41), "top 41 of 40 anchors"),
    (lambda a, b: relative_representation(a, a, k=5, p=0), "power p is 0"),
    (lambda a, b: ASIF(a, b[:30]), "anchors_a has 40 rows but anchors_b has 30"),
    (lambda a, b: relative_representation(np.where(np.arange(40)[:, None] == 3, np.nan, a), a, k=5),
     "queries has 1 rows with NaN"),
    (lambda a, b: relative_representation(a, a, k=5, backend="annoy"), "unknown ASIF backend 'annoy'"),
])
def test_bad_input_is_one_clear_line(call, message):
    images, texts = toy_pairs()
    with pytest.raises(EvalError, match=message) as raised:
        call(images, texts)
    assert "\n" not in str(raised.value)

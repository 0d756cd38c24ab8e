"""Retrieval recall on constructed rankings and a brute-force reference; mAP@R against numpy."""

import numpy as np
import pytest
import torch

from repsim.errors import EvalError
from repsim.eval import map_at_r, paired_retrieval, retrieval_recall


def _ranked_by(orders: np.ndarray) -> np.ndarray:
    """Queries (N, G) whose cosine similarity to gallery row orders[i, r] (gallery = identity) falls with r."""
    queries = np.zeros(orders.shape)
    np.put_along_axis(queries, orders, np.arange(orders.shape[1], 0, -1, dtype=float), axis=1)
    return queries


def _brute_force_recall(query, gallery, query_ids, gallery_ids, ks):
    """Recall@k by sorting each query's gallery on (similarity descending, row ascending)."""
    unit = lambda x: x / np.linalg.norm(x, axis=1, keepdims=True)  # noqa: E731
    similarity = unit(query) @ unit(gallery).T
    rows = np.broadcast_to(np.arange(len(gallery)), similarity.shape)
    order = np.lexsort((rows, -similarity), axis=1)
    first_match = (gallery_ids[order] == query_ids[:, None]).argmax(axis=1)
    return {k: float(np.mean(first_match < k)) for k in ks}


def test_recall_of_a_known_permutation_of_ranks():
    rng = np.random.default_rng(0)
    orders = np.stack([rng.permutation(50) for _ in range(50)])
    ranks = (orders == np.arange(50)[:, None]).argmax(axis=1)  # where query i's own gallery row lands
    recall = retrieval_recall(_ranked_by(orders), np.eye(50), ks=(1, 5, 10, 50), device="cpu")
    assert recall == {k: float(np.mean(ranks < k)) for k in (1, 5, 10, 50)}
    assert recall[50] == 1.0


def test_paired_retrieval_with_several_captions_per_image_equals_brute_force():
    rng = np.random.default_rng(1)
    images = rng.normal(size=(40, 8))
    text_owner = np.concatenate([np.arange(40), rng.integers(0, 40, size=60)])  # every image has a caption
    texts = images[text_owner] + rng.normal(scale=1.5, size=(100, 8))
    metrics = paired_retrieval(images, texts, (1, 5, 10), text_owner=text_owner, chunk_size=7, device="cpu")
    i2t = _brute_force_recall(images, texts, np.arange(40), text_owner, (1, 5, 10))
    t2i = _brute_force_recall(texts, images, text_owner, np.arange(40), (1, 5, 10))
    assert metrics == {f"i2t_r{k}": v for k, v in i2t.items()} | {f"t2i_r{k}": v for k, v in t2i.items()}
    assert 0 < metrics["t2i_r1"] < metrics["t2i_r10"] < 1


def test_one_to_one_pairs_by_default_and_ties_rank_the_lower_row_first():
    gallery = np.array([[1.0, 0.0], [1.0, 0.0], [0.0, 1.0]])
    query = np.array([[2.0, 0.0], [3.0, 0.0], [0.0, 1.0]])
    # Query 1 ties rows 0 and 1; its match (row 1) ranks second.
    assert retrieval_recall(query, gallery, ks=(1, 2), device="cpu") == {1: 2 / 3, 2: 1.0}
    assert paired_retrieval(gallery, query, ks=1, device="cpu") == {"i2t_r1": 2 / 3, "t2i_r1": 2 / 3}


def _brute_force_map_at_r(embeddings, labels):
    unit = embeddings / np.linalg.norm(embeddings, axis=1, keepdims=True)
    similarity = unit @ unit.T
    np.fill_diagonal(similarity, -np.inf)
    scores = []
    for i in range(len(labels)):
        r = int(np.sum(labels == labels[i])) - 1
        if r == 0:
            continue
        order = np.lexsort((np.arange(len(labels)), -similarity[i]))[:r]
        hits = labels[order] == labels[i]
        scores.append(np.sum(np.cumsum(hits) / np.arange(1, r + 1) * hits) / r)
    return float(np.mean(scores))


@pytest.mark.parametrize("chunk_size", [None, 1, 13])
def test_map_at_r_equals_brute_force(chunk_size):
    rng = np.random.default_rng(2)
    labels = np.concatenate([np.repeat([0, 1, 2, 3], [60, 25, 9, 2]), [4]])  # unbalanced, plus a lone sample
    centres = rng.normal(size=(5, 6))
    embeddings = np.round(centres[labels] + rng.normal(scale=0.9, size=(len(labels), 6)), 1)
    embeddings[7] = embeddings[3]  # an exact duplicate: ties must break by row
    ours = map_at_r(embeddings, labels, chunk_size=chunk_size, device="cpu")
    assert ours == pytest.approx(_brute_force_map_at_r(embeddings, labels), abs=1e-6)
    assert 0.2 < ours < 1


def test_map_at_r_is_one_for_separated_classes():
    embeddings = np.repeat(np.eye(3), [4, 5, 6], axis=0) + 0.01 * np.random.default_rng(3).normal(size=(15, 3))
    assert map_at_r(embeddings, np.repeat([0, 1, 2], [4, 5, 6]), device="cpu") == pytest.approx(1.0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_gpu_equals_cpu():
    rng = np.random.default_rng(4)
    labels = rng.integers(0, 7, size=500)
    embeddings = rng.normal(size=(7, 16))[labels] + rng.normal(scale=2.0, size=(500, 16))
    texts = embeddings + rng.normal(size=(500, 16))
    for device in ("cpu", "cuda"):
        assert map_at_r(embeddings, labels, device=device, dtype=torch.float64) == pytest.approx(
            _brute_force_map_at_r(embeddings, labels), abs=1e-9)
    assert paired_retrieval(embeddings, texts, device="cuda") == pytest.approx(
        paired_retrieval(embeddings, texts, device="cpu"), abs=1 / 500)


@pytest.mark.parametrize(("call", "message"), [
    (lambda: retrieval_recall(np.eye(3), np.eye(3)[:2]), "query has 3 rows but gallery has 2"),
    (lambda: retrieval_recall(np.eye(3), np.eye(3), query_ids=[0, 1, 5]), "1 queries match no gallery row"),
    (lambda: retrieval_recall(np.eye(3), np.eye(3), ks=(0,)), "ks=(0,) is not a positive int"),
    (lambda: paired_retrieval(np.eye(3), np.eye(3), text_owner=[0, 1]), "gallery_ids has 2 labels but gallery has 3"),
    (lambda: paired_retrieval(np.eye(3), np.eye(3), text_owner=[0, 1, 1]), "first: row 2, id 2"),
    (lambda: paired_retrieval(np.eye(3), np.full((3, 3), np.nan)), "text_embeddings has 3 rows with NaN"),
    (lambda: map_at_r(np.eye(3), [0, 1, 2]), "every class in labels has a single sample"),
    (lambda: map_at_r(np.eye(3), [0, 1]), "labels has 2 labels but embeddings has 3 rows"),
])
def test_bad_input_fails_with_one_line(call, message):
    with pytest.raises(EvalError) as caught:
        call()
    assert message in str(caught.value) and "\n" not in str(caught.value)

"""Retrieval on cosine similarity (ties to the lower gallery row): cross-modal recall@k, the fraction of
queries with a match in their first k, and mAP@R (Musgrave et al. 2020), fractions in [0, 1]."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from repsim.errors import EvalError
from repsim._checks import (ArrayLike, as_features, as_ks, as_labels, check_same_rows, check_same_width,
                                 resolve_device, unit_rows)
from repsim.eval.knn import QUERY_CHUNK, cosine_top_k

SIMILARITY_BUDGET = 2**25  # similarities held at once when the chunk size is chosen automatically


def retrieval_recall(query: ArrayLike, gallery: ArrayLike, ks: int | Iterable[int] = (1, 5, 10), *,
                     query_ids: ArrayLike | None = None, gallery_ids: ArrayLike | None = None,
                     chunk_size: int | None = None, device: str | torch.device | None = None) -> dict[int, float]:
    """Per k: the fraction of queries (Nq, D) with a matching gallery row (Ng, D) among their top k; query i
    matches row j when ``query_ids[i] == gallery_ids[j]``, ids defaulting to row numbers (then Nq == Ng)."""
    ks = as_ks(ks, "ks")
    query, gallery = as_features(query, "query"), as_features(gallery, "gallery")
    check_same_width(query, "query", gallery, "gallery")
    query_ids, gallery_ids = _match_ids(query, gallery, query_ids, gallery_ids)
    ranks = _first_match_ranks(query, gallery, query_ids, gallery_ids, chunk_size, resolve_device(device))
    return {k: float((ranks < k).double().mean()) for k in ks}


def paired_retrieval(image_embeddings: ArrayLike, text_embeddings: ArrayLike, ks: int | Iterable[int] = (1, 5, 10), *,
                     text_owner: ArrayLike | None = None, chunk_size: int | None = None,
                     device: str | torch.device | None = None) -> dict[str, float]:
    """Image→text and text→image recall ``{"i2t_r1": ..., "t2i_r1": ..., ...}`` of images (Ni, D) and texts
    (Nt, D); ``text_owner[t]`` is the image row of text t (default: t)."""
    images = as_features(image_embeddings, "image_embeddings")
    texts = as_features(text_embeddings, "text_embeddings")
    if text_owner is None:
        check_same_rows(images, "image_embeddings", texts, "text_embeddings")
        text_owner = torch.arange(len(texts))
    image_ids = torch.arange(len(images))
    options = {"chunk_size": chunk_size, "device": device}
    i2t = retrieval_recall(images, texts, ks, query_ids=image_ids, gallery_ids=text_owner, **options)
    t2i = retrieval_recall(texts, images, ks, query_ids=text_owner, gallery_ids=image_ids, **options)
    return {f"i2t_r{k}": v for k, v in i2t.items()} | {f"t2i_r{k}": v for k, v in t2i.items()}


def _match_ids(query: torch.Tensor, gallery: torch.Tensor, query_ids: ArrayLike | None,
               gallery_ids: ArrayLike | None) -> tuple[torch.Tensor, torch.Tensor]:
    if query_ids is None and gallery_ids is None:
        check_same_rows(query, "query", gallery, "gallery")
    query_ids = as_labels(torch.arange(len(query)) if query_ids is None else query_ids, len(query),
                          "query_ids", "query")
    gallery_ids = as_labels(torch.arange(len(gallery)) if gallery_ids is None else gallery_ids, len(gallery),
                            "gallery_ids", "gallery")
    unmatched = (~torch.isin(query_ids, gallery_ids)).nonzero().flatten()
    if len(unmatched):
        row = unmatched[0].item()
        raise EvalError(f"{len(unmatched)} queries match no gallery row (first: row {row}, id {query_ids[row].item()})",
                        "give every query at least one gallery item with its id")
    return query_ids, gallery_ids


def _first_match_ranks(query: torch.Tensor, gallery: torch.Tensor, query_ids: torch.Tensor,
                       gallery_ids: torch.Tensor, chunk_size: int | None, device: torch.device) -> torch.Tensor:
    """Per query (Nq,): how many gallery rows rank ahead of its best-ranked match."""
    gallery, gallery_ids = unit_rows(gallery, device), gallery_ids.to(device)
    columns = torch.arange(len(gallery), device=device)
    chunk_size = chunk_size or max(1, SIMILARITY_BUDGET // len(gallery))
    ranks = []
    for start in range(0, len(query), chunk_size):
        similarities = unit_rows(query[start:start + chunk_size], device) @ gallery.T
        matches = query_ids[start:start + chunk_size, None].to(device) == gallery_ids
        best = similarities.masked_fill(~matches, float("-inf")).max(dim=1, keepdim=True).values
        first = (matches & (similarities == best)).int().argmax(dim=1, keepdim=True)
        ahead = (similarities > best) | ((similarities == best) & (columns < first))
        ranks.append(ahead.sum(dim=1).cpu())
    return torch.cat(ranks)


def map_at_r(embeddings: ArrayLike, labels: ArrayLike, *, chunk_size: int | None = None,
             device: str | torch.device | None = None, dtype: torch.dtype = torch.float32) -> float:
    """Mean average precision at R over embeddings (N, D) with labels (N,): each sample queries all others,
    R = the other samples of its class, AP@R = (1/R) Σ_{i≤R} precision@i · [i-th is of its class]; R = 0 left out."""
    embeddings = as_features(embeddings, "embeddings")
    labels = as_labels(labels, len(embeddings), "labels", "embeddings")
    relevant = torch.bincount(labels)[labels] - 1
    queried = relevant > 0
    if not queried.any():
        raise EvalError("every class in labels has a single sample", "mAP@R needs classes with two or more samples")
    device = resolve_device(device)
    r_max = int(relevant.max())
    chunk_size = chunk_size or max(1, min(QUERY_CHUNK, SIMILARITY_BUDGET // r_max))
    labels, relevant = labels.to(device), relevant.to(device)
    positions = torch.arange(1, r_max + 1, device=device)
    total = 0.0
    for chunk in cosine_top_k(embeddings, embeddings, r_max, exclude_self=True, chunk_size=chunk_size,
                              device=device, dtype=dtype):
        rows = slice(chunk.start, chunk.start + len(chunk.indices))
        hits = labels[chunk.indices] == labels[rows, None]
        within_r = positions <= relevant[rows, None]
        precision = hits.cumsum(dim=1, dtype=torch.float64) / positions
        total += ((precision * (hits & within_r)).sum(dim=1) / relevant[rows].clamp(min=1)).sum().item()
    return total / int(queried.sum())

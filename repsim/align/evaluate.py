"""Scoring a shared image-text space, two maps (f and g, or ASIF's) from the frozen embeddings into
it, by zero-shot classification (prompts embedded by the caption text model) and retrieval.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from repsim.align.tables import EmbeddingTables
from repsim.eval.retrieval import paired_retrieval
from repsim.eval.zeroshot import zero_shot_accuracy, zero_shot_classifier
from repsim.similarity.captions import embed_captions

Map = Callable[[np.ndarray], torch.Tensor]


@dataclass(frozen=True)
class SharedSpace:
    """``image`` and ``text``: the maps of each modality's frozen embeddings into one space."""

    image: Map
    text: Map


def networks_space(image_net: torch.nn.Module, text_net: torch.nn.Module) -> SharedSpace:
    """The space of trained alignment networks f, g (run without gradients on their device)."""
    def apply(network: torch.nn.Module) -> Map:
        device = next(network.parameters()).device

        @torch.no_grad()
        def mapped(embeddings: np.ndarray) -> torch.Tensor:
            return network(torch.as_tensor(np.asarray(embeddings, dtype=np.float32), device=device)).float().cpu()
        return mapped
    return SharedSpace(apply(image_net), apply(text_net))


def score_space(space: SharedSpace, test: EmbeddingTables, templates: Sequence[str], text_model: str | None,
                retrieval_k: Sequence[int] = (1, 5, 10)) -> dict[str, dict[str, float]]:
    """``{"zeroshot": {...}, "retrieval": {...}}`` on the test tables (zero-shot only when labelled)."""
    images = space.image(test.image)
    suites = {}
    if test.class_names and (test.labels >= 0).all():
        def encode_prompts(prompts: list[str]) -> torch.Tensor:
            return space.text(embed_captions(prompts, model=text_model))
        classifier = zero_shot_classifier(test.class_names, list(templates), encode_prompts)
        suites["zeroshot"] = zero_shot_accuracy(images, test.labels, classifier)
    suites["retrieval"] = paired_retrieval(images, space.text(test.text), tuple(retrieval_k))
    return suites

"""Scoring a shared image-text space, two maps (f and g, or ASIF's) from the frozen embeddings into
it, by zero-shot classification (prompts embedded by the caption text model) and retrieval.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch

from repsim.align.tables import EmbeddingTables
from repsim.eval.retrieval import paired_retrieval
from repsim.eval.zeroshot import zero_shot_accuracy, zero_shot_classifier
from repsim.similarity.captions import embed_captions

Map = Callable[[np.ndarray], torch.Tensor]


def network_map(network: torch.nn.Module) -> Map:
    """A trained alignment network (f or g) as a map, run without gradients on its device."""
    device = next(network.parameters()).device

    @torch.no_grad()
    def mapped(embeddings: np.ndarray) -> torch.Tensor:
        return network(torch.as_tensor(np.asarray(embeddings, dtype=np.float32), device=device)).float().cpu()
    return mapped


def score_space(image: Map, text: Map, test: EmbeddingTables, templates: Sequence[str], text_model: str | None,
                retrieval_k: Sequence[int] = (1, 5, 10)) -> dict[str, dict[str, float]]:
    """``{"zeroshot": {...}, "retrieval": {...}}`` on the test tables (zero-shot only when labelled) of the
    space that ``image`` and ``text`` map each modality's frozen embeddings into."""
    images = image(test.image)
    suites = {}
    if test.class_names and (test.labels >= 0).all():
        classifier = zero_shot_classifier(test.class_names, list(templates),
                                          lambda prompts: text(embed_captions(prompts, model=text_model)))
        suites["zeroshot"] = zero_shot_accuracy(images, test.labels, classifier)
    suites["retrieval"] = paired_retrieval(images, text(test.text), tuple(retrieval_k))
    return suites

"""Zero-shot classification: images go to the class whose embedding, the renormalised mean of its
unit prompt embeddings (``template.format(name=class_name)``), is most cosine-similar."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from repsim.errors import EvalError
from repsim._checks import (ArrayLike, as_features, as_labels, check_same_width, count_classes,
                                 resolve_device, unit_rows)
from repsim.eval.knn import ranked_classes, top_k_accuracy

SCORE_CHUNK = 8192


def zero_shot_classifier(class_names: Sequence[str], templates: Sequence[str],
                         encode_text: Callable[[list[str]], ArrayLike]) -> torch.Tensor:
    """Class embeddings (C, D) float32, unit norm, from C names × T templates; ``encode_text`` maps the
    prompts (C·T, class-major) to embeddings (C·T, D)."""
    if not class_names or not templates:
        raise EvalError(f"zero-shot needs class names and templates, got {len(class_names)} and {len(templates)}",
                        "pass at least one of each")
    prompts = [_prompt(template, name) for name in class_names for template in templates]
    embeddings = as_features(encode_text(prompts), "encode_text(prompts)")
    if len(embeddings) != len(prompts):
        raise EvalError(f"encode_text returned {len(embeddings)} embeddings for {len(prompts)} prompts",
                        "return one row per prompt")
    per_class = F.normalize(embeddings.float().cpu(), dim=1).view(len(class_names), len(templates), -1)
    return F.normalize(per_class.mean(dim=1), dim=1)


def _prompt(template: str, class_name: str) -> str:
    try:
        return template.format(name=class_name)
    except (KeyError, IndexError, ValueError):
        raise EvalError(f"template {template!r} uses a field other than {{name}}",
                        "write templates like 'a photo of a {name}.'") from None


def zero_shot_accuracy(image_embeddings: ArrayLike, labels: ArrayLike, class_embeddings: ArrayLike, *,
                       device: str | torch.device | None = None) -> dict[str, float]:
    """``zeroshot_top1`` and ``zeroshot_top5`` of images (N, D) by cosine similarity to class embeddings
    (C, D), which labels (N,) index; ties go to the lower class id."""
    images = as_features(image_embeddings, "image_embeddings")
    classes = as_features(class_embeddings, "class_embeddings")
    check_same_width(images, "image_embeddings", classes, "class_embeddings")
    labels = as_labels(labels, len(images), "labels", "image_embeddings")
    count_classes(labels, len(classes), "labels")
    device = resolve_device(device)
    classes = unit_rows(classes, device)
    rankings = np.concatenate([ranked_classes(unit_rows(chunk, device) @ classes.T) for chunk in images.split(SCORE_CHUNK)])
    accuracy = top_k_accuracy(rankings, labels.numpy())
    return {"zeroshot_top1": accuracy[1], "zeroshot_top5": accuracy[5]}


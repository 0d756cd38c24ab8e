"""Zero-shot classification on constructed prompt embeddings with known answers."""

import numpy as np
import pytest
import torch

from repsim.errors import EvalError
from repsim.eval import zero_shot_accuracy, zero_shot_classifier

CLASSES = ["cat", "dog", "car"]
TEMPLATES = ["a photo of a {name}.", "a drawing of a {name}."]


def _encoder(log: list | None = None):
    """Prompt → embedding (4-d): the class axis plus a template-specific offset, at template-specific scale."""
    def encode(prompts):
        if log is not None:
            log.append(list(prompts))
        rows = []
        for prompt in prompts:
            axis = next(i for i, name in enumerate(CLASSES) if prompt.endswith(f" {name}."))
            row = np.zeros(4)
            row[axis], row[3] = (1.0, 1.0) if prompt.startswith("a photo") else (10.0, -10.0)
            rows.append(row)
        return np.array(rows)
    return encode


def test_prompts_are_class_major_and_class_embeddings_average_unit_prompts():
    prompts = []
    classifier = zero_shot_classifier(CLASSES, TEMPLATES, _encoder(prompts))
    assert prompts == [[t.format(name=c) for c in CLASSES for t in TEMPLATES]]
    # Each prompt is normalised first, so the 10× larger drawing prompt does not dominate: the offsets cancel.
    np.testing.assert_allclose(classifier.numpy(), np.eye(3, 4), atol=1e-6)
    assert classifier.dtype == torch.float32


def test_accuracy_counts_the_nearest_class_embedding():
    classifier = zero_shot_classifier(CLASSES, TEMPLATES, _encoder())
    images = np.array([[5, 1, 0, 3], [0, 2, 1, -9], [0.1, 0, 3, 0], [1, 2, 0, 0]])
    labels = np.array([0, 1, 2, 0])  # the last image is closer to "dog": one miss of four
    assert zero_shot_accuracy(images, labels, classifier, device="cpu") == {"zeroshot_top1": 0.75, "zeroshot_top5": 1.0}


def test_top5_among_many_classes_and_ties_to_the_lower_class():
    class_embeddings = torch.eye(8)
    images = torch.tensor([[0.0, 0, 0, 0, 0, 0, 1, 1], [1.0, 1, 1, 1, 1, 1, 0, 0]])
    # Image 0 ties classes 6 and 7: top-1 picks 6. Image 1 ties six classes: top-5 holds classes 0..4 only.
    metrics = zero_shot_accuracy(images, [7, 5], class_embeddings, device="cpu")
    assert metrics == {"zeroshot_top1": 0.0, "zeroshot_top5": 0.5}


def test_encoder_may_return_a_tensor_that_requires_grad():
    encode = lambda prompts: torch.tensor(_encoder()(prompts), requires_grad=True)  # noqa: E731
    np.testing.assert_allclose(zero_shot_classifier(CLASSES, TEMPLATES, encode).numpy(), np.eye(3, 4), atol=1e-6)


@pytest.mark.parametrize(("call", "message"), [
    (lambda: zero_shot_classifier(CLASSES, ["a photo of a {}."], _encoder()), "uses a field other than {name}"),
    (lambda: zero_shot_classifier([], TEMPLATES, _encoder()), "got 0 and 2"),
    (lambda: zero_shot_classifier(CLASSES, TEMPLATES, lambda p: np.ones((2, 4))), "returned 2 embeddings for 6 prompts"),
    (lambda: zero_shot_classifier(CLASSES, TEMPLATES, lambda p: np.full((6, 4), np.nan)), "rows with NaN"),
    (lambda: zero_shot_accuracy(np.eye(3), [0, 1, 3], np.eye(3)), "has class id 3 but num_classes=3"),
    (lambda: zero_shot_accuracy(np.eye(3), [0, 1], np.eye(3)), "labels has 2 labels but image_embeddings has 3 rows"),
    (lambda: zero_shot_accuracy(np.eye(3), [0, 1, 2], np.eye(4)), "image_embeddings has 3 dims but class_embeddings has 4"),
    (lambda: zero_shot_accuracy(np.zeros((0, 3)), [], np.eye(3)), "image_embeddings is empty"),
])
def test_bad_input_fails_with_one_line(call, message):
    with pytest.raises(EvalError) as caught:
        call()
    assert message in str(caught.value) and "\n" not in str(caught.value)

"""PNG figures drawn on matplotlib's Agg canvas without pyplot (no global state, no display): t-SNE,
confusion matrix, histogram and the heat map of any (C, C) matrix in [0, 1]. Each function writes
``path`` (creating its folder) and returns it. Kept apart from :mod:`repsim.eval` so that metric code
never loads matplotlib.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from matplotlib import colormaps
from matplotlib.figure import Figure

from repsim.errors import EvalError
from repsim._checks import ArrayLike, as_features, as_labels, count_classes

DPI = 120
ANNOTATE_MAX_CLASSES = 20  # write each cell's value up to this many classes
TICK_LABELS_MAX_CLASSES = 50
MAX_FIGURE_INCHES = 16
LUMINANCE = np.array([0.299, 0.587, 0.114])  # perceived brightness of RGB


def tsne_plot(features: ArrayLike, labels: ArrayLike, path: str | Path, *, class_names: Sequence[str] | None = None,
              max_points: int = 2000, seed: int = 0, title: str = "t-SNE of test features") -> Path:
    """2-D t-SNE of features (N, D) coloured by labels (N,), on a seeded subsample of ≤ max_points rows."""
    from sklearn.decomposition import PCA
    from sklearn.manifold import TSNE

    features = as_features(features, "features")
    labels = as_labels(labels, len(features), "labels", "features").numpy()
    if len(features) < 4:
        raise EvalError(f"t-SNE needs at least 4 samples, got {len(features)}", "pass more samples")
    rows = np.arange(len(features))
    if len(rows) > max_points:
        rows = np.sort(np.random.default_rng(seed).choice(len(rows), max_points, replace=False))
    points = features[rows].double().cpu().numpy()
    if points.shape[1] > 50:
        points = PCA(min(50, len(points)), random_state=seed).fit_transform(points)
    perplexity = min(30.0, (len(points) - 1) / 3)
    embedded = TSNE(2, perplexity=perplexity, init="pca", random_state=seed).fit_transform(points)
    figure = Figure(figsize=(7, 6))
    axes = figure.add_subplot()
    colours = _class_colours(int(labels.max()) + 1)
    for label in np.unique(labels[rows]):
        here = labels[rows] == label
        axes.scatter(*embedded[here].T, s=4, color=colours[label], label=_class_name(class_names, label))
    axes.legend(markerscale=3, fontsize="small", loc="best")
    axes.set(title=title, xticks=[], yticks=[])
    return _save(figure, path)


def confusion_matrix_plot(labels: ArrayLike, predictions: ArrayLike, path: str | Path, *,
                          class_names: Sequence[str] | None = None, num_classes: int | None = None,
                          title: str = "Confusion matrix") -> Path:
    """Row-normalised confusion matrix (true class rows, predicted class columns) of labels vs predictions (N,)."""
    labels = as_labels(labels, len(labels), "labels", "labels")
    predictions = as_labels(predictions, len(labels), "predictions", "labels")
    if len(labels) == 0:
        raise EvalError("labels is empty", "pass at least one prediction")
    if num_classes is None and class_names is not None:
        num_classes = len(class_names)
    num_classes = count_classes(torch.cat([labels, predictions]), num_classes, "labels and predictions")
    labels, predictions = labels.numpy(), predictions.numpy()
    counts = np.bincount(labels * num_classes + predictions, minlength=num_classes**2).reshape(num_classes, -1)
    rates = counts / np.maximum(counts.sum(axis=1, keepdims=True), 1)
    names = [_class_name(class_names, c) for c in range(num_classes)]
    return matrix_plot(rates, path, names=names, title=title, xlabel="predicted", ylabel="true", cmap="Blues")


def matrix_plot(matrix: ArrayLike, path: str | Path, *, names: Sequence[str] | None = None, title: str = "",
                xlabel: str = "", ylabel: str = "", cmap: str = "viridis") -> Path:
    """A square (C, C) matrix of values in [0, 1] as a heat map with a colour bar, ``names`` on the rows and
    columns up to TICK_LABELS_MAX_CLASSES, and each cell's value up to ANNOTATE_MAX_CLASSES."""
    matrix = np.asarray(matrix, dtype=np.float64)
    if matrix.ndim != 2 or matrix.shape[0] != matrix.shape[1] or matrix.size == 0:
        raise EvalError(f"matrix has shape {matrix.shape}, expected (C, C)", "pass a non-empty square matrix")
    size = len(matrix)
    side = min(2 + 0.45 * size, MAX_FIGURE_INCHES)
    figure = Figure(figsize=(side + 1, side))
    axes = figure.add_subplot()
    image = axes.imshow(matrix, cmap=cmap, vmin=0, vmax=1)
    figure.colorbar(image, ax=axes, fraction=0.046)
    axes.set(title=title, xlabel=xlabel, ylabel=ylabel)
    if names is not None and size <= TICK_LABELS_MAX_CLASSES:
        axes.set_xticks(range(size), names, rotation=90)
        axes.set_yticks(range(size), names)
    if size <= ANNOTATE_MAX_CLASSES:
        colours = image.cmap(image.norm(matrix))
        for (row, column), value in np.ndenumerate(matrix):
            dark = colours[row, column, :3] @ LUMINANCE < 0.5
            axes.text(column, row, f"{value:.2f}", ha="center", va="center", fontsize="x-small",
                      color="white" if dark else "black")
    return _save(figure, path)


def histogram_plot(values: ArrayLike, path: str | Path, *, bins: int = 50, title: str = "",
                   xlabel: str = "value") -> Path:
    """Histogram of all entries of ``values`` (any shape), e.g. target similarities."""
    values = np.asarray(values, dtype=np.float64).ravel()
    if values.size == 0 or not np.isfinite(values).all():
        raise EvalError(f"values has {values.size} entries, {int((~np.isfinite(values)).sum())} not finite",
                        "pass a non-empty array of finite numbers")
    figure = Figure(figsize=(6, 4))
    axes = figure.add_subplot()
    axes.hist(values, bins=bins, color="tab:blue")
    axes.set(title=title, xlabel=xlabel, ylabel="count")
    return _save(figure, path)


def _class_colours(count: int) -> Sequence:
    """One distinct colour per class: tab10/tab20 up to 20 classes, else evenly spaced turbo."""
    if count <= 20:
        return colormaps["tab10" if count <= 10 else "tab20"].colors[:count]
    return colormaps["turbo"](np.linspace(0, 1, count))


def _class_name(class_names: Sequence[str] | None, label: int) -> str:
    return class_names[label] if class_names is not None and label < len(class_names) else str(label)


def _save(figure: Figure, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.tight_layout()
    figure.savefig(path, dpi=DPI, format="png")
    return path

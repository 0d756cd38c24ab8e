"""Evaluation of frozen features: pure functions on arrays or tensors, returning plain numbers.

Suites return flat ``{name: float}`` dicts with accuracies as fractions in [0, 1] and names that
are valid MLflow metric keys:

- :func:`knn_accuracy`: ``knn_top1_k{k}``, ``knn_top5_k{k}`` per k
- :func:`linear_probe`: ``linear_top1``, ``linear_top5``, ``linear_weight_decay``, ``linear_val_top1_wd{wd:g}``
- :func:`zero_shot_accuracy`: ``zeroshot_top1``, ``zeroshot_top5``
- :func:`paired_retrieval`: ``i2t_r{k}``, ``t2i_r{k}``
- :func:`embedding_diagnostics`: ``effective_rank``, ``embedding_std``, ``uniformity``

Bad input raises :class:`~repsim.errors.EvalError` with a one-line message. Figures live in
:mod:`repsim.plots`, imported on its own so that metric code never loads matplotlib.
"""

from repsim.eval.diagnostics import alignment, effective_rank, embedding_diagnostics, embedding_std, uniformity
from repsim.eval.knn import NeighborChunk, cosine_top_k, knn_accuracy, knn_predict, knn_rankings, top_k_accuracy
from repsim.eval.linear import DEFAULT_WEIGHT_DECAYS, linear_probe, stratified_split
from repsim.eval.retrieval import map_at_r, paired_retrieval, retrieval_recall
from repsim.eval.zeroshot import zero_shot_accuracy, zero_shot_classifier

__all__ = [
    "DEFAULT_WEIGHT_DECAYS", "NeighborChunk", "alignment", "cosine_top_k", "effective_rank", "embedding_diagnostics",
    "embedding_std", "knn_accuracy", "knn_predict", "knn_rankings", "linear_probe", "map_at_r", "paired_retrieval",
    "retrieval_recall", "stratified_split", "top_k_accuracy", "uniformity", "zero_shot_accuracy",
    "zero_shot_classifier",
]

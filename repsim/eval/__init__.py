"""Evaluation of frozen features: pure functions on arrays or tensors, returning plain numbers.

Suites return flat ``{name: float}`` dicts of valid MLflow metric keys, accuracies as fractions in
[0, 1]. Bad input raises :class:`~repsim.errors.EvalError`. Figures live in :mod:`repsim.plots`.
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

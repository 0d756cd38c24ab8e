"""Similarity between samples and neighbor lists.

- :mod:`~repsim.similarity.wordnet`: class similarities from WordNet (wup, path, lch, hops).
- :mod:`~repsim.similarity.captions`: caption embeddings from a frozen sentence-transformer.
- :mod:`~repsim.similarity.targets`: per-batch (B, B) target similarities for training.
- :mod:`~repsim.similarity.neighbors`: FAISS nearest-neighbor lists and their recall.
- :mod:`~repsim.similarity.precompute`: the precompute stages (captions, wordnet, neighbors), cached.
"""

from repsim.similarity.captions import embed_captions, load_text_model
from repsim.similarity.neighbors import build_index, knn, load_neighbors, recall_at_k
from repsim.similarity.targets import (ClassMatrixSource, EmbeddingSource, GraphSource, IdentitySource,
                                       LabelSource, SimilaritySource, load_class_matrix, validate_class_matrix)
from repsim.similarity.precompute import (embed_captions_stage, embed_captions_stage_of, neighbors_stage,
                                          neighbors_stage_of, wordnet_similarity_stage, wordnet_similarity_stage_of)
from repsim.similarity.wordnet import class_similarity, gloss, synsets_for

__all__ = [
    "ClassMatrixSource", "EmbeddingSource", "GraphSource", "IdentitySource", "LabelSource",
    "SimilaritySource", "build_index", "class_similarity", "embed_captions", "embed_captions_stage",
    "embed_captions_stage_of", "gloss", "load_class_matrix", "load_neighbors", "load_text_model",
    "knn", "neighbors_stage", "neighbors_stage_of", "recall_at_k",
    "synsets_for", "validate_class_matrix", "wordnet_similarity_stage", "wordnet_similarity_stage_of",
]

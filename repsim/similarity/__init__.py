"""Similarity between samples and neighbour lists.

- :mod:`~repsim.similarity.wordnet`: class similarities from WordNet (wup, path, lch, hops).
- :mod:`~repsim.similarity.captions`: caption embeddings from a frozen sentence-transformer.
- :mod:`~repsim.similarity.sources`: per-batch (B, B) target similarities for training.
- :mod:`~repsim.similarity.neighbours`: FAISS nearest-neighbour lists and their recall.
"""

from repsim.similarity.captions import embed_captions, load_text_model
from repsim.similarity.neighbours import (build_index, load_neighbours, nearest_neighbours, recall_at_k,
                                          save_neighbours)
from repsim.similarity.sources import (ClassMatrixSource, EmbeddingSource, GraphSource, IdentitySource,
                                       LabelSource, SimilaritySource, load_class_matrix, validate_class_matrix)
from repsim.similarity.wordnet import class_similarity, gloss, synsets_for

__all__ = [
    "ClassMatrixSource", "EmbeddingSource", "GraphSource", "IdentitySource", "LabelSource",
    "SimilaritySource", "build_index", "class_similarity", "embed_captions", "gloss",
    "load_class_matrix", "load_neighbours", "load_text_model", "nearest_neighbours", "recall_at_k",
    "save_neighbours", "synsets_for", "validate_class_matrix",
]

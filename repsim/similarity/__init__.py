"""Similarity between samples and neighbour lists.

- :mod:`~repsim.similarity.wordnet`: class similarities from WordNet (wup, path, lch, hops).
- :mod:`~repsim.similarity.captions`: caption embeddings from a frozen sentence-transformer.
- :mod:`~repsim.similarity.sources`: per-batch (B, B) target similarities for training.
- :mod:`~repsim.similarity.neighbours`: FAISS nearest-neighbour lists and their recall.
- :mod:`~repsim.similarity.stages`: the precompute stages (captions, wordnet, neighbours), cached.
"""

from repsim.similarity.captions import embed_captions, load_text_model
from repsim.similarity.neighbours import (build_index, load_neighbours, nearest_neighbours, recall_at_k,
                                          save_neighbours)
from repsim.similarity.sources import (ClassMatrixSource, EmbeddingSource, GraphSource, IdentitySource,
                                       LabelSource, SimilaritySource, load_class_matrix, validate_class_matrix)
from repsim.similarity.stages import (embed_captions_stage, embed_captions_stage_of, neighbours_stage,
                                      neighbours_stage_of, wordnet_similarity_stage, wordnet_similarity_stage_of)
from repsim.similarity.wordnet import class_similarity, gloss, synsets_for

__all__ = [
    "ClassMatrixSource", "EmbeddingSource", "GraphSource", "IdentitySource", "LabelSource",
    "SimilaritySource", "build_index", "class_similarity", "embed_captions", "embed_captions_stage",
    "embed_captions_stage_of", "gloss", "load_class_matrix", "load_neighbours", "load_text_model",
    "nearest_neighbours", "neighbours_stage", "neighbours_stage_of", "recall_at_k", "save_neighbours",
    "synsets_for", "validate_class_matrix", "wordnet_similarity_stage", "wordnet_similarity_stage_of",
]

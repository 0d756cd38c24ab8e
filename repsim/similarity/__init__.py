"""Similarity between samples, a submodule each: WordNet class similarities (``wordnet``), caption embeddings
(``captions``), per-batch (B, B) targets (``targets``), FAISS neighbor lists (``neighbors``) and the cached
stages that precompute them (``stage``)."""

from repsim.similarity.captions import embed_captions, load_text_model
from repsim.similarity.neighbors import build_index, knn, load_neighbors, recall_at_k
from repsim.similarity.targets import (ClassMatrixSource, EmbeddingSource, GraphSource, IdentitySource,
                                       LabelSource, SimilaritySource, load_class_matrix, validate_class_matrix)
from repsim.similarity.stage import (embed_captions_stage, embed_captions_stage_of, neighbors_stage,
                                          neighbors_stage_of, wordnet_similarity_stage, wordnet_similarity_stage_of)
from repsim.similarity.wordnet import class_similarity, gloss, synsets_for

__all__ = [
    "ClassMatrixSource", "EmbeddingSource", "GraphSource", "IdentitySource", "LabelSource",
    "SimilaritySource", "build_index", "class_similarity", "embed_captions", "embed_captions_stage",
    "embed_captions_stage_of", "gloss", "load_class_matrix", "load_neighbors", "load_text_model",
    "knn", "neighbors_stage", "neighbors_stage_of", "recall_at_k",
    "synsets_for", "validate_class_matrix", "wordnet_similarity_stage", "wordnet_similarity_stage_of",
]

"""The precompute stages as Prefect tasks: caption embeddings, WordNet class similarities and
neighbor lists. Stage outputs are passed between tasks as directory paths, so each task's cache key
is its planner's stage key."""

from __future__ import annotations

from repsim.similarity.stages import (embed_captions_stage, embed_captions_stage_of, neighbors_stage,
                                      neighbors_stage_of, wordnet_similarity_stage, wordnet_similarity_stage_of)
from repsim.stage import Stage, StageOutput
from repsim.tasks.stage import stage_task


def plan_captions(shards_path: str, model: str | None = None) -> Stage:
    """The caption stage of a shard directory."""
    return embed_captions_stage_of(shards_path, model)


def plan_wordnet(spec_path: str, measure: str = "wup") -> Stage:
    """The WordNet stage of a spec's classes."""
    return wordnet_similarity_stage_of(spec_path, measure)


def plan_neighbors(embeddings_path: str, k: int = 10, index: str = "flat", metric: str = "cosine") -> Stage:
    """The neighbor stage of an embedding file or caption stage directory."""
    return neighbors_stage_of(embeddings_path, k, index, metric)


@stage_task("captions", plan_captions)
def embed_captions_task(shards_path: str, model: str | None = None, batch_size: int = 256,
                        out_dir: str | None = None) -> StageOutput:
    """Embed every manifest caption of a shard directory with a frozen sentence-transformer."""
    return embed_captions_stage(shards_path, model, batch_size, out_dir=out_dir)


@stage_task("wordnet", plan_wordnet)
def wordnet_task(spec_path: str, measure: str = "wup", out_dir: str | None = None) -> StageOutput:
    """The (C, C) WordNet class similarity of a data spec's classes."""
    return wordnet_similarity_stage(spec_path, measure, out_dir)


@stage_task("neighbors", plan_neighbors)
def neighbors_task(embeddings_path: str, k: int = 10, index: str = "flat", metric: str = "cosine",
                   out_dir: str | None = None) -> StageOutput:
    """The k nearest neighbors of every embedding row, with a FAISS ``index``."""
    return neighbors_stage(embeddings_path, k, index, metric, out_dir=out_dir)

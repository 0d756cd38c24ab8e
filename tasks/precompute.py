"""The precompute stages as Prefect tasks: caption embeddings, WordNet class similarities and
neighbor lists. Stage outputs are passed between tasks as directory paths, and each task's
parameters are named as its stage's planner (``*_stage_of``) names them, so that planner gives the
task's cache key."""

from __future__ import annotations

from repsim.similarity.stages import (embed_captions_stage, embed_captions_stage_of, neighbors_stage,
                                      neighbors_stage_of, wordnet_similarity_stage, wordnet_similarity_stage_of)
from repsim.stage import StageOutput
from repsim.tasks.stage import stage_task


@stage_task("captions", embed_captions_stage_of)
def embed_captions_task(shards: str, model: str | None = None, batch_size: int = 256,
                        out_dir: str | None = None) -> StageOutput:
    """Embed every manifest caption of a shard directory with a frozen sentence-transformer."""
    return embed_captions_stage(shards, model, batch_size, out_dir=out_dir)


@stage_task("wordnet", wordnet_similarity_stage_of)
def wordnet_task(classes: str, measure: str = "wup", out_dir: str | None = None) -> StageOutput:
    """The (C, C) WordNet class similarity of the classes of a data spec (its path)."""
    return wordnet_similarity_stage(classes, measure, out_dir)


@stage_task("neighbors", neighbors_stage_of)
def neighbors_task(embeddings: str, k: int = 10, index: str = "auto", metric: str = "cosine",
                   out_dir: str | None = None) -> StageOutput:
    """The k nearest neighbors of every embedding row, with a FAISS ``index``."""
    return neighbors_stage(embeddings, k, index, metric, out_dir=out_dir)

"""The precompute flow: shard a data spec, then embed its captions, compute WordNet class
similarities and find caption neighbours, each stage cached and tracked in MLflow."""

from __future__ import annotations

import functools
from collections.abc import Sequence

from prefect import flow

from repsim.data.sharding import MANIFEST
from repsim.errors import SimilarityError
from repsim.similarity.stages import CLASSES_FILE, HEAT_MAP_FILE, SIMILARITY_FILE
from repsim.tasks.precompute import embed_captions_task, neighbours_task, wordnet_task
from repsim.tasks.shard import shard_task
from repsim.tasks.stage import track as track_stage
from repsim.tasks.tracking import Tracker


@flow(name="precompute")
def precompute_flow(spec: str, captions: bool = True, wordnet_measures: Sequence[str] = ("wup",),
                    neighbours: bool = True, k: int = 10, kind: str = "flat") -> list[dict]:
    """Shard ``spec``, then run the precompute stages it asks for: caption embeddings, one WordNet
    class similarity per measure, and each caption's k nearest others with a ``kind`` FAISS index.

    Returns one summary per stage, in that order: stage, detail, key, path, cached.
    """
    if neighbours and not captions:
        raise SimilarityError("neighbour lists are found among caption embeddings, which captions=False leaves out",
                              "keep the caption stage, or set neighbours=False")
    params = {"spec": spec, "captions": captions, "wordnet_measures": list(wordnet_measures),
              "neighbours": neighbours, "k": k, "kind": kind}
    tracker = Tracker()
    summaries: list[dict] = []
    with tracker.flow_run("precompute", params) as parent:
        track = functools.partial(track_stage, tracker, parent, summaries)
        shards = track(shard_task(spec, return_state=True), [MANIFEST])
        embedded = track(embed_captions_task(str(shards.path), return_state=True)) if captions else None
        for measure in wordnet_measures:
            track(wordnet_task(spec, measure, return_state=True), [CLASSES_FILE, SIMILARITY_FILE, HEAT_MAP_FILE])
        if neighbours:
            track(neighbours_task(str(embedded.path), k, kind, return_state=True))
    return summaries

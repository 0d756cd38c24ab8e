"""The precompute flow: shard a data spec, then embed its captions, compute WordNet class
similarities and find caption neighbours, each stage cached and tracked in MLflow."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import repsim.tasks  # noqa: F401  (first: it fills in the embedded defaults before Prefect reads its settings)
from prefect import flow
from prefect.states import State

from repsim.data.sharding import MANIFEST
from repsim.errors import SimilarityError
from repsim.similarity.stages import CLASSES_FILE, HEAT_MAP_FILE, SIMILARITY_FILE
from repsim.stage import read_record
from repsim.tasks.precompute import embed_captions_task, neighbours_task, wordnet_task
from repsim.tasks.shard import shard_task
from repsim.tasks.stage import log_stage
from repsim.tasks.tracking import StageRun, Tracker


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
        track = functools.partial(_track, tracker, parent, summaries)
        shards = track(shard_task(spec, return_state=True), [MANIFEST])
        embedded = track(embed_captions_task(str(shards.path), return_state=True)) if captions else None
        for measure in wordnet_measures:
            track(wordnet_task(spec, measure, return_state=True), [CLASSES_FILE, SIMILARITY_FILE, HEAT_MAP_FILE])
        if neighbours:
            track(neighbours_task(str(embedded.path), k, kind, return_state=True))
    return summaries


def _track(tracker: Tracker, parent: StageRun, summaries: list[dict], state: State,
           artifacts: Sequence[str] = ()) -> Any:
    """Log a finished stage task as a nested run, append its summary, and return its result."""
    result = state.result()
    log_stage(tracker, parent, result.path, state, [result.path / name for name in artifacts])
    record = read_record(result.path)
    summaries.append({"stage": record["stage"], "detail": _detail(record), "key": result.key,
                      "path": str(result.path), "cached": result.cached or state.name == "Cached"})
    return result


def _detail(record: dict) -> str:
    """One line on what a stage produced, for the summary table."""
    config, metrics = record["config"], record["metrics"]
    if record["stage"] == "captions":
        return f"{metrics['samples']} x {metrics['dim']}, {metrics['unique_captions']} distinct captions"
    if record["stage"] == "wordnet":
        return f"{config['measure']}, {metrics['classes']} classes"
    if record["stage"] == "neighbours":
        recall = f", recall {metrics['recall_tie_aware']:.3f}" if "recall_tie_aware" in metrics else ""
        return f"{config['kind']} k={config['k']}{recall}"
    return f"{metrics['samples']} samples"

"""The precompute flow: shard a data spec, then embed its captions, compute WordNet class
similarities and find caption neighbors, each stage cached and tracked in MLflow.

Besides each stage's nested run, the flow's run gets ``target_similarity_<source>.png`` for every
similarity source it prepared (captions, each WordNet measure, and labels for labelled data): the
histogram of X-CLR's targets on random batches after the softmax with ``target_temperature``
(:func:`repsim.similarity.targets.target_histogram`).
"""

from __future__ import annotations

import functools
import tempfile
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from prefect import flow

from repsim.data.sharding import MANIFEST
from repsim.errors import SimilarityError
from repsim.similarity.sources import ClassMatrixSource, EmbeddingSource, LabelSource, SimilaritySource
from repsim.similarity.stages import CLASSES_FILE, EMBEDDINGS_FILE, HEAT_MAP_FILE, SIMILARITY_FILE
from repsim.similarity.targets import manifest_labels, target_histogram
from repsim.tasks.precompute import embed_captions_task, neighbors_task, wordnet_task
from repsim.tasks.shard import shard_task
from repsim.tasks.stage import track as track_stage
from repsim.tasks.tracking import StageRun, Tracker


@flow(name="precompute")
def precompute_flow(spec: str, captions: bool = True, wordnet_measures: Sequence[str] = ("wup",),
                    neighbors: bool = True, k: int = 10, index: str = "auto", metric: str = "cosine",
                    model: str | None = None, target_temperature: float = 0.1) -> list[dict]:
    """Shard ``spec``, then run the precompute stages it asks for: caption embeddings (with the
    sentence-transformer ``model``, default all-MiniLM-L6-v2), one WordNet class similarity per
    measure, and each caption's k nearest others with a FAISS ``index``.

    Returns one summary per stage, in that order: stage, detail, key, path, cached.
    """
    if neighbors and not captions:
        raise SimilarityError("neighbor lists are found among caption embeddings, which captions=False leaves out",
                              "keep the caption stage, or set neighbors=False")
    params = {"spec": spec, "captions": captions, "wordnet_measures": list(wordnet_measures), "neighbors": neighbors,
              "k": k, "index": index, "metric": metric, "model": model, "target_temperature": target_temperature}
    tracker = Tracker()
    summaries: list[dict] = []
    with tracker.flow_run("precompute", params) as parent:
        track = functools.partial(track_stage, tracker, parent, summaries)
        shards = track(shard_task(spec, return_state=True), [MANIFEST])
        labels = manifest_labels(shards.path / MANIFEST)
        sources: dict[str, SimilaritySource] = {"labels": LabelSource()} if (labels >= 0).all() else {}
        if captions:
            embedded = track(embed_captions_task(str(shards.path), model, return_state=True))
            sources["captions"] = EmbeddingSource.from_npy(embedded.path / EMBEDDINGS_FILE)
        for measure in wordnet_measures:
            similarity = track(wordnet_task(spec, measure, return_state=True),
                               [CLASSES_FILE, SIMILARITY_FILE, HEAT_MAP_FILE])
            sources[f"wordnet_{measure}"] = ClassMatrixSource(np.load(similarity.path / SIMILARITY_FILE))
        if neighbors:
            track(neighbors_task(str(embedded.path), k, index, metric, return_state=True))
        _log_target_histograms(parent, sources, labels, target_temperature)
    return summaries


def _log_target_histograms(run: StageRun, sources: dict[str, SimilaritySource], labels: np.ndarray,
                           target_temperature: float) -> None:
    with tempfile.TemporaryDirectory() as folder:
        run.log_artifacts([target_histogram(source, labels, Path(folder) / f"target_similarity_{name}.png", name,
                                            target_temperature) for name, source in sources.items()])

"""The evaluate flow: shard a data spec, extract an encoder's features of its train and test splits,
and run the evaluation suites on them, each stage cached and tracked in MLflow."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from prefect import flow

from repsim.data.sharding import MANIFEST
from repsim.eval.stages import DEFAULT_SUITES, KNN_K, PIXELS, RESULTS_FILE, check_split
from repsim.tasks.evaluate import evaluate_task, features_task
from repsim.tasks.shard import shard_task
from repsim.tasks.stage import track
from repsim.tasks.tracking import Tracker


@flow(name="evaluate")
def evaluate_flow(spec: str, encoder: str = PIXELS, suites: Sequence[str] = DEFAULT_SUITES,
                  knn_k: Sequence[int] = KNN_K, batch_size: int = 512, device: str | None = None,
                  train_split: str = "train", test_split: str = "test") -> dict[str, Any]:
    """Shard ``spec``, extract ``encoder``'s features of both splits, and run ``suites`` on them.

    The parent MLflow run also carries every evaluation metric. Returns ``{"stages": [one summary
    per stage: stage, detail, key, path, cached], "results": path of results.json}``.
    """
    params = {"spec": spec, "encoder": encoder, "suites": list(suites), "knn_k": list(knn_k),
              "batch_size": batch_size, "device": device, "train_split": train_split, "test_split": test_split}
    tracker = Tracker()
    summaries: list[dict] = []
    with tracker.flow_run("evaluate", params) as parent:
        shards = track(tracker, parent, summaries, shard_task(spec, return_state=True), [MANIFEST])
        for split in (train_split, test_split):  # both, before extracting either
            check_split(shards, split)
        train, test = [track(tracker, parent, summaries,
                              features_task(str(shards.path), encoder, split, batch_size, device, return_state=True))
                       for split in (train_split, test_split)]
        evaluated = track(tracker, parent, summaries,
                           evaluate_task(str(train.path), str(test.path), list(suites), list(knn_k), device=device,
                                         return_state=True), ["*.png", RESULTS_FILE])
        parent.log_metrics(evaluated.metrics)
    return {"stages": summaries, "results": str(evaluated.path / RESULTS_FILE)}

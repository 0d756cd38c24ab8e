"""The evaluation stages as Prefect tasks: features of one split under an encoder, and the suites run
on a train and a test features output. Stage outputs travel between tasks as directory paths, and
each task's parameters are named as its stage's planner (``*_stage_of``) names them, so that planner
gives the task's cache key."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from repsim.eval.stages import (DEFAULT_SUITES, KNN_K, PIXELS, TextEncoder, evaluate_features, evaluate_stage_of,
                                extract_features, features_stage_of)
from repsim.stage import StageOutput
from repsim.tasks.stage import stage_task


@stage_task("features", features_stage_of)
def features_task(shards: str, encoder: str = PIXELS, split: str = "test", batch_size: int = 512,
                  device: str | None = None, out_dir: str | None = None) -> StageOutput:
    """Features (N, F) of every sample of one split of a shard directory, under a frozen encoder."""
    return extract_features(shards, encoder, split, batch_size, device, out_dir=out_dir)


@stage_task("evaluate", evaluate_stage_of)
def evaluate_task(train: str, test: str, suites: Sequence[str] = DEFAULT_SUITES, knn_k: Sequence[int] = KNN_K,
                  text_encoder: TextEncoder | None = None, captions: str | None = None, device: str | None = None,
                  linear_options: dict[str, Any] | None = None, out_dir: str | None = None) -> StageOutput:
    """The evaluation suites (kNN, linear probe, diagnostics, plots, ...) on train/test features;
    ``linear_options`` go to the linear probe."""
    return evaluate_features(train, test, suites, knn_k, linear_options=linear_options, text_encoder=text_encoder,
                             captions=captions, device=device, out_dir=out_dir)

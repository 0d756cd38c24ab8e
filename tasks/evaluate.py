"""The evaluation stages as Prefect tasks: features of one split under an encoder, and the suites run
on a train and a test features output. Stage outputs travel between tasks as directory paths, so
each task's cache key is its planner's stage key."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from repsim.eval.stages import (DEFAULT_SUITES, KNN_K, PIXELS, TextEncoder, evaluate_features, evaluate_stage_of,
                                extract_features, features_stage_of)
from repsim.stage import Stage, StageOutput
from repsim.tasks.stage import stage_task


def plan_features(shards_path: str, encoder: str = PIXELS, split: str = "test", device: str | None = None) -> Stage:
    """The features stage of one split."""
    return features_stage_of(shards_path, encoder, split, device)


def plan_evaluate(train_path: str, test_path: str, suites: Sequence[str] = DEFAULT_SUITES,
                  knn_k: Sequence[int] = KNN_K, text_encoder: TextEncoder | None = None,
                  captions_path: str | None = None, linear_options: dict[str, Any] | None = None) -> Stage:
    """The evaluate stage of two features outputs."""
    return evaluate_stage_of(train_path, test_path, suites, knn_k, linear_options, text_encoder, captions_path)


@stage_task("features", plan_features)
def features_task(shards_path: str, encoder: str = PIXELS, split: str = "test", batch_size: int = 512,
                  device: str | None = None, out_dir: str | None = None) -> StageOutput:
    """Features (N, F) of every sample of one split of a shard directory, under a frozen encoder."""
    return extract_features(shards_path, encoder, split, batch_size, device, out_dir=out_dir)


@stage_task("evaluate", plan_evaluate)
def evaluate_task(train_path: str, test_path: str, suites: Sequence[str] = DEFAULT_SUITES,
                  knn_k: Sequence[int] = KNN_K, text_encoder: TextEncoder | None = None,
                  captions_path: str | None = None, device: str | None = None,
                  linear_options: dict[str, Any] | None = None, out_dir: str | None = None) -> StageOutput:
    """The evaluation suites (kNN, linear probe, diagnostics, plots, ...) on train/test features;
    ``linear_options`` go to the linear probe."""
    return evaluate_features(train_path, test_path, suites, knn_k, linear_options=linear_options,
                             text_encoder=text_encoder, captions=captions_path, device=device, out_dir=out_dir)

"""The align flow: shard the config's data, then align its image and text embeddings, tracked in MLflow."""

from __future__ import annotations

from prefect import flow

from repsim.align.config import load_align_config
from repsim.flows.one_stage import shard_then_stage
from repsim.tasks.align import ARTIFACTS, align_task


@flow(name="align")
def align_flow(config: str, overrides: list[str] | None = None) -> dict:
    """Align the config at ``config`` with ``overrides`` (``"geometry.alpha=0"``).

    Returns the align stage's key, path, whether it was cached, and its metrics.
    """
    return shard_then_stage("align", config, overrides, load_align_config, align_task, ARTIFACTS)

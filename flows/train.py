"""The train flow: shard the config's data, then train its method, tracked in MLflow."""

from __future__ import annotations

from prefect import flow

from repsim.flows.one_stage import shard_then_stage
from repsim.methods.config import load_config
from repsim.tasks.train import ARTIFACTS, train_task


@flow(name="train")
def train_flow(config: str, overrides: list[str] | None = None) -> dict:
    """Train the experiment config at ``config`` with ``overrides`` (``"optim.lr=0.1"``).

    Returns the train stage's key, path, whether it was cached, and its metrics.
    """
    return shard_then_stage("train", config, overrides, load_config, train_task, ARTIFACTS)

"""The train flow: shard the config's data, then train its method, tracked in MLflow."""

from __future__ import annotations

from prefect import flow

from repsim.data.sharding import MANIFEST
from repsim.methods.config import load_config
from repsim.tasks.shard import shard_task
from repsim.tasks.stage import log_stage
from repsim.tasks.tracking import Tracker
from repsim.tasks.train import ARTIFACTS, train_task


@flow(name="train")
def train_flow(config: str, overrides: list[str] | None = None) -> dict:
    """Train the experiment config at ``config`` with ``overrides`` (``"optim.lr=0.1"``).

    Returns the train stage's key, path, whether it was cached, and its metrics.
    """
    overrides = list(overrides or [])
    resolved = load_config(config, overrides)
    tracker = Tracker()
    with tracker.flow_run("train", {"config": config, "overrides": overrides,
                                    "resolved": resolved.model_dump(mode="json")}) as parent:
        shards = shard_task(str(resolved.data.spec), return_state=True)
        log_stage(tracker, parent, shards.result().path, shards, [shards.result().path / MANIFEST])
        state = train_task(config, overrides, parent.run_id, return_state=True)
        output = state.result()
        if state.name == "Cached":  # the task did not run, so it logged nothing
            log_stage(tracker, parent, output.path, state, [output.path / name for name in ARTIFACTS])
        parent.log_metrics(output.metrics)
    return {"key": output.key, "path": str(output.path), "cached": output.cached or state.name == "Cached",
            "metrics": output.metrics}

"""The align flow: shard the config's data, then align its image and text embeddings, tracked in MLflow."""

from __future__ import annotations

from prefect import flow
from repsim.tasks.align import ARTIFACTS, align_task
from repsim.tasks.shard import shard_task
from repsim.tasks.stage import log_stage
from repsim.tasks.tracking import Tracker

from repsim.align.config import load_align_config
from repsim.data.sharding import MANIFEST


@flow(name="align")
def align_flow(config: str, overrides: list[str] | None = None) -> dict:
    """Align the config at ``config`` with ``overrides`` (``"geometry.alpha=0"``).

    Returns the align stage's key, path, whether it was cached, and its metrics.
    """
    overrides = list(overrides or [])
    resolved = load_align_config(config, overrides)
    tracker = Tracker()
    with tracker.flow_run("align", {"config": config, "overrides": overrides,
                                    "resolved": resolved.model_dump(mode="json")}) as parent:
        shards = shard_task(str(resolved.data.spec), return_state=True)
        log_stage(tracker, parent, shards.result().path, shards, [shards.result().path / MANIFEST])
        state = align_task(config, overrides, parent.run_id, return_state=True)
        output = state.result()
        if state.name == "Cached":  # the task did not run, so it logged nothing
            log_stage(tracker, parent, output.path, state, [output.path / name for name in ARTIFACTS])
        parent.log_metrics(output.metrics)
    return {"key": output.key, "path": str(output.path), "cached": output.cached or state.name == "Cached",
            "metrics": output.metrics}

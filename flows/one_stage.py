"""What the train and align flows share: read a config, shard its data, then run its one stage task."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from prefect import Task
from pydantic import BaseModel

from repsim.data.sharding import MANIFEST
from repsim.tasks.shard import shard_task
from repsim.tasks.stage import from_prefect_cache, log_stage, reused
from repsim.tasks.tracking import Tracker


def shard_then_stage(flow_name: str, config: str, overrides: list[str] | None,
                     load: Callable[[str, list[str]], BaseModel], stage_task: Task, artifacts: Sequence[str]) -> dict:
    """``load(config, overrides)``, then a parent MLflow run ``flow_name`` (params: the config file, its
    overrides and the config so resolved), the shards of its ``data.spec``, then ``stage_task(config,
    overrides, parent_run_id)``, which logs its own nested run unless Prefect serves it from cache (then
    it is logged here).

    Returns the stage's key, path, whether it was cached, and its metrics.
    """
    overrides = list(overrides or [])
    resolved = load(config, overrides)
    tracker = Tracker()
    with tracker.flow_run(flow_name, {"config": config, "overrides": overrides,
                                      "resolved": resolved.model_dump(mode="json")}) as parent:
        shards = shard_task(str(resolved.data.spec), return_state=True)
        log_stage(tracker, parent, shards.result().path, shards, [shards.result().path / MANIFEST])
        state = stage_task(config, overrides, parent.run_id, return_state=True)
        output = state.result()
        if from_prefect_cache(state):  # the task did not run, so it logged nothing
            log_stage(tracker, parent, output.path, state, [output.path / name for name in artifacts])
        parent.log_metrics(output.metrics)
    return {"key": output.key, "path": str(output.path), "cached": reused(state),
            "metrics": output.metrics}

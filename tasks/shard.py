"""The shard stage as a Prefect task."""

from __future__ import annotations

from repsim.data import ShardResult, load_spec, shard, shard_stage
from repsim.stage import Stage
from repsim.tasks.stage import stage_task


def plan_shard(spec_path: str) -> Stage:
    """The shard stage of a spec."""
    return shard_stage(load_spec(spec_path))


@stage_task("shard", plan_shard)
def shard_task(spec_path: str, out_dir: str | None = None) -> ShardResult:
    """Shard the dataset that ``spec_path`` describes into WebDataset tars and a manifest."""
    return shard(load_spec(spec_path), out_dir)

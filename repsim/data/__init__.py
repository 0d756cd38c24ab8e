"""Data specs, source readers and the shard stage."""

from repsim.data.sharding import ShardResult, shard, shard_stage
from repsim.data.spec import DataSpec, load_spec

__all__ = ["DataSpec", "ShardResult", "load_spec", "shard", "shard_stage"]

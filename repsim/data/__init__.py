"""Data specs, source readers, the shard stage, augmentation presets and loaders.

Exports resolve on first use, so reading a data spec does not import torch.
"""

import importlib

_EXPORTS = {
    "DataSpec": "spec", "load_spec": "spec",
    "ShardResult": "sharding", "shard": "sharding", "shard_stage": "sharding",
    "PRESETS": "augment", "Views": "augment", "make_views": "augment",
    "ShardLoader": "loader", "make_loader": "loader",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'repsim.data' has no attribute {name!r}")
    return getattr(importlib.import_module(f"repsim.data.{_EXPORTS[name]}"), name)

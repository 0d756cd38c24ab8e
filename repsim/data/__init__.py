"""Data specs, source readers, the shard stage, augmentation presets (per image and batched) and loaders.

Exports resolve on first use, so reading a data spec does not import torch.
"""

from repsim._lazy import lazy_exports

_EXPORTS = {
    "DataSpec": "spec", "load_spec": "spec",
    "ShardResult": "stage", "shard": "stage", "shard_stage": "stage",
    "PRESETS": "augment", "Views": "augment", "make_views": "augment",
    "BatchViews": "batch_augment", "make_batch_views": "batch_augment",
    "ShardLoader": "loader", "make_loader": "loader",
}
__all__ = sorted(_EXPORTS)
__getattr__ = lazy_exports(__name__, _EXPORTS)

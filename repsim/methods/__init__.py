"""Training methods, one per module, on the shared :class:`~repsim.methods.train.Trainer`.

A method module registers its ``build(config, data) -> Method`` under its name
(:func:`~repsim.methods.base.register`), with, when it consumes more than the shards,
``upstream(config, data) -> Upstream`` naming that input's cache key and how to produce it
(:class:`~repsim.methods.base.MethodSpec`). The train stage (:func:`repsim.methods.training.train`;
not exported here, where ``train`` is the Trainer's module) wires config, data, method and Trainer.

Importing the package imports every method module in it, so their settings are registered before
any config is read: a shipped method is one file here. Other exports resolve on first use.
"""

import importlib
import pkgutil

from repsim._lazy import lazy_exports

_EXPORTS = {
    "Config": "config", "load_config": "config",
    "Method": "base", "Trainer": "train", "KnnMonitor": "train", "LARS": "train", "init_distributed": "train",
    "train_stage_of": "training", "load_encoder": "training",
    "MethodSpec": "base", "register": "base", "method_spec": "base", "TrainingData": "base", "Upstream": "base",
}
__all__ = sorted(_EXPORTS)
__getattr__ = lazy_exports(__name__, _EXPORTS)

for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")

"""Training methods, one per module (:func:`~repsim.methods.base.register`), on the shared
:class:`~repsim.methods.train.Trainer`; the train stage is :func:`repsim.methods.training.train`.

Importing the package imports every method module, so their settings are registered before any config
is read. Other exports resolve on first use.
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

"""Training methods, one per module (:func:`~repsim.methods.base.register`), on the shared
:class:`~repsim.methods.trainer.Trainer`; the train stage is :func:`repsim.methods.stage.train`.

Methods are found by name when a config is validated (:data:`repsim.methods.config.METHODS`);
importing the package imports none of them, and its exports resolve on first use.
"""

from repsim._lazy import lazy_exports

_EXPORTS = {
    "Config": "config", "load_config": "config",
    "Method": "base", "Trainer": "trainer", "KnnMonitor": "trainer", "LARS": "trainer", "init_distributed": "trainer",
    "train_stage_of": "stage", "load_encoder": "stage",
    "MethodSpec": "base", "register": "base", "method_spec": "base", "TrainingData": "base", "Upstream": "base",
}
__all__ = sorted(_EXPORTS)
__getattr__ = lazy_exports(__name__, _EXPORTS)


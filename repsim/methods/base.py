"""The method contract: :class:`Method`, what it is built from (:class:`TrainingData`, :class:`Upstream`),
and how it is registered and found by name. A method is one module registering its ``build`` with its
settings model (``name: Literal["simclr"]``)::

    @register("simclr", settings=SimCLRConfig)
    def build(config: Config, data: TrainingData) -> SimCLR: ...

Shipped ones live in ``repsim.methods``; an outside one is named under the entry-point group
``repsim.methods`` (``mymethod = "mypackage.method"``) and imported when a config names it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from pydantic import BaseModel
from torch import nn

from repsim.data.loader import Batch
from repsim.data.stage import ShardResult
from repsim.data.spec import DataSpec
from repsim.errors import SpecError
from repsim.methods.config import METHODS, Config
from repsim.stage import StageOutput


class Method(nn.Module, ABC):
    """A training method: ``training_step(batch) -> {"loss": scalar, **scalars}`` and an ``encoder``.

    ``batch`` is the loader's dict (``views``, ``label``, ``index``) already on the device.
    """

    encoder: nn.Module

    @abstractmethod
    def training_step(self, batch: Batch) -> dict[str, torch.Tensor]:
        """The loss of one batch, plus any scalars worth logging."""

    def forward(self, batch: Batch) -> dict[str, torch.Tensor]:
        return self.training_step(batch)

    def before_optimizer_step(self, step: int, total_steps: int) -> None:
        """Called with the (clipped) gradients of step ``step`` + 1 before the optimizer applies them."""

    def after_optimizer_step(self, step: int, total_steps: int) -> None:
        """Called after optimizer step ``step`` (1-based) of ``total_steps``, e.g. to update an EMA teacher."""

    def epoch_metrics(self) -> dict[str, float]:
        """Scalars logged with the kNN accuracies at each epoch's end, on rank 0 (e.g. collapse diagnostics)."""
        return {}

    def monitored_encoders(self) -> dict[str, nn.Module]:
        """The encoders the kNN monitor scores, by the prefix of their metrics."""
        return {"": self.encoder}


@dataclass(frozen=True)
class Upstream:
    """What a method consumes besides the shards: its cache key, and how to produce it (None: a user's file)."""

    key: str
    run: Callable[[], StageOutput] | None = None


@dataclass(frozen=True)
class TrainingData:
    """What a method is built from: spec, shards, the images' channels and view size, and its upstream output."""

    spec: DataSpec
    shards: ShardResult
    channels: int
    image_size: int
    upstream: StageOutput | None = None

    @property
    def labelled(self) -> bool:
        return self.spec.classes is not None


Build = Callable[[Config, TrainingData], Method]


def no_upstream(config: Config, data: TrainingData) -> None:
    """Nothing besides the shards."""


def no_figures(method: Method, out: Path) -> None:
    """No figures of training."""


@dataclass(frozen=True)
class MethodSpec:
    """What a method gives the train stage: ``build(config, data) -> Method``, ``upstream(config, data)``
    (what it consumes besides the shards) and ``write_figures(method, out)`` (PNGs written once training ends)."""

    build: Build
    upstream: Callable[[Config, TrainingData], Upstream | None] = no_upstream
    write_figures: Callable[[Method, Path], None] = no_figures


_methods: dict[str, MethodSpec] = {}


def register(name: str, *, upstream: Callable[[Config, TrainingData], Upstream | None] = no_upstream,
             write_figures: Callable[[Method, Path], None] = no_figures,
             settings: type[BaseModel] | None = None) -> Callable[[Build], Build]:
    """Decorator registering ``build`` as method ``name`` (see :class:`MethodSpec`) with its ``settings`` model."""
    def decorate(build: Build) -> Build:
        taken = _methods.get(name)
        if taken is not None and taken.build.__module__ != build.__module__:
            raise ValueError(f"method {name!r} is registered by {taken.build.__module__} already")
        if settings is not None:
            METHODS.accept(name, settings)
        _methods[name] = MethodSpec(build, upstream, write_figures)
        return build
    return decorate


def method_spec(name: str) -> MethodSpec:
    """The method registered as ``name`` (an outside one imported through its entry point); else SpecError."""
    METHODS.load(name)
    if name not in _methods:
        known = ", ".join(repr(known) for known in dict.fromkeys([*METHODS.registered(), *_methods]))
        raise SpecError(f"method.name is {name!r}, which is not known", f"use one of {known}")
    return _methods[name]

"""The training methods by name (``method.name``) and what each gives the train stage.

A method is one module that registers its ``build`` under its name, with what else it provides::

    @register("simclr")
    def build(config: Config, data: TrainingData) -> SimCLR: ...

A method outside the library registers its settings model too (``name: Literal["mymethod"]``), so
that a config naming it validates: ``@register("mymethod", settings=MyMethodConfig)``.

A shipped method (a name the config accepts) lives in the module ``repsim.methods.<name>``, imported
on the first lookup of that name, so no caller imports a method by hand and reading a config
imports none.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, get_args

from pydantic import BaseModel

from repsim.errors import SpecError
from repsim.methods.config import MethodConfig, accept_method

if TYPE_CHECKING:
    from repsim.methods.config import Config
    from repsim.methods.stage import TrainingData, Upstream
    from repsim.methods.train import Method

Build = Callable[["Config", "TrainingData"], "Method"]


def no_upstream(config: Config, data: TrainingData) -> None:
    """Nothing besides the shards."""


def no_figures(method: Method, out: Path) -> None:
    """No figures of training."""


@dataclass(frozen=True)
class MethodSpec:
    """What a method gives the train stage.

    ``build(config, data) -> Method`` (required); ``upstream(config, data) -> Upstream | None``: what
    the method consumes besides the shards, its cache key and how to produce it; ``write_figures(method,
    out)``: its figures of training, written into the stage's folder ``out`` once training ends.
    """

    build: Build
    upstream: Callable[[Config, TrainingData], Upstream | None] = no_upstream
    write_figures: Callable[[Method, Path], None] = no_figures


_methods: dict[str, MethodSpec] = {}


def register(name: str, *, upstream: Callable[[Config, TrainingData], Upstream | None] = no_upstream,
             write_figures: Callable[[Method, Path], None] = no_figures,
             settings: type[BaseModel] | None = None) -> Callable[[Build], Build]:
    """Decorator registering ``build`` as method ``name``, with its ``upstream`` and ``write_figures``,
    and, for a method outside the library, the ``settings`` model the config reads ``method`` into
    (see :func:`~repsim.methods.config.accept_method`)."""
    def decorate(build: Build) -> Build:
        taken = _methods.get(name)
        if taken is not None and taken.build.__module__ != build.__module__:
            raise ValueError(f"method {name!r} is registered by {taken.build.__module__} already")
        if settings is not None:
            accept_method(name, settings)
        _methods[name] = MethodSpec(build, upstream, write_figures)
        return build
    return decorate


def shipped() -> tuple[str, ...]:
    """The method names the config accepts (``method.name``), in its order."""
    union, _ = get_args(MethodConfig)
    return tuple(get_args(model.model_fields["name"].annotation)[0] for model in get_args(union))


def method_spec(name: str) -> MethodSpec:
    """The method registered as ``name`` (a shipped one's module imported first); SpecError naming
    the known methods for any other name."""
    if name not in _methods and name in shipped():
        importlib.import_module(f"repsim.methods.{name}")
    if name not in _methods:
        known = ", ".join(repr(known) for known in dict.fromkeys([*shipped(), *_methods]))
        raise SpecError(f"method.name is {name!r}, which is not known", f"use one of {known}")
    return _methods[name]

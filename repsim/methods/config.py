"""Training configs: pydantic models (the one place defaults live) read from a YAML file or a shipped
config's name (``xclr``), then ``a.b=value`` overrides in order (see :mod:`repsim.layering`)."""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Sequence
from functools import cache
from importlib.metadata import entry_points
from pathlib import Path
from typing import Annotated, Any, Literal, Union, get_args

from pydantic import BaseModel, Field, GetCoreSchemaHandler, TypeAdapter, model_validator
from pydantic_core import core_schema

from repsim.data.augment import PRESETS, preset_options
from repsim.errors import SpecError, first_line
from repsim.layering import KEYED_WHEN_SET, NOT_KEYED, SettingsFile, Strict, load_model
from repsim.models.backbones import RESNETS
from repsim.models.vit import VITS
from repsim.shipped import packaged

DEFAULT_SPEC = "animal-mnist"  # the shipped data spec a config trains on unless it names one
ENTRY_POINTS = "repsim.methods"  # the entry-point group under which a package names its methods' modules
PATH_FIELDS = ("data.spec", "method.similarity.path", "model.init_encoder", "image.path")  # image: alignment configs
CONFIG_FILE = SettingsFile("config", "configs/simclr.yaml", "optim.lr=0.01", PATH_FIELDS)
_settings: dict[str, type[BaseModel]] = {}  # method name -> the settings model its module registered


class DataConfig(Strict):
    """What to train on: a data spec, its training split and the augmentation preset."""

    spec: Path = Field(default_factory=lambda: packaged("data spec", DEFAULT_SPEC), json_schema_extra=NOT_KEYED,
                       description="data spec YAML; default: the shipped animal-mnist (28×28 silhouettes, 10 classes)")
    split: str = "train"
    preset: Literal[tuple(PRESETS)] = "simclr"
    preset_options: dict[str, Any] = {}
    augment: Literal["sample", "batch"] = Field("sample", description="sample: each image's views in the loader "
                                                "workers (torchvision); batch: a batch's views in one call on the "
                                                "training device (kornia)")
    image_size: int | None = Field(28, gt=0, description="side of the views; None: the images' own")

    @model_validator(mode="after")
    def _known_preset_options(self) -> DataConfig:
        unknown = sorted(set(self.preset_options) - set(preset_options(self.preset)))
        if unknown:
            raise ValueError(f"preset_options {', '.join(map(repr, unknown))} is no option of the {self.preset} preset, "
                             f"whose options are {', '.join(preset_options(self.preset))} (write each as 'name: value')")
        return self


class ModelConfig(Strict):
    """The backbone and the projection head on top of it."""

    backbone: Literal[RESNETS + VITS] = "resnet18"
    small_images: bool = True
    patch_size: int = Field(4, gt=0, description="ViT patch side in pixels (4 for 28 px images, 16 for 224 px)")
    depth: int = Field(12, gt=0, description="ViT blocks")
    projection_hidden_dim: int = Field(512, gt=0)
    projection_dim: int = Field(128, gt=0)
    projection_layers: int = Field(2, ge=1)
    init_encoder: Path | None = Field(None, json_schema_extra=NOT_KEYED,  # its weights' digest is an input
                                      description="a saved encoder (a train stage's encoder.pt or its "
                                      "directory) whose weights start the backbone; None: random weights")


class OptimConfig(Strict):
    """Optimisation; ``batch_size`` is global (split evenly between DDP ranks)."""

    optimizer: Literal["adamw", "lars"] = "adamw"
    lr: float = Field(1e-3, gt=0)
    weight_decay: float = Field(1e-4, ge=0)
    momentum: float = Field(0.9, ge=0, lt=1, description="LARS momentum")
    trust_coefficient: float = Field(1e-3, gt=0, description="LARS trust coefficient")
    batch_size: int = Field(256, gt=0)
    epochs: int = Field(5, gt=0)
    max_steps: int | None = Field(None, gt=0, description="stop after this many steps, mid-epoch if need be "
                                  "(the schedule ends there); None: train every epoch")
    warmup_epochs: float = Field(1.0, ge=0)
    grad_clip: float | None = Field(None, gt=0)
    precision: Literal["auto", "fp32", "bf16"] = "auto"
    channels_last: bool = False
    compile: bool = False
    seed: int = 0
    num_workers: int | None = Field(None, ge=0, json_schema_extra=KEYED_WHEN_SET,  # a shuffle stream per worker
                                    description="DataLoader workers; default: repsim.device.cpu_plan")
    threads: int | None = Field(None, gt=0, json_schema_extra=NOT_KEYED,
                                description="torch intra-op threads; default: the cores the workers leave")
    checkpoint_every: int = Field(50, ge=0, json_schema_extra=NOT_KEYED,
                                  description="steps between checkpoints; 0: only at the end")
    keep_checkpoint: bool = Field(False, json_schema_extra=NOT_KEYED,
                                  description="keep the final checkpoint (optimizer, queues, step) in the "
                                  "stage output; by default it is removed once the stage completes")


class MonitorConfig(Strict):
    """The online kNN monitor: eval-preset features of the training and ``test_split`` samples, each epoch."""

    knn: bool = True
    k: int = Field(20, gt=0)
    test_split: str = "test"
    batch_size: int = Field(512, gt=0, json_schema_extra=NOT_KEYED)


def _validate_method(value: Any) -> BaseModel:
    """``value`` (a mapping, or settings already validated) as the settings model its ``name`` registered."""
    name = value.get("name") if isinstance(value, dict) else getattr(value, "name", None)
    if isinstance(name, str):
        import_method(name)
    registered = _registered()
    if isinstance(value, BaseModel) and registered.get(name) is type(value):
        return value
    return _method_union(tuple(registered.values())).validate_python(value)


@cache
def _method_union(models: tuple[type[BaseModel], ...]) -> TypeAdapter:
    """The discriminated union of ``models`` by ``name``: its errors are pydantic's own (unknown or missing tag,
    the field of the member the tag picks)."""
    return TypeAdapter(Annotated[Union[models], Field(discriminator="name")])  # noqa: UP007 (models known at run time)


class MethodSettings:
    """``Config.method``'s validation: a mapping becomes the settings model registered under its ``name``
    (:func:`accept_method`), looked up when a config is validated. :meth:`models` lists the candidates
    (for error descriptions, :mod:`repsim.config_errors`)."""

    def __get_pydantic_core_schema__(self, source: Any, handler: GetCoreSchemaHandler) -> core_schema.CoreSchema:
        return core_schema.no_info_plain_validator_function(_validate_method)

    @staticmethod
    def models() -> tuple[type[BaseModel], ...]:
        return tuple(_registered().values())


class Config(Strict):
    """One training experiment; ``method`` validates into the settings model its method registered
    (by ``method.name``, see :func:`accept_method`), so a method's settings live in its own module."""

    method: Annotated[Any, MethodSettings()]
    data: DataConfig = Field(default_factory=DataConfig)
    model: ModelConfig = ModelConfig()
    optim: OptimConfig = OptimConfig()
    monitor: MonitorConfig = MonitorConfig()


def accept_method(name: str, settings: type[BaseModel]) -> None:
    """Let ``method.name: <name>`` validate into ``settings``, a model whose ``name`` is ``Literal["<name>"]``
    (see :func:`repsim.methods.base.register`); it replaces settings accepted under that name before."""
    field = settings.model_fields.get("name")
    if field is None or get_args(field.annotation) != (name,):
        raise TypeError(f"the settings of method {name!r} must be a model with name: Literal[{name!r}]")
    _settings[name] = settings


def shipped() -> tuple[str, ...]:
    """The method names the library ships (``method.name``): those registered by its own modules, sorted."""
    _import_shipped()
    return tuple(sorted(name for name, settings in _settings.items() if _is_shipped(settings)))


def accepted_methods() -> tuple[str, ...]:
    """The method names a config accepts now: those shipped, then those accepted from outside."""
    return tuple(_registered())


def import_method(name: str) -> None:
    """Register the shipped methods, then, when none is ``name``, import the module a package names for it under
    the ``repsim.methods`` entry points (nothing when none does); SpecError in one line when it does not import."""
    if name in _registered():
        return
    for point in entry_points(group=ENTRY_POINTS, name=name):
        try:
            point.load()
        except Exception as err:  # whatever the outside module raises while it imports
            raise SpecError(f"method {name!r} of {point.value!r} (entry point of {point.dist.name if point.dist else '?'}) "
                            f"does not import: {first_line(err)}", "fix or reinstall the package") from None


def _registered() -> dict[str, type[BaseModel]]:
    """The settings models by method name, shipped ones first (their modules imported, so registered, first)."""
    outside = [name for name, settings in _settings.items() if not _is_shipped(settings)]
    return {name: _settings[name] for name in (*shipped(), *outside)}


def _is_shipped(settings: type[BaseModel]) -> bool:
    return settings.__module__.startswith(f"{__package__}.")


@cache
def _import_shipped() -> None:
    package = importlib.import_module(__package__)
    for module in pkgutil.iter_modules(package.__path__):
        importlib.import_module(f"{__package__}.{module.name}")


def load_config(path: str | Path, overrides: Sequence[str] = (), schema: type[BaseModel] = Config) -> Any:
    """The config at ``path`` (or the shipped config of that name) with ``overrides`` (``"optim.lr=0.01"``), as a
    ``schema`` (default: a training :class:`Config`); SpecError in one line naming file and field."""
    return load_model(schema, path, CONFIG_FILE, overrides)

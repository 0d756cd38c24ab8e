"""Training configs: pydantic models (the one place defaults live) read from a YAML file or a shipped
config's name (``xclr``), then ``a.b=value`` overrides in order (see :mod:`repsim.layering`)."""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field, model_validator

from repsim.data.augment import PRESETS, preset_options
from repsim.layering import KEYED_WHEN_SET, NOT_KEYED, Override, SettingsFile, Strict, load_model
from repsim.models.backbones import RESNETS
from repsim.models.vit import VITS
from repsim.registry import Registry
from repsim.shipped import packaged

DEFAULT_SPEC = "animal-mnist"  # the shipped data spec a config trains on unless it names one
ENTRY_POINTS = "repsim.methods"  # the entry-point group under which a package names its methods' modules
PATH_FIELDS = ("data.spec", "method.similarity.path", "model.init_encoder", "image.path")  # image: alignment configs
CONFIG_FILE = SettingsFile("config", "configs/simclr.yaml", "optim.lr=0.01", PATH_FIELDS)


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
    max_steps: int | None = Field(None, ge=0, description="stop after this many steps, mid-epoch if need be "
                                  "(the schedule ends there); 0: none, the initialised encoder (the untrained "
                                  "floor); None: train every epoch")
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


METHODS = Registry("method", "name", ENTRY_POINTS, __package__,
                   lambda: [importlib.import_module(f"{__package__}.{module.name}")
                            for module in pkgutil.iter_modules(importlib.import_module(__package__).__path__)])


class Config(Strict):
    """One training experiment; ``method`` validates into the settings model its method registered
    (by ``method.name``, :data:`METHODS`), so a method's settings live in its own module."""

    method: Annotated[Any, METHODS]
    data: DataConfig = Field(default_factory=DataConfig)
    model: ModelConfig = ModelConfig()
    optim: OptimConfig = OptimConfig()
    monitor: MonitorConfig = MonitorConfig()


def load_config(path: str | Path, overrides: Sequence[Override] = (), schema: type[BaseModel] = Config) -> Any:
    """The config at ``path`` (or the shipped config of that name) with ``overrides`` (``"optim.lr=0.01"``, or
    ``{"optim": {"lr": 0.01}}``), as a
    ``schema`` (default: a training :class:`Config`); SpecError in one line naming file and field."""
    return load_model(schema, path, CONFIG_FILE, overrides)

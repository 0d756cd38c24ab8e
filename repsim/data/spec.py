"""Data specs: YAML files naming a source (one of the types below), the classes with their WordNet
synsets, caption templates for labelled data without captions, the split and the shard layout. Relative
paths resolve against the spec's folder; every validation error names the file, the field and the fix."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (BaseModel, Field, SerializerFunctionWrapHandler, ValidationError, field_validator,
                      model_serializer, model_validator)

from repsim.config_errors import describe, message, model_at
from repsim.data.remote import info, is_url
from repsim.errors import SpecError
from repsim.layering import SettingsFile, Strict, load_model
from repsim.shipped import locate

FASHION_MNIST_ROOT = Path("/usr/share/datasets/fashion-mnist")
FASHION_MNIST_FIX = "install it with 'apt-get install dataset-fashion-mnist' or set source.root to its IDX files"
SYNSET_PATTERN = re.compile(r"^.+\.[nvasr]\.\d{2}$")
PATH_FIELDS = ("source.root", "source.path", "source.urls", "source.manifest")  # relative to the spec's folder
SPEC_FILE = SettingsFile("data spec", "data_specs/fashion-mnist.yaml", paths=PATH_FIELDS)


class FashionMnistSource(Strict):
    """The IDX files of Fashion-MNIST (Debian package ``dataset-fashion-mnist``); splits train/test."""

    type: Literal["fashion_mnist"]
    root: Path = FASHION_MNIST_ROOT


class AnimalMnistSource(Strict):
    """The gzip pickles of the PyPI package ``animal-mnist``; ``root`` defaults to the package's data."""

    type: Literal["animal_mnist"]
    root: Path | None = None


class ImageFolderSource(Strict):
    """``root/<class>/<image>``, or ``root/<split>/<class>/<image>`` with ``split: {type: source}``."""

    type: Literal["image_folder"]
    root: Path
    extensions: tuple[str, ...] = (".png", ".jpg", ".jpeg", ".bmp", ".webp")


class ManifestSource(Strict):
    """A CSV or Parquet table with a ``path`` column and ``label`` (class names) and/or ``caption`` (``split``
    optional); relative image paths resolve against ``root`` (default: the manifest's folder)."""

    type: Literal["manifest"]
    path: Path
    root: Path | None = None


class WebDatasetSource(Strict):
    """Existing WebDataset shards as img2dataset writes them (``jpg`` + ``txt`` + ``json``): ``urls`` a brace
    pattern or glob (``cc3m/{00000..00331}.tar``), ``label_field`` the json key holding a class name, if any.
    With ``manifest`` (the shard stage's ``manifest.parquet`` beside them) they are shards that stage wrote,
    read in place at paths or URLs (``s3://bucket/shards/train-{00000..00009}.tar``), never copied."""

    type: Literal["webdataset"]
    urls: str
    image_ext: str = "jpg"
    label_field: str | None = None
    manifest: str | None = None

    @model_validator(mode="after")
    def _urls_need_a_manifest(self) -> WebDatasetSource:
        if is_url(self.urls) and self.manifest is None:
            raise ValueError("shards at a URL are read in place, which needs the manifest.parquet the shard stage "
                             "wrote beside them: set source.manifest")
        return self

    @model_serializer(mode="wrap")
    def _without_unset_manifest(self, dump: SerializerFunctionWrapHandler) -> dict[str, Any]:
        """The fields, ``manifest`` only when set: specs without one keep the shard keys they had."""
        fields = dump(self)
        return fields if self.manifest is not None else {k: v for k, v in fields.items() if k != "manifest"}


Source = Annotated[
    FashionMnistSource | AnimalMnistSource | ImageFolderSource | ManifestSource | WebDatasetSource,
    Field(discriminator="type"),
]


class SourceSplit(Strict):
    """Keep the splits the source defines (e.g. Fashion-MNIST's official train/test)."""

    type: Literal["source"]


class RandomSplit(Strict):
    """A seeded random split, stratified by label when the data is labelled."""

    type: Literal["random"]
    fractions: dict[str, float] = {"train": 0.8, "test": 0.2}
    seed: int = 0
    stratify: bool = True

    @field_validator("fractions")
    @classmethod
    def _fractions_sum_to_one(cls, fractions: dict[str, float]) -> dict[str, float]:
        if not fractions or any(f <= 0 for f in fractions.values()):
            raise ValueError("every split fraction must be positive")
        if abs(sum(fractions.values()) - 1.0) > 1e-6:
            raise ValueError(f"fractions sum to {sum(fractions.values()):g}, not 1")
        return fractions


Split = Annotated[SourceSplit | RandomSplit, Field(discriminator="type")]


class Captions(Strict):
    """Caption templates for samples without a caption; ``{name}`` is the class name."""

    templates: tuple[str, ...] = ("a photo of a {name}.",)

    @field_validator("templates")
    @classmethod
    def _templates_name_the_class(cls, templates: tuple[str, ...]) -> tuple[str, ...]:
        if not templates:
            raise ValueError("give at least one template")
        for template in templates:
            try:
                template.format(name="x")
            except (KeyError, IndexError, ValueError) as err:
                raise ValueError(f"template {template!r} may only use the field {{name}}") from err
        return templates


class DataSpec(Strict):
    """One dataset: its source, classes (name -> WordNet synset), captions, split and shard layout."""

    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
    source: Source
    classes: dict[str, str] | None = None
    captions: Captions = Captions()
    split: Split = SourceSplit(type="source")
    image_format: Literal["png", "jpg"] = "png"
    jpeg_quality: int = Field(95, ge=1, le=100)
    shard_size: int = Field(10_000, gt=0)
    shuffle_seed: int | None = 0
    on_error: Literal["skip", "fail"] = "fail"
    fingerprint: Literal["stat", "content"] = Field(
        "stat", description="what of the source files keys the shards: their paths, sizes and modification "
        "times (stat), or their bytes' sha256 (content: slower, blind to touched but unchanged files)")

    @field_validator("classes")
    @classmethod
    def _every_class_has_a_synset(cls, classes: dict[str, str] | None) -> dict[str, str] | None:
        for name, synset in (classes or {}).items():
            if not SYNSET_PATTERN.match(synset):
                raise ValueError(f"class {name!r} has synset {synset!r}, not of the form lemma.n.01")
        return classes

    @model_validator(mode="after")
    def _labelled_sources_need_classes(self) -> DataSpec:
        if self.classes is None and isinstance(self.source, (FashionMnistSource, AnimalMnistSource,
                                                             ImageFolderSource)):
            raise ValueError(f"source type {self.source.type!r} is labelled and needs a classes list")
        return self

    @property
    def class_names(self) -> list[str]:
        return list(self.classes or {})

    def caption_for(self, label: int, index: int) -> str:
        """The template caption of a labelled sample; templates rotate deterministically by index."""
        template = self.captions.templates[index % len(self.captions.templates)]
        return template.format(name=self.class_names[label])


def load_spec(path: str | Path) -> DataSpec:
    """Read and validate a data spec (a path, or a shipped spec's name: ``animal-mnist``); relative paths
    resolve against its folder. SpecError (one line: the file, the field and the fix) if invalid."""
    spec = load_model(DataSpec, path, SPEC_FILE, explain=_describe)
    _check_paths_exist(spec, locate(path, SPEC_FILE.kind))
    return spec


def _check_paths_exist(spec: DataSpec, spec_path: Path) -> None:
    for field in ("root", "path", "manifest"):
        value = getattr(spec.source, field, None)
        if is_url(value):
            info(value)  # reachable with these credentials (a DataError says what to check)
        elif value is not None and not Path(value).exists():
            raise SpecError(f"{spec_path}: field 'source.{field}' points at {value}, which does not exist",
                            FASHION_MNIST_FIX if isinstance(spec.source, FashionMnistSource)
                            else "correct the path (relative paths start at the spec's folder)")


def _describe(err: ValidationError, path: str, _: type[BaseModel] = DataSpec) -> tuple[str, str]:
    """Turn the first pydantic error into (what, fix) naming the file and the field."""
    _, field = model_at(DataSpec, err.errors()[0]["loc"])
    if field[:1] == ("classes",) and len(field) == 2:
        return (f"{path}: class '{field[1]}' in field 'classes' has no valid WordNet synset",
                f"write it as '{field[1]}: lemma.n.01' (run 'repsim synsets \"{field[1]}\"' for candidates)")
    if field == ("classes",):
        return (f"{path}: field 'classes': {message(err)}",
                "write each class as 'name: lemma.n.01' (run 'repsim synsets NAME' for candidates)")
    return describe(err, path, DataSpec)

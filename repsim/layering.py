"""Config layering: YAML files and ``key.sub=value`` overrides (values parsed as YAML) as nested
mappings (:class:`Layer`), merged in order, the later winning key by key. Relative paths at path
fields (dotted names, ``*`` for every list item) resolve against the naming file's folder, or the
working directory for overrides. :func:`load_model` validates the result; errors name their layer."""

from __future__ import annotations

import contextlib
import functools
import os
import re
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ConfigDict, ValidationError

from repsim.config_errors import describe, model_at, read_yaml_mapping
from repsim.errors import SpecError
from repsim.shipped import FOLDERS, SUFFIX, locate, shipped

TAG_FIELDS = ("type", "name")  # a mapping whose tag changes is replaced whole, not merged
_KEPT = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*://|pipe:)")  # URLs and webdataset pipes are no paths to resolve


class Strict(BaseModel):
    """The base of every config model: an unknown field is an error, and a validated config is frozen."""

    model_config = ConfigDict(extra="forbid", frozen=True)


M = TypeVar("M", bound=BaseModel)
NOT_KEYED = {"key": False}  # a field's json_schema_extra: kept out of stage keys (e.g. threads, or a path whose
KEYED_WHEN_SET = {"key": "when set"}  # contents the key holds otherwise); kept out while None (a machine's choice)


def keyed_values(config: BaseModel) -> dict[str, Any]:
    """``config`` as JSON values without the fields marked :data:`NOT_KEYED` (and :data:`KEYED_WHEN_SET` ones
    while None), at any depth: what a stage key holds of it."""
    values = config.model_dump(mode="json")
    for name, field in type(config).model_fields.items():
        mark, value = (field.json_schema_extra or {}).get("key"), getattr(config, name)
        if mark is False or (mark == KEYED_WHEN_SET["key"] and value is None):
            del values[name]
        elif isinstance(value, BaseModel):
            values[name] = keyed_values(value)
    return values


@dataclass(frozen=True)
class SettingsFile:
    """A kind of settings file: its name in errors (``config``), an example file and override that the
    fix of an error shows, and its path fields (resolved against the file's folder)."""

    kind: str
    example: str
    override_example: str = ""
    paths: tuple[str, ...] = ()


Explain = Callable[[ValidationError, str, type[BaseModel]], tuple[str, str]]
_READ: ContextVar[dict[tuple, Layer] | None] = ContextVar("settings_read", default=None)


@contextlib.contextmanager
def read_once() -> Iterator[None]:
    """Within this block :func:`read_layer` reads and parses each settings file once (while it is
    unchanged), however many layers of one command load it; nested blocks share the outer one's."""
    token = _READ.set({} if _READ.get() is None else _READ.get())
    try:
        yield
    finally:
        _READ.reset(token)


Override = str | Mapping[str, Any]  # "key.sub=value", or a nested mapping: the overrides of each value it sets


def load_model(schema: type[M], path: str | Path, file: SettingsFile, overrides: Sequence[Override] = (),
               explain: Explain = describe) -> M:
    """The one merge of settings: the ``file`` at ``path`` (or the shipped file of that name) over the schema's
    defaults, then each override in order (an experiment's settings come as mappings, the command line's as
    strings), validated as ``schema``; a SpecError in one line names the layer that set the failing field and
    the fix (``explain``)."""
    path = locate(path, file.kind)
    layers = [read_layer(path, file.kind, file.example, file.paths)]
    layers += [layer for override in overrides for layer in override_layers(override, file.override_example, file.paths)]
    try:
        return schema.model_validate(merge_layers(layers))
    except ValidationError as err:
        _, field = model_at(schema, err.errors()[0]["loc"])
        raise SpecError(*explain(err, origin(layers, field) or str(path), schema)) from None


@dataclass(frozen=True)
class Layer:
    """One source of settings: its name in errors (the file, ``override '...'``) and its nested values."""

    name: str
    values: dict[str, Any]


def read_layer(path: Path, kind: str, example: str, paths: Iterable[str] = ()) -> Layer:
    """The ``kind`` YAML file at ``path`` as a layer, its ``paths`` resolved against its folder (inside
    :func:`read_once`, read once); SpecError in one line when it is no YAML mapping (the fix shows ``example``)."""
    read = _READ.get()
    if read is None:
        return _read_layer(path, kind, example, paths)
    stat = path.stat()
    key = (path.resolve(), stat.st_mtime_ns, stat.st_size, kind, example, tuple(paths))
    if key not in read:
        read[key] = _read_layer(path, kind, example, paths)
    return read[key]


def _read_layer(path: Path, kind: str, example: str, paths: Iterable[str]) -> Layer:
    values = read_yaml_mapping(path, kind, example)
    return Layer(str(path), resolve_paths(values, paths, path.parent.resolve()))


def override_layers(override: Override, example: str, paths: Iterable[str] = ()) -> list[Layer]:
    """An override as layers, its ``paths`` resolved against the working directory: a ``key.sub=value`` string
    is one; a nested mapping is one per value it sets, named as the string that would set it."""
    if isinstance(override, str):
        return [_layer(override, *parse_override(override, example), paths)]
    return [_layer(f"{key}={inline(value)}", key.split("."), value, paths) for key, value in flatten(override).items()]


def _layer(override: str, keys: Sequence[str], value: Any, paths: Iterable[str]) -> Layer:
    return Layer(f"override {override!r}", resolve_paths(set_dotted({}, keys, value), paths, Path.cwd()))


def parse_override(override: str, example: str) -> tuple[list[str], Any]:
    """The dotted keys and YAML-parsed value of a ``key.sub=value`` override; SpecError in one line
    (the fix shows ``example``) when it is not of that form or its value is not valid YAML."""
    name = f"override {override!r}"
    dotted, separator, text = override.partition("=")
    keys = dotted.strip().split(".")
    if not separator or not all(keys):
        raise SpecError(f"{name} is not of the form key=value", f"write it like {example}")
    try:
        return keys, yaml.safe_load(text)
    except yaml.YAMLError:
        raise SpecError(f"{name}: the value is not valid YAML", "quote it or fix its syntax") from None


def merge_layers(layers: Iterable[Layer]) -> dict[str, Any]:
    return functools.reduce(merge, (layer.values for layer in layers), {})


def merge(base: Any, update: Any) -> Any:
    """``update`` over ``base``: mappings merge key by key unless a TAG_FIELDS value differs
    (then ``update`` replaces ``base`` whole); anything else is replaced."""
    if not (isinstance(base, dict) and isinstance(update, dict)):
        return update
    if any(key in base and key in update and base[key] != update[key] for key in TAG_FIELDS):
        return update
    return {**base, **{key: merge(base.get(key), value) for key, value in update.items()}}


def origin(layers: Sequence[Layer], field: Sequence[str]) -> str | None:
    """The name of the last layer that sets ``field`` (its keys), None when none does."""
    return next((layer.name for layer in reversed(layers) if _sets(layer.values, field)), None)


def _sets(values: Any, field: Sequence[str]) -> bool:
    return not field or isinstance(values, dict) and field[0] in values and _sets(values[field[0]], field[1:])


def set_dotted(tree: dict[str, Any], keys: Sequence[str], value: Any) -> dict[str, Any]:
    """A copy of ``tree`` with ``value`` at ``keys``; what lies on the way and is no mapping becomes one."""
    head, *rest = keys
    child = tree.get(head)
    return {**tree, head: set_dotted(child if isinstance(child, dict) else {}, rest, value) if rest else value}


def flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}``; lists and empty mappings stay values."""
    flat: dict[str, Any] = {}
    for name, value in tree.items():
        if isinstance(value, Mapping) and value:
            flat.update(flatten(value, f"{prefix}{name}."))
        else:
            flat[f"{prefix}{name}"] = value
    return flat


def as_settings(overrides: Iterable[str], example: str) -> dict[str, Any]:
    """``key=value`` overrides as the nested mapping they set, in order."""
    settings: dict[str, Any] = {}
    for override in overrides:
        settings = set_dotted(settings, *parse_override(override, example))
    return settings


def inline(value: Any) -> str:
    """``value`` as one line of YAML that parses back to it: ``[a, b]``, ``null``, ``'yes'``."""
    return yaml.safe_dump(value, default_flow_style=True, width=1 << 16).strip().removesuffix("\n...")


def resolve_paths(tree: Any, fields: Iterable[str], base: Path) -> Any:
    """A copy of ``tree`` with the path string at each dotted field (``*``: every list item) made absolute
    against ``base`` (:func:`resolve_path`); fields that are absent or no string stay as they are."""
    for field in fields:
        tree = _resolve_at(tree, field.split("."), base)
    return tree


def _resolve_at(node: Any, keys: list[str], base: Path) -> Any:
    if not keys:
        return resolve_path(node, base) if isinstance(node, str) else node
    head, *rest = keys
    if head == "*":
        return [_resolve_at(item, rest, base) for item in node] if isinstance(node, list) else node
    if isinstance(node, dict) and head in node:
        return {**node, head: _resolve_at(node[head], rest, base)}
    return node


def resolve_path(path: str, base: Path) -> str:
    """``path`` (``~`` expanded) made absolute against ``base`` and normalised, or, for the bare name
    of a shipped file (``animal-mnist``) that names no file at ``base``, that shipped file; URLs
    (``scheme://...``) and ``pipe:`` commands unchanged."""
    if _KEPT.match(path):
        return path
    found = _shipped_files().get(path.removesuffix(SUFFIX), set())
    if Path(path).name == path and len(found) == 1 and not (base / path).exists():
        return str(next(iter(found)))
    return os.path.normpath(base / os.path.expanduser(path))


@functools.cache
def _shipped_files() -> dict[str, set[Path]]:
    """Every shipped file by name, over all kinds (listed once: the installed folders do not change)."""
    files: dict[str, set[Path]] = {}
    for kind in FOLDERS:
        for name, path in shipped(kind).items():
            files.setdefault(name, set()).add(path)
    return files

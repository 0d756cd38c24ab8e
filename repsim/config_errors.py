"""One-line descriptions of pydantic validation errors in YAML specs and configs: the file, the field, the fix.
Fields inside discriminated unions are named without the union's tag (``source.root``, not ``source.image_folder.root``).
"""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

import yaml
from pydantic import BaseModel, ValidationError
from pydantic.fields import FieldInfo

from repsim.errors import SpecError


def read_yaml_mapping(path: Path, kind: str, example: str) -> dict[str, Any]:
    """The YAML mapping in the ``kind`` file at ``path`` (e.g. "data spec"); SpecError when it is not readable
    text, not valid YAML, or not a mapping of field names (the fix points at ``example``)."""
    text = read_text(path, kind)
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark else ""
        raise SpecError(f"{path}: not valid YAML{where}", "fix the YAML syntax") from None
    except RecursionError:
        raise SpecError(f"{path}: the YAML nests too deeply to read", f"start from {example}") from None
    if not isinstance(raw, dict):
        raise SpecError(f"{path}: the top level is {_what_value(raw)}, not a mapping of fields",
                        f"start from {example}")
    names = [name for name in raw if not isinstance(name, str)]
    if names:
        raise SpecError(f"{path}: the top-level key {names[0]!r} is not a field name", f"start from {example}")
    return raw


def read_text(path: Path, kind: str) -> str:
    """The UTF-8 text of the ``kind`` file at ``path``; SpecError when it is missing, not a regular file,
    unreadable, binary (holds NUL bytes) or not UTF-8."""
    path = Path(path)
    if not path.exists():
        raise SpecError(f"{kind} {path} does not exist", "check the path")
    if not path.is_file():
        raise SpecError(f"{kind} {path} is {'a directory' if path.is_dir() else 'not a regular file'}",
                        "give the path of a YAML file")
    try:
        data = path.read_bytes()
    except OSError as err:
        raise SpecError(f"{kind} {path} cannot be read ({err.strerror or err})", "check its permissions") from None
    if b"\0" in data:
        raise SpecError(f"{kind} {path} is a binary file (it holds NUL bytes), not YAML text",
                        "give the path of a YAML file")
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as err:
        raise SpecError(f"{kind} {path} is not UTF-8 text (byte {data[err.start]:#04x} at offset {err.start})",
                        "save it as UTF-8") from None


def _what_value(value: Any) -> str:
    """How a YAML top level that is not a mapping reads to a person: "empty", "a list", "text"."""
    return {type(None): "empty", list: "a list", str: "text"}.get(type(value), f"a single value ({value!r:.40})")


def describe(err: ValidationError, path: Path | str, model: type[BaseModel]) -> tuple[str, str]:
    """(what, fix) for the first error of validating the YAML at ``path`` as ``model``."""
    first = err.errors()[0]
    kind, loc = first["type"], first["loc"]
    _, field = model_at(model, loc)
    dotted = ".".join(field) or "(top level)"
    if kind == "extra_forbidden":
        parent, _ = model_at(model, loc[:-1])
        allowed = sorted(parent.model_fields) if parent else []
        close = difflib.get_close_matches(field[-1], allowed, n=1)
        hint = f"did you mean '{close[0]}'? " if close else ""
        return f"{path}: unknown field '{dotted}'", f"{hint}allowed here: {', '.join(allowed)}"
    tag_field = first.get("ctx", {}).get("discriminator", "").strip("'")
    if kind == "union_tag_invalid":
        return (f"{path}: field '{dotted}.{tag_field}' is {first['ctx']['tag']!r}, which is not known",
                f"use one of {first['ctx']['expected_tags']}")
    if kind == "union_tag_not_found":
        return (f"{path}: field '{dotted}' has no '{tag_field}'",
                f"add '{tag_field}:' with one of {_tags_at(model, loc, tag_field)}")
    if kind == "missing":
        return f"{path}: field '{dotted}' is required", "add it"
    return f"{path}: field '{dotted}': {message(err)}", "correct that value"


def message(err: ValidationError) -> str:
    """The first error's message without pydantic's ``Value error, `` prefix."""
    return err.errors()[0]["msg"].removeprefix("Value error, ")


def model_at(model: type[BaseModel], loc: tuple[Any, ...]) -> tuple[type[BaseModel] | None, tuple[str, ...]]:
    """Walk a pydantic error location: the innermost model and the field path without union tags."""
    current: type[BaseModel] | None = model
    union: list[type[BaseModel]] = []
    field: list[str] = []
    for part in loc:
        if isinstance(part, int):
            continue
        tagged = [m for m in union if _has_tag(m, part)]
        if tagged:
            current, union = tagged[0], []
            continue
        field.append(str(part))
        inner = current.model_fields.get(part) if current is not None else None
        candidates = _field_models(inner) if inner is not None else []
        current = candidates[0] if len(candidates) == 1 else None
        union = candidates if len(candidates) > 1 else []
    return current, tuple(field)


def _has_tag(model: type[BaseModel], tag: Any) -> bool:
    """Whether one of ``model``'s fields is the literal ``tag`` (the member of a discriminated union)."""
    return any(get_origin(info.annotation) is Literal and tag in get_args(info.annotation)
               for info in model.model_fields.values())


def _tags_at(model: type[BaseModel], loc: tuple[Any, ...], tag_field: str) -> str:
    """The tags the union at ``loc`` accepts, quoted and comma-separated."""
    parent, _ = model_at(model, loc[:-1]) if loc else (None, ())
    inner = parent.model_fields.get(loc[-1]) if parent is not None else None
    members = _field_models(inner) if inner is not None else []
    tags = [tag for m in members for tag in get_args(m.model_fields[tag_field].annotation)]
    return ", ".join(repr(tag) for tag in tags)


def _field_models(field: FieldInfo) -> list[type[BaseModel]]:
    """The models a value of ``field`` can validate into: those its annotation names, and those a validator in
    its metadata picks from (``models()``, e.g. :class:`repsim.registry.Registry`)."""
    return [m for part in (field.annotation, *field.metadata) for m in _models_in(part)]


def _models_in(annotation: Any) -> list[type[BaseModel]]:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    if hasattr(annotation, "models"):
        return list(annotation.models())
    return [m for arg in get_args(annotation) for m in _models_in(arg)]

"""Models chosen by a tag field, registered by the modules that define them: a method's settings by ``name``
(:mod:`repsim.methods.config`), an experiment section by ``kind`` (:mod:`repsim.sections`). A field annotated
``Annotated[Any, registry]`` validates a mapping into the model its tag names, consulting the registry when a
value is validated: the library's own modules are imported then, and a package's through its entry points."""

from __future__ import annotations

from collections.abc import Callable
from functools import cache
from importlib.metadata import entry_points
from typing import Annotated, Any, Union, get_args

from pydantic import BaseModel, Field, GetCoreSchemaHandler, TypeAdapter
from pydantic_core import core_schema

from repsim.errors import SpecError, first_line


class Registry:
    """The models of ``what`` accepted under each value of their ``tag`` field, shipped ones (defined in a module of
    ``package``, registered once ``import_shipped()`` has run) first, then those of other packages, found
    through the entry points ``group`` (an entry point named for the tag value names the defining module).
    Shipped ones are listed ``in_order`` of registration, else sorted."""

    def __init__(self, what: str, tag: str, group: str, package: str, import_shipped: Callable[[], None],
                 in_order: bool = False) -> None:
        self.what, self.tag, self.group, self.package, self.in_order = what, tag, group, package, in_order
        self._import_shipped = cache(import_shipped)
        self._models: dict[str, type[BaseModel]] = {}

    def accept(self, value: str, model: type[BaseModel]) -> None:
        """Let ``<tag>: <value>`` validate into ``model``, whose tag field is ``Literal["<value>"]``; it
        replaces a model accepted under ``value`` before."""
        field = model.model_fields.get(self.tag)
        if field is None or get_args(field.annotation) != (value,):
            raise TypeError(f"{model.__name__} must be a model with {self.tag}: Literal[{value!r}]")
        self._models[value] = model

    def shipped(self) -> tuple[str, ...]:
        """The tag values the library ships."""
        self._import_shipped()
        shipped = [value for value, model in self._models.items() if self._is_shipped(model)]
        return tuple(shipped if self.in_order else sorted(shipped))

    def registered(self) -> dict[str, type[BaseModel]]:
        """The models by tag value, shipped ones first."""
        outside = [value for value, model in self._models.items() if not self._is_shipped(model)]
        return {value: self._models[value] for value in (*self.shipped(), *outside)}

    def load(self, value: str) -> None:
        """Register the shipped models, then, when none is ``value``, import the module a package names for it
        under the entry points (nothing when none does); SpecError in one line when it does not import."""
        if value in self.registered():
            return
        for point in entry_points(group=self.group, name=value):
            try:
                point.load()
            except Exception as err:  # whatever the outside module raises while it imports
                package = point.dist.name if point.dist else "?"
                raise SpecError(f"{self.what} {value!r} of {point.value!r} (entry point of {package}) does not import: "
                                f"{first_line(err)}", "fix or reinstall the package") from None

    def validate(self, value: Any) -> BaseModel:
        """``value`` (a mapping, or a model already validated) as the model its tag names."""
        tag = value.get(self.tag) if isinstance(value, dict) else getattr(value, self.tag, None)
        if isinstance(tag, str):
            self.load(tag)
        registered = self.registered()
        if isinstance(value, BaseModel) and registered.get(tag) is type(value):
            return value
        return _union(tuple(registered.values()), self.tag).validate_python(value)

    def models(self) -> tuple[type[BaseModel], ...]:
        """The candidates a value validates into (for error descriptions, :mod:`repsim.config_errors`)."""
        return tuple(self.registered().values())

    def __get_pydantic_core_schema__(self, source: Any, handler: GetCoreSchemaHandler) -> core_schema.CoreSchema:
        return core_schema.no_info_plain_validator_function(self.validate)

    def _is_shipped(self, model: type[BaseModel]) -> bool:
        return model.__module__.startswith(f"{self.package}.") or model.__module__ == self.package


@cache
def _union(models: tuple[type[BaseModel], ...], tag: str) -> TypeAdapter:
    """The discriminated union of ``models`` by ``tag``: its errors are pydantic's own (unknown or missing tag,
    the field of the member the tag picks)."""
    return TypeAdapter(Annotated[Union[models], Field(discriminator=tag)])  # noqa: UP007 (models known at run time)

"""Strict loading of YAML files into pydantic models, with errors that name the file and the field."""

from __future__ import annotations

import types
from pathlib import Path
from typing import Any, TypeVar, Union, get_args, get_origin

import yaml
from pydantic import BaseModel, ConfigDict, Tag, TypeAdapter, ValidationError, ValidationInfo, field_validator
from pydantic_core import ErrorDetails, PydanticCustomError

from common.errors import ConfigError

T = TypeVar("T")

# Pydantic's error types for "not a mapping" where a model or a dict was wanted: at the top level its
# message names an internal class (`instance of ClusterFile`), which tells the file's author nothing.
_NOT_A_MAPPING = ("model_type", "dict_type")
_KINDS = {list: "a list", str: "a string", int: "a number", float: "a number", bool: "true or false"}


_TAG_MARK = "~"   # starts the name of a union member's tag, which pydantic puts in the error's path


def union_tag(name: str) -> Tag:
    """The tag of one member of a discriminated union, left out of the field paths errors name: in the
    file the member's fields sit where the union is (`launch.time_scale`, not `launch.engine.time_scale`)."""
    return Tag(_TAG_MARK + name)


def _takes_number_not_bool(annotation: Any) -> bool:
    """The field takes an int or a float (alone or in a union, `int | None`) and no boolean."""
    args = get_args(annotation) if get_origin(annotation) in (Union, types.UnionType) else (annotation,)
    return bool not in args and any(a in (int, float) for a in args)


class StrictModel(BaseModel):
    """Base for config models: unknown keys are errors, values are immutable after loading, a float
    is finite (YAML's `.inf` would turn a timeout or a limit off without a word, `.nan` fail every
    comparison made with it), and a number is not a boolean: YAML reads `off`, `no` and `yes` as
    booleans, which pydantic would take as 0 and 1 (`ttft_slo_s: no` a 0 s target)."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _no_boolean_numbers(cls, value: Any, info: ValidationInfo) -> Any:
        if isinstance(value, bool) and info.field_name is not None and _takes_number_not_bool(
                cls.model_fields[info.field_name].annotation):
            raise PydanticCustomError("number_not_bool", "a number, not {value} (YAML reads yes/no/on/off as "
                                      "true/false)", {"value": str(value).lower()})
        return value


class UniqueKeyLoader(yaml.SafeLoader):  # type: ignore[misc]   # PyYAML ships no type hints
    """SafeLoader that refuses a key given twice in one mapping: PyYAML keeps the last one silently, so
    a setting written twice would take whichever came later, and the file would read as if both held."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        first: dict[Any, yaml.Node] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":   # `<<: *base` may override what it merges
                continue
            key = self.construct_object(key_node, deep=deep)
            try:
                seen = first.setdefault(key, key_node)
            except TypeError:   # unhashable: the base class refuses it with its own message
                continue
            if seen is not key_node:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r} (first at line {seen.start_mark.line + 1})",
                    key_node.start_mark)
        mapping: dict[Any, Any] = super().construct_mapping(node, deep)
        return mapping


def _one_line(exc: yaml.YAMLError) -> str:
    """Where and what: the problem at its mark, and the construct it was in (`while parsing a flow sequence`).
    PyYAML's own message spans five lines, the offending text and a caret among them, and names the
    input `<unicode string>`; the commands that read a config print the file's path instead."""
    if not isinstance(exc, yaml.MarkedYAMLError) or exc.problem_mark is None:
        return " ".join(str(exc).split())
    mark = exc.problem_mark
    within = (f" ({exc.context} at line {exc.context_mark.line + 1}, column {exc.context_mark.column + 1})"
              if exc.context and exc.context_mark is not None else "")
    return f"line {mark.line + 1}, column {mark.column + 1}: {exc.problem}{within}"


def read_yaml(path: Path) -> Any:
    try:
        return yaml.load(path.read_text(), Loader=UniqueKeyLoader)
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror}") from exc
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {_one_line(exc)}") from exc


def where(data: Any, loc: tuple[int | str, ...]) -> str:
    """A field's path, naming list entries that have an `id` by it too: `backends.3 (h100-0).gpu`."""
    parts: list[str] = []
    node = data
    for key in loc:
        if isinstance(key, str) and key.startswith(_TAG_MARK):
            continue
        part = str(key)
        if isinstance(node, list) and isinstance(key, int) and 0 <= key < len(node):
            node = node[key]
            if isinstance(node, dict) and isinstance(node.get("id"), str):
                part = f"{key} ({node['id']})"
        elif isinstance(node, dict):
            node = node.get(key)
        else:
            node = None
        parts.append(part)
    return ".".join(parts) or "(top level)"


def _not_a_mapping(path: Path, data: Any, errors: list[ErrorDetails]) -> str | None:
    """The plain message for a file that is no mapping where one was wanted (empty, comments only, a
    list); None for any other error."""
    if len(errors) != 1 or errors[0]["loc"] != () or errors[0]["type"] not in _NOT_A_MAPPING:
        return None
    if data is None:
        return f"{path}: the file is empty (no keys, at most comments)"
    return f"{path}: expected a mapping of keys at the top level, got {_KINDS.get(type(data), type(data).__name__)}"


def validate(path: Path, data: Any, target: type[T] | Any) -> T:
    """Validate `data` (read from `path`) as `target`; raise ConfigError listing every bad field."""
    try:
        return TypeAdapter(target).validate_python(data)  # type: ignore[no-any-return]
    except ValidationError as exc:
        errors = exc.errors()
        plain = _not_a_mapping(path, data, errors)
        if plain is not None:
            raise ConfigError(plain) from None
        raise ConfigError("\n".join(f"{path}: {where(data, err['loc'])}: {err['msg']}" for err in errors)) from None


def load(path: Path, target: type[T] | Any) -> T:
    loaded: T = validate(path, read_yaml(path), target)
    return loaded

"""Strict loading of YAML files into pydantic models, with errors that name the file and the field."""

from __future__ import annotations

from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ConfigDict, TypeAdapter, ValidationError

from common.errors import ConfigError

T = TypeVar("T")


class StrictModel(BaseModel):
    """Base for config models: unknown keys are errors, values are immutable after loading."""

    model_config = ConfigDict(extra="forbid", frozen=True)


def read_yaml(path: Path) -> Any:
    try:
        return yaml.safe_load(path.read_text())
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror}") from exc
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from exc


def where(data: Any, loc: tuple[int | str, ...]) -> str:
    """A field's path, naming list entries that have an `id` by it too: `backends.3 (h100-0).gpu`."""
    parts: list[str] = []
    node = data
    for key in loc:
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


def validate(path: Path, data: Any, target: type[T] | Any) -> T:
    """Validate `data` (read from `path`) as `target`; raise ConfigError listing every bad field."""
    try:
        return TypeAdapter(target).validate_python(data)  # type: ignore[no-any-return]
    except ValidationError as exc:
        lines = []
        for err in exc.errors():
            where_ = where(data, err["loc"])
            lines.append(f"{path}: {where_}: {err['msg']}")
        raise ConfigError("\n".join(lines)) from None


def load(path: Path, target: type[T] | Any) -> T:
    loaded: T = validate(path, read_yaml(path), target)
    return loaded

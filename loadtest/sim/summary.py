"""Aggregated results with label lookups, shared by the report's tables and plots."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any


class Summary:
    """Rows of (experiment, labels…, metric means and stds); `one`/`where` select by labels."""

    def __init__(self, rows: list[dict[str, Any]]) -> None:
        self.rows = rows

    def where(self, experiment: str, **labels: Any) -> list[dict[str, Any]]:
        return [
            r for r in self.rows
            if r["experiment"] == experiment and all(r.get(k) == v for k, v in labels.items())
        ]

    def one(self, experiment: str, **labels: Any) -> dict[str, Any]:
        found = self.where(experiment, **labels)
        if len(found) != 1:
            raise KeyError(f"{experiment} {labels}: {len(found)} rows")
        return found[0]

    def value(self, experiment: str, metric: str, **labels: Any) -> float:
        return float(self.one(experiment, **labels)[metric])

    def values(self, experiment: str, metric: str, key: str, keys: Iterable[Any], **labels: Any) -> list[float]:
        return [self.value(experiment, metric, **{key: k}, **labels) for k in keys]


def fmt(mean: float, std: float | None = None, digits: int = 0) -> str:
    """'1,234 ± 56' with thousands separators; NaN as '–'."""
    if mean != mean:
        return "–"
    text = f"{mean:,.{digits}f}"
    return text if std is None else f"{text} ± {std:,.{digits}f}"


def cell(row: dict[str, Any], metric: str, digits: int = 0) -> str:
    return fmt(row[metric], row.get(f"{metric}_std"), digits)


def table(header: list[str], rows: list[list[str]]) -> str:
    """A GitHub-flavoured Markdown table."""
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)

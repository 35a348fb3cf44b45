"""Argument types of the planner's command lines (`gateway plan`, the bursty autoscaling benchmark).

Each raises argparse's ArgumentTypeError, so that argparse names the option in its error, which
`common.one_line_parser.OneLineParser` makes the one line `PROG: error: ...` (argparse's own puts the
whole usage before it). Every
float is checked finite: `float()` takes "inf" and "nan", which no rate, duration or SLO can be (an
infinite rate overflows the trace length, a nan time scale writes a file the gateway refuses).
"""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Callable
from pathlib import Path

from loadtest.planner.workload import MAX_RATE_RPS


def finite(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, not {text}")
    return value


def positive(text: str) -> float:
    value = finite(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be positive, not {text}")
    return value


def rate(text: str) -> float:
    """Requests/s: positive, and MAX_RATE_RPS at most (loadtest/planner/workload.py says why)."""
    value = positive(text)
    if value > MAX_RATE_RPS:
        raise argparse.ArgumentTypeError(f"must be at most {MAX_RATE_RPS:,.0f} requests/s, not {text}")
    return value


def non_negative(text: str) -> float:
    value = finite(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be at least 0, not {text}")
    return value


def share(text: str) -> float:
    value = finite(text)
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be in [0, 1], not {text}")
    return value


def some_share(text: str) -> float:
    """A share that asks for something: in (0, 1] (an attainment target of 0 is met by any plan)."""
    value = finite(text)
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], not {text}")
    return value


def below_one(text: str) -> float:
    """A share that must leave something: in [0, 1) (a low mark under the high mark it is a share of)."""
    value = finite(text)
    if not 0.0 <= value < 1.0:
        raise argparse.ArgumentTypeError(f"must be in [0, 1), not {text}")
    return value


def between(low: float, high: float) -> Callable[[str], float]:
    """A number type in [low, high] (a duration with a floor or a ceiling of its own)."""
    def parse(text: str) -> float:
        value = finite(text)
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"must be in [{low:g}, {high:g}], not {text}")
        return value
    return parse


def at_least(low: int, high: int | None = None) -> Callable[[str], int]:
    """An integer type of `low` or more, and `high` at most if given (a seed: 0; a count: 1)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not an integer: {text}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be at least {low}, not {text}")
        if high is not None and value > high:
            raise argparse.ArgumentTypeError(f"must be at most {high:,}, not {text}")
        return value
    return parse


count = at_least(1)
seed = at_least(0)          # numpy's generators take no negative seed
# Simulation processes: past a few per core they only add memory (each holds the trace and a simulator),
# and a slip such as 1000 would start a thousand processes.
MAX_WORKERS = 4 * (os.cpu_count() or 1)
workers = at_least(1, MAX_WORKERS)


def inventory(text: str) -> tuple[tuple[str, int], ...]:
    """`H100=4,L40S=8` → (("H100", 4), ("L40S", 8)); a count of 0 is a slip (a GPU not on hand is left out),
    refused rather than searched."""
    out: dict[str, int] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, sep, n = part.partition("=")
        if not sep or not name.strip() or not n.strip().isdigit() or int(n) < 1:
            raise argparse.ArgumentTypeError(f"{part!r}: write GPU=COUNT with a count of 1 or more, e.g. H100=4")
        out[name.strip()] = out.get(name.strip(), 0) + int(n)
    if not out:
        raise argparse.ArgumentTypeError("an inventory needs at least one GPU=COUNT")
    return tuple(out.items())


def names(text: str) -> tuple[str, ...]:
    """`H100, L40S` → ("H100", "L40S"); an empty list (`,`) is refused rather than read as no choice made."""
    out = tuple(filter(None, (p.strip() for p in text.split(","))))
    if not out:
        raise argparse.ArgumentTypeError(f"{text!r}: give at least one name, comma-separated")
    return out


def unwritable(path: Path) -> str | None:
    """Why a file cannot be written at `path` (None: it can), checked before minutes of search rather than after:
    the path is a folder, or its nearest existing folder is not one or is not writable (the missing ones
    between are created on writing)."""
    if path.is_dir():
        return f"{path} is a folder; give a file name"
    if path.exists():
        return None if os.access(path, os.W_OK) else f"{path}: not writable"
    parent = path.parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        return f"{path}: {parent} is not a folder"
    return None if os.access(parent, os.W_OK | os.X_OK) else f"{path}: folder {parent} is not writable"

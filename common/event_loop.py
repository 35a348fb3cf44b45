"""The event loop every HeteroGate process runs on."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


def run(main_coro: Coroutine[Any, Any, T]) -> T:
    """asyncio.run on uvloop when it is installed; what the coroutine returns."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main_coro)
    return uvloop.run(main_coro)

"""The event loop every HeteroGate process runs on."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any


def run(main_coro: Coroutine[Any, Any, None]) -> None:
    """asyncio.run on uvloop when it is installed."""
    try:
        import uvloop
    except ImportError:
        asyncio.run(main_coro)
    else:
        uvloop.run(main_coro)

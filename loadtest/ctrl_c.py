"""Ctrl-C for a command whose forked workers must not answer it themselves.

Ctrl-C at a terminal reaches the whole process group. The workers of `gateway plan` and `loadtest.sim`'s
reports ignore SIGINT (their initializers say so) and their parent stops them; but a worker forks with
the parent's handler, and one signalled between its fork and its initializer raised KeyboardInterrupt
in multiprocessing's start-up code and printed a traceback of its own (a command's one-line message
became several). Within `ctrl_c_in_this_process_only`, Python's Ctrl-C handler is replaced by one that
raises only in the process that installed it and does nothing in a child forked with it.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType


@contextmanager
def ctrl_c_in_this_process_only() -> Iterator[None]:
    """Within, Ctrl-C raises KeyboardInterrupt in this process and is ignored by its forks. Left as it
    is where Ctrl-C is already ignored (a command started in the background). Main thread only."""
    if signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        yield
        return
    owner = os.getpid()

    def handler(signum: int, frame: FrameType | None) -> None:
        if os.getpid() == owner:
            raise KeyboardInterrupt

    signal.signal(signal.SIGINT, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)

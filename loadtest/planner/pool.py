"""The search's simulation processes, which must not outlive the command that started them.

A forked worker of a ProcessPoolExecutor keeps its end of the pool's pipes, so when the parent dies it
never sees them close: it would wait, re-parented to PID 1, for ever. Three things stop it:

    the parent unwinds  an exception leaving `worker_pool` (Ctrl-C, or SIGTERM once the command turns it into
                        `Terminated`) terminates the workers, without waiting for the simulations they
                        are running, and cancels what is queued
    the parent is killed  each worker asks Linux for SIGTERM when its parent dies (PR_SET_PDEATHSIG), and
                        exits at once if the parent died before it asked
    Ctrl-C at a terminal  reaches the whole process group; the workers ignore it, and the parent stops them
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from contextlib import contextmanager
from multiprocessing import get_context
from types import FrameType

from loadtest.ctrl_c import ctrl_c_in_this_process_only

PR_SET_PDEATHSIG = 1            # <linux/prctl.h>


class Terminated(BaseException):
    """SIGTERM, raised in the main thread so that `with` blocks unwind. A BaseException, like KeyboardInterrupt,
    so that no `except Exception` on the way swallows it."""


@contextmanager
def sigterm_raises() -> Iterator[None]:
    """Within, SIGTERM raises `Terminated` (a command's choice, not the search's: a library call leaves the
    process's signals alone); the previous handler is back on leaving. Main thread only."""
    owner = os.getpid()

    def handler(signum: int, frame: FrameType | None) -> None:
        if os.getpid() != owner:        # a worker forked with this handler, stopped before its initializer ran
            os._exit(128 + signum)
        raise Terminated

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextmanager
def worker_pool(workers: int) -> Iterator[ProcessPoolExecutor]:
    """A pool of `workers` forked processes, shut down on leaving; on an exception, at once (module docstring)."""
    pool = ProcessPoolExecutor(workers, mp_context=get_context("fork"), initializer=_follow_parent,
                               initargs=(os.getpid(),))
    try:
        with ctrl_c_in_this_process_only():   # a worker not yet in its initializer ignores it too
            yield pool
    except BaseException:
        for process in list((pool._processes or {}).values()):   # no public way to stop work under way
            process.terminate()
        pool.shutdown(cancel_futures=True)     # prompt with no worker left; no thread of it left at exit
        raise
    pool.shutdown()


def _follow_parent(parent: int) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)     # forked with the parent's handler: restore the default
    if sys.platform == "linux":
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != parent:
        os._exit(1)

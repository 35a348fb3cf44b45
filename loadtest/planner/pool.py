"""The search's simulation processes, which must not outlive the command that started them.

A forked worker of a ProcessPoolExecutor keeps its end of the pool's pipes, so when the parent dies it
never sees them close: it would wait, re-parented to PID 1, for ever. Three things stop it:

    the parent unwinds  an exception leaving `worker_pool` (Ctrl-C, or SIGTERM once the command turns it into
                        `Terminated`) terminates the workers, without waiting for the simulations they
                        are running, and cancels what is queued
    the parent is killed  each worker asks Linux for SIGTERM when its parent dies (PR_SET_PDEATHSIG), and
                        exits at once if the parent died before it asked
    Ctrl-C at a terminal  reaches the whole process group; the workers ignore it, and the parent stops them

Two things keep that unwinding clean. Jobs are submitted with Ctrl-C and SIGTERM held back (`submit_all`):
the first submission forks the workers and starts the pool's manager thread, and an interrupt landing
between the two left a pool whose shutdown raised "cannot join thread before it is started" (a traceback
and exit status 1 instead of the command's one line). And the data every job shares (the search's
problem: its trace pickles to about 200 kB) reaches the workers through the fork (`shared`), so that a job
on the call queue is a few hundred bytes: terminated workers never leave the queue's feeder thread
half-way through a write larger than the pipe.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from contextlib import contextmanager
from multiprocessing import get_context
from types import FrameType
from typing import Any, TypeVar

from loadtest.ctrl_c import ctrl_c_in_this_process_only

PR_SET_PDEATHSIG = 1            # <linux/prctl.h>
INTERRUPTS = (signal.SIGINT, signal.SIGTERM)

T = TypeVar("T")
R = TypeVar("R")

_shared: Any = None             # in a worker: what `worker_pool(..., shared=)` was given


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


def stopped_in_one_line(prog: str, stopped: str, run: Callable[[], int]) -> int:
    """`run()`'s status; Ctrl-C and SIGTERM (`sigterm_raises` within) unwind it and end in one line,
    "PROG: interrupted; STOPPED" (130) or "PROG: terminated; STOPPED" (143), not a traceback."""
    try:
        with sigterm_raises():
            return run()
    except KeyboardInterrupt:
        print(f"{prog}: interrupted; {stopped}", file=sys.stderr)
        return 130
    except Terminated:
        print(f"{prog}: terminated; {stopped}", file=sys.stderr)
        return 143


@contextmanager
def worker_pool(workers: int, shared: object = None) -> Iterator[ProcessPoolExecutor]:
    """A pool of `workers` forked processes, shut down on leaving; on an exception, at once (module docstring).
    In the workers, `shared()` returns `shared`, inherited through the fork rather than pickled per job."""
    pool = ProcessPoolExecutor(workers, mp_context=get_context("fork"), initializer=_follow_parent,
                               initargs=(os.getpid(), shared))
    try:
        with ctrl_c_in_this_process_only():   # a worker not yet in its initializer ignores it too
            yield pool
    except BaseException:
        for process in list((pool._processes or {}).values()):   # no public way to stop work under way
            process.terminate()
        pool.shutdown(cancel_futures=True)     # prompt with no worker left; no thread of it left at exit
        raise
    pool.shutdown()


def submit_all(pool: ProcessPoolExecutor, fn: Callable[[T], R], jobs: Iterable[T]) -> list[Future[R]]:
    """`pool.submit(fn, job)` for each job with Ctrl-C and SIGTERM held back, then delivered: an interrupt
    never lands inside the pool's own start-up (module docstring). Main thread only."""
    owner = os.getpid()
    held: list[int] = []

    def hold(signum: int, frame: FrameType | None) -> None:
        if os.getpid() == owner:
            held.append(signum)
        elif signum == signal.SIGTERM:    # a worker forked here, stopped before its initializer ran
            os._exit(128 + signum)

    previous = {s: signal.signal(s, hold) for s in INTERRUPTS}
    try:
        return [pool.submit(fn, job) for job in jobs]
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        for signum in dict.fromkeys(held):
            signal.raise_signal(signum)     # now, by the handler the command had


def shared() -> Any:
    """In a worker of `worker_pool`, the data the pool was made with."""
    return _shared


def _follow_parent(parent: int, data: object) -> None:
    global _shared
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)     # forked with the parent's handler: restore the default
    if sys.platform == "linux":
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != parent:
        os._exit(1)
    _shared = data

"""`gateway plan`'s simulation processes stop with it: on SIGTERM, on Ctrl-C, and when it is killed outright."""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Iterator

import pytest

from loadtest.planner.pool import sigterm_raises, submit_all, worker_pool
from tests.planner.processes import stop_with_workers

pytestmark = pytest.mark.timeout(180)

# a search of many minutes: 120 req/s, half with images, a $30/hour budget (docs/PLANNING.md's long example)
LONG_SEARCH = [sys.executable, "-m", "gateway.cli", "plan", "--rate", "120", "--image-share", "0.5", "--budget", "30",
               "--time-limit", "600", "--max-simulations", "1000", "--workers", "2"]


@pytest.mark.parametrize(("sig", "status", "said"), [
    (signal.SIGTERM, 143, "gateway plan: terminated"),
    (signal.SIGINT, 130, "gateway plan: interrupted"),
    (signal.SIGKILL, -signal.SIGKILL, ""),
])
def test_no_worker_outlives_the_command(sig: signal.Signals, status: int, said: str) -> None:
    stopped = stop_with_workers(LONG_SEARCH, sig)
    assert stopped.survivors == []
    assert stopped.returncode == status
    assert stopped.stderr.startswith(said) and "Traceback" not in stopped.stderr
    assert stopped.stderr.count("\n") == (1 if said else 0)      # one line: no worker says anything


def _fork_and_signal(sig: signal.Signals) -> int:
    """The exit code of a child forked here that receives `sig` before anything else runs in it: 7 when
    the signal was ignored there, 8 when it raised there."""
    pid = os.fork()
    if pid == 0:
        try:
            os.kill(os.getpid(), sig)
            time.sleep(0.5)
        except BaseException:
            os._exit(8)
        os._exit(7)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def test_a_worker_stopped_before_its_initializer_exits_quietly() -> None:
    """A worker forks with the command's SIGTERM handler: it must exit as SIGTERM would, not raise in the child."""
    with sigterm_raises():
        assert _fork_and_signal(signal.SIGTERM) == 128 + signal.SIGTERM


def test_a_worker_ignores_ctrl_c_before_its_initializer() -> None:
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)   # as at a terminal
    try:
        with worker_pool(1):
            assert _fork_and_signal(signal.SIGINT) == 7
    finally:
        signal.signal(signal.SIGINT, previous)


def test_an_interrupt_during_submission_is_delivered_after_it() -> None:
    """Ctrl-C while jobs are being submitted (the first submission forks the workers and starts the pool's
    thread) waits until every job is in, then raises as usual: the pool is never left half started."""
    yielded = []

    def jobs() -> Iterator[int]:
        for n in range(3):
            yielded.append(n)
            if n == 0:
                os.kill(os.getpid(), signal.SIGINT)
            yield n

    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt), worker_pool(1) as pool:
            submit_all(pool, abs, jobs())
        assert yielded == [0, 1, 2]
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        signal.signal(signal.SIGINT, previous)

"""`gateway plan`'s simulation processes stop with it: on SIGTERM, on Ctrl-C, and when it is killed outright."""

from __future__ import annotations

import signal
import sys

import pytest

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

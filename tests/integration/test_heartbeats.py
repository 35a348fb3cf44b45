"""Heartbeats drive the candidate set: a silent engine leaves it, a resumed or restarted one rejoins.

One gateway, three managed engines (one per GPU type), heartbeats every 100 ms, round robin so that
every candidate gets its turn and a backend missing from the responses can only be missing because
the gateway dropped it.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from testkit.harness import (
    Gateway,
    engine_pid,
    pid_alive,
    run_gateway,
    sigstopped,
    wait_all_healthy,
    write_config,
)

MODEL = "llava-1.5-7b"
INTERVAL_S = 0.1
MISS_LIMIT = 3
# Scheduling, the admin poll and HTTP on a busy two-core machine, on top of MISS_LIMIT intervals.
SLACK_S = 0.6
IDS = ("h100-0", "a100-0", "l40s-0")

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    tmp: Path = tmp_path_factory.mktemp("heartbeats")
    launch = {"time_scale": 0.05}
    config = write_config(tmp, {
        "model": MODEL,
        "gateway": {"heartbeat_interval_ms": int(INTERVAL_S * 1000), "heartbeat_miss_limit": MISS_LIMIT},
        "backends": [
            {"id": "h100-0", "gpu": "H100", "launch": launch},
            {"id": "a100-0", "gpu": "A100-80GB", "launch": launch},
            {"id": "l40s-0", "gpu": "L40S", "launch": launch},
        ],
    })
    with run_gateway(config, "--policy", "round_robin") as g:
        yield g


def served_by(gw: Gateway, n: int) -> list[str]:
    """Send `n` small requests one after another; the backend that served each (all must succeed)."""
    out = []
    with gw.client(timeout=15) as c:
        for i in range(n):
            r = c.post("/v1/completions", json={"model": MODEL, "prompt": f"ping {i}", "max_tokens": 2})
            assert r.status_code == 200, r.text
            out.append(r.headers["x-heterogate-backend"])
    return out


def test_managed_engines_report_their_own_kv_capacity_and_context(gw: Gateway) -> None:
    for b in wait_all_healthy(gw):
        assert (b["kv_capacity_source"], b["context_source"], b["max_model_len"]) == ("engine", "engine", 4096), b
        assert b["kv_total_bytes"] > 0


def test_stopped_engine_leaves_the_candidate_set_and_returns_after_sigcont(gw: Gateway) -> None:
    wait_all_healthy(gw)
    victim = "a100-0"
    pid = engine_pid(gw, victim)
    with sigstopped(pid):
        bound = MISS_LIMIT * INTERVAL_S + SLACK_S
        try:
            gw.wait_until(lambda: not gw.backend(victim)["healthy"], timeout=bound, interval=0.02)
        except TimeoutError:
            pytest.fail(f"{victim} still healthy {bound:.2f} s after its engine stopped heartbeating")
        others = {b["id"]: b["healthy"] for b in gw.backends() if b["id"] != victim}
        assert all(others.values()), others
        ready = httpx.get(f"{gw.url}/ready", timeout=5).json()
        assert ready["healthy_language_backends"] == len(IDS) - 1
        seen = served_by(gw, 6)
        assert victim not in seen, seen
        assert set(seen) == set(IDS) - {victim}
        assert not gw.backend(victim)["healthy"]
    gw.wait_until(lambda: gw.backend(victim)["healthy"], timeout=10)
    assert gw.backend(victim)["pid"] == pid   # the same engine came back, not a restart
    assert victim in served_by(gw, 2 * len(IDS))


def test_killed_engine_is_restarted_and_serves_again(gw: Gateway) -> None:
    wait_all_healthy(gw)
    victim = "l40s-0"
    old = engine_pid(gw, victim)
    os.kill(old, signal.SIGKILL)
    # While it is down, and before its heartbeats lapse, requests routed to it are retried elsewhere.
    assert all(b in IDS for b in served_by(gw, 3))

    def restarted() -> bool:
        b = gw.backend(victim)
        return bool(b["healthy"] and b["pid"] not in (None, old))

    gw.wait_until(restarted, timeout=20)
    gw.wait_until(lambda: not pid_alive(old), timeout=5)   # the supervisor reaped the dead one
    assert gw.backend(victim)["in_flight"] == 0
    assert victim in served_by(gw, 2 * len(IDS))
    assert all(b["healthy"] for b in gw.backends())

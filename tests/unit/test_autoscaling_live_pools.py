"""The scaler on a real gateway (managed simulated engines on 127.0.0.1): a monolithic plan's language pool
grows by a copy of its `both` engine, which keeps the role (manage mode), and the desired count exported
after a burst comes back to min once the burst is over (export mode, nothing applying it)."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import httpx
import pytest

from testkit.harness import Gateway, metric_total, run_gateway, text_part, write_config

pytestmark = pytest.mark.timeout(180)

MODEL = "llava-1.5-7b"


class Load:
    """Closed-loop text clients until stopped; every status kept."""

    def __init__(self, gw: Gateway, clients: int, max_tokens: int) -> None:
        self.statuses: list[int] = []
        self._stop = threading.Event()
        body = {"model": MODEL, "messages": [{"role": "user", "content": [text_part("tell me a story")]}],
                "max_tokens": max_tokens}
        self._threads = [threading.Thread(target=self._run, args=(gw, body), daemon=True) for _ in range(clients)]
        for t in self._threads:
            t.start()

    def _run(self, gw: Gateway, body: dict[str, Any]) -> None:
        while not self._stop.is_set():
            self.statuses.append(httpx.post(f"{gw.url}/v1/chat/completions", json=body, timeout=120).status_code)

    def stop(self) -> list[int]:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=120)
        return self.statuses


def cluster(tmp: Path, autoscaling: dict[str, Any], gpu: str, role: str) -> Path:
    return write_config(tmp, {
        "model": MODEL,
        "gateway": {"heartbeat_interval_ms": 100, "heartbeat_miss_limit": 20, "drain_timeout_s": 60,
                    "autoscaling": {"interval_s": 0.2, "up_delay_s": 0.5, **autoscaling}},
        # slow decodes: a few clients keep requests held above the queue mark
        "backends": [{"id": "engine-0", "role": role, "gpu": gpu, "launch": {"time_scale": 5}}],
    })


def test_a_monolithic_pool_grows_by_a_copy_of_its_both_engine(tmp_path: Path) -> None:
    config = cluster(tmp_path, {"mode": "manage", "down_delay_s": 1.0, "pools": {"language": {
        "min": 1, "max": 2, "gpus": ["RTX-4090"], "queue_per_engine": 1}}}, "RTX-4090", "both")
    with run_gateway(config) as gw:
        load = Load(gw, clients=6, max_tokens=32)
        added = gw.wait_until(lambda: next((b for b in gw.backends() if b["id"] == "language-auto-0"), None),
                              timeout=60)
        assert (added["role"], added["gpu"], added["managed"]) == ("both", "RTX-4090", True)
        gw.wait_until(lambda: gw.backend("language-auto-0")["healthy"], timeout=60)
        statuses = load.stop()
        gw.wait_until(lambda: [b["id"] for b in gw.backends()] == ["engine-0"], timeout=60)   # drained, removed
        assert statuses and all(s == 200 for s in statuses), sorted(set(statuses))


def test_the_exported_desired_count_returns_to_min_after_a_burst(tmp_path: Path) -> None:
    config = cluster(tmp_path, {"mode": "export", "down_delay_s": 1.0, "pools": {"language": {
        "min": 1, "max": 4, "queue_per_engine": 2}}}, "L40S", "language")
    with run_gateway(config) as gw:
        def desired() -> float:
            return metric_total(gw, "heterogate_pool_desired_replicas", pool="language")

        load = Load(gw, clients=12, max_tokens=32)
        gw.wait_until(lambda: desired() >= 3, timeout=60)
        statuses = load.stop()
        gw.wait_until(lambda: desired() == 1, timeout=30)
        assert metric_total(gw, "heterogate_pool_replicas", pool="language") == 1
        assert statuses and all(s == 200 for s in statuses), sorted(set(statuses))


def test_the_pools_engines_count_shows_a_drain_at_once_not_a_tick_later(tmp_path: Path) -> None:
    """heterogate_pool_replicas is read at scrape time: with a decision a minute apart, an admin drain
    showed in it only at the next one."""
    config = write_config(tmp_path, {
        "model": MODEL,
        "gateway": {"heartbeat_interval_ms": 100, "heartbeat_miss_limit": 20,
                    "autoscaling": {"mode": "export", "interval_s": 60, "pools": {"language": {"min": 1, "max": 4}}}},
        "backends": [{"id": f"l40s-{k}", "role": "language", "gpu": "L40S", "launch": {}} for k in range(2)],
    })
    with run_gateway(config) as gw:
        def replicas() -> float:
            return metric_total(gw, "heterogate_pool_replicas", pool="language")

        assert gw.wait_until(lambda: replicas() == 2, timeout=10)
        drained = httpx.post(f"{gw.url}/admin/backends/l40s-1/drain", headers=gw.admin_headers, timeout=10)
        assert drained.status_code == 202, drained.text
        assert gw.wait_until(lambda: replicas() == 1, timeout=10)
        assert metric_total(gw, "heterogate_pool_desired_replicas", pool="language") == 2   # the minute's decision

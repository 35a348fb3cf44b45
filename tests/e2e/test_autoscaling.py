"""Autoscaling on a real gateway with managed simulated engines (gateway.autoscaling, manage mode): a
sustained burst of image requests grows the vision pool in one step by copies of its template on both of
the inventory's GPUs, /metrics carries the desired and current counts, and once the burst is over the
added engines are drained and removed, one at a time, with every request answered."""

from __future__ import annotations

import contextlib
import json
import re
import signal
import threading
from pathlib import Path
from typing import Any

import httpx
import yaml

from testkit.harness import (
    ROOT,
    Gateway,
    data_url,
    image_bytes,
    image_part,
    metric_total,
    run_gateway,
    text_part,
    write_config,
)

MODEL = "llava-1.5-7b"


def cluster(tmp: Path) -> Path:
    return write_config(tmp, {
        "model": MODEL,
        "gateway": {
            # a loaded machine may hold a heartbeat back: this test is about the pool's size, not failover
            "heartbeat_interval_ms": 100, "heartbeat_miss_limit": 20, "drain_timeout_s": 60,
            "autoscaling": {"mode": "manage", "interval_s": 0.2, "up_delay_s": 1.0, "down_delay_s": 2.0,
                            "pools": {"vision": {"min": 1, "max": 3, "gpus": ["L4", "L4"],
                                                 "image_tokens_per_engine": 1},
                                      "language": {"min": 1, "max": 1}}},
        },
        "backends": [
            {"id": "h100-0", "role": "language", "gpu": "H100", "launch": {"time_scale": 0.2}},
            # slow encodes: a few images keep the encoder's backlog above the mark for seconds
            {"id": "vision-0", "role": "vision", "gpu": "L4", "launch": {"time_scale": 20}},
        ],
    })


class Load:
    """Closed-loop clients, each sending `body()` until stopped; every status kept."""

    def __init__(self, gw: Gateway, clients: int, images: bool) -> None:
        self.statuses: list[int] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(gw, images, i), daemon=True) for i in range(clients)]
        for t in self._threads:
            t.start()

    def _run(self, gw: Gateway, images: bool, client: int) -> None:
        n = 0
        while not self._stop.is_set():
            parts: list[dict[str, Any]] = [text_part("what is in the picture?")]
            if images:   # a new image each time: nothing served from a cache
                parts.append(image_part(data_url(image_bytes(noise=True, seed=client * 10_000 + n))))
            body = {"model": MODEL, "messages": [{"role": "user", "content": parts}], "max_tokens": 4}
            n += 1
            r = httpx.post(f"{gw.url}/v1/chat/completions", json=body, timeout=120)
            self.statuses.append(r.status_code)

    def stop(self) -> list[int]:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=120)
        return self.statuses


def keda_queries() -> list[str]:
    docs = yaml.safe_load_all((ROOT / "deploy" / "k8s" / "keda-scaledobject.yaml").read_text())
    return [t["metadata"]["query"] for doc in docs for t in doc["spec"]["triggers"]]


def log_events(gw: Gateway) -> list[dict[str, Any]]:
    events = []
    for line in gw.log_path.read_text(errors="replace").splitlines():
        with contextlib.suppress(ValueError):
            events.append(json.loads(line))
    return [e for e in events if isinstance(e, dict)]


def vision_ids(gw: Gateway) -> list[str]:
    return [b["id"] for b in gw.backends() if b["role"] == "vision"]


def test_a_burst_grows_the_vision_pool_and_the_scale_down_drains_losing_nothing(tmp_path: Path) -> None:
    with run_gateway(cluster(tmp_path), "--log-level", "info") as gw:   # info: the scaler's decisions logged
        assert metric_total(gw, "heterogate_pool_desired_replicas", pool="vision") == 1
        for query in keda_queries():   # deploy/k8s/keda-scaledobject.yaml reads what /metrics carries
            name, pool = re.fullmatch(r'max\((\w+)\{pool="(\w+)"\}\)', query).groups()  # type: ignore[union-attr]
            assert metric_total(gw, name, pool=pool) == 1
        burst = Load(gw, clients=8, images=True)
        gw.wait_until(lambda: "vision-auto-0" in vision_ids(gw), timeout=60)
        # the backlog is many engines' worth over this mark: both GPUs of the inventory in one step
        assert {"vision-auto-0", "vision-auto-1"} <= set(vision_ids(gw))
        steps = [e for e in log_events(gw) if e.get("event") == "autoscale_decision" and e.get("pool") == "vision"]
        assert (steps[0]["engines"], steps[0]["desired"]) == (1, 3)
        for backend_id in ("vision-auto-0", "vision-auto-1"):
            added = gw.backend(backend_id)
            assert added["gpu"] == "L4" and added["managed"] is True
            gw.wait_until(lambda i=backend_id: gw.backend(i)["healthy"], timeout=60)
        assert metric_total(gw, "heterogate_pool_desired_replicas", pool="vision") == 3
        gw.wait_until(lambda: metric_total(gw, "heterogate_pool_replicas", pool="vision") == 3, timeout=10)
        # a SIGHUP of the unchanged file keeps the scaler's engines (it drained and stopped them mid-burst)
        gw.process.send_signal(signal.SIGHUP)
        gw.wait_until(lambda: "config_reload_unchanged" in gw.log_path.read_text(), timeout=30)
        assert {"vision-auto-0", "vision-auto-1"} <= set(vision_ids(gw)) and not any(
            e.get("event") == "config_reload" for e in log_events(gw))
        served = len(burst.statuses)
        gw.wait_until(lambda: len(burst.statuses) >= served + 8, timeout=120)   # both encoders at work
        statuses = burst.stop()
        # the burst is over: text only from now on, while the added encoder is drained and removed
        after = Load(gw, clients=2, images=False)
        gw.wait_until(lambda: vision_ids(gw) == ["vision-0"], timeout=120)
        statuses += after.stop()
        assert statuses and all(s == 200 for s in statuses), sorted(set(statuses))
        assert metric_total(gw, "heterogate_pool_desired_replicas", pool="vision") == 1   # min
        assert "autoscale_refused" not in gw.log_path.read_text()

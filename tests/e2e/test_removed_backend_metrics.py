"""A backend removed from the fleet leaves /metrics: its per-backend counters and histograms go with it
(kept, a gateway whose fleet changes over months would list every backend it ever had), while the
backends still in the fleet keep theirs."""

from __future__ import annotations

from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from testkit.harness import Gateway, run_gateway, write_config

MODEL = "llava-1.5-7b"


def series_backends(gw: Gateway) -> dict[str, set[str]]:
    """The backend label values of each metric family in /metrics that has one."""
    out: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(httpx.get(f"{gw.url}/metrics", timeout=5).text):
        for s in family.samples:
            if "backend" in s.labels:
                out.setdefault(family.name, set()).add(s.labels["backend"])
    return out


def test_a_removed_backend_leaves_metrics_and_the_others_keep_theirs(tmp_path: Path) -> None:
    config = write_config(tmp_path, {"model": MODEL, "gateway": {"routing": {"policy": "round_robin"}}, "backends": [
        {"id": "h100-0", "role": "language", "gpu": "H100", "launch": {"time_scale": 0.05}},
        {"id": "l40s-0", "role": "language", "gpu": "L40S", "launch": {"time_scale": 0.05}},
    ]})
    with run_gateway(config, healthy=2) as gw:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        served = set()
        for _ in range(4):   # round robin: each backend answers some
            r = httpx.post(f"{gw.url}/v1/chat/completions", json=body, timeout=30)
            assert r.status_code == 200
            served.add(r.headers["x-heterogate-backend"])
        assert served == {"h100-0", "l40s-0"}
        before = series_backends(gw)
        for name in ("heterogate_requests", "heterogate_routing_decisions", "heterogate_ttft_seconds",
                     "heterogate_e2e_seconds", "heterogate_prompt_tokens", "heterogate_generation_tokens"):
            assert before[name] >= {"h100-0", "l40s-0"}, name
        assert httpx.delete(f"{gw.url}/admin/backends/l40s-0", timeout=10).status_code == 202
        gw.wait_until(lambda: [b["id"] for b in gw.backends()] == ["h100-0"], timeout=30)
        after = series_backends(gw)
        assert all("l40s-0" not in ids for ids in after.values()), {n: i for n, i in after.items() if "l40s-0" in i}
        assert after["heterogate_requests"] == {"h100-0"} and after["heterogate_ttft_seconds"] == {"h100-0"}

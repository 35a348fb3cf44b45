"""The Grafana dashboard and the Prometheus alert rules in deploy/ name only metrics that a running gateway
exports: a renamed metric fails here instead of leaving a panel empty or an alert silent."""

from __future__ import annotations

import json
import re

import httpx
import yaml

from testkit.harness import ROOT, Gateway

METRIC = re.compile(r"\bheterogate_[a-z_]+\b")
SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_count", "_sum"), "gauge": ("",), "info": ("_info",)}


def exported(text: str) -> set[str]:
    """Every sample name /metrics can carry, from its # TYPE lines (families are declared before any sample)."""
    names = set()
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, family, kind = line.split()
            names.update(family + s for s in SUFFIXES.get(kind, ("",)))
            names.add(family)
    return names


def named_in_deploy() -> dict[str, set[str]]:
    grafana = json.loads((ROOT / "deploy" / "grafana" / "heterogate.json").read_text())
    exprs = [t["expr"] for panel in grafana["panels"] for t in panel["targets"]]
    rules = yaml.safe_load((ROOT / "deploy" / "prometheus" / "alerts.yaml").read_text())
    alerts = {r["alert"]: r["expr"] for g in rules["groups"] for r in g["rules"]}
    return {"grafana": {m for e in exprs for m in METRIC.findall(e)},
            "alerts": {m for e in alerts.values() for m in METRIC.findall(e)}}


def test_every_metric_the_dashboard_and_alerts_name_is_exported(demo_gateway: Gateway) -> None:
    """On the session's demo gateway (a request of this test's own is served first, so that the request
    families have samples whatever ran before)."""
    named = named_in_deploy()
    assert named["grafana"] and named["alerts"]
    resp = httpx.post(f"{demo_gateway.url}/v1/chat/completions", timeout=30, json={
        "model": "llava-1.5-7b", "messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 4})
    assert resp.status_code == 200
    text = httpx.get(f"{demo_gateway.url}/metrics", timeout=10).text
    have = exported(text)
    for where, names in named.items():
        assert names <= have, f"{where} names metrics /metrics does not export: {sorted(names - have)}"
    assert 'heterogate_backend_breaker_open{backend="h100-0"} 0.0' in text

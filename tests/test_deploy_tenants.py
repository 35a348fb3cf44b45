"""deploy/ for an operator of many teams and several replicas: the Grafana dashboard shows every per-tenant
series the gateway exports, an alert fires while Redis cannot check the tenants' limits, and a panel that adds
up a per-backend gauge counts each backend once, however many replicas export it."""

from __future__ import annotations

import json
import re

import yaml

from gateway.config.tenants import TenantsConfig
from gateway.pipeline.tenants import TenantCollector, Tenants
from testkit.harness import ROOT

BACKEND_GAUGE_SUMMED = re.compile(r"\bsum\s*\(\s*heterogate_backend_")


def grafana_exprs() -> list[str]:
    grafana = json.loads((ROOT / "deploy" / "grafana" / "heterogate.json").read_text())
    return [t["expr"] for panel in grafana["panels"] for t in panel["targets"]]


def alert_exprs() -> list[str]:
    rules = yaml.safe_load((ROOT / "deploy" / "prometheus" / "alerts.yaml").read_text())
    return [r["expr"] for g in rules["groups"] for r in g["rules"]]


def test_every_tenant_series_is_on_the_dashboard_and_unchecked_limits_alert() -> None:
    families = {f.name for f in TenantCollector(Tenants(TenantsConfig())).collect()}
    assert "heterogate_tenant_rate_limited" in families
    shown = " ".join(grafana_exprs())
    missing = sorted(f for f in families if not re.search(rf"\b{f}(_total)?\b", shown))
    assert not missing, f"per-tenant series no panel shows: {missing}"
    assert any("heterogate_tenant_limiter_errors_total" in e for e in alert_exprs())


def test_per_backend_gauges_are_counted_once_per_backend_across_replicas() -> None:
    """Every replica exports every backend's gauges: `sum(heterogate_backend_healthy)` over three replicas
    showed three times the healthy backends."""
    summed = [e for e in grafana_exprs() + alert_exprs() if BACKEND_GAUGE_SUMMED.search(e)]
    assert not summed, f"sums over every replica's series: {summed}"

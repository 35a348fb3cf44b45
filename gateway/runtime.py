"""Everything one gateway process holds, built once at start-up and passed to the front doors."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gateway.config import ClusterConfig, Limits
from gateway.engine_client import EngineClients
from gateway.metrics import GatewayMetrics
from gateway.pipeline import LANGUAGE_ROLES, Pipeline, Timeouts
from gateway.policies import build_policy
from gateway.state_table import StateTable


@dataclass
class Runtime:
    config: ClusterConfig
    table: StateTable
    clients: EngineClients
    metrics: GatewayMetrics
    pipeline: Pipeline

    @property
    def limits(self) -> Limits:
        return self.config.settings.limits

    def healthy_language_backends(self) -> int:
        return len(self.table.candidates(LANGUAGE_ROLES))

    def describe_backends(self) -> list[dict[str, Any]]:
        out = []
        for e in self.table.entries():
            snap = self.table.snapshot(e)
            out.append({
                "id": e.id,
                "role": e.role,
                "gpu": e.gpu.name,
                "address": e.address,
                "managed": e.managed,
                "pid": e.reported.pid or None,
                "healthy": self.table.is_healthy(e),
                "queue_depth": snap.queue_depth,
                "waiting": e.reported.waiting,
                "running": e.reported.running,
                "in_flight": e.in_flight,
                "kv_free_bytes": snap.kv_free_bytes,
                "kv_total_bytes": snap.kv_total_bytes,
                "vision_backlog": snap.vision_backlog,
                "mean_service_s": snap.mean_service_s,
                "tokens_generated": e.reported.tokens_generated,
                "requests_completed": e.reported.requests_completed,
            })
        return out


def build_runtime(config: ClusterConfig, policy_name: str | None = None) -> Runtime:
    settings = config.settings
    table = StateTable(config.model, settings.heartbeat_interval_ms / 1000, settings.heartbeat_miss_limit)
    for spec in config.raw.backends:
        table.register(
            spec.id, spec.role, config.gpus[spec.id], address=spec.address, managed=spec.launch is not None,
            steal=spec.steal,
        )
    name = policy_name or settings.routing.policy
    policy = build_policy(name, settings.routing.params.get(name))
    clients = EngineClients()
    for spec in config.raw.backends:
        if spec.address is not None:
            clients.ensure(spec.id, spec.address)
    metrics = GatewayMetrics(table)
    limits = settings.limits
    pipeline = Pipeline(
        table, policy, clients, metrics,
        max_attempts=limits.max_attempts,
        timeouts=Timeouts(first_token_s=limits.first_token_timeout_s, request_s=limits.request_timeout_s),
    )
    return Runtime(config, table, clients, metrics, pipeline)

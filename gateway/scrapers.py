"""Gateway-side scraping for `kind: openai` backends that have `scrape:` and no agent of their own.

Each one runs the heartbeat agent's `MetricsAgent` inside the gateway process, pushing to the
gateway's own Control port, so scraped and agent-reported backends go through one code path
(the same metric tables, staleness rule and heartbeat messages).
"""

from __future__ import annotations

import asyncio

from gateway.config import ClusterConfig
from heterogate.engine_scraper import AgentConfig, MetricsAgent, make_client
from heterogate.metric_tables import TABLES


async def run_scrapers(config: ClusterConfig, control_address: str, stop: asyncio.Event) -> None:
    specs = [s for s in config.raw.backends if s.scrape is not None]
    if not specs:
        return
    runs = []
    clients = []
    for spec in specs:
        assert spec.scrape is not None and spec.address is not None
        table = TABLES[spec.scrape.engine]
        address = spec.address.rstrip("/")
        agent_config = AgentConfig(
            backend_id=spec.id, table=table, address=address,
            metrics_url=spec.scrape.metrics_url or address + table.metrics_path,
            gateway=control_address, interval_s=spec.scrape.interval_ms / 1000,
            kv_total_tokens=spec.kv_capacity_tokens, upstream_model=spec.upstream_model or config.served_model_name,
        )
        client = make_client(agent_config.scrape_timeout_s)
        clients.append(client)
        runs.append(MetricsAgent(agent_config, config.model, config.gpus[spec.id], client).run(stop))
    try:
        await asyncio.gather(*runs)
    finally:
        await asyncio.gather(*(c.aclose() for c in clients))

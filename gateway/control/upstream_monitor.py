"""The gateway-side producer of load signals for `kind: openai` backends it can watch itself.

Two kinds of such backends, neither with an agent of its own:
- with `scrape:` (managed or not): the engine's Prometheus /metrics are scraped by the agent's
  `MetricsAgent` (the same metric tables and staleness rule as the standalone agent), and what it
  would send as a heartbeat is written straight into the state table;
- managed without `scrape:`: the readiness probe doubles as liveness, each success a heartbeat with
  no load figures (routing then rests on the gateway's own in-flight counts), and the context length
  is read from its /v1/models once per launch.

A managed backend is watched only while the supervisor has it `ready`; a failed probe or scrape
simply writes nothing, so the entry goes stale after the heartbeat miss limit like any other.
The standalone agent (`backends.agent`) remains the producer for engines on other hosts. A backend
with an api key is asked with it (vLLM's --api-key guards /v1/models).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import httpx
import structlog

from common.engine_scraper import AgentConfig, MetricsAgent
from common.metric_tables import TABLES
from common.upstream_models import ModelsUnavailable, fetch_max_model_len
from gateway.config.cluster import BackendSpec, ClusterConfig, CommandLaunchSpec
from gateway.control.heartbeat_service import reported_from
from gateway.routing.backend_entry import Reported
from gateway.routing.state_table import StateTable

log = structlog.get_logger("upstream_monitor")
PROBE_TIMEOUT_S = 2.0


async def probe(client: httpx.AsyncClient, url: str) -> bool:
    """GET url answered 200 (within the client's timeout)."""
    try:
        return (await client.get(url)).status_code == 200
    except httpx.HTTPError:
        return False


def make_probe(client: httpx.AsyncClient) -> Callable[[str], Awaitable[bool]]:
    return lambda url: probe(client, url)


@dataclass
class Watched:
    spec: BackendSpec
    address: str
    interval_s: float
    agent: MetricsAgent | None      # None: probe only
    ready_url: str | None           # managed: its readiness URL
    client: httpx.AsyncClient
    seq: int = 0
    max_model_len: int | None = None   # probe only: from /v1/models, read once per launch
    context_read: bool = False


class UpstreamMonitor:
    def __init__(
        self, config: ClusterConfig, table: StateTable, addresses: dict[str, str], client: httpx.AsyncClient,
    ) -> None:
        self._table = table
        self._model = config.served_model_name
        self._client = client
        self._heartbeat_s = config.settings.heartbeat_interval_ms / 1000
        self._watched: dict[str, Watched] = {}
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._running = False
        for spec in config.raw.backends:
            self.watch(config, spec, addresses.get(spec.id))

    def watch(self, config: ClusterConfig, spec: BackendSpec, managed_address: str | None) -> None:
        """Watch one entry of `config` if it is a kind: openai backend the gateway launches or scrapes
        (at start-up, and for a backend added at runtime: gateway/control/fleet.py)."""
        managed = isinstance(spec.launch, CommandLaunchSpec)
        if spec.kind != "openai" or not (managed or spec.scrape is not None):
            return
        address = managed_address or (spec.address or "").rstrip("/")
        key = config.api_keys.get(spec.id)
        own = self._client
        if key:
            own = httpx.AsyncClient(timeout=self._client.timeout, follow_redirects=True, trust_env=False,
                                    headers={"authorization": f"Bearer {key}"})
        agent, interval_s = None, self._heartbeat_s
        if spec.scrape is not None:
            engine = TABLES[spec.scrape.engine]
            interval_s = spec.scrape.interval_ms / 1000
            agent = MetricsAgent(AgentConfig(
                backend_id=spec.id, table=engine, address=address,
                metrics_url=spec.scrape.metrics_url or address + engine.metrics_path,
                gateway="", interval_s=interval_s, kv_total_tokens=spec.kv_capacity_tokens,
                upstream_model=spec.upstream_model or config.served_model_name,
            ), config.model, config.gpus[spec.id], own)
        ready_url = address + spec.launch.ready_path if isinstance(spec.launch, CommandLaunchSpec) else None
        w = self._watched[spec.id] = Watched(spec, address, interval_s, agent, ready_url, own, time.time_ns() // 1000)
        if self._running:
            self._tasks[spec.id] = asyncio.create_task(self._watch(w))

    async def unwatch(self, backend_id: str) -> None:
        """Stop watching a backend that left the fleet."""
        w = self._watched.pop(backend_id, None)
        task = self._tasks.pop(backend_id, None)
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        if w is not None and w.client is not self._client:
            await w.client.aclose()

    async def run(self, stop: asyncio.Event) -> None:
        self._running = True
        self._tasks = {backend_id: asyncio.create_task(self._watch(w)) for backend_id, w in self._watched.items()}
        try:
            await stop.wait()
        finally:
            self._running = False
            await asyncio.gather(*(self.unwatch(backend_id) for backend_id in list(self._watched)))

    async def _watch(self, w: Watched) -> None:
        next_at = time.monotonic()
        while True:
            await self.tick(w)
            next_at += w.interval_s
            delay = next_at - time.monotonic()
            if delay < 0:   # a tick ran past its slot: skip the slots it missed
                next_at, delay = time.monotonic(), 0.0
            await asyncio.sleep(delay)

    async def tick(self, w: Watched) -> bool:
        """One look at the backend; True when it wrote a heartbeat into the table."""
        entry = self._table.get(w.spec.id)
        if entry is None or (w.ready_url is not None and entry.lifecycle != "ready"):
            w.context_read = False   # a relaunched engine may serve another context
            return False
        if w.agent is not None:
            await w.agent.scrape_once()
            if not w.agent.first_scrape.is_set():
                return False
            reported = reported_from(w.agent.state())
            reported.pid = 0   # the scraper's own (this gateway's): the engine's pid is not in its metrics
        elif w.ready_url is not None and await probe(w.client, w.ready_url):
            if not w.context_read:
                await self._read_context(w)
            reported = Reported(max_model_len=w.max_model_len or 0)
        else:
            return False
        w.seq += 1
        reported.seq = w.seq
        return self._table.apply_heartbeat(w.spec.id, w.seq, w.address, reported) is not None

    async def _read_context(self, w: Watched) -> None:
        try:
            w.max_model_len = await fetch_max_model_len(w.client, w.address, w.spec.upstream_model or self._model)
        except ModelsUnavailable:
            return   # asked again on the next tick
        w.context_read = True

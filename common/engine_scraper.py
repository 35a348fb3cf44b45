"""Scrapes an OpenAI-compatible engine's Prometheus metrics and pushes them as heartbeats.

Used by the standalone heartbeat agent (`backends.agent`) beside engines on other hosts and by the
gateway's own scraping of `scrape:` backends, so both go through one code path (the same metric
tables, staleness rule and heartbeat messages).

Each scrape turns into the BackendState a managed engine sends (parsing lives in `metric_tables`).
Staleness: a failed scrape keeps the last good values. Once the last good scrape is older than
STALE_INTERVALS intervals, the backend is reported saturated (queue_depth = SATURATED_QUEUE, no free
KV) so that policies route around it while heartbeats, and so its health, go on. Nothing is sent
before the first good scrape: an engine never seen is no candidate.

KV capacity, first found: the engine's metrics; the configured capacity; the performance model's
estimate for this GPU and model. The heartbeat says which (`kv_capacity_source`).

Context length: read from the engine's `GET /v1/models` (`max_model_len`) after the first good scrape,
and again after the metrics recover from staleness or a counter goes back (the engine may have
restarted with other flags); 0 in the heartbeat when the engine does not say, so the gateway applies
its own configuration.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx
import structlog

from common import perf_model
from common.catalog import GpuProfile, ModelProfile
from common.control_credentials import ControlCredentials
from common.errors import HeteroGateError
from common.heartbeat_sender import HeartbeatSender, gpu_message
from common.metric_tables import SATURATED_QUEUE, EngineMetrics, EngineTable, KvSource, parse
from common.upstream_models import ModelsUnavailable, fetch_max_model_len
from common.wire import control_pb2

log = structlog.get_logger("agent")

STALE_INTERVALS = 3

KV_SOURCES: dict[KvSource, control_pb2.KvCapacitySource] = {
    "engine": control_pb2.KV_CAPACITY_SOURCE_ENGINE,
    "config": control_pb2.KV_CAPACITY_SOURCE_CONFIG,
    "estimate": control_pb2.KV_CAPACITY_SOURCE_ESTIMATE,
}


class ScrapeError(HeteroGateError):
    """The engine's metrics endpoint gave no usable Prometheus text (network, status or format)."""


@dataclass(frozen=True, slots=True)
class AgentConfig:
    backend_id: str
    table: EngineTable
    address: str                   # engine base URL, reported to the gateway
    metrics_url: str
    gateway: str                   # host:port of the gateway's Control service
    role: str = "language"
    interval_s: float = 0.2
    kv_total_tokens: int | None = None   # used where the engine's metrics give no capacity
    scrape_timeout_s: float = 2.0
    upstream_model: str | None = None    # the model whose max_model_len counts (default: the first listed)
    credentials: ControlCredentials = field(default_factory=ControlCredentials)   # towards the control port


def make_client(timeout_s: float, transport: httpx.AsyncBaseTransport | None = None) -> httpx.AsyncClient:
    """One pooled keep-alive connection to the engine; trtllm-serve redirects /prometheus/metrics."""
    return httpx.AsyncClient(
        timeout=httpx.Timeout(timeout_s, connect=min(1.0, timeout_s), pool=min(1.0, timeout_s)),
        limits=httpx.Limits(max_connections=2, max_keepalive_connections=1),
        follow_redirects=True,
        transport=transport,
    )


class MetricsAgent:
    def __init__(
        self,
        config: AgentConfig,
        model: ModelProfile,
        gpu: GpuProfile,
        client: httpx.AsyncClient,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config, self.model, self.gpu = config, model, gpu
        self._client = client
        self._clock = clock
        self._role = control_pb2.Role.Value(f"ROLE_{config.role.upper()}")
        self._kv_estimate = perf_model.kv_capacity_bytes(model, gpu) // model.kv_bytes_per_token
        self.metrics: EngineMetrics | None = None
        self.last_ok: float | None = None         # clock time of the last good scrape
        self.last_error = ""
        self.saturated = False
        self._logged_missing: frozenset[str] = frozenset()
        self._logged_rejected: set[str] = set()    # each metric's absurd value is logged once, not every scrape
        self._warned_unscraped = False
        self.max_model_len: int | None = None   # from the engine's /v1/models
        self._context_read = False               # asked again after a restart or a stale spell
        self.first_scrape = asyncio.Event()
        self.heartbeats = HeartbeatSender(config.gateway, self.state, interval_s=config.interval_s,
                                          credentials=config.credentials)

    # -- scraping ----------------------------------------------------------------------------

    async def fetch(self) -> str:
        url = self.config.metrics_url
        try:
            response = await self._client.get(url)
        except httpx.HTTPError as exc:
            raise ScrapeError(f"GET {url}: {type(exc).__name__}: {exc}") from exc
        if response.status_code != 200:
            raise ScrapeError(f"GET {url}: HTTP {response.status_code}")
        return response.text

    async def scrape_once(self) -> bool:
        """One scrape; False (and the last good values kept) when it failed."""
        table = self.config.table
        try:
            text = await self.fetch()
            try:
                metrics = parse(table, text, self.metrics)
            except ValueError as exc:
                raise ScrapeError(f"GET {self.config.metrics_url}: not Prometheus text: {exc}") from exc
            self._log_rejected(metrics)
            if {table.waiting, table.running} <= metrics.missing:
                raise ScrapeError(f"GET {self.config.metrics_url}: no {table.name} load metrics in the response")
        except ScrapeError as exc:
            self.last_error = str(exc)
            if self.last_ok is None and not self._warned_unscraped:
                self._warned_unscraped = True
                log.warning("engine_metrics_unavailable", backend=self.config.backend_id, error=self.last_error,
                            detail="no heartbeat until a scrape succeeds")
            log.debug("scrape_failed", backend=self.config.backend_id, error=self.last_error)
            if self.update_staleness():
                self.heartbeats.poke()
            return False
        if metrics.missing != self._logged_missing:
            self._logged_missing = metrics.missing
            if metrics.missing:
                log.warning("engine_metrics_missing", backend=self.config.backend_id, engine=table.name,
                            names=sorted(metrics.missing))
        changed = self.metrics is None or _load(metrics) != _load(self.metrics) or bool(self.last_error)
        self.last_error = ""
        if self.metrics is not None and metrics.latency_count < self.metrics.latency_count:
            self._context_read = False    # a counter went back: the engine restarted, perhaps with other flags
        self.metrics, self.last_ok = metrics, self._clock()
        if not self._context_read:
            changed = await self.read_context() or changed
        if self.update_staleness() or changed:
            self.heartbeats.poke()
        self.first_scrape.set()
        return True

    def _log_rejected(self, metrics: EngineMetrics) -> None:
        """An absurd value is the engine's bug: said once per metric, not at every scrape that repeats it."""
        for name, value in metrics.rejected:
            if name not in self._logged_rejected:
                self._logged_rejected.add(name)
                log.warning("engine_metric_rejected", backend=self.config.backend_id, engine=self.config.table.name,
                            metric=name, value=value, detail="negative, NaN or infinite: treated as missing")

    async def read_context(self) -> bool:
        """Read max_model_len from the engine's /v1/models; True when it changed. A network or server
        error leaves it to the next scrape; an answer without the field is final until a restart."""
        try:
            value = await fetch_max_model_len(self._client, self.config.address, self.config.upstream_model)
        except ModelsUnavailable as exc:
            log.debug("models_read_failed", backend=self.config.backend_id, error=str(exc))
            return False
        self._context_read = True
        if value == self.max_model_len:
            return False
        self.max_model_len = value
        log.info("engine_context", backend=self.config.backend_id, max_model_len=value)
        return True

    def update_staleness(self, now: float | None = None) -> bool:
        """Re-evaluates `saturated` from the age of the last good scrape; True when it flipped (logged)."""
        if self.last_ok is None:
            return False
        now = self._clock() if now is None else now
        age = now - self.last_ok
        stale = age > STALE_INTERVALS * self.config.interval_s
        if stale != self.saturated:
            self.saturated = stale
            if stale:
                self._context_read = False   # read it again once it is back
                log.warning("engine_metrics_stale", backend=self.config.backend_id, age_s=round(age, 3),
                            error=self.last_error, reported="saturated")
            else:
                log.info("engine_metrics_recovered", backend=self.config.backend_id)
            return True
        return False

    async def run_scraper(self) -> None:
        interval = self.config.interval_s
        next_at = self._clock()
        while True:
            await self.scrape_once()
            next_at += interval
            delay = next_at - self._clock()
            if delay < 0:          # a scrape ran past its tick: skip the ticks it missed
                next_at, delay = self._clock(), 0.0
            await asyncio.sleep(delay)

    # -- heartbeats --------------------------------------------------------------------------

    def state(self) -> control_pb2.BackendState:
        self.update_staleness()
        saturated = self.saturated
        m = self.metrics or EngineMetrics()
        free, total, source = m.kv_tokens(self.config.kv_total_tokens, self._kv_estimate)
        bpt = self.model.kv_bytes_per_token
        return control_pb2.BackendState(
            backend_id=self.config.backend_id,
            role=self._role,
            address=self.config.address,
            model=self.model.name,
            gpu=gpu_message(self.gpu),
            queue_depth=SATURATED_QUEUE if saturated else m.waiting,
            running=m.running,
            kv_free_bytes=0 if saturated else free * bpt,
            kv_total_bytes=total * bpt,
            mean_service_s=m.mean_service_s,
            tokens_generated=m.generation_tokens,
            requests_completed=int(m.latency_count),
            pid=os.getpid(),   # the agent's: the engine's own pid is not in its metrics
            max_model_len=self.max_model_len or 0,
            kv_capacity_source=KV_SOURCES[source],
            prefix_cache_queries=m.prefix_cache_queries,
            prefix_cache_hits=m.prefix_cache_hits,
            kv_block_tokens=m.kv_block_tokens or 0,
            scrape_error=self.last_error or (self._stale_error() if saturated else ""),
        )

    def _stale_error(self) -> str:
        """Why a saturated report is sent while no scrape has failed yet: the one under way hangs."""
        age = self._clock() - (self.last_ok or 0.0)
        return f"GET {self.config.metrics_url}: no answer in the {age:.1f} s since the last good scrape"

    async def run(self, stop: asyncio.Event) -> None:
        """Scrape and heartbeat until `stop` is set; the first heartbeat waits for the first good scrape."""

        async def send() -> None:
            await self.first_scrape.wait()
            m = self.metrics or EngineMetrics()
            log.info("engine_metrics_first_scrape", backend=self.config.backend_id,
                     kv_capacity=m.kv_tokens(self.config.kv_total_tokens, self._kv_estimate)[2],
                     max_model_len=self.max_model_len)
            await self.heartbeats.run()

        tasks = [asyncio.create_task(c) for c in (self.run_scraper(), send(), stop.wait())]
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        for t in done:
            exc = None if t.cancelled() else t.exception()
            if exc is not None:
                raise exc


def _load(m: EngineMetrics) -> tuple[object, ...]:
    """The values a heartbeat carries: a change is worth an early heartbeat."""
    return m.waiting, m.running, m.kv_total_tokens, m.kv_free_tokens, m.mean_service_s

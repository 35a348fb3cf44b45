"""The gateway's own watch over the `kind: openai` backends: whether each upstream answers, and the
load signals of those it can read itself.

Every kind: openai backend is probed (`probe:`, a GET of `/v1/models` by default, of `launch.ready_path`
for a managed one): the answer, apart from any metrics, is what the state table keeps as its
reachability (`StateTable.set_reachable`), so an upstream that stopped answering is no candidate and a
stale one that answers can be failed open on. Load signals come from:
- `scrape:` (managed or not): the engine's Prometheus /metrics are scraped by the agent's
  `MetricsAgent` (the same metric tables and staleness rule as the standalone agent), and what it
  would send as a heartbeat is written straight into the state table;
- managed without `scrape:`: each answer of the probe is a heartbeat with no load figures (routing then
  rests on the gateway's own in-flight counts), and the context length is read from its /v1/models
  once per launch;
- otherwise the standalone agent (`backends.agent`) beside the engine, through the control port.
A backend with `kv_events:` is also subscribed to its engine's KV cache events, which the prefix index
follows (gateway/control/kv_event_listener.py).

A managed backend is watched only while the supervisor has it `ready`; a failed probe or scrape
simply writes no heartbeat, so the entry goes stale after the heartbeat miss limit like any other.
Why the last one failed (connection refused, /metrics 404, metrics of another engine, malformed text,
a timeout) is kept on the entry as one line (`last_error` in /admin/backends), so an operator who sees
an unhealthy or saturated upstream need not search the log for it; the next success clears it.
A backend with an api key is asked with it (vLLM's --api-key guards /v1/models); an https one with the
system's trust store, as its requests are.
"""

from __future__ import annotations

import asyncio
import ssl
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import httpx
import structlog

from common.engine_scraper import AgentConfig, MetricsAgent
from common.metric_tables import TABLES
from common.upstream_models import ModelsUnavailable, fetch_max_model_len
from gateway.config.cluster import BackendSpec, ClusterConfig, CommandLaunchSpec, ProbeSpec
from gateway.control.heartbeat_service import reported_from
from gateway.control.kv_event_listener import listen
from gateway.routing.backend_entry import Reported
from gateway.routing.prefix_index import PrefixIndex
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


async def probe_error(client: httpx.AsyncClient, url: str, timeout_s: float) -> str | None:
    """Why GET url is no sign of a server that will serve the gateway: no HTTP answer within `timeout_s`,
    a 5xx, or 401/403 (it refuses the gateway's key, as it will every request); None when it answered
    otherwise below 500 (the server is up, whatever it says)."""
    try:
        status = (await client.get(url, timeout=timeout_s)).status_code
    except httpx.HTTPError as exc:
        return f"probe GET {url}: {type(exc).__name__}: {exc}".rstrip(": ")
    if status in (401, 403):
        return (f"probe GET {url}: HTTP {status}: the upstream refuses the gateway's key "
                "(the backend's api_key / api_key_env)")
    return f"probe GET {url}: HTTP {status}" if status >= 500 else None


@dataclass
class Watched:
    spec: BackendSpec
    address: str
    probe_url: str
    probe_interval_s: float
    probe_timeout_s: float
    probe_failures: int             # failed probes in a row that make it unreachable
    agent: MetricsAgent | None      # with `scrape:`
    managed: bool
    client: httpx.AsyncClient
    seq: int = 0
    failed: int = 0                 # probes in a row without an answer
    max_model_len: int | None = None   # managed without `scrape:`: from /v1/models, read once per launch
    context_read: bool = False
    probe_error: str | None = None     # why the last probe failed (None: it answered)
    scrape_error: str | None = None    # why the last scrape failed (None: it succeeded)


class UpstreamMonitor:
    def __init__(
        self, config: ClusterConfig, table: StateTable, addresses: dict[str, str], client: httpx.AsyncClient,
        prefixes: PrefixIndex | None = None,
    ) -> None:
        self._table = table
        self._prefixes = prefixes   # fed the KV events of the backends with `kv_events:`
        self._names: dict[str, str] = {}   # per backend, the model name whose context /v1/models gives
        self._client = client
        self._heartbeat_s = config.settings.heartbeat_interval_ms / 1000
        self._watched: dict[str, Watched] = {}
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._running = False
        for spec in config.raw.backends:
            self.watch(config, spec, addresses.get(spec.id))

    def watch(self, config: ClusterConfig, spec: BackendSpec, managed_address: str | None) -> None:
        """Watch one entry of `config` if it is a kind: openai backend (at start-up, and for a backend
        added at runtime: gateway/control/fleet.py)."""
        if spec.kind != "openai":
            return
        launch = spec.launch if isinstance(spec.launch, CommandLaunchSpec) else None
        self._names[spec.id] = spec.upstream_model or config.model_of(spec.id).name
        address = managed_address or (spec.address or "").rstrip("/")
        key = config.api_keys.get(spec.id)
        own = self._client
        if key or address.startswith("https:"):
            # An https upstream is trusted as the request path trusts it (`UpstreamPool`: the system's
            # store, SSL_CERT_FILE / SSL_CERT_DIR included), not by httpx's bundle of public CAs alone:
            # an engine behind a private CA would answer its requests and fail every probe, unreachable.
            own = httpx.AsyncClient(timeout=self._client.timeout, follow_redirects=True, trust_env=False,
                                    headers={"authorization": f"Bearer {key}"} if key else None,
                                    verify=ssl.create_default_context())
        agent = None
        if spec.scrape is not None:
            engine = TABLES[spec.scrape.engine]
            agent = MetricsAgent(AgentConfig(
                backend_id=spec.id, table=engine, address=address,
                metrics_url=spec.scrape.metrics_url or address + engine.metrics_path,
                gateway="", interval_s=spec.scrape.interval_s(config.settings.heartbeat_interval_ms),
                kv_total_tokens=spec.kv_capacity_tokens,
                upstream_model=self._names[spec.id],
            ), config.model_of(spec.id).profile, config.gpus[spec.id], own)
        probing = spec.probe or ProbeSpec()
        interval_s = probing.interval_ms / 1000 if probing.interval_ms is not None else self._heartbeat_s
        w = self._watched[spec.id] = Watched(
            spec, address, probing.url(address, launch), interval_s, probing.timeout_ms / 1000, probing.failures,
            agent, launch is not None, own, time.time_ns() // 1000)
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
        """Probe it, and scrape it when it has `scrape:`, each at its own interval; listen to its KV
        events when it has `kv_events:`."""
        loops = [every(w.probe_interval_s, self.probe_once, w)]
        if w.agent is not None:
            loops.append(every(w.agent.config.interval_s, self.scrape_once, w))
        if w.spec.kv_events is not None and self._prefixes is not None:
            loops.append(listen(w.spec.id, w.spec.kv_events, self._prefixes))
        await asyncio.gather(*loops)

    def _watching(self, w: Watched) -> bool:
        """A managed backend only while the supervisor has it ready (a relaunched engine starts afresh)."""
        entry = self._table.get(w.spec.id)
        if entry is not None and (not w.managed or entry.lifecycle == "ready"):
            return True
        if w.managed and entry is not None:
            w.context_read, w.failed = False, 0   # a relaunched engine may serve another context
            w.probe_error = w.scrape_error = None
            entry.last_error = None
            self._table.set_reachable(w.spec.id, None)
        return False

    async def probe_once(self, w: Watched) -> None:
        """One probe: the backend's reachability, and for a managed one without `scrape:` its heartbeat. An
        agent's accepted address move (`ControlAuth`) moves the probe with it: probing the old address
        found it unreachable for good while the agent reported from the new one."""
        if not self._watching(w):
            return
        entry = self._table.get(w.spec.id)
        moved = entry.address.rstrip("/") if entry is not None and entry.address else w.address
        if not w.managed and w.agent is None and moved != w.address:
            w.address, w.probe_url = moved, (w.spec.probe or ProbeSpec()).url(moved, None)
            w.failed = 0
            log.info("upstream_probe_moved", backend=w.spec.id, url=w.probe_url)
        w.probe_error = await probe_error(w.client, w.probe_url, w.probe_timeout_s)
        self._note_error(w)
        answered = w.probe_error is None
        w.failed = 0 if answered else w.failed + 1
        if answered or w.failed >= w.probe_failures:
            known = self._table.reachable(w.spec.id)
            if answered and known is False:
                log.info("upstream_answers", backend=w.spec.id, url=w.probe_url)
            elif not answered and known is not False:
                log.warning("upstream_unreachable", backend=w.spec.id, url=w.probe_url, probes=w.failed)
            self._table.set_reachable(w.spec.id, answered)
        if answered and w.managed and w.agent is None:
            if not w.context_read:
                await self._read_context(w)
            self._heartbeat(w, Reported(max_model_len=w.max_model_len or 0))

    async def scrape_once(self, w: Watched) -> None:
        """One scrape; once one succeeded, what the agent would send (saturated when stale) is written."""
        assert w.agent is not None
        if not self._watching(w):
            return
        w.scrape_error = None if await w.agent.scrape_once() else w.agent.last_error
        self._note_error(w)
        if w.agent.first_scrape.is_set():
            reported = reported_from(w.agent.state())
            reported.pid = 0   # the scraper's own (this gateway's): the engine's pid is not in its metrics
            self._heartbeat(w, reported)

    def _note_error(self, w: Watched) -> None:
        """The entry's `last_error`: the probe's (the upstream does not answer at all) before the scrape's."""
        entry = self._table.get(w.spec.id)
        if entry is not None:
            error = w.probe_error or w.scrape_error
            entry.last_error = " ".join(error.split()) if error else None

    def _heartbeat(self, w: Watched, reported: Reported) -> None:
        w.seq += 1
        reported.seq = w.seq
        self._table.apply_heartbeat(w.spec.id, w.seq, w.address, reported)

    async def _read_context(self, w: Watched) -> None:
        try:
            w.max_model_len = await fetch_max_model_len(w.client, w.address, self._names[w.spec.id])
        except ModelsUnavailable:
            return   # asked again on the next probe
        w.context_read = True


async def every(interval_s: float, tick: Callable[[Watched], Awaitable[None]], w: Watched) -> None:
    """Run `tick(w)` every `interval_s`, skipping the slots a slow tick ran past."""
    next_at = time.monotonic()
    while True:
        await tick(w)
        next_at += interval_s
        delay = next_at - time.monotonic()
        if delay < 0:
            next_at, delay = time.monotonic(), 0.0
        await asyncio.sleep(delay)

"""Prometheus metrics of one gateway process, on its own registry (no module globals).

Per-backend gauges are not pushed on every change: a collector reads the state table at scrape
time, so they are exact and cost nothing on the request path. The counters and histograms every
request touches are plain tables rendered at scrape time too (`gateway.pipeline.request_metrics`); the rare
ones (retries, encodes, hand-offs, stolen requests) are prometheus_client objects. Counters carry no
`_created` series (one per label set, which doubles the scrape for nothing a rate() needs).
"""

from __future__ import annotations

import collections
import platform
from collections.abc import Callable, Iterator

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    Info,
    PlatformCollector,
    ProcessCollector,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from common import __version__
from gateway.pipeline.request_metrics import CounterTable, HistogramTable, TablesCollector
from gateway.routing.prefix_index import PrefixIndex
from gateway.routing.state_table import StateTable

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
# Inter-token times: a fast GPU's decode step is a few ms, a slow tier's or a loaded batch's tens to hundreds.
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1)
# The backend label of what a request did on a backend that has since left the fleet (its drain ran out
# and the request was cut, and ended after the removal): counted, without bringing the backend's series back.
REMOVED = "(removed)"
_DECISION_BUCKETS = (1e-6, 2.5e-6, 5e-6, 1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 1e-2)


class BackendCollector(Collector):
    def __init__(self, table: StateTable) -> None:
        self._table = table

    def collect(self) -> Iterator[Metric]:
        labels = ["backend", "role", "gpu"]
        families: dict[str, GaugeMetricFamily | CounterMetricFamily] = {
            "queue": GaugeMetricFamily("heterogate_backend_queue_depth", "Q_i as routed on", labels=labels),
            "in_flight": GaugeMetricFamily("heterogate_backend_in_flight", "Requests in flight", labels=labels),
            "kv_free": GaugeMetricFamily("heterogate_backend_kv_free_bytes", "Free KV cache bytes", labels=labels),
            "kv_total": GaugeMetricFamily("heterogate_backend_kv_total_bytes", "KV cache bytes", labels=labels),
            "context": GaugeMetricFamily(
                "heterogate_backend_max_model_len", "Context routed on, prompt + completion tokens", labels=labels
            ),
            "vision": GaugeMetricFamily(
                "heterogate_backend_vision_backlog_tokens", "Image tokens waiting to be encoded", labels=labels
            ),
            "healthy": GaugeMetricFamily("heterogate_backend_healthy", "1 if heartbeats are current", labels=labels),
            # what /ready counts: heard from, or a kind: openai upstream that answers its probe though its
            # metrics are stale or absent (it serves, routed on the gateway's own counts)
            "serving": GaugeMetricFamily(
                "heterogate_backend_serving", "1 if it can serve now: heard from, or an upstream that answers "
                "its probe", labels=labels,
            ),
            # A drain (the fleet API, a reload, the autoscaler) stops a managed engine, so its `healthy` goes to
            # 0 on purpose: alerts on `healthy` leave out the backends this says are draining.
            "draining": GaugeMetricFamily(
                "heterogate_backend_draining", "1 while the backend is drained: no new requests, on purpose",
                labels=labels,
            ),
            "service": GaugeMetricFamily(
                "heterogate_backend_mean_service_seconds", "T̄_service used by the router", labels=labels
            ),
            "prefill": GaugeMetricFamily(
                "heterogate_backend_prefill_seconds_per_token", "Learned prefill rate p̂ (prior blended with "
                "observations)", labels=labels
            ),
            "decode": GaugeMetricFamily(
                "heterogate_backend_decode_step_seconds", "Learned decode step ŝ (mean inter-token time)", labels=labels
            ),
            "prior_share": GaugeMetricFamily(
                "heterogate_backend_speed_prior_share", "Weight of the performance-model prior in p̂", labels=labels
            ),
            "backlog": GaugeMetricFamily(
                "heterogate_backend_prefill_backlog_tokens", "Prompt tokens sent, first token not seen", labels=labels
            ),
            "foreign": GaugeMetricFamily(
                "heterogate_backend_foreign_waiting", "Requests waiting in the engine that this gateway did not "
                "send (other clients'), as of its last report", labels=labels
            ),
            "episodes": CounterMetricFamily(
                "heterogate_backend_steal_episodes", "Work-stealing episodes (engine-reported)", labels=labels
            ),
            "stolen": CounterMetricFamily(
                "heterogate_backend_tokens_stolen", "Tokens generated while stealing (engine-reported)", labels=labels
            ),
            "age": GaugeMetricFamily(
                "heterogate_backend_heartbeat_age_seconds", "Seconds since the last heartbeat (absent before the "
                "first)", labels=labels,
            ),
            "restarts": CounterMetricFamily(
                "heterogate_backend_restarts", "Times the gateway restarted this managed engine", labels=labels
            ),
        }
        now = self._table.clock()
        for e in self._table.entries():
            values = [e.id, e.role, e.gpu.name]
            snap = self._table.snapshot(e)
            families["queue"].add_metric(values, snap.queue_depth)
            families["in_flight"].add_metric(values, e.in_flight)
            families["kv_free"].add_metric(values, snap.kv_free_bytes)
            families["kv_total"].add_metric(values, snap.kv_total_bytes)
            families["context"].add_metric(values, snap.max_context)
            families["vision"].add_metric(values, snap.vision_backlog)
            healthy = self._table.is_healthy(e)
            families["healthy"].add_metric(values, 1.0 if healthy else 0.0)
            families["serving"].add_metric(values, 1.0 if healthy or self._table.answers_unheard(e) else 0.0)
            families["draining"].add_metric(values, 1.0 if self._table.is_draining(e.id) else 0.0)
            families["service"].add_metric(values, snap.mean_service_s)
            families["prefill"].add_metric(values, e.speed.prefill.value)
            families["decode"].add_metric(values, e.speed.decode.value)
            families["prior_share"].add_metric(values, e.speed.prefill.prior_share)
            families["backlog"].add_metric(values, e.prefill_backlog_tokens)
            families["foreign"].add_metric(values, e.foreign_waiting)
            families["episodes"].add_metric(values, e.reported.steal_episodes)
            families["stolen"].add_metric(values, e.reported.tokens_stolen)
            if e.last_heartbeat is not None:
                families["age"].add_metric(values, max(0.0, now - e.last_heartbeat))
            if e.managed:
                families["restarts"].add_metric(values, e.restarts)
        yield from families.values()
        fail_open = GaugeMetricFamily(
            "heterogate_routing_failing_open", "1 when every candidate's metrics are stale and routing uses "
            "the gateway's own in-flight counts")
        fail_open.add_metric([], 1.0 if self._table.failing_open else 0.0)
        yield fail_open
        served = GaugeMetricFamily("heterogate_backend_model", "1 per model a backend serves (its pools)",
                                   labels=["backend", "model"])
        for e in self._table.entries():
            for model in sorted(e.models):
                served.add_metric([e.id, model], 1.0)
        yield served
        yield self.model_readiness()

    def model_readiness(self) -> GaugeMetricFamily:
        """Per model, the language backends that can serve it now (readiness: `StateTable.servable`)."""
        family = GaugeMetricFamily("heterogate_model_servable_backends", "Language backends that can serve the "
                                   "model now (0: its requests get 503)", labels=["model"])
        models = sorted({m for e in self._table.entries() for m in e.models})
        for model in models:
            family.add_metric([model], self._table.servable(("language", "both"), model=model))
        return family


class PrefixCollector(Collector):
    """The prefix index per backend (gateway.routing.prefix_index): where its figures come from
    (`source`: estimate, or engine when the engine reports its prefix-cache counters), its size, the
    share of the KV it counts as cached, and the prompt tokens predicted cached against what the engine
    reports.
    Read at scrape time, the engines' latest counters first."""

    def __init__(self, index: PrefixIndex, table: StateTable) -> None:
        self._index, self._table = index, table

    def collect(self) -> Iterator[Metric]:
        labels = ["backend"]
        source = GaugeMetricFamily(
            "heterogate_prefix_index_source", "1 for the source of the backend's prefix index: estimate (routed "
            "prompts only), engine (the engine's counters correct it) or events (its KV cache events)",
            labels=["backend", "source"])
        # keys of PrefixIndex.describe
        families: dict[str, GaugeMetricFamily | CounterMetricFamily] = {
            "blocks": GaugeMetricFamily(
                "heterogate_prefix_index_blocks", "Prompt blocks the index holds for the backend", labels=labels),
            "keep": GaugeMetricFamily(
                "heterogate_prefix_index_keep", "Share of the backend's KV the index counts as cached, learned "
                "from the engine's hit counters (1 until it reports)", labels=labels),
            "evicted_reuse": GaugeMetricFamily(
                "heterogate_prefix_evicted_reuse", "Share of the prefix blocks the backend evicted lately that later "
                "prompts asked for again (rho_i; priced while its cache is full)", labels=labels),
            "predicted_query_tokens": CounterMetricFamily(
                "heterogate_prefix_predicted_query_tokens", "Prompt tokens routed to the backend", labels=labels),
            "predicted_hit_tokens": CounterMetricFamily(
                "heterogate_prefix_predicted_hit_tokens", "Of them, predicted in its prefix cache", labels=labels),
            "reported_query_tokens": CounterMetricFamily(
                "heterogate_prefix_reported_query_tokens", "Prompt tokens the engine reports looked up "
                "(prefix_cache_queries) since the gateway first heard", labels=labels),
            "reported_hit_tokens": CounterMetricFamily(
                "heterogate_prefix_reported_hit_tokens", "Of them, found cached (prefix_cache_hits)", labels=labels),
        }
        index = self._index
        for e in self._table.entries():
            if e.id not in index:
                continue
            index.read(e)
            described = index.describe(e.id)
            source.add_metric([e.id, described["source"]], 1.0)
            for key, family in families.items():
                family.add_metric([e.id], described[key])
        yield source
        yield from families.values()


class VetoCollector(Collector):
    """Candidates vetoed for lack of KV room, per backend. A decision may veto many candidates: they
    are counted in one Counter.update and rendered at scrape time (a labelled prometheus Counter
    costs about a microsecond per increment)."""

    def __init__(self, counts: collections.Counter[str]) -> None:
        self._counts = counts

    def collect(self) -> Iterator[Metric]:
        family = CounterMetricFamily(
            "heterogate_routing_oom_vetoes", "Candidates vetoed for lack of KV room", labels=["backend"]
        )
        for backend, count in list(self._counts.items()):
            family.add_metric([backend], count)
        yield family


class BreakerCollector(Collector):
    """1 per backend whose circuit breaker is not closed (open, or half-open with its probe), read from the
    pipeline's breakers at scrape time."""

    def __init__(self, table: StateTable, tripped: Callable[[str], bool]) -> None:
        self._table = table
        self._tripped = tripped

    def collect(self) -> Iterator[Metric]:
        family = GaugeMetricFamily("heterogate_backend_breaker_open",
                                   "1 while the backend's circuit breaker is open or half-open", labels=["backend"])
        for e in self._table.entries():
            family.add_metric([e.id], 1.0 if self._tripped(e.id) else 0.0)
        yield family


class GatewayMetrics:
    def __init__(self, table: StateTable) -> None:
        self._table = table
        self.removed: set[str] = set()   # backends whose series were forgotten (`forget_backend`), until re-added
        disable_created_metrics()  # type: ignore[no-untyped-call]  # process-wide in prometheus_client; no registry of ours wants them
        self.registry = CollectorRegistry()
        r = self.registry
        ProcessCollector(registry=r)
        PlatformCollector(registry=r)
        Info("heterogate_build", "Version of the running gateway", registry=r).info(
            {"version": __version__, "python": platform.python_version()})
        # The request path's: plain tables (gateway.pipeline.request_metrics), label values given in this order.
        self.prompt_tokens = CounterTable(
            "heterogate_prompt_tokens", "Prompt tokens of served requests (as the backend counted them)", ["backend"]
        )
        self.generation_tokens = CounterTable(
            "heterogate_generation_tokens", "Tokens generated for served requests", ["backend"]
        )
        self.requests = CounterTable(
            "heterogate_requests", "Requests by outcome", ["endpoint", "model", "policy", "backend", "status"]
        )
        self.decisions = CounterTable("heterogate_routing_decisions", "Routing decisions", ["policy", "backend"])
        self.decision_seconds = HistogramTable(
            "heterogate_routing_decision_seconds", "Time to choose a backend", ["policy"], _DECISION_BUCKETS
        )
        # Both from the request's arrival, as its client and the request log count: a saturated gateway's
        # queueing is what an SLO alert on them must see.
        self.ttft_seconds = HistogramTable(
            "heterogate_ttft_seconds", "Time to first token from the request's arrival (the gateway's queues and "
            "retries included), by the backend that answered", ["backend"], _LATENCY_BUCKETS)
        self.e2e_seconds = HistogramTable(
            "heterogate_e2e_seconds", "Request latency from its arrival to its last token (the gateway's queues "
            "included)", ["backend"], _LATENCY_BUCKETS)
        # One observation per completed streamed request of two tokens or more: its mean gap between tokens,
        # (end - first token) / (tokens - 1). Per-token gaps are not seen: an engine's or upstream's tokens
        # that arrive together reach the pipeline as one chunk.
        self.itl_seconds = HistogramTable(
            "heterogate_itl_seconds", "Mean inter-token time of a completed streamed request", ["backend"],
            _ITL_BUCKETS)
        r.register(TablesCollector([self.prompt_tokens, self.generation_tokens, self.requests, self.decisions,
                                    self.decision_seconds, self.ttft_seconds, self.itl_seconds, self.e2e_seconds]))
        self.admission_waiting = Gauge(
            "heterogate_admission_queue_waiting", "Requests waiting in the admission queue", registry=r
        )
        self.overload_held = Gauge(
            "heterogate_overload_queue_held", "Requests held by the overload queue (every TTFT predicted late)",
            registry=r,
        )
        self.oom_vetoes: collections.Counter[str] = collections.Counter()   # backend id -> vetoes
        self.retries = Counter(
            "heterogate_dispatch_retries", "Re-dispatches before the first token", ["backend"], registry=r
        )
        self.encode_seconds = Histogram(
            "heterogate_encode_seconds", "Encode RPC latency (queue + encode + hand-off)", ["backend"],
            buckets=_LATENCY_BUCKETS, registry=r,
        )
        self.embedding_bytes = Counter(
            "heterogate_embedding_bytes", "Embedding bytes sent vision -> language", ["backend"], registry=r
        )
        self.handoff_wait_seconds = Histogram(
            "heterogate_handoff_wait_seconds", "Time a language engine waited for embeddings", ["backend"],
            buckets=_LATENCY_BUCKETS, registry=r,
        )
        self.stolen_requests = Counter(
            "heterogate_stolen_requests", "Language requests routed to a vision backend (work stealing)",
            ["backend"], registry=r,
        )
        self.backends = BackendCollector(table)
        r.register(self.backends)
        r.register(VetoCollector(self.oom_vetoes))

    def forget_backend(self, backend_id: str) -> None:
        """A backend left the fleet: its series leave /metrics (the gauges, read from the state table, go
        with its entry). Kept, a fleet whose backends come and go (admin calls, reloads) would show every
        backend it ever had, and hold their series for as long as the gateway runs."""
        for table in (self.prompt_tokens, self.generation_tokens, self.requests, self.decisions,
                      self.ttft_seconds, self.itl_seconds, self.e2e_seconds):
            table.forget("backend", backend_id)
        for metric in (self.retries, self.encode_seconds, self.embedding_bytes, self.handoff_wait_seconds,
                       self.stolen_requests):
            metric.remove(backend_id)   # no-op where it has no series
        self.oom_vetoes.pop(backend_id, None)
        self.removed.add(backend_id)

    def backend_added(self, backend_id: str) -> None:
        """A backend joined the fleet at runtime (perhaps under the id of one removed earlier)."""
        self.removed.discard(backend_id)

    def live(self, backend_id: str) -> str:
        """The backend label to count a request's work under: `REMOVED` for a backend no longer in the fleet."""
        return REMOVED if backend_id in self.removed else backend_id

    def watch_breakers(self, tripped: Callable[[str], bool]) -> None:
        """Export the breakers' state (the pipeline, which owns them, is built after the metrics)."""
        self.registry.register(BreakerCollector(self._table, tripped))

    def render(self) -> bytes:
        return generate_latest(self.registry)

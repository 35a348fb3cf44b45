"""Everything one gateway process holds, built once at start-up and passed to the front doors."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import httpx
import structlog

from common.errors import ConfigError
from gateway.clients.engine_client import EngineClients, client_factory
from gateway.clients.openai_upstream import Upstream
from gateway.config.auth import KeyRing
from gateway.config.cluster import BackendSpec, ClusterConfig, GatewaySettings, Limits
from gateway.config.models import ServedModel
from gateway.pipeline.admission import AdmissionQueue
from gateway.pipeline.breakers import Breakers, State
from gateway.pipeline.dispatch import LANGUAGE_ROLES, VISION_ROLES, Pipeline, PipelineSettings
from gateway.pipeline.metrics import GatewayMetrics, PrefixCollector
from gateway.pipeline.overload import OverloadGate
from gateway.pipeline.tenants import TenantCollector, Tenants
from gateway.requests.exact_prompt import ExactPrompts
from gateway.routing.backend_entry import SERVING, BackendEntry
from gateway.routing.encoder_index import EncoderIndex
from gateway.routing.policies import build_policy
from gateway.routing.prefix_index import PrefixIndex
from gateway.routing.signals import LocalSignals, SignalStore
from gateway.routing.state_table import StateTable

log = structlog.get_logger("runtime")


@dataclass
class Runtime:
    config: ClusterConfig
    table: StateTable
    clients: EngineClients
    metrics: GatewayMetrics
    pipeline: Pipeline
    fetcher: httpx.AsyncClient    # remote image URLs (only when the config enables them)
    keys: KeyRing
    exact_prompts: ExactPrompts | None = None   # the model's tokenizer, when torch engines run the model
    # other models' tokenizers by served name (`tokenizer:`), for their text prompts' counts and prefix blocks
    tokenizers: dict[str, ExactPrompts] = field(default_factory=dict)
    upstreams: dict[str, Upstream] = field(default_factory=dict)   # kind: openai backends, read by the clients' factory
    # where the backends' reports go: this process's table (the Redis store once it joins replicas)
    signals: SignalStore = field(init=False)
    # the models the fleet has had a vision backend for (the last one may be removed at runtime:
    # gateway/control/fleet.py)
    had_encoders: frozenset[str] = field(init=False)

    def __post_init__(self) -> None:
        self.signals = LocalSignals(self.table, self.clients.ensure)
        self.had_encoders = has_encoders(self.config)

    def reload_keys(self) -> None:
        """SIGHUP: the API keys read again from the files and variables the settings name (the settings
        themselves are start-up's), so a key is added or revoked without a restart. A file that start-up
        would refuse (unreadable, no key, a key of two tenants) keeps the keys in use, logged; keys never
        go off this way (a file without keys is refused). Keys are never logged, only their counts."""
        settings = self.config.settings
        try:
            keys = KeyRing.load(settings.auth, settings.tenants)
        except ConfigError as exc:
            log.error("keys_reload_refused", error=str(exc), detail="the keys in use are kept")
            return
        if keys == self.keys:
            return
        self.keys = keys
        log.info("keys_reloaded", api_keys=len(keys.user), admin_keys=len(keys.admin),
                 tenant_keys={name: keys.tenant_of.count(name) for name in dict.fromkeys(keys.tenant_of)})

    async def close(self) -> None:
        await self.clients.close()
        await self.fetcher.aclose()

    @property
    def limits(self) -> Limits:
        return self.config.settings.limits

    def readiness(self) -> dict[str, Any]:
        """Ready when the language pool has a backend that can serve now (`StateTable.servable`: not
        the stale ones kept only to fail open on). The vision pool is reported when the cluster serves
        images and some language backend relies on a separate encoder (a `both` backend or an upstream
        that reads images itself does not); without it image requests get 503 while text is served, so
        the gateway stays ready and says `"degraded": ["vision"]`: taking every replica out of its
        load balancer for the images would stop the text too. With several models each model's encoders
        are counted apart (`"vision:<model>"`: an encoder of one model does not encode another's images).
        So with backends kept for higher priority classes (`min_priority`): where only those serve, the
        lowest class's requests get 503 and it is named, `"priority:<class>"`."""
        language = self.table.servable(LANGUAGE_ROLES)
        out: dict[str, Any] = {"ready": language > 0, "healthy_language_backends": language}
        degraded = []
        several = len(self.config.models) > 1
        if needs_vision_pool(self.config, self.had_encoders):
            vision = self.table.servable(VISION_ROLES)
            out["healthy_vision_backends"] = vision
            if vision == 0 and not several:
                degraded.append("vision")
        kept = any(b.min_priority is not None for b in self.config.raw.backends)
        if kept and language:   # backends kept for higher classes: a class none is open to is degraded
            lowest = self.config.settings.tenants.classes[0]
            if not self.table.servable(LANGUAGE_ROLES, priority=lowest):
                degraded.append(f"priority:{lowest}")
        if several:   # per model: ready while any model is, the others named degraded
            models: dict[str, dict[str, Any]] = {}
            for name in self.config.models.models:
                n = self.table.servable(LANGUAGE_ROLES, model=name)
                models[name] = {"ready": n > 0, "healthy_language_backends": n}
                if n == 0:
                    degraded.append(f"model:{name}")
                if needs_vision_pool(self.config, self.had_encoders, name):
                    models[name]["healthy_vision_backends"] = vision = self.table.servable(VISION_ROLES, model=name)
                    if vision == 0:
                        degraded.append(f"vision:{name}")
            out["models"] = models
        if degraded:
            out["degraded"] = degraded
        return out

    def model_cards(self) -> list[dict[str, Any]]:
        """`/v1/models`: every model the cluster serves, as vLLM lists one (max_model_len: here the longest
        context any of its backends serves), with its aliases."""
        return [self.model_card(name) for name in self.config.models.models]

    def model_card(self, name: str) -> dict[str, Any]:
        served = self.config.models.models[name]
        return {"id": served.name, "object": "model", "created": 0, "owned_by": "heterogate",
                "max_model_len": self.table.largest_context(served.name), "aliases": list(served.aliases)}

    def _prefix_cache(self, e: BackendEntry) -> dict[str, Any] | None:
        """The prefix index's view of a backend (None: cache-aware routing is off), the engine's latest
        counters read first."""
        index = self.pipeline.prefixes
        if index is None or e.id not in index:
            return None
        index.read(e)
        return index.describe(e.id)

    def describe_backends(self) -> list[dict[str, Any]]:
        out = []
        for e in self.table.entries():
            snap = self.table.snapshot(e)
            context, context_source = self.table.context(e)
            out.append({
                "id": e.id,
                "role": e.role,
                "gpu": e.gpu.name,
                "models": sorted(e.models),
                "address": e.address,
                "managed": e.managed,
                # starting / restarting / stopped (managed, by the supervisor), else healthy / reachable /
                # unhealthy (reachable: a kind: openai upstream that answers its probe but sends no fresh
                # load figures, no `scrape:` or a stale one: it serves, routed on the gateway's own counts)
                "state": e.lifecycle if e.lifecycle not in SERVING else
                "healthy" if self.table.is_healthy(e) else
                "reachable" if self.table.answers_unheard(e) else "unhealthy",
                # the engine's own as it reports it, else the process the supervisor runs for it; while a
                # managed engine starts again, that process (its last report's pid is the one that went)
                "pid": None if e.lifecycle == "stopped" else
                (e.reported.pid if e.lifecycle in SERVING else 0) or e.process_pid or None,
                "healthy": self.table.is_healthy(e),
                "draining": self.table.is_draining(e.id),   # no new requests (fleet changes at runtime)
                "reachable": self.table.reachable(e.id),   # kind: openai: does the upstream answer the probe
                # why its last probe or scrape failed (kind: openai; a heartbeat agent's scrape), None: they did not
                "last_error": e.last_error or e.reported.scrape_error or None,
                # managed: why its engine last stopped unasked (exit status, signal, start timeout), and how
                # often the supervisor relaunched it
                "last_exit": e.last_exit,
                "restarts": e.restarts if e.managed else None,
                "breaker": self.pipeline.breakers.state(e.id).value,
                "queue_depth": snap.queue_depth,
                "waiting": e.reported.waiting,
                "running": e.reported.running,
                "in_flight": e.in_flight,   # language requests (prefill and decode) this gateway has there
                "encoding_image_tokens": e.vision_in_flight_tokens,   # image tokens of its encodes there now
                "peer_in_flight": e.peer_in_flight,   # other replicas' (shared through Redis)
                "kv_free_bytes": snap.kv_free_bytes,
                "kv_total_bytes": snap.kv_total_bytes,
                "kv_capacity_source": self.table.kv_capacity(e)[2],
                "max_model_len": context,
                "context_source": context_source,
                # per model it serves (several: a kind: openai upstream), [tokens, source]
                "model_contexts": {m: list(self.table.context(e, m)) for m in sorted(e.models)},
                "vision_backlog": snap.vision_backlog,
                "images_encoded": e.reported.images_encoded,
                "embedding_cache_hits": e.reported.embedding_cache_hits,
                "embedding_cache_images": e.reported.embedding_cache_images,
                "embedding_bytes_sent": e.reported.embedding_bytes_sent,
                "steal": e.steal,
                "min_priority": e.min_priority,   # kept for tenants of this class or higher (None: anyone's)
                "steal_episodes": e.reported.steal_episodes,
                "tokens_stolen": e.reported.tokens_stolen,
                "mean_service_s": snap.mean_service_s,
                "prefilling": e.prefilling,
                "prefill_backlog_tokens": e.prefill_backlog_tokens,
                # other clients' requests waiting in the engine, as of its last report, and their prompt tokens
                # as priced (at the mean this gateway's requests prefill): in the policies' prefill backlog
                "foreign_waiting": e.foreign_waiting,
                "foreign_running": e.foreign_running,
                "foreign_backlog_tokens": e.foreign_backlog_tokens,
                "kv_reserved_tokens": e.kv_reserved_tokens,
                "learned_speed": e.speed.describe(),
                "prefix_cache": self._prefix_cache(e),
                "tokens_generated": e.reported.tokens_generated,
                "requests_completed": e.reported.requests_completed,
            })
        return out


def has_encoders(config: ClusterConfig) -> frozenset[str]:
    """The models some vision backend of the fleet encodes for."""
    return frozenset(m.name for b in config.raw.backends if b.role == "vision" for m in config.backend_models[b.id])


def needs_vision_pool(config: ClusterConfig, had_encoders: frozenset[str] | None = None,
                      model: str | None = None) -> bool:
    """Image requests (of `model`; None: of any) are served (the model takes images and the fleet has
    encoders for it, or had them before the fleet changed at runtime: `had_encoders`), and some language
    backend of it depends on a separate encoder for them."""
    encoders = has_encoders(config) if had_encoders is None else had_encoders
    models = [m for m in config.models.models.values() if model is None or m.name == model]
    return any(
        m.profile.vision is not None and m.name in encoders
        and any(((s.kind == "engine" and s.role == "language") or s.image_embeds) and m in config.backend_models[s.id]
                for s in config.raw.backends)
        for m in models
    )


def pipeline_settings(settings: GatewaySettings) -> PipelineSettings:
    limits = settings.limits
    return PipelineSettings(
        max_attempts=limits.max_attempts,
        first_token_timeout_s=limits.first_token_timeout_s,
        request_timeout_s=limits.request_timeout_s,
        handoff_timeout_s=settings.handoff_timeout_s,
        stealing=settings.stealing.enabled,
        steal_threshold=settings.stealing.threshold,
        steal_max_batch=settings.stealing.max_batch,
        retry_backoff_s=settings.retry_backoff_s,
        retry_backoff_max_s=settings.retry_backoff_max_s,
        first_token_floor_s=limits.first_token_floor_s,
        first_token_ttft_factor=limits.first_token_ttft_factor,
    )


def index_backend(index: PrefixIndex, table: StateTable, config: ClusterConfig, entry: BackendEntry) -> None:
    """Give the prefix index a backend a prompt can be routed to (at start-up and when one is added at
    runtime), sized by its KV capacity in tokens; one that takes no language work is left out."""
    if entry.takes_language and entry.id not in index:
        index.add_backend(entry.id, table.kv_capacity(entry)[1] // config.model_of(entry.id).profile.kv_bytes_per_token)


def register_backend(table: StateTable, config: ClusterConfig, spec: BackendSpec, address: str | None) -> None:
    """One entry of backends.yaml into the table: at start-up, and when the fleet changes at runtime."""
    table.register(
        spec.id, spec.role, config.gpus[spec.id], address=address, managed=spec.launch is not None,
        steal=spec.steal, external=spec.kind == "openai", max_model_len=spec.max_model_len,
        min_priority=spec.min_priority,
        kv_capacity_tokens=spec.kv_capacity_tokens, models=[m.name for m in config.backend_models[spec.id]],
        profile=config.model_of(spec.id).profile,
        other_contexts={m.name: m.profile.max_context for m in config.backend_models[spec.id][1:]},
        report_interval_s=spec.scrape.interval_s(config.settings.heartbeat_interval_ms) if spec.scrape else None,
    )


def upstream_of(config: ClusterConfig, spec: BackendSpec) -> Upstream:
    """What the HTTP client of a kind: openai entry sends upstream (model name, image embeds, key)."""
    return Upstream(spec.upstream_model, config.model_of(spec.id).profile if spec.image_embeds else None,
                    config.api_keys[spec.id])


def routing_tokenizer(model: ServedModel) -> ExactPrompts:
    """The model's `tokenizer:` loaded (blocking, once at start-up)."""
    try:
        return ExactPrompts(model.profile, str(model.tokenizer))
    except ImportError:
        raise ConfigError(f"model {model.name!r}: `tokenizer:` needs the transformers package "
                          "(pip install 'transformers>=5.17,<6')") from None


def build_runtime(config: ClusterConfig, policy_name: str | None = None,
                  addresses: dict[str, str] | None = None) -> Runtime:
    """`addresses`: where managed kind: openai backends will listen (their ports are picked at start-up)."""
    settings = config.settings
    table = StateTable(config.model, settings.heartbeat_interval_ms / 1000, settings.heartbeat_miss_limit,
                       itl_target_s=settings.routing.itl_target_ms / 1000,
                       fail_open_s=settings.heartbeat_fail_open_s)
    address_of = {s.id: s.address for s in config.raw.backends} | (addresses or {})
    for spec in config.raw.backends:
        register_backend(table, config, spec, address_of[spec.id])
    routing = settings.routing
    name = policy_name or routing.policy
    policy = build_policy(name, routing.params.get(name))
    vision_policy = build_policy(routing.vision_policy, routing.params.get(routing.vision_policy))
    upstreams = {s.id: upstream_of(config, s) for s in config.raw.backends if s.kind == "openai"}
    clients = EngineClients(client_factory(upstreams, upstream_idle_s=settings.keep_alive.upstream_idle_s,
                                           upstream_max_connections=settings.keep_alive.upstream_max_connections))
    for spec in config.raw.backends:
        if (address := address_of[spec.id]) is not None:
            clients.ensure(spec.id, address)
    metrics = GatewayMetrics(table)
    pipeline = Pipeline(table, policy, vision_policy, clients, metrics, pipeline_settings(settings),
                        Breakers(settings.breaker), AdmissionQueue(settings.admission))
    metrics.admission_waiting.set_function(lambda: pipeline.admission.waiting)
    if settings.overload.enabled:
        pipeline.overload = gate = OverloadGate(settings.overload, pipeline.clock, table.heartbeat_interval_s)
        metrics.overload_held.set_function(lambda: gate.held)
    pipeline.tenants = Tenants(settings.tenants)
    metrics.registry.register(TenantCollector(pipeline.tenants))
    prefix = routing.prefix_cache
    if prefix.enabled:
        pipeline.prefixes = index = PrefixIndex(prefix.block_tokens, prefix.max_blocks_per_backend)
        for entry in table.entries():
            index_backend(index, table, config, entry)
        metrics.registry.register(PrefixCollector(index, table))
        pipeline.encoders = EncoderIndex(prefix.images_per_encoder)
    metrics.watch_breakers(lambda backend_id: pipeline.breakers.state(backend_id) is not State.CLOSED)
    fetcher = httpx.AsyncClient(
        timeout=httpx.Timeout(settings.images.fetch_timeout_s), follow_redirects=False, trust_env=False
    )
    exact = None
    if config.torch_weights is not None and config.torch_model is not None:
        exact = ExactPrompts(config.torch_model.profile, config.torch_weights[0])
    tokenizers = {m.name: routing_tokenizer(m) for m in config.models.models.values()
                  if m.tokenizer is not None and m is not config.torch_model}   # the torch model's: `exact`
    keys = KeyRing.load(settings.auth, settings.tenants)
    return Runtime(config, table, clients, metrics, pipeline, fetcher, keys, exact, tokenizers, upstreams)

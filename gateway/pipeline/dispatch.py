"""The request pipeline: route both pools, dispatch, hand off embeddings, retry before the first token.

Text-only: route the language pool (L_r = text tokens) and call Generate. With images: route the
language pool first (L_r = text + image tokens), then the vision pool; the vision engine encodes and
delivers the embedding straight to the chosen language engine while that engine's Generate waits for
it. The gateway carries control, not tensors, with one exception: an OpenAI-compatible upstream that
takes embeddings in its request (vLLM `image_embeds`) gets them from the gateway, so there the encode
comes first. A vision failure before delivery re-encodes on another vision backend; a `both`
(monolithic) backend encodes its own images.

`start()` returns only once the first token is in hand, so every failure that can still be retried
is retried and the HTTP door can still answer with a proper status. After the first token, failures
surface from `Dispatch.rest()`: nothing is dispatched twice once a token has been sent. A
non-streamed request (`complete()`) has sent nothing until its last token, so a backend that fails
mid-generation is restarted on another.

One budget bounds the request, kept in its `RequestRecord`:
- one deadline (the client's `x-request-timeout` or gRPC deadline, capped by `request_timeout_s`),
  counted from its arrival: the admission wait, every attempt, every encode, every backoff and the
  stream itself. No attempt starts after it; a request that runs out of time gets
  `DeadlineExceeded` (504);
- at most `max_attempts` dispatches per pool (language attempts, restarts included; encodes), each
  retry after a backoff, none to a backend that already failed the request.

Each dispatch is one `Dispatch`: it holds the backend's lease from the attempt's start to its end and
settles the backend's breaker, both in one place (`Dispatch._end`). Only the backend's own faults count
against it (`Pipeline.backend_fault`): a request whose own deadline passes, whose client leaves, or
that the backend refuses as invalid costs the backend nothing.

A first token is awaited for at most `max(first_token_floor_s, first_token_ttft_factor x predicted
TTFT)` (predicted from the backend's learned prefill speed and prefill backlog, as `marginal_delay`'s
T_first; at most `first_token_timeout_s`), and no longer than the backend stays healthy: a backend
that misses its heartbeats while a request waits on it (a hung or stopped engine) loses the request
to another backend at once (`FirstTokenWatch`). A non-streamed request to a kind: openai upstream gets
its reply whole after its last token: it is awaited `first_token_timeout_s` plus
`first_token_ttft_factor` x max_tokens x the backend's decode step.

Clock, randomness and clients are the constructor's (the client factory is `EngineClients`'), so a
test builds a Pipeline on fake engine clients (tests/unit/test_pipeline.py).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import random
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import structlog

from common.tracing import pass_through, tracestate
from common.wire import engine_pb2
from gateway.clients.engine_client import HANDOFF_TIMEOUT, BackendClient, EncoderClient, EngineClients
from gateway.clients.engine_fields import refused_fields
from gateway.clients.openai_upstream import UpstreamRateLimited
from gateway.config.tenants import TenantsConfig
from gateway.pipeline.admission import AdmissionQueue
from gateway.pipeline.breakers import Breakers
from gateway.pipeline.metrics import GatewayMetrics
from gateway.pipeline.overload import OverloadGate
from gateway.pipeline.request_log import RequestRecord
from gateway.pipeline.tenants import Tenants
from gateway.pipeline.tracing import AttemptTrace, RequestTrace, Tracing
from gateway.requests.errors import (
    BackendDrained,
    BackendFailure,
    BackendTimeout,
    DeadlineExceeded,
    NoBackendAvailable,
    Overloaded,
)
from gateway.requests.job import GenerationJob
from gateway.routing.backend_entry import BackendEntry, Lease
from gateway.routing.encoder_index import EncoderIndex
from gateway.routing.policies.candidates import Candidates
from gateway.routing.policies.contracts import BackendSnapshot, Decision, Policy, RequestProfile, Role
from gateway.routing.policies.first_token import SoonestFirstToken, predicted_ttft_s
from gateway.routing.policies.stealing import stealers
from gateway.routing.prefix_index import PrefixIndex
from gateway.routing.state_table import StateTable

log = structlog.get_logger("pipeline")

# The loop's timers may fire this much before their time (uvloop's count whole milliseconds).
LOOP_TIMER_RESOLUTION_S = 0.001
SOONEST_FIRST_TOKEN = SoonestFirstToken()   # how a request that went on its tenant's guarantee is routed

LANGUAGE_ROLES: tuple[Role, ...] = ("language", "both")
VISION_ROLES: tuple[Role, ...] = ("vision",)


class NoEncoder(Exception):
    """No vision backend could encode a request's images for the language backend chosen (none healthy,
    or each failed it), while another backend of its pool encodes its own images (`role: both`, or an
    upstream that takes the images themselves): the request goes there instead (`Pipeline._dispatch`)."""


@dataclass(frozen=True, slots=True)
class PipelineSettings:
    max_attempts: int
    first_token_timeout_s: float
    request_timeout_s: float
    handoff_timeout_s: float
    stealing: bool
    steal_threshold: int
    steal_max_batch: int
    retry_backoff_s: float = 0.02
    retry_backoff_max_s: float = 1.0
    first_token_floor_s: float = 10.0      # the first-token limit is never below this
    first_token_ttft_factor: float = 4.0   # ... nor below this many times the predicted TTFT


class _Wait:
    """One attempt waiting for its first token: what to cancel, and what its limit is worked out from
    (at the watch's first tick: most first tokens come before it)."""

    __slots__ = ("backend", "due", "late", "reason", "reserve", "since", "target", "tokens", "whole")

    def __init__(self, target: asyncio.Future[Any], backend: BackendSnapshot, tokens: int, reserve: int, whole: bool,
                 since: float | None, late: bool) -> None:
        self.target = target            # the task or future that waits
        self.backend = backend          # as routed
        self.late = late                # its heartbeats were already late then (the pool failed open on it)
        self.tokens = tokens            # its prompt's (text + image)
        self.reserve = reserve          # the KV it holds there: its prompt + max_tokens
        self.whole = whole              # a non-streamed request
        self.since = since              # loop time its limit counts from; None: not yet (embeddings to come)
        self.due: float | None = None   # loop time its limit passes (inf: none); None: not worked out yet
        self.reason: str | None = None  # why it was ended; None while it was not


class FirstTokenWatch:
    """Ends waits for a first token early, by cancelling what waits: when its backend is marked
    unhealthy (missed heartbeats), or when its first-token limit (`limit`) passes. One timer for all of
    a pipeline's waits, ticking every `every_s` (the heartbeat interval) while any wait, and the limits
    worked out at a wait's first tick: a timer per request cost the request path ~15 us in
    benchmarks/gateway_micro.py. A limit is so met within a tick of its time (limits are seconds).

    A kind: openai backend is known by scraping, whose staleness does not mean it hangs (the table
    fails open on it): its limit is watched, and whether the gateway's probe has found its upstream
    unreachable (`StateTable.reachable`). A non-streamed request to it gets its reply whole after the
    last token, so its limit is the reply's (`Pipeline.first_token_limit` with `whole`): an upstream
    that takes the request and never answers while it still answers the probe (a wedged engine behind
    a live HTTP server) held such a request until `request_timeout_s` (600 s), never retried. A backend
    whose heartbeats were already late when the request was sent there is not cancelled as unhealthy
    either: the table failed open on it, none of its pool being fresh (`StateTable.candidates`), and a
    retry would find nothing better."""

    def __init__(self, table: StateTable, every_s: float,
                 limit: Callable[[BackendSnapshot, int, int, bool], float | None]) -> None:
        self._table = table
        self._every_s = every_s
        self._limit = limit
        self._waits: set[_Wait] = set()
        self._handle: asyncio.TimerHandle | None = None

    def watch(self, target: asyncio.Future[Any], backend: BackendSnapshot, job: GenerationJob,
              since: float | None) -> _Wait:
        tokens = job.prompt_tokens + job.image_tokens
        entry = self._table.get(backend.id)
        late = entry is not None and not entry.external and not self._table.is_healthy(entry)
        wait = _Wait(target, backend, tokens, tokens + job.max_tokens, job.whole, since, late)
        self._waits.add(wait)
        if self._handle is None:
            self._handle = asyncio.get_running_loop().call_later(self._every_s, self._tick)
        return wait

    @staticmethod
    def arm(wait: _Wait) -> None:
        """Count `wait`'s limit from now (the embeddings it waited for have been delivered)."""
        wait.since, wait.due = asyncio.get_running_loop().time(), None

    def stop(self, wait: _Wait) -> None:
        self._waits.discard(wait)

    def _tick(self) -> None:
        loop = asyncio.get_running_loop()
        now = loop.time()
        health: dict[str, bool] = {}
        for wait in list(self._waits):
            entry = self._table.get(wait.backend.id)
            if entry is None:   # it left the fleet: the dispatch ends on its own
                self._waits.discard(wait)
                continue
            reason = self._why_end(wait, entry, now, health)
            if reason is None:
                continue
            self._waits.discard(wait)
            wait.reason = reason
            wait.target.cancel()
        self._handle = loop.call_later(self._every_s, self._tick) if self._waits else None

    def _why_end(self, wait: _Wait, entry: BackendEntry, now: float, health: dict[str, bool]) -> str | None:
        """Why `wait` ends now (class docstring); None: it goes on. `health`: this tick's verdicts."""
        backend, table = wait.backend, self._table
        if entry.external and table.reachable(backend.id) is False:
            return "its upstream stopped answering the gateway's probe while the request waited"
        whole = entry.external and wait.whole
        if wait.due is None and wait.since is not None:
            limit = self._limit(backend, wait.tokens, wait.reserve, whole)
            wait.due = float("inf") if limit is None else wait.since + limit
        if wait.due is not None and now >= wait.due:
            if whole:
                return f"no reply within {wait.due - (wait.since or 0.0):.3g} s (its reply limit)"
            return f"no first token within {wait.due - (wait.since or 0.0):.3g} s (its first-token limit)"
        if not (entry.external or wait.late or health.setdefault(backend.id, table.is_healthy(entry))):
            return "marked unhealthy (missed heartbeats) while the request waited for its first token"
        return None


class Dispatch:
    """One dispatch of a request to one backend, from its lease to its end: the one owner of the
    lease and of the backend's breaker verdict, both settled in `_end`, once, however it ends.

    `start()` hands it out once it has its first token; read it with exactly one of `rest()` and
    `whole()` (each ends it)."""

    __slots__ = ("_answered", "_ended", "_pipeline", "_stream", "backend_id", "decision", "first", "lease",
                 "loop_deadline", "record", "request_id", "sent", "streamed", "trace", "ttft_s",
                 "vision_backend_id")

    first: engine_pb2.GenerateChunk   # set once the first token is in hand
    # From the request's arrival, as its client and the request log count it: the admission and overload
    # queues' waits and the retries included (from this dispatch's routing, the TTFT histogram and alert
    # showed a saturated gateway's clients waiting seconds as first tokens in milliseconds).
    ttft_s: float

    def __init__(
        self, pipeline: Pipeline, job: GenerationJob, decision: Decision, record: RequestRecord, lease: Lease,
    ) -> None:
        self._pipeline = pipeline
        self.request_id = job.request_id
        self.decision = decision
        self.backend_id = decision.backend.id
        self.vision_backend_id: str | None = None
        self.record = record
        self.lease = lease
        self.streamed = not job.whole   # tokens arrive as they are made: the decode time is measurable
        self._stream: AsyncIterator[engine_pb2.GenerateChunk] | None = None
        self.sent = 0.0                           # loop time the request went to its client
        self.loop_deadline: float | None = None   # the deadline its client's timers count to (`backend_fault`)
        self._answered = False   # the breaker has its success: the first token came
        self._ended = False
        self.trace: AttemptTrace | None = None   # tracing on: its spans (none unsampled) and traceparent

    def _first_token(self, first: engine_pb2.GenerateChunk, job: GenerationJob) -> None:
        p, record = self._pipeline, self.record
        now = p.clock()
        self.first = first
        self.ttft_s = record.ttft_s = now - record.started
        record.policy = self.decision.policy
        record.prompt_tokens = len(job.token_ids) or job.prompt_tokens + job.image_tokens
        record.completion_tokens = first.index + 1
        self._answered = True
        p.breakers.on_success(self.backend_id)
        p.table.first_token(self.lease)
        if p.overload is not None:   # the backlog ahead of a held request fell
            p.overload.notify()
        if first.embedding_wait_s:
            p.metrics.handoff_wait_seconds.labels(self.backend_id).observe(first.embedding_wait_s)
        p.metrics.ttft_seconds.observe((self.backend_id,), self.ttft_s)
        if self.trace is not None:
            self.trace.first_token(first)

    async def rest(self) -> AsyncIterator[engine_pb2.GenerateChunk]:
        """The chunks as they come, the first one included (a streamed response)."""
        completed = 0   # tokens of a completed request
        error: BaseException | None = None
        record = self.record
        try:
            chunk = self.first
            yield chunk
            while not chunk.finish_reason:
                chunk = await self._next()
                record.completion_tokens = chunk.index + 1   # handed to the door: the door sends it
                yield chunk
            completed = chunk.usage.completion_tokens or chunk.index + 1
        except BaseException as exc:   # GeneratorExit (closed early) included: the dispatch still ends
            error = exc
            if isinstance(exc, BackendFailure) and self._pipeline.deadline_passed(record, self.loop_deadline):
                raise self._pipeline._deadline_error(record, exc) from None   # the client's deadline, not the backend
            if isinstance(exc, BackendFailure) and self._pipeline.table.was_cut(self.backend_id):
                raise BackendDrained(f"backend {self.backend_id} was drained and stopped before the request "
                                     "finished (its drain's time, gateway.drain_timeout_s, ran out); send it again",
                                     backend_id=self.backend_id, retryable=False) from exc
            raise
        finally:
            await self.close(completed, error)

    async def whole(self) -> list[engine_pb2.GenerateChunk]:
        """Every chunk, the first one included (a non-streamed response): one coroutine, where
        collecting `rest()` would take an async generator and its clean-up per request."""
        completed = 0
        error: BaseException | None = None
        chunks = [self.first]
        try:
            while not chunks[-1].finish_reason:
                chunks.append(await self._next())
                self.record.completion_tokens = chunks[-1].index + 1
            completed = chunks[-1].usage.completion_tokens or chunks[-1].index + 1
        except BaseException as exc:
            error = exc
            raise
        finally:
            await self.close(completed, error)
        return chunks

    async def _next(self) -> engine_pb2.GenerateChunk:
        assert self._stream is not None
        try:
            return await anext(self._stream)
        except StopAsyncIteration:
            raise BackendFailure(
                f"backend {self.backend_id}: stream ended without a finish reason",
                backend_id=self.backend_id,
                retryable=False,
            ) from None

    async def close(self, completed: int, error: BaseException | None) -> None:
        """Close the stream (the engine cancels what it still runs), then `_end`."""
        try:
            if self._stream is not None:
                await self._stream.aclose()  # type: ignore[attr-defined]
        finally:
            self._end(completed, error)

    def _end(self, completed: int, error: BaseException | None) -> None:
        """The one place the dispatch lets go of its backend: the lease back (`completed` > 0: with that
        many tokens, which teach the backend's decode speed when they were streamed), the admission
        queue woken, and the breaker told: a failure for the backend's own fault, nothing else (a probe
        that ended for the client's reasons is given back)."""
        if self._ended:
            return
        self._ended = True
        p = self._pipeline
        p.table.release(self.lease, completed if self.streamed else 0)
        p.admission.notify()
        if p.overload is not None:
            p.overload.finished()
        if error is not None and p.backend_fault(error, self.backend_id, self.record, self.loop_deadline):
            p.breakers.on_failure(self.backend_id)
        elif not self._answered:
            p.breakers.on_abandon(self.backend_id)
        if completed:
            now = p.clock()
            latency_s = now - self.record.started
            backend = (p.metrics.live(self.backend_id),)   # its label: "(removed)" once it left the fleet
            p.metrics.e2e_seconds.observe(backend, latency_s)
            if self.streamed and completed > 1:   # the request's mean inter-token time
                p.metrics.itl_seconds.observe(backend, (latency_s - self.ttft_s) / (completed - 1))
        if self.trace is not None:
            self.trace.end(completed, error)


class Pipeline:
    def __init__(
        self,
        table: StateTable,
        policy: Policy,
        vision_policy: Policy,
        clients: EngineClients,
        metrics: GatewayMetrics,
        settings: PipelineSettings,
        breakers: Breakers,
        admission: AdmissionQueue,
        *,
        clock: Callable[[], float] | None = None,
        rng: random.Random | None = None,
    ) -> None:
        """`clock`: monotonic seconds, the table's own by default (health and deadlines read one clock);
        `rng`: the retries' backoff jitter; `clients`: the engine clients, made by its factory."""
        self.breakers = breakers
        self.admission = admission
        self.debug = logging.getLogger().isEnabledFor(logging.DEBUG)   # set by configure_logging
        self.table = table
        self.policy = policy
        self.vision_policy = vision_policy
        self.clients = clients
        self.metrics = metrics
        self.settings = settings
        self.prefixes: PrefixIndex | None = None   # cache-aware routing (set by the runtime when enabled)
        self.overload: OverloadGate | None = None   # the overload queue (set by the runtime when enabled)
        self.encoders: EncoderIndex | None = None  # which encoder holds which image (the same)
        self.watch = FirstTokenWatch(table, table.heartbeat_interval_s, self.first_token_limit)
        self.tenants = Tenants(TenantsConfig())    # the keys' tenants: limits, shares, usage (set by the runtime)
        self.clock = clock or table.clock
        self.rng = rng or random.Random()
        self.tracing = Tracing.from_env()   # None: tracing is off (the OTEL_* variables, common.tracing)

    def _decide(self, policy: Policy, profile: RequestProfile, candidates: Candidates, now: float,
                gate: OverloadGate | None = None) -> Decision:
        """The policy's decision, recorded; with the overload queue (`gate`), to a backend that takes the
        request (`OverloadQueue.route`)."""
        t0 = time.perf_counter()
        if gate is None:
            decision = policy.choose(profile, candidates, now)
        else:
            decision = gate.queue.route(lambda within: policy.choose(profile, within, now), candidates, profile)
        m = self.metrics
        m.decision_seconds.observe((policy.name,), time.perf_counter() - t0)
        m.decisions.inc((policy.name, decision.backend.id))
        vetoed = decision.vetoed
        if vetoed:   # mostly none: Counter.update walks even an empty tuple
            m.oom_vetoes.update(vetoed)
        if self.debug:   # the cost table is O(N) to render: only when someone reads it
            log.debug("routed", request_id=profile.request_id, policy=policy.name, backend=decision.backend.id,
                      costs=[c._asdict() for c in decision.costs])
        return decision

    def profile(self, job: GenerationJob, record: RequestRecord) -> RequestProfile:
        """The job's profile for the language pool, with the prompt prefix each backend is predicted to
        hold (`gateway.routing.prefix_index`, images by their content hash at their places in the prompt);
        the index's view is kept in `record` for the dispatches."""
        profile = job.profile()
        index = self.prefixes
        if index is None:
            return profile
        tokens = profile.input_tokens
        blocks = record.prefix.blocks if record.prefix is not None else index.hashes(
            job.prompt, job.token_ids or job.prefix_ids, tokens, job.placed_images() if job.images else (),
            job.cache_salt)
        # a session named under a cache salt is its own (one tenant's "alice" is not another's)
        session = f"{job.cache_salt}\x00{job.session}" if job.session and job.cache_salt else job.session
        named = bool(job.token_ids or job.prefix_ids) and not job.images and not job.cache_salt   # as events name them
        record.prefix = query = index.lookup(blocks, session, tokens, named)
        if not query.cached and not query.reuse:
            return profile
        return replace(profile, cached_tokens=query.cached, evicted_reuse=query.reuse)

    def _routed(self, record: RequestRecord, backend: BackendSnapshot) -> int:
        """The request goes to `backend`: the index remembers its prompt there. Returns the prompt tokens
        predicted cached there (those its lease does not count as prefill)."""
        query, index = record.prefix, self.prefixes
        if query is None or index is None:
            return 0
        entry = self.table.get(backend.id)
        if entry is not None:   # the engine's latest counters first: they set keep_i
            index.read(entry)
        per_token = backend.kv_bytes_per_token
        index.record(query, backend.id, backend.kv_total_bytes // per_token if per_token else 0)
        return query.cached.get(backend.id, 0)

    def saturated(self, model: str | None = None, closed: Sequence[str] = ()) -> bool:
        """Every language candidate (of `model`'s pool, less the backends `closed` to the request) is at
        the admission queue-depth limit (none at all: not saturated)."""
        limit = self.admission.config.saturated_queue_depth
        candidates = self.language_candidates(model, closed)
        return bool(candidates) and all(b.queue_depth >= limit for b in candidates)

    def language_candidates(self, model: str | None = None, closed: Sequence[str] = ()) -> Candidates:
        """The healthy language candidates (of `model`'s pool) now, less `closed` (what saturation reads)."""
        return self.table.candidates(LANGUAGE_ROLES, exclude=[*closed, *self.breakers.blocked()], model=model)

    def routable(self, now: float, exclude: Sequence[str], model: str | None = None) -> Candidates:
        """What a language decision chooses among: the healthy language candidates of `model`'s pool
        (None: every backend) and the vision backends that would steal language work now, less
        `exclude`; the overload queue predicts on the same set."""
        exclude = [*exclude, *self.breakers.blocked()]
        candidates = self.table.candidates(LANGUAGE_ROLES, now, exclude, model)
        if self.settings.stealing and self.table.has_role(VISION_ROLES):   # a text-only cluster: nobody to steal
            vision = self.table.candidates(VISION_ROLES, now, exclude, model)
            candidates = candidates.extended(stealers(vision, self.table.language_backlog(model),
                                                      self.settings.steal_threshold, self.settings.steal_max_batch))
        return candidates

    def route_language(self, profile: RequestProfile, exclude: Sequence[str], context_tokens: int = 0,
                       model: str | None = None, policy: Policy | None = None) -> Decision | None:
        """Route among the routable candidates whose context holds `context_tokens` (prompt + max_tokens)
        by `policy` (the pool's by default); with the overload queue on, to one that takes the request
        (`OverloadQueue.route`)."""
        now = self.clock()
        candidates = self.routable(now, exclude, model).fitting(context_tokens)
        return self._decide(policy or self.policy, profile, candidates, now, self.overload) if candidates else None

    def _admitted(self, profile: RequestProfile, context_tokens: int, model: str | None,
                  closed: Sequence[str]) -> Decision | None:
        """The first attempt's decision when the request may go at once: it finds nobody waiting in the
        admission queue, and the language backend chosen for it is below the queue-depth limit, which
        proves the pool is not saturated (one read of the candidates instead of two). None: it waits in
        the queue while every language backend is saturated (`AdmissionQueue.wait_for_capacity`), then
        routes. A plain function: most requests never wait, and a coroutine per request costs. `closed`:
        the backends kept for classes above the request's."""
        if not self.admission.waiting:
            decision = self.route_language(profile, closed, context_tokens, model)
            if (decision is not None and decision.backend.role in LANGUAGE_ROLES
                    and decision.backend.queue_depth < self.admission.config.saturated_queue_depth):
                return decision
        return None

    def _unable(self, job: GenerationJob) -> tuple[str, ...]:
        """The engines of the job's pool that cannot honour its fields where kind: openai backends beside
        them can (else none: a pool of engines alone refuses such a request at its dispatch, with a 400 that
        names the fields). Checked only for such a pool: the check costs a few µs a request."""
        engines = self.table.engines_beside_upstreams(job.model)
        if engines and refused_fields(job.body, exact=bool(job.token_ids), chat=job.kind == "chat"):
            return engines
        return ()

    def deadline(self, job: GenerationJob, record: RequestRecord) -> float:
        """The request's deadline, fixed on first use: restarts of the same request share it."""
        if record.deadline is None:
            limit = self.settings.request_timeout_s
            record.deadline = record.started + min(job.timeout_s or limit, limit)
        return record.deadline

    def backend_fault(
        self, error: BaseException, backend_id: str, record: RequestRecord, loop_deadline: float | None = None,
    ) -> bool:
        """Whether a dispatch to `backend_id` ended by the backend's own fault: its failure, but not a
        hand-off the vision side never delivered, nor an upstream's 429 (busy, not broken: its breaker
        would take a working upstream out for `open_s` whenever it sheds load), nor a timeout of the
        request's own deadline (the client chose it), nor anything else (the client left, its request is
        invalid, another backend failed)."""
        if not isinstance(error, BackendFailure) or error.backend_id != backend_id or error.code == HANDOFF_TIMEOUT:
            return False
        if isinstance(error, UpstreamRateLimited):
            return False
        return not (isinstance(error, BackendTimeout) and self.deadline_passed(record, loop_deadline))

    def deadline_passed(self, record: RequestRecord, loop_deadline: float | None = None) -> bool:
        """Whether the request's deadline has passed. The clients' timers run on the event loop's clock,
        which can lag the monotonic clock by a loop turn (uvloop reads it once a turn) and counts whole
        milliseconds there: a timer set for the deadline may fire before the monotonic clock reaches
        it. So the deadline has passed when the monotonic clock says so, or the loop's clock is within
        its resolution of `loop_deadline`, the deadline an attempt gave its client in loop time."""
        if record.deadline is not None and self.clock() >= record.deadline:
            return True
        return loop_deadline is not None and (
            asyncio.get_running_loop().time() >= loop_deadline - LOOP_TIMER_RESOLUTION_S)

    async def start(self, job: GenerationJob, record: RequestRecord | None = None) -> Dispatch:
        """Admit, route, dispatch; retry until the first token, the deadline or the end of the budget."""
        record = record or RequestRecord(job.request_id, job.kind, started=self.clock())
        record.model = job.model or ""
        if self.tracing is not None and record.trace is None:
            record.trace = self.tracing.request(job, record.traceparent, self.clock() - record.started)
        elif self.tracing is None and record.traceparent and (
                passed := pass_through(record.traceparent, record.tracestate)):
            job = job.traced(*passed)   # tracing off: the client's, as sent
        job = self.tenants.fitted(job)
        ticket = record.tenant = self.tenants.ticket(job)
        closed = record.closed = self.table.closed_to(ticket.tenant.policy.priority)
        record.unable = self._unable(job)
        if record.unable:
            closed = (*closed, *record.unable)
        if ticket.tenant.limits:   # over a limit: 429 at once, before anything waits
            await self.tenants.charge(ticket)
        deadline = self.deadline(job, record)
        profile = self.profile(job, record)
        admitted = self._admitted(profile, job.context_tokens, job.model, closed)
        gate = self.overload
        try:
            if gate is not None and (
                    gate.held or admitted is None or not gate.queue.goes((admitted.backend,), profile)):
                # held: route when released
                if await gate.wait(profile, lambda: self.routable(self.clock(), closed, job.model), deadline,
                                   ticket.tenant.policy.priority, ticket.tenant.name, ticket.tenant.policy.weight):
                    admitted = self._admitted(profile, job.context_tokens, job.model, closed)
            guaranteed = False
            if admitted is None:
                waiting = self.clock()
                try:
                    guaranteed = await self.admission.wait_for_capacity(
                        functools.partial(self.saturated, job.model, closed), deadline, ticket.share)
                finally:
                    if record.trace is not None:
                        record.trace.admission(self.clock() - waiting)
        except Overloaded as exc:
            if self.clock() >= deadline:   # its own deadline, not a queue's limit, ran out while it waited
                raise DeadlineExceeded(f"the request's deadline of {deadline - record.started:.3g} s passed while "
                                       f"it waited for admission: {exc.message}") from None
            raise
        if admitted is None:
            if guaranteed and self.admission.config.guaranteed_first_token:
                admitted = self.route_language(profile, closed, job.context_tokens, job.model, SOONEST_FIRST_TOKEN)
        return await self._dispatch(job, record, profile, admitted)

    async def _dispatch(
        self, job: GenerationJob, record: RequestRecord, profile: RequestProfile, decision: Decision | None,
    ) -> Dispatch:
        """The one retry loop: attempts on the language pool, each retry after a backoff and on a backend
        that has not failed the request, until one has its first token, the deadline passes (504) or the
        budget is spent (the last failure)."""
        assert record.deadline is not None
        deadline = record.deadline
        last_error: BackendFailure | None = None
        while record.attempts < self.settings.max_attempts:
            if record.attempts and not await self._backoff(record.attempts, deadline):
                raise self._deadline_error(record, last_error)
            if self.clock() >= deadline:
                raise self._deadline_error(record, last_error)
            decision = decision or self.route_language(
                profile, [*record.failed, *record.closed, *record.unable, *record.no_encoder], job.context_tokens,
                job.model)
            if decision is None:
                break
            backend_id = decision.backend.id
            client = self.clients.get(backend_id)
            if client is None:   # no address yet: not an attempt
                record.failed.append(backend_id)
                decision = None
                continue
            try:
                return await self._attempt(job, decision, client, record)
            except NoEncoder as exc:   # not the language backend's fault: the same request, on one that encodes
                record.no_encoder = self._needs_encoder(job.model)
                log.warning("encoders_unavailable", request_id=job.request_id, backend=backend_id, error=str(exc))
            except BackendFailure as exc:
                record.failed.append(backend_id)
                if not exc.retryable:
                    raise
                last_error = exc
                self.metrics.retries.labels(self.metrics.live(backend_id)).inc()
                log.warning("dispatch_failed", request_id=job.request_id, backend=backend_id, error=str(exc))
            decision = None
        if self.clock() >= deadline:
            raise self._deadline_error(record, last_error)
        if last_error is not None:
            raise last_error
        raise NoBackendAvailable(
            f"no healthy language backend is available for a context of {job.context_tokens} tokens"
            + (f" of model {job.model!r}" if job.model else "")
            + (f" (kept for higher priority classes: {', '.join(record.closed)})" if record.closed else "")
            + (f" (not the engines {', '.join(record.unable)}: they cannot honour its fields)" if record.unable else "")
            + (f" (not {', '.join(record.no_encoder)}: no vision backend could encode its images for them)"
               if record.no_encoder else "")
            + self._breakers_open(vision=False)
            + "; retry later"
        )

    @staticmethod
    def _deadline_error(record: RequestRecord, last_error: BackendFailure | None) -> DeadlineExceeded:
        assert record.deadline is not None
        message = (f"the request's deadline of {record.deadline - record.started:.3g} s passed "
                   f"after {record.attempts} attempt(s)")
        return DeadlineExceeded(message + (f"; last error: {last_error.message}" if last_error else ""))

    async def complete(
        self, job: GenerationJob, record: RequestRecord | None = None
    ) -> tuple[Dispatch, list[engine_pb2.GenerateChunk]]:
        """A whole completion for a non-streamed response.

        Nothing has reached the client yet, so a backend that dies mid-generation is not fatal: the
        request starts over on another backend (within the request's budget and deadline), and the
        client gets one answer. Engines send it in two messages (`whole`): the first token, then the rest.
        """
        if not job.whole:   # the door builds a non-streamed request's job whole already
            job = replace(job, whole=True)
        record = record or RequestRecord(job.request_id, job.kind, started=self.clock())
        dispatch = await self.start(job, record)
        while True:
            try:
                return dispatch, await dispatch.whole()
            except BackendFailure as exc:
                if self.deadline_passed(record, dispatch.loop_deadline):   # nothing can restart
                    raise self._deadline_error(record, exc) from None
                if record.attempts >= self.settings.max_attempts:
                    raise
                record.failed.append(dispatch.backend_id)
                self.metrics.retries.labels(self.metrics.live(dispatch.backend_id)).inc()
                log.warning("restarting_after_midstream_failure", request_id=job.request_id,
                            backend=dispatch.backend_id, error=str(exc))
            dispatch = await self._dispatch(job, record, self.profile(job, record), None)

    async def _backoff(self, attempt: int, deadline: float) -> bool:
        """Sleep before retry `attempt` (full-jitter exponential); False if the deadline leaves no time."""
        cap = min(self.settings.retry_backoff_max_s, self.settings.retry_backoff_s * 2 ** (attempt - 1))
        delay = cap * self.rng.uniform(0.5, 1.0)
        if self.clock() + delay >= deadline:
            return False
        await asyncio.sleep(delay)
        return True

    async def _attempt(
        self, job: GenerationJob, decision: Decision, client: BackendClient, record: RequestRecord,
    ) -> Dispatch:
        """One attempt: its `Dispatch` takes the lease, sends the request and waits for its first token
        (and its images' hand-off); if none comes, the dispatch ends here."""
        backend = decision.backend
        job = job.for_context(backend.max_context)
        record.attempt(backend.id)
        self.breakers.on_dispatch(backend.id)
        cached = self._routed(record, backend)
        # images encoded on another backend: no prefill there before their embeddings come (a `both` engine
        # encodes its own, GPU time ahead of the prompt's prefill)
        elsewhere = bool(job.images) and client.handoff != "none" and backend.role != "both"
        dispatch = Dispatch(self, job, decision, record,
                            self.table.acquire(backend.id, job.prompt_tokens + job.image_tokens, job.max_tokens,
                                               cached, awaiting_inputs=elsewhere, engine_requests=job.choices))
        if record.trace is not None:   # the engine's spans join the dispatch's
            dispatch.trace = record.trace.attempt(decision, record.attempts)
            job = job.traced(dispatch.trace.traceparent, tracestate(record.tracestate))
        if backend.role == "vision":
            self.metrics.stolen_requests.labels(backend.id).inc()
        try:
            if job.images:
                first, job = await self._first_with_images(dispatch, job, client, record)
            else:
                stream = self._send(dispatch, job, client, record)   # sets dispatch.sent
                first = await self._first_chunk(stream, backend, job, dispatch.sent)
        except BaseException as exc:
            error = exc
            if isinstance(exc, StopAsyncIteration):
                error = BackendFailure(f"backend {backend.id}: empty stream", backend_id=backend.id)
            await dispatch.close(0, error)
            if error is not exc:
                raise error from None
            raise
        dispatch._first_token(first, job)
        return dispatch

    def first_token_limit(self, backend: BackendSnapshot, prompt_tokens: int, reserve_tokens: int,
                          whole: bool = False) -> float | None:
        """How long an attempt on `backend` may wait for its first token (`prompt_tokens`, holding
        `reserve_tokens` of KV there); None: as long as its client's own timers allow
        (`first_token_timeout_s` and the deadline). `whole`: a reply that comes only after its last token
        (a non-streamed request to a kind: openai upstream): `first_token_timeout_s`, the longest any
        first token is awaited, plus `first_token_ttft_factor` times its max_tokens at the backend's
        decode step ŝ. Not the predicted first token's limit: nothing arrives early to confirm the
        upstream works, a cut reply is the whole generation lost and done again elsewhere, and the ŝ of a
        backend that serves only such requests stays at its prior, the unloaded step."""
        s = self.settings
        if whole:
            output_tokens = reserve_tokens - prompt_tokens
            return s.first_token_timeout_s + s.first_token_ttft_factor * output_tokens * backend.decode_step_s
        predicted = predicted_ttft_s(backend, prompt_tokens, reserve_tokens)
        limit = max(s.first_token_floor_s, s.first_token_ttft_factor * predicted)
        return limit if limit < s.first_token_timeout_s else None

    def _send(
        self, dispatch: Dispatch, job: GenerationJob, client: BackendClient, record: RequestRecord, key: str = "",
        handoff_s: float = 0.0,
    ) -> AsyncIterator[engine_pb2.GenerateChunk]:
        """The attempt's stream, bounded by the request's deadline (`dispatch.loop_deadline`: as its
        client's timers count it) and the first-token timeout (plus the hand-off's time)."""
        assert record.deadline is not None
        remaining = max(0.001, record.deadline - self.clock())
        dispatch.sent = asyncio.get_running_loop().time()
        dispatch.loop_deadline = dispatch.sent + remaining
        stream = dispatch._stream = client.generate(
            job, handoff_key=key, handoff_timeout_s=handoff_s,
            first_token_timeout_s=min(self.settings.first_token_timeout_s + handoff_s, remaining), timeout_s=remaining,
        )
        return stream

    async def _first_with_images(
        self, dispatch: Dispatch, job: GenerationJob, client: BackendClient, record: RequestRecord,
    ) -> tuple[engine_pb2.GenerateChunk, GenerationJob]:
        """The first token of a request with images, and the job as sent. An upstream that takes the
        embeddings in its request gets them encoded first; an engine waits for the embeddings the vision
        engine delivers (direct), and its first-token limit counts from their delivery."""
        backend = dispatch.decision.backend
        key = uuid.uuid4().hex   # never the client's id: no cross-request pick-up
        if client.handoff != "direct":
            if client.handoff == "inline":   # encode first: the embeddings go in the request
                dispatch.vision_backend_id, reply = await self._encode(job, key, backend, "", record)
                job = replace(job, embeddings=tuple(reply.embeddings))
                self.table.inputs_delivered(dispatch.lease)
            stream = self._send(dispatch, job, client, record)   # sets dispatch.sent
            return await self._first_chunk(stream, backend, job, dispatch.sent), job
        # The language engine waits long enough for every vision attempt (a re-encode must still land).
        stream = self._send(dispatch, job, client, record, key, self.settings.handoff_timeout_s
                            * self.settings.max_attempts)
        first_read = asyncio.ensure_future(anext(stream))
        encoding = asyncio.ensure_future(self._encode(job, key, backend, client.address, record))
        wait = self.watch.watch(first_read, backend, job, None)
        try:
            await asyncio.wait({first_read, encoding}, return_when=asyncio.FIRST_COMPLETED)
            if encoding.done():
                if encoding.exception() is not None:
                    raise encoding.exception()  # type: ignore[misc]
                self.watch.arm(wait)
                self.table.inputs_delivered(dispatch.lease)
            try:
                first = await first_read
            except asyncio.CancelledError:
                current = asyncio.current_task()
                if wait.reason is None or (current is not None and current.cancelling()):
                    raise
                raise self._silent(backend.id, wait.reason) from None
            dispatch.vision_backend_id, _ = await encoding
        finally:
            self.watch.stop(wait)
            for task in (first_read, encoding):
                task.cancel()   # nothing, where done
            # The stream must be idle to close it; the exception of the half not raised is read here.
            await asyncio.gather(first_read, encoding, return_exceptions=True)
        return first, job

    async def _first_chunk(
        self, stream: AsyncIterator[engine_pb2.GenerateChunk], backend: BackendSnapshot, job: GenerationJob,
        sent: float | None,
    ) -> engine_pb2.GenerateChunk:
        """The stream's first chunk, read in this task (no task, and no loop turn, per request) under the
        first-token watch: a watch that fires cancels the read, answered as the backend's silence."""
        task = asyncio.current_task()
        assert task is not None
        wait = self.watch.watch(task, backend, job, sent)
        try:
            return await anext(stream)
        except asyncio.CancelledError:
            if wait.reason is None or task.uncancel() > 0:   # the client left
                raise
            raise self._silent(backend.id, wait.reason) from None
        finally:
            self.watch.stop(wait)

    @staticmethod
    def _silent(backend_id: str, reason: str) -> BackendTimeout:
        return BackendTimeout(f"backend {backend_id}: {reason}", backend_id=backend_id)

    def _encoder(self, backend_id: str) -> tuple[int, int | None]:
        """The engine process the vision backend last reported and the size it reported for its
        embedding cache ((0, None): none yet, or gone from the table)."""
        entry = self.table.get(backend_id)
        return (entry.reported.pid, entry.reported.embedding_cache_images) if entry is not None else (0, None)

    def _encoder_hits(self, images: list[tuple[int, int]]) -> dict[str, int]:
        """Per encoder, the image tokens of `images` its embedding cache is predicted to hold, after
        forgetting the encoders that restarted since they were sent them (an empty cache) and the
        entries past the cache size each reports."""
        encoders = self.encoders
        assert encoders is not None
        hits = encoders.cached(images)
        if hits and any([encoders.observe(encoder, *self._encoder(encoder)) for encoder in hits]):
            hits = encoders.cached(images)
        return hits

    async def _encode(
        self, job: GenerationJob, key: str, language: BackendSnapshot, deliver_to: str, record: RequestRecord
    ) -> tuple[str, engine_pb2.EncodeReply]:
        """Encode the job's images for `language` under `key`: delivered to `deliver_to`, or returned in
        the reply when it is empty. Returns the vision backend that did it, and its reply. Encodes share
        the request's budget (at most `max_attempts`, none after the deadline, none on a vision backend
        that failed it)."""
        assert record.deadline is not None
        request = engine_pb2.EncodeRequest(
            request_id=key, deliver_to=deliver_to,
            images=[engine_pb2.Image(data=i.data, width=i.width, height=i.height, tokens=i.tokens)
                    for i in job.images], cache_salt=job.cache_salt,
        )
        own = self.clients.engine(language.id)
        if language.role == "both" and own is not None:   # monolithic: this GPU encodes its own images
            return language.id, await self._encode_on(language.id, own, request, job.image_tokens, record.deadline,
                                                      record.trace)
        profile, images = job.profile(), [(i.digest, i.tokens) for i in job.images]
        if self.encoders is not None:
            profile = replace(profile, cached_image_tokens=self._encoder_hits(images))
        last_error: BackendFailure | None = None
        while len(record.vision_backends) < self.settings.max_attempts:
            now = self.clock()
            if now >= record.deadline:
                break
            candidates = self.table.candidates(VISION_ROLES, now, [*record.failed, *record.closed,
                                                                    *self.breakers.blocked()], job.model)
            if not candidates:
                break
            vision_id = self._decide(self.vision_policy, profile, candidates, now).backend.id
            client = self.clients.engine(vision_id)
            if client is None:
                break
            record.vision_backends.append(vision_id)
            if self.encoders is not None:
                self.encoders.record(images, vision_id, *self._encoder(vision_id))
            self.breakers.on_dispatch(vision_id)
            try:
                reply = await self._encode_on(vision_id, client, request, job.image_tokens, record.deadline,
                                              record.trace)
            except BaseException as exc:
                if isinstance(exc, BackendFailure) and self.backend_fault(exc, vision_id, record) \
                        and not self._queued_too_long(exc, vision_id):
                    self.breakers.on_failure(vision_id)
                else:
                    self.breakers.on_abandon(vision_id)
                if not isinstance(exc, BackendFailure):
                    raise
                last_error = exc
                record.failed.append(vision_id)
                self.metrics.retries.labels(self.metrics.live(vision_id)).inc()
                log.warning("encode_failed", request_id=job.request_id, backend=vision_id, error=str(exc))
                continue
            self.breakers.on_success(vision_id)
            return vision_id, reply
        if self.clock() >= record.deadline:
            raise self._deadline_error(record, last_error)
        if self._encodes_itself(job, [language.id, *record.failed, *record.closed, *record.unable]):
            raise NoEncoder(str(last_error) if last_error is not None else "no healthy vision backend")
        if last_error is not None:   # the language backend is fine: do not re-dispatch it for this
            kind = BackendTimeout if isinstance(last_error, BackendTimeout) else BackendFailure
            raise kind(last_error.message, backend_id=last_error.backend_id, retryable=False)
        raise NoBackendAvailable("no healthy vision backend is available for the request's images"
                                 f"{self._breakers_open(vision=True)}; retry later")

    def _queued_too_long(self, error: BackendFailure, vision_id: str) -> bool:
        """An encode that timed out on a vision backend whose heartbeats still come: queued behind a
        burst, not broken (an engine that hangs stops heartbeating and leaves the pool by that), so no
        fault for its breaker, which would turn the whole pool away from requests it can serve."""
        entry = self.table.get(vision_id)
        return isinstance(error, BackendTimeout) and entry is not None and self.table.is_healthy(entry)

    def _breakers_open(self, *, vision: bool) -> str:
        """Why a pool whose backends /admin/backends calls healthy took nothing: their breakers, open
        after failures (words for a 503; "" when none is)."""
        held = sorted(b for b in self.breakers.blocked() if (e := self.table.get(b)) is not None and (
            e.role in VISION_ROLES if vision else e.takes_language))
        return f" (circuit breaker open after failures: {', '.join(held)})" if held else ""

    def _self_encoding(self, backend_id: str, role: Role) -> bool:
        """Whether a language-pool backend takes a request's images without the vision pool: a `both`
        engine encodes them itself, an upstream without `image_embeds` takes the images as they are."""
        if role == "both":
            return True
        client = self.clients.get(backend_id)
        return client is not None and client.handoff == "none"

    def _encodes_itself(self, job: GenerationJob, exclude: Sequence[str]) -> bool:
        """Some backend the job could be routed to (`routable`, its context fitting), not in `exclude`, takes
        images without the vision pool; else the encoders' own failure is the answer. O(N), on a failed
        encode only."""
        candidates = self.routable(self.clock(), exclude, job.model).fitting(job.context_tokens)
        return any(self._self_encoding(b.id, b.role) for b in candidates)

    def _needs_encoder(self, model: str | None) -> tuple[str, ...]:
        """The healthy backends of `model`'s language pool that need the vision pool for a request's images."""
        return tuple([b.id for b in self.table.candidates(LANGUAGE_ROLES, self.clock(), (), model)
                      if not self._self_encoding(b.id, b.role)])

    async def _encode_on(
        self, backend_id: str, client: EncoderClient, request: engine_pb2.EncodeRequest, tokens: int, deadline: float,
        trace: RequestTrace | None,
    ) -> engine_pb2.EncodeReply:
        encoding = self.table.acquire_vision(backend_id, tokens)
        t0 = self.clock()
        timeout_s = max(0.001, min(self.settings.handoff_timeout_s, deadline - t0))
        encode = trace.encode(backend_id, request) if trace is not None else None
        try:
            reply = await client.encode(request, timeout_s=timeout_s)
        except BaseException as exc:
            if encode is not None:
                encode.end(None, exc)
            if isinstance(exc, BackendTimeout) and timeout_s == self.settings.handoff_timeout_s:
                raise BackendTimeout(f"backend {backend_id}: the images' encode did not finish within "
                                     f"{timeout_s:g} s (gateway.handoff_timeout_s)", backend_id=backend_id) from None
            raise
        finally:
            self.table.release_vision(encoding, tokens)
        if encode is not None:
            encode.end(reply, None)
        self.metrics.encode_seconds.labels(backend_id).observe(self.clock() - t0)
        self.metrics.embedding_bytes.labels(backend_id).inc(reply.embedding_bytes)
        return reply

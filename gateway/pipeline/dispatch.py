"""The request pipeline: route both pools, dispatch, hand off embeddings, retry before the first token.

Text-only: route the language pool (heteroserve with L_r = text tokens) and call Generate.
With images: route the language pool first (L_r = text + image tokens), then the vision pool; the
vision engine encodes and delivers the embedding straight to the chosen language engine while that
engine's Generate waits for it. The gateway carries control, not tensors, with one exception: an
OpenAI-compatible upstream that takes embeddings in its request (vLLM `image_embeds`) gets them from
the gateway, so there the encode comes first. A vision failure before delivery re-encodes on another
vision backend; a `both` (monolithic) backend encodes its own images.

`start()` returns only once the first token is in hand, so every failure that can still be retried
is retried (up to `max_attempts` per pool) and the HTTP door can still answer with a proper status.
After the first token, failures surface from `Dispatch.rest()`: nothing is dispatched twice once a
token has been sent.

One deadline bounds the whole request (the client's `x-request-timeout` or gRPC deadline, capped by
`request_timeout_s`), counted from its arrival and kept in its `RequestRecord`: the admission wait,
every attempt, every encode, every backoff and the stream itself. No attempt starts after it; a
request that runs out of time gets `DeadlineExceeded` (504).
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace

import structlog

from common.wire import engine_pb2
from gateway.clients.engine_client import HANDOFF_TIMEOUT, BackendClient, EngineClient, EngineClients
from gateway.config.tenants import TenantsConfig
from gateway.pipeline.admission import AdmissionQueue
from gateway.pipeline.breakers import Breakers
from gateway.pipeline.metrics import GatewayMetrics
from gateway.pipeline.request_log import RequestRecord
from gateway.pipeline.tenants import Tenants
from gateway.requests.errors import BackendFailure, DeadlineExceeded, NoBackendAvailable
from gateway.requests.job import GenerationJob
from gateway.routing.backend_entry import Lease
from gateway.routing.policies.candidates import Candidates
from gateway.routing.policies.contracts import BackendSnapshot, Decision, Policy, RequestProfile, Role
from gateway.routing.policies.stealing import stealers
from gateway.routing.prefix_index import PrefixIndex
from gateway.routing.state_table import StateTable

log = structlog.get_logger("pipeline")

LANGUAGE_ROLES: tuple[Role, ...] = ("language", "both")
VISION_ROLES: tuple[Role, ...] = ("vision",)


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


class Dispatch:
    """A request that has its first token; read it with exactly one of `rest()` and `whole()` (each
    releases the backend)."""

    def __init__(
        self,
        pipeline: Pipeline,
        job: GenerationJob,
        decision: Decision,
        vision_backend_id: str | None,
        first: engine_pb2.GenerateChunk,
        stream: AsyncIterator[engine_pb2.GenerateChunk],
        started: float,
        record: RequestRecord,
        lease: Lease,
    ) -> None:
        self._pipeline = pipeline
        self.request_id = job.request_id
        self.decision = decision
        self.backend_id = decision.backend.id
        self.vision_backend_id = vision_backend_id
        self.first = first
        self._stream = stream
        self.started = started
        self.record = record
        self.ttft_s = time.monotonic() - started
        record.ttft_s = time.monotonic() - record.started
        record.policy = decision.policy
        self.lease = lease
        self.streamed = not job.whole   # tokens arrive as they are made: the decode time is measurable

    async def rest(self) -> AsyncIterator[engine_pb2.GenerateChunk]:
        """The chunks as they come, the first one included (a streamed response)."""
        completed = 0   # tokens of a completed request
        try:
            chunk = self.first
            chunks = 1
            yield chunk
            while not chunk.finish_reason:
                chunk = await self._next()
                chunks += 1
                yield chunk
            completed = chunk.usage.completion_tokens or chunks
        finally:
            await self._close(completed)

    async def whole(self) -> list[engine_pb2.GenerateChunk]:
        """Every chunk, the first one included (a non-streamed response): one coroutine, where
        collecting `rest()` would take an async generator and its clean-up per request."""
        completed = 0
        chunks = [self.first]
        try:
            while not chunks[-1].finish_reason:
                chunks.append(await self._next())
            completed = chunks[-1].usage.completion_tokens or len(chunks)
        finally:
            await self._close(completed)
        return chunks

    async def _next(self) -> engine_pb2.GenerateChunk:
        try:
            return await anext(self._stream)
        except StopAsyncIteration:
            raise BackendFailure(
                f"backend {self.backend_id}: stream ended without a finish reason",
                backend_id=self.backend_id,
                retryable=False,
            ) from None
        except BackendFailure:
            self._pipeline.breakers.on_failure(self.backend_id)
            raise

    async def _close(self, completed: int) -> None:
        """The stream closed and the backend released (`completed` > 0: with that many tokens)."""
        await self._stream.aclose()  # type: ignore[attr-defined]
        self._pipeline.finish(self, completed)


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
    ) -> None:
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
        self.tenants = Tenants(TenantsConfig())    # the keys' tenants: limits, shares, usage (set by the runtime)

    def _decide(self, policy: Policy, profile: RequestProfile, candidates: Candidates, now: float) -> Decision:
        t0 = time.perf_counter()
        decision = policy.choose(profile, candidates, now)
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
        hold (`gateway.routing.prefix_index`); the index's view is kept in `record` for the dispatches.
        Requests with images are not indexed (their images are not in the rendered prompt)."""
        profile = job.profile()
        index = self.prefixes
        if index is None or job.images:
            return profile
        tokens = profile.input_tokens
        blocks = record.prefix.blocks if record.prefix is not None else (
            index.hashes(job.prompt, job.token_ids, tokens))
        record.prefix = query = index.lookup(blocks, job.session, tokens)
        return replace(profile, cached_tokens=query.cached) if query.cached else profile

    def _routed(self, record: RequestRecord, backend: BackendSnapshot) -> int:
        """The request goes to `backend`: the index remembers its prompt there. Returns the prompt tokens
        predicted cached there (those its lease does not count as prefill)."""
        query, index = record.prefix, self.prefixes
        if query is None or index is None:
            return 0
        entry = self.table.get(backend.id)
        if entry is not None:   # the engine's latest counters first: they set keep_i
            index.observe(backend.id, entry.reported.prefix_cache_queries, entry.reported.prefix_cache_hits)
        per_token = backend.kv_bytes_per_token
        index.record(query, backend.id, backend.kv_total_bytes // per_token if per_token else 0)
        return query.cached.get(backend.id, 0)

    def saturated(self) -> bool:
        """Every language candidate is at the admission queue-depth limit (none at all: not saturated)."""
        limit = self.admission.config.saturated_queue_depth
        candidates = self.table.candidates(LANGUAGE_ROLES, exclude=self.breakers.blocked())
        return bool(candidates) and all(b.queue_depth >= limit for b in candidates)

    def route_language(self, profile: RequestProfile, exclude: list[str], context_tokens: int = 0) -> (
        Decision | None
    ):
        """Route among healthy language candidates whose context holds `context_tokens` (prompt + max_tokens)."""
        now = time.monotonic()
        exclude = exclude + self.breakers.blocked()
        candidates = self.table.candidates(LANGUAGE_ROLES, now, exclude)
        if self.settings.stealing and self.table.has_role(VISION_ROLES):   # a text-only cluster: nobody to steal
            vision = self.table.candidates(VISION_ROLES, now, exclude)
            candidates = candidates.extended(stealers(vision, self.table.language_backlog(),
                                                      self.settings.steal_threshold, self.settings.steal_max_batch))
        candidates = candidates.fitting(context_tokens)
        return self._decide(self.policy, profile, candidates, now) if candidates else None

    def _admitted(self, profile: RequestProfile, context_tokens: int) -> Decision | None:
        """The first attempt's decision when the request may go at once: it finds nobody waiting in the
        admission queue, and the language backend chosen for it is below the queue-depth limit, which
        proves the pool is not saturated (one read of the candidates instead of two). None: it waits in
        the queue while every language backend is saturated (`AdmissionQueue.wait_for_capacity`), then
        routes. A plain function: most requests never wait, and a coroutine per request costs."""
        if not self.admission.waiting:
            decision = self.route_language(profile, [], context_tokens)
            if (decision is not None and decision.backend.role in LANGUAGE_ROLES
                    and decision.backend.queue_depth < self.admission.config.saturated_queue_depth):
                return decision
        return None

    def deadline(self, job: GenerationJob, record: RequestRecord) -> float:
        """The request's deadline, fixed on first use: restarts of the same request share it."""
        if record.deadline is None:
            limit = self.settings.request_timeout_s
            record.deadline = record.started + min(job.timeout_s or limit, limit)
        return record.deadline

    async def start(self, job: GenerationJob, record: RequestRecord | None = None) -> Dispatch:
        """Admit, route, dispatch; retry (with backoff and jitter) until the first token or the deadline."""
        started = time.monotonic()
        record = record or RequestRecord(job.request_id, job.kind)
        ticket = record.tenant = self.tenants.ticket(job)
        if ticket.tenant.limits:   # over a limit: 429 at once, before anything waits
            await self.tenants.charge(ticket)
        deadline = self.deadline(job, record)
        profile = self.profile(job, record)
        admitted = self._admitted(profile, job.context_tokens)
        if admitted is None:
            await self.admission.wait_for_capacity(self.saturated, deadline, ticket.share)
        tried: list[str] = []
        last_error: BackendFailure | None = None
        out_of_time = False
        for attempt in range(self.settings.max_attempts):
            if (attempt and not await self._backoff(attempt, deadline)) or time.monotonic() >= deadline:
                out_of_time = True
                break
            decision = admitted if attempt == 0 and admitted is not None else (
                self.route_language(profile, tried, job.context_tokens))
            if decision is None:
                break
            backend_id = decision.backend.id
            tried.append(backend_id)
            client = self.clients.get(backend_id)
            if client is None:
                continue
            record.attempt(backend_id)
            self.breakers.on_dispatch(backend_id)
            try:
                dispatch = await self._attempt(job, decision, client, started, record)
            except BackendFailure as exc:
                if exc.backend_id == backend_id and exc.code != HANDOFF_TIMEOUT:   # not the vision side's fault
                    self.breakers.on_failure(backend_id)
                if not exc.retryable:
                    raise
                last_error = exc
                self.metrics.retries.labels(backend_id).inc()
                log.warning("dispatch_failed", request_id=job.request_id, backend=backend_id, error=str(exc))
                continue
            self.breakers.on_success(backend_id)
            return dispatch
        if out_of_time or time.monotonic() >= deadline:
            raise self._deadline_error(record, last_error)
        if last_error is not None:
            raise last_error
        raise NoBackendAvailable(
            f"no healthy language backend is available for a context of {job.context_tokens} tokens; retry later"
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
        request starts over on another backend (within max_attempts), and the client gets one answer.
        Engines send it in two messages (`whole`): the first token, then the rest.
        """
        if not job.whole:   # the door builds a non-streamed request's job whole already
            job = replace(job, whole=True)
        record = record or RequestRecord(job.request_id, job.kind)
        for attempt in range(1, self.settings.max_attempts + 1):
            dispatch = await self.start(job, record)
            try:
                return dispatch, await dispatch.whole()
            except BackendFailure as exc:
                if attempt == self.settings.max_attempts:
                    raise
                self.metrics.retries.labels(dispatch.backend_id).inc()
                log.warning("restarting_after_midstream_failure", request_id=job.request_id,
                            backend=dispatch.backend_id, error=str(exc))
        raise AssertionError("unreachable")

    async def _backoff(self, attempt: int, deadline: float) -> bool:
        """Sleep before retry `attempt` (full-jitter exponential); False if the deadline leaves no time."""
        cap = min(self.settings.retry_backoff_max_s, self.settings.retry_backoff_s * 2 ** (attempt - 1))
        delay = cap * random.uniform(0.5, 1.0)
        if time.monotonic() + delay >= deadline:
            return False
        await asyncio.sleep(delay)
        return True

    async def _attempt(
        self, job: GenerationJob, decision: Decision, client: BackendClient, started: float, record: RequestRecord
    ) -> Dispatch:
        assert record.deadline is not None
        deadline = record.deadline
        backend_id = decision.backend.id
        job = job.for_context(decision.backend.max_context)
        lease = self.table.acquire(backend_id, job.prompt_tokens + job.image_tokens, job.max_tokens,
                                   self._routed(record, decision.backend))
        if decision.backend.role == "vision":
            self.metrics.stolen_requests.labels(backend_id).inc()
        key = uuid.uuid4().hex if job.images else ""   # never the client's id: no cross-request pick-up
        vision_id = None
        if job.images and client.handoff == "inline":   # encode first: the embeddings go in the request
            try:
                vision_id, reply = await self._encode(job, key, decision.backend, "", record)
            except BaseException:
                self._abandon(lease)
                raise
            job = replace(job, embeddings=tuple(reply.embeddings))
        direct = bool(job.images) and client.handoff == "direct"
        remaining = max(0.001, deadline - time.monotonic())
        # The language engine waits long enough for every vision attempt (a re-encode must still land).
        handoff_s = self.settings.handoff_timeout_s * self.settings.max_attempts if direct else 0.0
        stream = client.generate(
            job, handoff_key=key if direct else "", handoff_timeout_s=handoff_s,
            first_token_timeout_s=min(self.settings.first_token_timeout_s + handoff_s, remaining), timeout_s=remaining,
        )
        first_read: asyncio.Future[engine_pb2.GenerateChunk] | None = None
        encoding: asyncio.Future[tuple[str, engine_pb2.EncodeReply]] | None = None
        try:
            if direct:   # the language engine waits for the embeddings the vision engine delivers
                first_read = asyncio.ensure_future(anext(stream))
                encoding = asyncio.ensure_future(self._encode(job, key, decision.backend, client.address, record))
                await asyncio.wait({first_read, encoding}, return_when=asyncio.FIRST_COMPLETED)
                if encoding.done() and encoding.exception() is not None:
                    raise encoding.exception()  # type: ignore[misc]
                first = await first_read
                vision_id, _ = await encoding
            else:   # read in this task: no task, and no loop turn, per request
                first = await anext(stream)
        except BaseException as exc:
            pending = [t for t in (first_read, encoding) if t is not None]
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)   # the stream must be idle to close it
            self._abandon(lease)
            await stream.aclose()  # type: ignore[attr-defined]
            if isinstance(exc, StopAsyncIteration):
                raise BackendFailure(f"backend {backend_id}: empty stream", backend_id=backend_id) from None
            raise
        if first.embedding_wait_s:
            self.metrics.handoff_wait_seconds.labels(backend_id).observe(first.embedding_wait_s)
        self.table.first_token(lease)
        dispatch = Dispatch(self, job, decision, vision_id, first, stream, started, record, lease)
        self.metrics.ttft_seconds.observe((backend_id,), dispatch.ttft_s)
        return dispatch

    def _abandon(self, lease: Lease) -> None:
        """An attempt that never reached its first token gives its slot back."""
        self.table.release(lease)
        self.admission.notify()

    async def _encode(
        self, job: GenerationJob, key: str, language: BackendSnapshot, deliver_to: str, record: RequestRecord
    ) -> tuple[str, engine_pb2.EncodeReply]:
        """Encode the job's images for `language` under `key`: delivered to `deliver_to`, or returned in
        the reply when it is empty. Returns the vision backend that did it, and its reply. Each encode
        is bounded by the request's deadline too."""
        assert record.deadline is not None
        request = engine_pb2.EncodeRequest(
            request_id=key, deliver_to=deliver_to,
            images=[engine_pb2.Image(data=i.data, width=i.width, height=i.height, tokens=i.tokens)
                    for i in job.images],
        )
        own = self.clients.engine(language.id)
        if language.role == "both" and own is not None:   # monolithic: this GPU encodes its own images
            return language.id, await self._encode_on(language.id, own, request, job.image_tokens, record.deadline)
        profile = job.profile()
        tried: list[str] = []
        last_error: BackendFailure | None = None
        for _ in range(self.settings.max_attempts):
            now = time.monotonic()
            if now >= record.deadline:
                break
            candidates = self.table.candidates(VISION_ROLES, now, tried + self.breakers.blocked())
            client = None
            if candidates:
                vision_id = self._decide(self.vision_policy, profile, candidates, now).backend.id
                tried.append(vision_id)
                client = self.clients.engine(vision_id)
            if client is None:
                break
            record.vision_backends.append(vision_id)
            self.breakers.on_dispatch(vision_id)
            try:
                reply = await self._encode_on(vision_id, client, request, job.image_tokens, record.deadline)
                self.breakers.on_success(vision_id)
                return vision_id, reply
            except BackendFailure as exc:
                last_error = exc
                self.breakers.on_failure(vision_id)
                self.metrics.retries.labels(vision_id).inc()
                log.warning("encode_failed", request_id=job.request_id, backend=vision_id, error=str(exc))
        if time.monotonic() >= record.deadline:
            raise self._deadline_error(record, last_error)
        if last_error is not None:   # the language backend is fine: do not re-dispatch it for this
            raise BackendFailure(str(last_error), backend_id=last_error.backend_id, retryable=False)
        raise NoBackendAvailable("no healthy vision backend is available for the request's images; retry later")

    async def _encode_on(
        self, backend_id: str, client: EngineClient, request: engine_pb2.EncodeRequest, tokens: int, deadline: float
    ) -> engine_pb2.EncodeReply:
        self.table.acquire_vision(backend_id, tokens)
        t0 = time.monotonic()
        timeout_s = max(0.001, min(self.settings.handoff_timeout_s, deadline - t0))
        try:
            reply = await client.encode(request, timeout_s=timeout_s)
        finally:
            self.table.release_vision(backend_id, tokens)
        self.metrics.encode_seconds.labels(backend_id).observe(time.monotonic() - t0)
        self.metrics.embedding_bytes.labels(backend_id).inc(reply.embedding_bytes)
        return reply

    def finish(self, dispatch: Dispatch, completion_tokens: int) -> None:
        """`completion_tokens` > 0: the request completed with that many tokens."""
        self.table.release(dispatch.lease, completion_tokens if dispatch.streamed else 0)
        self.admission.notify()
        if completion_tokens:
            self.metrics.e2e_seconds.observe((dispatch.backend_id,), time.monotonic() - dispatch.started)

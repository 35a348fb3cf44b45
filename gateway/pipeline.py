"""The request pipeline: route, dispatch, retry before the first token, count in flight.

`start()` returns only once the first token is in hand, so every failure that can still be retried
is retried (on another backend, up to `max_attempts`) and the HTTP door can still answer with a
proper status. After the first token, failures surface from `Dispatch.rest()` and the client gets an
error event; nothing is ever dispatched twice once a token has been sent.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import structlog

from gateway.engine_client import EngineClients
from gateway.errors import BackendFailure, NoBackendAvailable
from gateway.metrics import GatewayMetrics
from gateway.policies.contracts import Decision, Policy, RequestProfile, Role
from gateway.state_table import StateTable
from gateway.wire import engine_pb2

log = structlog.get_logger("pipeline")

LANGUAGE_ROLES: tuple[Role, ...] = ("language", "both")


@dataclass(frozen=True, slots=True)
class GenerationJob:
    request_id: str
    prompt: str
    prompt_tokens: int
    max_tokens: int
    temperature: float = 1.0
    image_tokens: int = 0

    def profile(self) -> RequestProfile:
        return RequestProfile(
            self.request_id, self.prompt_tokens + self.image_tokens, self.max_tokens, self.image_tokens
        )


@dataclass(frozen=True, slots=True)
class Timeouts:
    first_token_s: float
    request_s: float


class Dispatch:
    """A request that has its first token; iterate `rest()` exactly once (it releases the backend)."""

    def __init__(
        self,
        pipeline: Pipeline,
        request_id: str,
        decision: Decision,
        first: engine_pb2.GenerateChunk,
        stream: AsyncIterator[engine_pb2.GenerateChunk],
        started: float,
    ) -> None:
        self._pipeline = pipeline
        self.request_id = request_id
        self.decision = decision
        self.backend_id = decision.backend.id
        self.first = first
        self._stream = stream
        self.started = started
        self.ttft_s = time.monotonic() - started

    async def rest(self) -> AsyncIterator[engine_pb2.GenerateChunk]:
        completed = False
        try:
            chunk = self.first
            yield chunk
            while not chunk.finish_reason:
                chunk = await anext(self._stream)
                yield chunk
            completed = True
        except StopAsyncIteration:
            raise BackendFailure(
                f"backend {self.backend_id}: stream ended without a finish reason",
                backend_id=self.backend_id,
                retryable=False,
            ) from None
        finally:
            await self._stream.aclose()  # type: ignore[attr-defined]
            elapsed = time.monotonic() - self.started
            self._pipeline.finish(self, elapsed if completed else None)


class Pipeline:
    def __init__(
        self,
        table: StateTable,
        policy: Policy,
        clients: EngineClients,
        metrics: GatewayMetrics,
        *,
        max_attempts: int,
        timeouts: Timeouts,
    ) -> None:
        self.table = table
        self.policy = policy
        self.clients = clients
        self.metrics = metrics
        self.max_attempts = max_attempts
        self.timeouts = timeouts

    def route(self, profile: RequestProfile, exclude: list[str]) -> Decision | None:
        now = time.monotonic()
        candidates = self.table.candidates(LANGUAGE_ROLES, now, exclude)
        if not candidates:
            return None
        t0 = time.perf_counter()
        decision = self.policy.choose(profile, candidates, now)
        self.metrics.decision_seconds.labels(self.policy.name).observe(time.perf_counter() - t0)
        self.metrics.decisions.labels(self.policy.name, decision.backend.id).inc()
        for vetoed in decision.vetoed:
            self.metrics.oom_vetoes.labels(vetoed).inc()
        log.debug("routed", request_id=profile.request_id, policy=self.policy.name,
                  backend=decision.backend.id, costs=[c._asdict() for c in decision.costs])
        return decision

    async def start(self, job: GenerationJob) -> Dispatch:
        profile = job.profile()
        request = engine_pb2.GenerateRequest(
            request_id=job.request_id,
            prompt=job.prompt,
            prompt_tokens=job.prompt_tokens,
            image_tokens=job.image_tokens,
            max_tokens=job.max_tokens,
            temperature=job.temperature,
        )
        started = time.monotonic()
        tried: list[str] = []
        last_error: BackendFailure | None = None
        for _ in range(self.max_attempts):
            decision = self.route(profile, tried)
            if decision is None:
                break
            backend_id = decision.backend.id
            tried.append(backend_id)
            client = self.clients.get(backend_id)
            if client is None:
                continue
            self.table.acquire(backend_id)
            stream = client.generate(
                request, first_token_timeout_s=self.timeouts.first_token_s, timeout_s=self.timeouts.request_s
            )
            try:
                first = await anext(stream)
            except (BackendFailure, StopAsyncIteration) as exc:
                self.table.release(backend_id, None)
                await stream.aclose()  # type: ignore[attr-defined]
                if isinstance(exc, BackendFailure) and not exc.retryable:
                    raise
                last_error = exc if isinstance(exc, BackendFailure) else BackendFailure(
                    f"backend {backend_id}: empty stream", backend_id=backend_id
                )
                self.metrics.retries.labels(backend_id).inc()
                log.warning("dispatch_failed", request_id=job.request_id, backend=backend_id, error=str(exc))
                continue
            except BaseException:
                self.table.release(backend_id, None)
                await stream.aclose()  # type: ignore[attr-defined]
                raise
            dispatch = Dispatch(self, job.request_id, decision, first, stream, started)
            self.metrics.ttft_seconds.labels(backend_id).observe(dispatch.ttft_s)
            return dispatch
        if last_error is not None:
            raise last_error
        raise NoBackendAvailable("no healthy language backend is available; retry later")

    def finish(self, dispatch: Dispatch, service_s: float | None) -> None:
        self.table.release(dispatch.backend_id, service_s)
        if service_s is not None:
            self.metrics.e2e_seconds.labels(dispatch.backend_id).observe(service_s)

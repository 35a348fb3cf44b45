"""The Pipeline on fake engine clients: retries, the deadline, hand-off failures, cancellation, what
counts against a backend's breaker, the first-token watch and what the request log is left with.

The fakes stand in for the engine clients (`EngineClients`' factory), not for the pipeline: the real
Pipeline, state table, policies, breakers and admission queue run, on a clock the test moves. Each
fake backend plays a script per call: an async generator of the chunks it sends, raising what the
real client raises (BackendFailure, BackendTimeout, InvalidRequest).
"""

from __future__ import annotations

import asyncio
import gc
import logging
import random
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
import structlog.testing

from common.wire import engine_pb2
from gateway.clients.engine_client import BackendClient, EngineClients
from gateway.config.sections import AdmissionConfig, BreakerConfig, OverloadConfig
from gateway.pipeline.admission import AdmissionQueue
from gateway.pipeline.breakers import Breakers, State
from gateway.pipeline.dispatch import Pipeline, PipelineSettings
from gateway.pipeline.metrics import GatewayMetrics
from gateway.pipeline.overload import OverloadGate
from gateway.pipeline.request_log import RequestLog, RequestRecord
from gateway.requests.errors import (
    BackendFailure,
    BackendTimeout,
    DeadlineExceeded,
    InvalidRequest,
    NoBackendAvailable,
    Overloaded,
)
from gateway.requests.images import ImageInput
from gateway.requests.job import GenerationJob, Handoff
from gateway.routing.backend_entry import Reported
from gateway.routing.policies import build_policy
from gateway.routing.policies.contracts import Role
from gateway.routing.policies.first_token import kv_wait_s, predicted_ttft_s
from gateway.routing.state_table import StateTable
from tests.snapshots import catalog

MODEL = "llava-1.5-7b"


class Clock:
    """Monotonic seconds that move only when the test (or a fake engine's work) moves them."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@dataclass
class Call:
    """One generate call a fake engine got."""

    backend_id: str
    job: GenerationJob
    at: float                       # the clock when it was made
    handoff_key: str
    timeout_s: float
    first_token_timeout_s: float
    closed: bool = False            # the stream was closed: the real client cancels it on the engine


Script = Callable[[Call, "Fleet"], AsyncIterator[engine_pb2.GenerateChunk]]


def chunk(index: int, finish: str = "", prompt_tokens: int = 0) -> engine_pb2.GenerateChunk:
    c = engine_pb2.GenerateChunk(text=f"t{index} ", index=index, finish_reason=finish)
    if finish:
        c.usage.prompt_tokens, c.usage.completion_tokens = prompt_tokens, index + 1
    return c


async def serves(call: Call, fleet: Fleet, tokens: int = 3) -> AsyncIterator[engine_pb2.GenerateChunk]:
    if call.job.images:   # a language engine waits for the embeddings the vision engine delivers
        await asyncio.wait_for(fleet.delivery(call.handoff_key).wait(), 5)
    for i in range(tokens):
        yield chunk(i, "stop" if i == tokens - 1 else "", call.job.prompt_tokens)


async def fails(call: Call, fleet: Fleet) -> AsyncIterator[engine_pb2.GenerateChunk]:
    """Refused before any token, as an engine that is down (UNAVAILABLE)."""
    raise BackendFailure(f"backend {call.backend_id}: unavailable", backend_id=call.backend_id)
    yield chunk(0)


def fails_after(seconds: float) -> Script:
    """Works `seconds` on the clock, then fails before any token."""
    async def script(call: Call, fleet: Fleet) -> AsyncIterator[engine_pb2.GenerateChunk]:
        fleet.clock.advance(seconds)
        raise BackendFailure(f"backend {call.backend_id}: failed after {seconds} s", backend_id=call.backend_id)
        yield chunk(0)
    return script


def serves_when(go: asyncio.Event) -> Script:
    """Serves once `go` is set."""
    async def script(call: Call, fleet: Fleet) -> AsyncIterator[engine_pb2.GenerateChunk]:
        await go.wait()
        async for c in serves(call, fleet):
            yield c
    return script


async def hangs(call: Call, fleet: Fleet) -> AsyncIterator[engine_pb2.GenerateChunk]:
    """Never answers; cut only by whoever gives up on it."""
    await asyncio.Event().wait()
    yield chunk(0)


async def times_out(call: Call, fleet: Fleet) -> AsyncIterator[engine_pb2.GenerateChunk]:
    """Never answers; the client's own timer ends it as the real client's does (BackendTimeout at the
    request's deadline), here with the clock moved to that moment."""
    await asyncio.sleep(0)
    fleet.clock.advance(call.timeout_s)
    raise BackendTimeout(f"backend {call.backend_id}: deadline_exceeded: deadline exceeded",
                         backend_id=call.backend_id)
    yield chunk(0)


async def refuses(call: Call, fleet: Fleet) -> AsyncIterator[engine_pb2.GenerateChunk]:
    """The engine says the request itself is bad (INVALID_ARGUMENT)."""
    raise InvalidRequest("max_tokens must be at least 1")
    yield chunk(0)


def first_then_fails(*, deadline: bool) -> Script:
    """The first token, then a failure: the backend's own (`deadline` False) or the request's deadline
    passing (the clock moved to it, as the real client's timer fires then)."""
    async def script(call: Call, fleet: Fleet) -> AsyncIterator[engine_pb2.GenerateChunk]:
        yield chunk(0)
        await asyncio.sleep(0)
        if deadline:
            fleet.clock.advance(call.timeout_s)
            raise BackendTimeout(f"backend {call.backend_id}: deadline_exceeded: deadline exceeded",
                                 backend_id=call.backend_id, retryable=False)
        raise BackendFailure(f"backend {call.backend_id}: stream broke", backend_id=call.backend_id, retryable=False)
    return script


@dataclass
class Fleet:
    """The fake engines of one test: the script of each backend and the calls each got."""

    clock: Clock
    scripts: dict[str, Script] = field(default_factory=dict)
    encode_fails: set[str] = field(default_factory=set)
    calls: list[Call] = field(default_factory=list)
    encodes: list[str] = field(default_factory=list)
    _deliveries: dict[str, asyncio.Event] = field(default_factory=dict)

    def delivery(self, key: str) -> asyncio.Event:
        return self._deliveries.setdefault(key, asyncio.Event())

    def client(self, backend_id: str, address: str) -> BackendClient:
        return FakeEngineClient(self, backend_id, address)

    def backends_called(self) -> list[str]:
        return [c.backend_id for c in self.calls]


class FakeEngineClient:
    """A fake of `EngineClient`: generate runs the backend's script; encode delivers to the
    language engine (or fails, for the backends in `encode_fails`)."""

    handoff: Handoff = "direct"

    def __init__(self, fleet: Fleet, backend_id: str, address: str) -> None:
        self.fleet, self.backend_id, self.address = fleet, backend_id, address

    async def generate(
        self, job: GenerationJob, *, handoff_key: str = "", handoff_timeout_s: float, first_token_timeout_s: float,
        timeout_s: float,
    ) -> AsyncIterator[engine_pb2.GenerateChunk]:
        call = Call(self.backend_id, job, self.fleet.clock(), handoff_key, timeout_s, first_token_timeout_s)
        self.fleet.calls.append(call)
        try:
            async for c in self.fleet.scripts[self.backend_id](call, self.fleet):
                yield c
        finally:
            call.closed = True

    async def encode(self, request: engine_pb2.EncodeRequest, *, timeout_s: float) -> engine_pb2.EncodeReply:
        self.fleet.encodes.append(self.backend_id)
        await asyncio.sleep(0)
        if self.backend_id in self.fleet.encode_fails:
            raise BackendFailure(f"backend {self.backend_id}: encoder crashed", backend_id=self.backend_id)
        self.fleet.delivery(request.request_id).set()
        return engine_pb2.EncodeReply(embedding_bytes=1024)

    async def close(self) -> None:
        pass


@dataclass
class Rig:
    pipeline: Pipeline
    table: StateTable
    fleet: Fleet
    clock: Clock
    breakers: Breakers

    def heartbeat(self, *backend_ids: str) -> None:
        for b in backend_ids or [e.id for e in self.table.entries()]:
            entry = self.table.get(b)
            assert entry is not None
            self.table.apply_heartbeat(b, entry.reported.seq + 1, f"fake://{b}", Reported(
                seq=entry.reported.seq + 1, kv_free_bytes=40 << 30, kv_total_bytes=40 << 30))

    def in_flight(self, backend_id: str) -> tuple[int, int, int]:
        """The backend's leases as the table holds them: in flight, prefilling, KV tokens reserved."""
        e = self.table.get(backend_id)
        assert e is not None
        return e.in_flight, e.prefilling, e.kv_reserved_tokens


def rig(
    backends: dict[str, Role], *, max_attempts: int = 3, breaker: BreakerConfig | None = None,
    heartbeat_s: float = 10.0, **settings: Any,
) -> Rig:
    """A Pipeline as `build_runtime` builds it, on fake engines (round robin: the order is known).
    Backends heartbeat once, at the start: they stay healthy for 3 x `heartbeat_s` on the clock."""
    clock = Clock()
    cat = catalog()
    table = StateTable(cat.model(MODEL), heartbeat_s, 3, clock=clock)
    fleet = Fleet(clock)
    clients = EngineClients(fleet.client)
    for b, role in backends.items():
        table.register(b, role, cat.gpu("A100-80GB" if role != "vision" else "RTX-4090"),
                       address=f"fake://{b}", managed=False)
        clients.ensure(b, f"fake://{b}")
    defaults: dict[str, Any] = dict(first_token_timeout_s=60.0, request_timeout_s=600.0, handoff_timeout_s=5.0,
                                    stealing=False, steal_threshold=8, steal_max_batch=4, retry_backoff_s=0.001,
                                    retry_backoff_max_s=0.002)
    breakers = Breakers(breaker or BreakerConfig(), clock)
    pipeline = Pipeline(table, build_policy("round_robin"), build_policy("round_robin"), clients,
                        GatewayMetrics(table), PipelineSettings(max_attempts=max_attempts, **(defaults | settings)),
                        breakers, AdmissionQueue(AdmissionConfig(), clock), rng=random.Random(7))
    r = Rig(pipeline, table, fleet, clock, breakers)
    r.heartbeat()
    return r


def job(rid: str = "r", *, timeout_s: float | None = None, images: int = 0, whole: bool = False) -> GenerationJob:
    pictures = tuple(ImageInput(b"png", 32, 32, "PNG", 576) for _ in range(images))
    return GenerationJob(rid, "hello", 12, 8, images=pictures, timeout_s=timeout_s, whole=whole)


def record(r: Rig, rid: str = "r") -> RequestRecord:
    return RequestRecord(rid, "chat", started=r.clock())


async def drain(dispatch: Any) -> list[engine_pb2.GenerateChunk]:
    return [c async for c in dispatch.rest()]


async def until(condition: Callable[[], bool], timeout_s: float = 5.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not condition():  # noqa: ASYNC110 - polling what the fakes record
            await asyncio.sleep(0.001)


# --- retries, the deadline, hand-offs, cancellation ------------------------------------------------


async def test_a_failure_before_the_first_token_is_retried_on_another_backend() -> None:
    r = rig({"a": "language", "b": "language", "c": "language"}, breaker=BreakerConfig(failure_threshold=1))
    r.fleet.scripts = {"a": fails, "b": serves, "c": serves}
    rec = record(r)
    dispatch = await r.pipeline.start(job(), rec)
    chunks = await drain(dispatch)
    assert [c.finish_reason for c in chunks] == ["", "", "stop"]
    first, second = r.fleet.backends_called()
    assert first == "a" and second != "a" and dispatch.backend_id == second
    assert rec.attempts == 2 and rec.backends == ["a", second] and rec.failed == ["a"]
    assert r.breakers.state("a") is State.OPEN and r.breakers.state(second) is State.CLOSED
    assert all(r.in_flight(b) == (0, 0, 0) for b in "abc")   # both leases back
    assert all(c.closed for c in r.fleet.calls)


async def test_the_budget_spans_the_request_and_the_last_failure_is_the_answer() -> None:
    r = rig({"a": "language", "b": "language", "c": "language", "d": "language"}, max_attempts=3)
    r.fleet.scripts = dict.fromkeys("abcd", fails)
    rec = record(r)
    with pytest.raises(BackendFailure) as err:
        await r.pipeline.start(job(), rec)
    assert err.value.status == 502 and rec.attempts == 3 and len(set(r.fleet.backends_called())) == 3
    assert all(r.in_flight(b) == (0, 0, 0) for b in "abcd")


async def test_no_attempt_starts_after_the_deadline() -> None:
    r = rig({"a": "language", "b": "language", "c": "language", "d": "language"}, max_attempts=4)
    r.fleet.scripts = dict.fromkeys("abcd", fails_after(0.6))
    rec = record(r)
    with pytest.raises(DeadlineExceeded) as err:
        await r.pipeline.start(job(timeout_s=1.5), rec)
    assert err.value.status == 504 and "deadline" in err.value.message
    assert rec.deadline == rec.started + 1.5
    starts = [c.at for c in r.fleet.calls]
    # Each attempt took 0.6 s: at 0, 0.6 and 1.2 s they started before the deadline, a fourth would not.
    assert len(starts) == 3 < 4 and all(t < rec.deadline for t in starts)
    assert all(r.in_flight(b) == (0, 0, 0) for b in "abcd")


async def test_a_deadline_already_past_starts_nothing() -> None:
    r = rig({"a": "language"})
    r.fleet.scripts = {"a": serves}
    rec = record(r)
    r.clock.advance(2.0)
    with pytest.raises(DeadlineExceeded):
        await r.pipeline.start(job(timeout_s=1.0), rec)
    assert r.fleet.calls == [] and rec.attempts == 0


async def test_a_failed_encode_is_redone_on_another_vision_backend() -> None:
    r = rig({"lang": "language", "v1": "vision", "v2": "vision"}, breaker=BreakerConfig(failure_threshold=1))
    r.fleet.scripts = {"lang": serves}
    r.fleet.encode_fails = {"v1"}
    rec = record(r)
    dispatch = await r.pipeline.start(job(images=1), rec)
    await drain(dispatch)
    assert r.fleet.encodes == ["v1", "v2"] and dispatch.vision_backend_id == "v2"
    assert rec.vision_backends == ["v1", "v2"] and rec.attempts == 1 and r.fleet.backends_called() == ["lang"]
    assert r.breakers.state("v1") is State.OPEN and r.breakers.state("lang") is State.CLOSED
    assert r.in_flight("lang") == (0, 0, 0)
    vision = r.table.get("v1")
    assert vision is not None and vision.vision_in_flight_tokens == 0


async def test_every_encode_failing_fails_the_request_not_the_language_backend() -> None:
    r = rig({"lang": "language", "lang2": "language", "v1": "vision", "v2": "vision"})
    r.fleet.scripts = {"lang": serves, "lang2": serves}
    r.fleet.encode_fails = {"v1", "v2"}
    rec = record(r)
    with pytest.raises(BackendFailure) as err:
        await r.pipeline.start(job(images=1), rec)
    assert err.value.backend_id in {"v1", "v2"} and not err.value.retryable
    assert rec.attempts == 1, "the language backend was not at fault: not re-dispatched"
    assert r.breakers.state("lang") is State.CLOSED and r.in_flight("lang") == (0, 0, 0)


async def test_an_encode_and_a_language_attempt_failing_together_leave_no_exception_unread() -> None:
    """Both halves of a split request failing in the same turn: the one not raised was a task whose
    exception was never retrieved ("Task exception was never retrieved" in the log, per request)."""
    r = rig({"lang": "language", "v1": "vision"}, max_attempts=1)
    r.fleet.scripts = {"lang": fails}
    r.fleet.encode_fails = {"v1"}
    unread: list[dict[str, Any]] = []
    loop = asyncio.get_running_loop()
    loop.set_exception_handler(lambda _loop, context: unread.append(context))
    try:
        with pytest.raises(BackendFailure):
            await r.pipeline.start(job(images=1), record(r))
        for _ in range(3):
            await asyncio.sleep(0)
        gc.collect()
    finally:
        loop.set_exception_handler(None)
    assert r.fleet.encodes == ["v1"] and r.fleet.backends_called() == ["lang"]
    assert unread == []


async def test_no_encoder_because_its_breaker_is_open_says_so() -> None:
    """The encoder is healthy (its heartbeats come), its breaker open: the 503 said "no healthy vision
    backend" while /admin/backends said healthy."""
    r = rig({"lang": "language", "v1": "vision"}, breaker=BreakerConfig(failure_threshold=1, open_s=60.0))
    r.fleet.scripts = {"lang": serves}
    r.fleet.encode_fails = {"v1"}
    with pytest.raises(BackendFailure):
        await r.pipeline.start(job(images=1), record(r))
    assert r.breakers.state("v1") is State.OPEN and r.table.is_healthy(r.table.get("v1"))  # type: ignore[arg-type]
    with pytest.raises(NoBackendAvailable) as err:
        await r.pipeline.start(job("r2", images=1), record(r, "r2"))
    assert "(circuit breaker open after failures: v1)" in err.value.message, err.value.message


async def test_no_language_backend_because_its_breaker_is_open_says_so() -> None:
    r = rig({"a": "language"}, max_attempts=1, breaker=BreakerConfig(failure_threshold=1, open_s=60.0))
    r.fleet.scripts = {"a": fails}
    with pytest.raises(BackendFailure):
        await r.pipeline.start(job(), record(r))
    with pytest.raises(NoBackendAvailable) as err:
        await r.pipeline.start(job("r2"), record(r, "r2"))
    assert "(circuit breaker open after failures: a)" in err.value.message, err.value.message


async def test_a_cancelled_request_releases_its_lease_and_counts_nothing() -> None:
    r = rig({"a": "language"}, breaker=BreakerConfig(failure_threshold=1, open_s=1.0))
    r.fleet.scripts = {"a": hangs}
    r.breakers.on_failure("a")
    r.clock.advance(1.0)
    assert r.breakers.state("a") is State.HALF_OPEN
    task = asyncio.create_task(r.pipeline.start(job()))
    await until(lambda: bool(r.fleet.calls))
    assert r.in_flight("a")[0] == 1 and r.breakers.blocked() == ["a"]   # this request is the probe
    task.cancel()   # the client left
    with pytest.raises(asyncio.CancelledError):
        await task
    assert r.in_flight("a") == (0, 0, 0) and r.fleet.calls[0].closed
    # Not a failure of the backend: the breaker is as it was, and the next request may probe.
    assert r.breakers.state("a") is State.HALF_OPEN and r.breakers.blocked() == []


async def test_a_client_leaving_mid_stream_releases_the_lease_and_counts_nothing() -> None:
    r = rig({"a": "language"}, breaker=BreakerConfig(failure_threshold=1))
    r.fleet.scripts = {"a": lambda call, fleet: serves(call, fleet, tokens=50)}
    rec = record(r)
    dispatch = await r.pipeline.start(job(), rec)
    stream = dispatch.rest()
    for _ in range(5):
        await anext(stream)
    await stream.aclose()   # the door closes it when its client is gone
    assert r.in_flight("a") == (0, 0, 0) and r.fleet.calls[0].closed
    assert r.breakers.state("a") is State.CLOSED and r.breakers.blocked() == []
    assert rec.completion_tokens == 5


async def test_a_non_streamed_request_restarts_after_a_midstream_failure() -> None:
    r = rig({"a": "language", "b": "language"})
    r.fleet.scripts = {"a": first_then_fails(deadline=False), "b": serves}
    rec = record(r)
    dispatch, chunks = await r.pipeline.complete(job(whole=True), rec)
    assert dispatch.backend_id == "b" and chunks[-1].finish_reason == "stop"
    assert rec.attempts == 2 and rec.failed == ["a"]
    assert r.in_flight("a") == r.in_flight("b") == (0, 0, 0)


async def test_a_request_whose_own_deadline_passes_in_the_admission_queue_gets_504_not_429() -> None:
    """The admission queue gives up on a request at its own deadline or after `max_wait_s`, whichever is
    sooner: the first is the request's time running out (504 deadline_exceeded, as every other place
    answers it), the second the queue's limit (429 overloaded, retry later)."""
    r = rig({"a": "language"})
    r.pipeline.admission = AdmissionQueue(AdmissionConfig(saturated_queue_depth=1, max_wait_s=5.0), r.clock)
    go = asyncio.Event()
    r.fleet.scripts["a"] = serves_when(go)
    first = asyncio.create_task(r.pipeline.start(job("r1"), record(r, "r1")))
    await until(lambda: len(r.fleet.calls) == 1)
    impatient = asyncio.create_task(r.pipeline.start(job("r2", timeout_s=1.0), record(r, "r2")))
    patient = asyncio.create_task(r.pipeline.start(job("r3", timeout_s=60.0), record(r, "r3")))
    await until(lambda: r.pipeline.admission.waiting == 2)
    r.clock.advance(1.5)
    r.pipeline.admission.notify()
    with pytest.raises(DeadlineExceeded) as err:
        await asyncio.wait_for(impatient, 5)
    assert err.value.status == 504 and "waited for admission" in err.value.message
    r.clock.advance(5.0)
    r.pipeline.admission.notify()
    with pytest.raises(Overloaded) as refused:
        await asyncio.wait_for(patient, 5)
    assert refused.value.status == 429
    go.set()
    assert len(await drain(await asyncio.wait_for(first, 5))) == 3
    assert len(r.fleet.calls) == 1 and r.in_flight("a") == (0, 0, 0)


# --- the overload queue ---------------------------------------------------------------------------------


async def test_a_request_held_by_the_overload_queue_is_sent_when_the_one_ahead_has_its_first_token() -> None:
    """One backend; a request whose predicted first token there is past the bound while another's prompt
    is still ahead of it waits at the gateway, not on the engine, and goes when that first token comes."""
    r = rig({"a": "language"})
    gate = r.pipeline.overload = OverloadGate(
        OverloadConfig(ttft_slo_s=100.0, hold_above_s=1e-9, max_wait_s=50.0, protect_itl=False), r.clock, 10.0)
    go = asyncio.Event()
    r.fleet.scripts["a"] = serves_when(go)
    first = asyncio.create_task(r.pipeline.start(job("r1"), record(r, "r1")))
    await until(lambda: len(r.fleet.calls) == 1)
    second = asyncio.create_task(r.pipeline.start(job("r2"), record(r, "r2")))
    await until(lambda: gate.held == 1)
    await asyncio.sleep(0.01)
    assert len(r.fleet.calls) == 1 and r.in_flight("a")[0] == 1   # held here: nothing more on the engine
    go.set()
    one = await asyncio.wait_for(first, 5)
    two = await asyncio.wait_for(second, 5)
    assert [c.job.request_id for c in r.fleet.calls] == ["r1", "r2"] and gate.held == 0
    assert len(await drain(one)) == 3 and len(await drain(two)) == 3
    assert r.in_flight("a") == (0, 0, 0)


# --- what counts against a backend's breaker ----------------------------------------------------------


async def test_requests_whose_own_deadline_passes_never_open_a_breaker() -> None:
    r = rig({"a": "language", "b": "language", "c": "language"}, breaker=BreakerConfig(failure_threshold=2))
    r.fleet.scripts = dict.fromkeys("abc", times_out)
    for i in range(30):
        with pytest.raises(DeadlineExceeded):
            await r.pipeline.start(job(f"impatient-{i}", timeout_s=0.001))
    assert len(r.fleet.calls) == 30, "each had one attempt, cut by its own deadline"
    assert all(r.breakers.state(b) is State.CLOSED for b in "abc") and r.breakers.blocked() == []
    r.fleet.scripts = dict.fromkeys("abc", serves)
    dispatch = await r.pipeline.start(job("patient"))
    assert (await drain(dispatch))[-1].finish_reason == "stop"


async def test_a_request_the_engine_refuses_as_invalid_counts_nothing() -> None:
    r = rig({"a": "language"}, breaker=BreakerConfig(failure_threshold=1))
    r.fleet.scripts = {"a": refuses}
    for _ in range(3):
        with pytest.raises(InvalidRequest):
            await r.pipeline.start(job())
    assert r.breakers.state("a") is State.CLOSED and r.in_flight("a") == (0, 0, 0)


async def test_the_backends_own_timeout_before_the_deadline_still_counts() -> None:
    async def first_token_timeout(call: Call, fleet: Fleet) -> AsyncIterator[engine_pb2.GenerateChunk]:
        raise BackendTimeout(f"backend {call.backend_id}: no first token within 0.5 s", backend_id=call.backend_id)
        yield chunk(0)

    r = rig({"a": "language", "b": "language"}, breaker=BreakerConfig(failure_threshold=1))
    r.fleet.scripts = {"a": first_token_timeout, "b": serves}
    dispatch = await r.pipeline.start(job(timeout_s=30))
    await drain(dispatch)
    assert dispatch.backend_id == "b" and r.breakers.state("a") is State.OPEN


# --- the first-token watch --------------------------------------------------------------------------


async def test_a_backend_marked_unhealthy_while_a_request_waits_loses_it_at_once() -> None:
    r = rig({"a": "language", "b": "language"}, heartbeat_s=0.01, breaker=BreakerConfig(failure_threshold=1))
    r.fleet.scripts = {"a": hangs, "b": serves}
    rec = record(r)
    task = asyncio.create_task(r.pipeline.start(job(), rec))
    await until(lambda: bool(r.fleet.calls))
    assert r.fleet.calls[0].backend_id == "a"
    r.clock.advance(1.0)   # a misses its heartbeats (3 x 10 ms); b keeps sending them
    r.heartbeat("b")
    dispatch = await asyncio.wait_for(task, 5)
    await drain(dispatch)
    assert rec.backends == ["a", "b"] and dispatch.backend_id == "b"
    assert r.fleet.calls[0].closed and r.in_flight("a") == (0, 0, 0)
    assert r.breakers.state("a") is State.OPEN   # a silent backend is a backend fault


async def test_a_first_token_slower_than_its_limit_is_retried_elsewhere() -> None:
    # The watch ticks every heartbeat interval: 10 ms here (the clock stands still: nobody goes stale).
    r = rig({"a": "language", "b": "language"}, heartbeat_s=0.01, first_token_floor_s=0.05,
            first_token_ttft_factor=4.0)
    r.fleet.scripts = {"a": hangs, "b": serves}
    rec = record(r)
    dispatch = await asyncio.wait_for(r.pipeline.start(job(timeout_s=60), rec), 5)
    await drain(dispatch)
    assert rec.backends == ["a", "b"] and r.fleet.calls[0].closed and r.in_flight("a") == (0, 0, 0)


async def test_the_first_token_limit_follows_the_predicted_ttft() -> None:
    r = rig({"a": "language"}, first_token_floor_s=0.5, first_token_ttft_factor=4.0)
    quiet = r.table.candidates(("language",))[0]
    assert r.pipeline.first_token_limit(quiet, 12, 28) == 0.5   # a short prompt on an idle backend: the floor
    backlog = r.table.acquire("a", 100_000, 16)   # prompts ahead of it, not yet prefilled
    busy = r.table.candidates(("language",))[0]
    predicted = predicted_ttft_s(busy, 12, 28)
    assert predicted == pytest.approx((100_000 + 12) * busy.learned_prefill_s_per_token + busy.decode_step_s
                                      + kv_wait_s(busy, 28))
    assert r.pipeline.first_token_limit(busy, 12, 28) == pytest.approx(4.0 * predicted) and 0.5 < 4.0 * predicted < 60
    r.table.release(backlog)
    # A cache this router has filled: the wait for it turning over lengthens the limit.
    capacity = quiet.kv_total_bytes // quiet.kv_bytes_per_token
    held = r.table.acquire("a", 12, capacity)   # prefilled at once (a prompt of 12), its KV reserved
    r.table.first_token(held)
    full = r.table.candidates(("language",))[0]
    assert kv_wait_s(full, 28) > 0
    assert predicted_ttft_s(full, 12, 28) == pytest.approx(predicted_ttft_s(quiet, 12, 28) + kv_wait_s(full, 28))
    r.table.release(held)


def external(r: Rig, *backend_ids: str) -> None:
    for backend_id in backend_ids:
        entry = r.table.get(backend_id)
        assert entry is not None
        entry.external = True   # as a kind: openai backend registers


async def test_a_whole_reply_from_an_openai_upstream_is_not_cut_by_the_first_token_limit() -> None:
    async def answers_whole_later(call: Call, fleet: Fleet) -> AsyncIterator[engine_pb2.GenerateChunk]:
        await asyncio.sleep(0.2)   # the reply comes after its last token, past the 0.01 s first-token limit
        yield chunk(7, "stop", call.job.prompt_tokens)

    r = rig({"a": "language"}, heartbeat_s=0.01, first_token_floor_s=0.01, first_token_ttft_factor=1.0,
            first_token_timeout_s=0.4)
    external(r, "a")
    r.fleet.scripts = {"a": answers_whole_later}
    rec = record(r)
    _, chunks = await r.pipeline.complete(job(whole=True), rec)
    assert rec.attempts == 1 and chunks[-1].finish_reason == "stop"


async def test_a_whole_reply_that_never_comes_is_retried_elsewhere_at_its_reply_limit() -> None:
    """An upstream that takes a non-streamed request and never answers, while its probe still does (a
    wedged engine behind a live server): cut at first_token_timeout_s + factor x max_tokens x ŝ, not
    the request's deadline, and retried on another backend."""
    r = rig({"a": "language", "b": "language"}, heartbeat_s=0.01, first_token_ttft_factor=1.0,
            first_token_timeout_s=0.1)
    external(r, "a", "b")
    a = r.table.candidates(("language",))[0]
    limit = r.pipeline.first_token_limit(a, 12, 12 + 8, whole=True)
    assert limit == pytest.approx(0.1 + 8 * a.decode_step_s) and a.decode_step_s > 0
    r.fleet.scripts = {"a": hangs, "b": serves}
    rec = record(r)
    _, chunks = await asyncio.wait_for(r.pipeline.complete(job(whole=True, timeout_s=60), rec), 5)
    assert rec.backends == ["a", "b"] and chunks[-1].finish_reason
    assert r.fleet.calls[0].closed and r.in_flight("a") == (0, 0, 0)


# --- what the request log is left with ------------------------------------------------------------


def request_line(logs: list[dict[str, Any]]) -> dict[str, Any]:
    lines = [e for e in logs if e["event"] == "request"]
    assert len(lines) == 1, logs
    return lines[0]


async def test_a_deadline_after_tokens_flowed_logs_its_tokens_and_restarts_nothing(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO)   # the request log writes its lines at INFO
    r = rig({"a": "language", "b": "language"})
    requests = RequestLog(r.pipeline.metrics, "round_robin")
    r.fleet.scripts = {"a": first_then_fails(deadline=True), "b": serves}
    rec = record(r)
    with structlog.testing.capture_logs() as logs:
        with pytest.raises(DeadlineExceeded) as err:
            await r.pipeline.complete(job(whole=True, timeout_s=5), rec)
        requests.finish(rec, err.value.status, error=err.value.message)
    assert not [e for e in logs if e["event"] == "restarting_after_midstream_failure"], logs
    assert rec.attempts == 1 and r.fleet.backends_called() == ["a"]
    line = request_line(logs)
    assert line["status"] == 504 and line["prompt_tokens"] == 12 and line["completion_tokens"] == 1


async def test_a_midstream_failure_that_restarts_says_so(caplog: pytest.LogCaptureFixture) -> None:
    r = rig({"a": "language", "b": "language"})
    r.fleet.scripts = {"a": first_then_fails(deadline=False), "b": serves}
    with structlog.testing.capture_logs() as logs:
        await r.pipeline.complete(job(whole=True, timeout_s=5), record(r))
    assert [e["backend"] for e in logs if e["event"] == "restarting_after_midstream_failure"] == ["a"]


async def test_a_client_leaving_mid_stream_logs_the_tokens_sent(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    r = rig({"a": "language"})
    requests = RequestLog(r.pipeline.metrics, "round_robin")
    r.fleet.scripts = {"a": lambda call, fleet: serves(call, fleet, tokens=100)}
    rec = record(r)
    dispatch = await r.pipeline.start(job(), rec)
    stream = dispatch.rest()
    with structlog.testing.capture_logs() as logs:
        for _ in range(7):
            await anext(stream)
        requests.finish(rec, 499)   # the door's line, written as the client goes
        await stream.aclose()
    line = request_line(logs)
    assert line["status"] == 499 and line["prompt_tokens"] == 12 and line["completion_tokens"] == 7

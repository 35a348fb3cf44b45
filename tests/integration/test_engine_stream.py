"""The gateway's engine client against real engine processes: many requests over one Session stream.

A standalone simulated language engine heartbeats to a Control service the test runs (so its load
reports can be read), and the gateway's own `EngineClient` talks to it over loopback, as the gateway
does: every request is a tag on one long-lived stream.

    many concurrent requests            each gets its own tokens, in order, one chunk per token,
                                        with its own usage
    the reader leaves early             the engine drops the sequence and frees its KV
    the request's deadline passes       BackendTimeout, and the engine frees its KV as well
    the engine is killed mid-stream     every request in flight fails with BackendFailure (retryable
                                        only if it had no token yet), none hangs; requests after a
                                        restart on the same address succeed over a new stream
"""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from backends.sim_executor import natural_length
from common.wire import engine_pb2
from gateway.clients.engine_client import EngineClient
from gateway.requests.errors import BackendFailure, BackendTimeout
from gateway.requests.job import GenerationJob
from gateway.routing.backend_entry import Reported
from testkit.harness import StandaloneEngines, free_port, long_request_id, standalone_engines

MODEL = "llava-1.5-7b"
WORDS = ("the", "model", "answers", "with", "simulated", "tokens", "from", "a", "heterogeneous", "cluster")
LONG = 200   # tokens: long enough at --time-scale 0.2 to still be generating when the test acts

pytestmark = pytest.mark.timeout(90)


@pytest.fixture
def engines(tmp_path: Path) -> Iterator[StandaloneEngines]:
    with standalone_engines(MODEL, tmp_path, heartbeat_ms=50) as engines:
        yield engines


def job(request_id: str, max_tokens: int = 256, whole: bool = False) -> GenerationJob:
    return GenerationJob(request_id=request_id, prompt="user: hello", prompt_tokens=11, max_tokens=max_tokens,
                         whole=whole)


def expected_text(tokens: int) -> str:
    return "".join(WORDS[i % len(WORDS)] + " " for i in range(tokens))


async def collect(
    client: EngineClient, request: GenerationJob, timeout_s: float = 30.0,
) -> list[engine_pb2.GenerateChunk]:
    stream = client.generate(request, handoff_timeout_s=0, first_token_timeout_s=timeout_s, timeout_s=timeout_s)
    return [chunk async for chunk in stream]


def idle(engines: StandaloneEngines, backend_id: str) -> Reported:
    """Wait for a load report with nothing running or waiting and the whole KV cache free."""
    return engines.wait_reported(
        backend_id, lambda r: r.running == 0 and r.waiting == 0 and r.kv_free_bytes == r.kv_total_bytes)


def test_concurrent_requests_over_one_stream_each_get_their_own_tokens(engines: StandaloneEngines) -> None:
    engines.launch("l0", "language", "H100", "--time-scale", "0.02")
    address = engines.address("l0")
    ids = [f"mux-{i}" for i in range(120)]

    async def run() -> list[list[engine_pb2.GenerateChunk]]:
        client = EngineClient("l0", address)
        try:
            return await asyncio.gather(*(collect(client, job(rid, 64 + i % 5 * 48, whole=i % 4 == 0))
                                          for i, rid in enumerate(ids)))
        finally:
            await client.close()

    results = asyncio.run(run())
    for i, (rid, chunks) in enumerate(zip(ids, results, strict=True)):
        want = min(64 + i % 5 * 48, natural_length(rid))
        indexes = [c.index for c in chunks]
        assert indexes == sorted(set(indexes)) and indexes[-1] == want - 1, (rid, indexes)
        assert "".join(c.text for c in chunks) == expected_text(want), rid
        assert chunks[-1].usage.completion_tokens == want and chunks[-1].finish_reason, rid
        assert not any(c.finish_reason for c in chunks[:-1]), rid
        if i % 4:   # streamed: one chunk per token, as on Generate, however many share a message
            assert indexes == list(range(want)), rid
    idle(engines, "l0")


def test_a_reader_that_leaves_cancels_the_request_on_the_engine(engines: StandaloneEngines) -> None:
    engines.launch("l0", "language", "H100", "--time-scale", "0.2")
    address = engines.address("l0")
    before = idle(engines, "l0")

    async def run() -> None:
        client = EngineClient("l0", address)
        try:
            stream = client.generate(job(long_request_id(LONG, "leave")), handoff_timeout_s=0,
                                     first_token_timeout_s=30, timeout_s=30)
            for _ in range(3):
                await anext(stream)
            await asyncio.to_thread(engines.wait_reported, "l0",
                                    lambda r: r.running == 1 and r.kv_free_bytes < r.kv_total_bytes)
            await stream.aclose()   # type: ignore[attr-defined]
            await asyncio.to_thread(idle, engines, "l0")
            # the stream stays usable for the next request
            chunks = await collect(client, job("after-leave", 8))
            assert chunks[-1].usage.completion_tokens == min(8, natural_length("after-leave"))
        finally:
            await client.close()

    asyncio.run(run())
    generated = idle(engines, "l0").tokens_generated - before.tokens_generated
    assert generated < LONG // 2 + 8, f"the engine went on generating ({generated} tokens) after the reader left"


def test_a_deadline_fails_the_request_and_frees_the_engine(engines: StandaloneEngines) -> None:
    engines.launch("l0", "language", "H100", "--time-scale", "0.5")
    address = engines.address("l0")
    idle(engines, "l0")

    async def run() -> list[engine_pb2.GenerateChunk]:
        client = EngineClient("l0", address)
        got: list[engine_pb2.GenerateChunk] = []
        try:
            stream = client.generate(job(long_request_id(LONG, "deadline")), handoff_timeout_s=0,
                                     first_token_timeout_s=5, timeout_s=0.3)
            with pytest.raises(BackendTimeout, match="deadline"):
                async for chunk in stream:
                    got.append(chunk)
        finally:
            await client.close()
        return got

    got = asyncio.run(run())
    assert got and not got[-1].finish_reason, "the request was cut while it was generating"
    idle(engines, "l0")


def test_an_engine_killed_mid_stream_fails_its_requests_cleanly_and_a_restart_serves_again(
    engines: StandaloneEngines,
) -> None:
    port = free_port()
    victim = engines.launch("l0", "language", "H100", "--time-scale", "0.2", "--port", str(port))
    address = engines.address("l0")
    assert address.endswith(f":{port}")

    async def one(client: EngineClient, rid: str, started: asyncio.Event) -> str:
        stream = client.generate(job(rid), handoff_timeout_s=0, first_token_timeout_s=30, timeout_s=30)
        try:
            async for chunk in stream:
                started.set()
                if chunk.finish_reason:
                    return "finished"
        except BackendFailure as exc:
            return f"failed retryable={exc.retryable}"
        return "ended without a finish reason"

    async def run() -> list[str]:
        client = EngineClient("l0", address)
        try:
            events = [asyncio.Event() for _ in range(16)]
            tasks = [asyncio.create_task(one(client, long_request_id(LONG, f"kill{i}"), e))
                     for i, e in enumerate(events)]
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in events)), 20)
            os.kill(victim.pid, signal.SIGKILL)
            outcomes = await asyncio.wait_for(asyncio.gather(*tasks), 20)
            # Down: a new request fails at once, retryable (it never reached the engine).
            with pytest.raises(BackendFailure) as down:
                await collect(client, job("while-down", 4), timeout_s=10)
            assert down.value.retryable
            # Back on the same address: the client opens a new stream by itself (once the channel's
            # reconnect backoff lets it; until then requests fail fast and retryable).
            engines.launch("l0b", "language", "H100", "--time-scale", "0.2", "--port", str(port))
            await asyncio.to_thread(engines.address, "l0b")
            async with asyncio.timeout(20):
                while True:
                    try:
                        chunks = await collect(client, job("after-restart", 8), timeout_s=10)
                        break
                    except BackendFailure as exc:
                        assert exc.retryable, exc
                        await asyncio.sleep(0.1)
            assert chunks[-1].usage.completion_tokens == min(8, natural_length("after-restart"))
            return outcomes
        finally:
            await client.close()

    outcomes = asyncio.run(run())
    assert outcomes == ["failed retryable=False"] * 16, outcomes

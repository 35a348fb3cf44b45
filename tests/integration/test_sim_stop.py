"""Stop strings on a simulated language engine, token by token: a real engine process, the gateway's own
`EngineClient` over loopback (one chunk per token), its load reports read from a Control service the test runs.

The engine detokenises its made-up words as the torch engine does (`backends.detokenizer.IncrementalText`):

    text that could still become a stop string     held back (empty chunks), sent if it never does
    the token that completes a stop string         ends the request: finish_reason "stop", the text cut
                                                   before the stop string, usage counts that token
    after a stop                                   the engine generates nothing more for it, frees its KV
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any

import pytest

from backends.sim_executor import natural_length
from common.wire import engine_pb2
from gateway.clients.engine_client import EngineClient
from gateway.requests.job import GenerationJob
from testkit.harness import StandaloneEngines, long_request_id, standalone_engines

MODEL = "llava-1.5-7b"
LONG = 200   # tokens the request would run to without its stop string

pytestmark = pytest.mark.timeout(90)


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StandaloneEngines]:
    with standalone_engines(MODEL, tmp_path_factory.mktemp("sim-stop"), heartbeat_ms=50) as engines:
        engines.launch("l0", "language", "H100", "--time-scale", "0.05")
        engines.address("l0")
        yield engines


def idle(engines: StandaloneEngines, tokens_at_least: int = 0) -> Any:
    """Wait for a load report with nothing running or waiting, the whole KV cache free and at least
    `tokens_at_least` tokens generated since the engine started."""
    return engines.wait_reported(
        "l0", lambda r: r.running == 0 and r.waiting == 0 and r.kv_free_bytes == r.kv_total_bytes
        and r.tokens_generated >= tokens_at_least)


def run(engines: StandaloneEngines, request_id: str, stop: tuple[str, ...], max_tokens: int = LONG,
        whole: bool = False) -> list[engine_pb2.GenerateChunk]:
    request = GenerationJob(request_id=request_id, prompt="user: hello", prompt_tokens=11, max_tokens=max_tokens,
                            whole=whole, stop=stop)

    async def collect() -> list[engine_pb2.GenerateChunk]:
        client = EngineClient("l0", engines.address("l0"))
        try:
            stream = client.generate(request, handoff_timeout_s=0, first_token_timeout_s=30, timeout_s=30)
            return [chunk async for chunk in stream]
        finally:
            await client.close()

    return asyncio.run(collect())


def texts(chunks: list[engine_pb2.GenerateChunk]) -> list[str]:
    return [c.text for c in chunks]


def test_a_stop_string_ends_the_sequence_and_frees_the_engine(engines: StandaloneEngines) -> None:
    """"heterogeneous" is completed by token 9 of a request that would run to 200: it ends there, the
    engine generates no more tokens for it and its KV is free again."""
    before = idle(engines).tokens_generated
    rid = long_request_id(LONG, "stop-long")
    chunks = run(engines, rid, ("heterogeneous",))
    assert "".join(texts(chunks)) == "the model answers with simulated tokens from a "
    assert [c.index for c in chunks] == list(range(9)), "one chunk per token, up to the one that completed it"
    assert chunks[-1].finish_reason == "stop" and not any(c.finish_reason for c in chunks[:-1])
    assert chunks[-1].usage.completion_tokens == 9
    idle(engines, before + 9)
    time.sleep(0.5)   # at this clock the 191 tokens it would have gone on to take about 0.1 s
    generated = idle(engines).tokens_generated - before
    assert generated == 9, f"the engine went on generating ({generated} tokens) after the stop string"


def test_text_that_could_become_a_stop_string_is_held_back(engines: StandaloneEngines) -> None:
    rid = long_request_id(LONG, "stop-held")
    # "model " could still be "model answers": held back, then "answers" completes it and nothing is sent
    assert texts(run(engines, rid, ("model answers",))) == ["the ", "", ""]
    # a stop string beginning with a space holds back each word's trailing space until the next word
    chunks = run(engines, rid, (" with", "answers"))
    assert texts(chunks) == ["the", " model", " "] and chunks[-1].finish_reason == "stop"
    # cut inside a word: the text ends before the stop string, not at a word boundary
    chunks = run(engines, rid, ("s with sim",))
    assert "".join(texts(chunks)) == "the model answer" and chunks[-1].usage.completion_tokens == 5
    # held back until max_tokens ends the request first: then it is sent, finish_reason "length"
    chunks = run(engines, rid, ("answers with",), max_tokens=3)
    assert texts(chunks) == ["the ", "model ", "answers "] and chunks[-1].finish_reason == "length"


def test_whole_and_streamed_agree_and_an_absent_stop_string_changes_nothing(engines: StandaloneEngines) -> None:
    rid = next(f"stop-short-{k}" for k in range(1000) if 20 <= natural_length(f"stop-short-{k}") <= 40)
    plain = run(engines, rid, ())
    never = run(engines, rid, ("zzz", "models"))
    assert texts(never) == texts(plain) and never[-1].finish_reason == plain[-1].finish_reason == "stop"
    assert never[-1].usage.completion_tokens == plain[-1].usage.completion_tokens == natural_length(rid)
    for stop in [("model",), ("cluster", "a het"), ("the",)]:
        streamed, whole = run(engines, rid, stop), run(engines, rid, stop, whole=True)
        assert "".join(texts(whole)) == "".join(texts(streamed)), stop
        assert (whole[-1].finish_reason, whole[-1].usage.completion_tokens) == \
            (streamed[-1].finish_reason, streamed[-1].usage.completion_tokens), stop
        assert streamed[-1].finish_reason == "stop"
    assert "".join(texts(run(engines, rid, ("cluster", "a het")))) == "the model answers with simulated tokens from "
    assert "".join(texts(run(engines, rid, ("the",)))) == ""
    idle(engines)

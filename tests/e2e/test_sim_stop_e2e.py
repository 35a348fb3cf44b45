"""The OpenAI `stop` field against the demo cluster (simulated engines): the official `openai` client, the
real gateway and its engine processes on 127.0.0.1.

The engines' made-up words ("the model answers with simulated tokens from a heterogeneous cluster ...")
hold the stop strings asked here. On /v1/chat/completions and /v1/completions, streamed or whole: the text
ends before the first stop string to occur and never holds one, finish_reason is "stop", usage counts the
tokens up to the one that completed it, and the streamed text is the whole one. A stop string that never
occurs changes nothing.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import openai
import pytest

from backends.sim_executor import natural_length
from testkit.harness import Gateway, demo_config, run_gateway

MODEL = "llava-1.5-7b"
pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    config = demo_config(tmp_path_factory.mktemp("sim-stop"), time_scale=0.05, heartbeat_interval_ms=100)
    with run_gateway(config, timeout=120) as gw:
        yield gw


def ask(gw: Gateway, *, chat: bool, stream: bool, stop: list[str] | None, max_tokens: int = 40,
        request_id: str | None = None) -> tuple[str, str | None, int]:
    """(text, finish_reason, completion tokens) of one request."""
    sdk = openai.OpenAI(base_url=f"{gw.url}/v1", api_key="unused", max_retries=0, timeout=30)
    common: dict[str, Any] = {"model": MODEL, "max_tokens": max_tokens, "stream": stream,
                          "extra_headers": {"x-request-id": request_id} if request_id else None}
    if stop is not None:
        common["stop"] = stop
    if stream:
        common["stream_options"] = {"include_usage": True}
    if chat:
        out = sdk.chat.completions.create(messages=[{"role": "user", "content": "hi"}], **common)
    else:
        out = sdk.completions.create(prompt="hi", **common)
    if not stream:
        usage = out.usage
        assert usage is not None
        choice = out.choices[0]
        return (choice.message.content if chat else choice.text) or "", choice.finish_reason, usage.completion_tokens
    chunks = list(out)
    pieces = [(c.choices[0].delta.content or "") if chat else c.choices[0].text for c in chunks if c.choices]
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finishes) == 1, finishes
    usage = chunks[-1].usage
    assert usage is not None
    for stop_string in stop or []:
        assert all(stop_string not in p for p in pieces), (stop_string, pieces)
    return "".join(pieces), finishes[0], usage.completion_tokens


@pytest.mark.parametrize("chat", [True, False], ids=["chat", "completions"])
@pytest.mark.parametrize(("stop", "text", "tokens"), [
    (["model"], "the ", 2),
    ([" with"], "the model answers", 4),
    ([" with", "answers"], "the model ", 3),                   # the first to occur wins
    (["cluster", "simulated tokens", "a het"], "the model answers with ", 6),
    (["s with sim"], "the model answer", 5),                   # cut inside a word
])
def test_text_ends_before_the_first_stop_string(gw: Gateway, chat: bool, stop: list[str], text: str,
                                                tokens: int) -> None:
    whole = ask(gw, chat=chat, stream=False, stop=stop)
    streamed = ask(gw, chat=chat, stream=True, stop=stop)
    assert whole == streamed == (text, "stop", tokens)
    assert not any(s in text for s in stop)


@pytest.mark.parametrize("chat", [True, False], ids=["chat", "completions"])
def test_a_stop_string_that_never_occurs_changes_nothing(gw: Gateway, chat: bool) -> None:
    rid = next(f"sim-stop-{k}" for k in range(1000) if natural_length(f"sim-stop-{k}") <= 30)
    for stream in (False, True):
        plain = ask(gw, chat=chat, stream=stream, stop=None, request_id=rid)
        never = ask(gw, chat=chat, stream=stream, stop=["zzz", "models", "cluster model"],
                    request_id=rid)
        assert never == plain and plain[1:] == ("stop", natural_length(rid)), (stream, plain, never)
        # at max_tokens the text held back for a stop string that might have come is sent
        late = ask(gw, chat=chat, stream=stream, stop=["answers with"], max_tokens=3, request_id=rid)
        assert late == ("the model answers ", "length", 3), (stream, late)


def test_a_string_stop_field_is_one_stop_string(gw: Gateway) -> None:
    sdk = openai.OpenAI(base_url=f"{gw.url}/v1", api_key="unused", max_retries=0, timeout=30)
    out = sdk.completions.create(model=MODEL, prompt="hi", max_tokens=40, stop="simulated")
    assert (out.choices[0].text, out.choices[0].finish_reason) == ("the model answers with ", "stop")
    assert out.usage is not None and out.usage.completion_tokens == 5

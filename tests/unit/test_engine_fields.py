"""The fields the gateway's own engines refuse: those they would otherwise silently ignore."""

from __future__ import annotations

import pytest

from gateway.clients.engine_fields import check_engine_can_honour, refused_fields
from gateway.requests.errors import InvalidRequest


def test_plain_requests_and_fields_that_ask_nothing_pass() -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi", "name": "ann"}], "max_tokens": 4,
            "temperature": 0.2, "top_p": 0.9, "stop": ["\n"], "user": "u-1", "n": 1, "logprobs": False,
            "tools": [], "tool_choice": "none", "response_format": {"type": "text"}, "presence_penalty": 0,
            "seed": None, "stream_options": {"include_usage": True}, "echo": False,
            "top_k": -1, "repetition_penalty": 1.0, "service_tier": "auto",   # vLLM's "off", OpenAI's default
            "modalities": ["text"]}
    assert refused_fields(body) == []
    assert refused_fields({"model": "m", "messages": [], "modalities": ["text", "audio"]}) == ["modalities"]
    check_engine_can_honour(body)
    assert refused_fields({"model": "m", "prompt": "hi", "echo": False, "stream": None, "best_of": 1}, chat=False) == []


def test_a_zero_seed_and_zero_logprobs_ask_something() -> None:
    """seed 0 is a seed, and a completion's logprobs 0 asks for the sampled token's logprob; a chat's
    logprobs false asks nothing."""
    assert refused_fields({"model": "m", "prompt": "hi", "logprobs": 0, "seed": 0}, chat=False) == ["logprobs", "seed"]
    assert refused_fields({"model": "m", "messages": [], "logprobs": False, "seed": None}) == []
    assert refused_fields({"model": "m", "prompt": "hi", "seed": 0}, chat=False, exact=True) == []


def test_what_the_other_endpoint_reads_and_echo_are_refused() -> None:
    """A chat request's `prompt` and a completion's `messages` would be ignored; `echo: true` is not done."""
    assert refused_fields({"model": "m", "messages": [{"role": "user", "content": "hi"}], "prompt": "x"}) == ["prompt"]
    assert refused_fields({"model": "m", "prompt": "hi", "messages": [{"role": "user", "content": "x"}],
                           "echo": True}, chat=False) == ["messages", "echo"]


def test_fields_an_engine_cannot_honour_are_named() -> None:
    body = {"model": "m", "n": 2, "logprobs": True, "top_logprobs": 3, "seed": 7, "top_k": 20,
            "tools": [{"type": "function", "function": {"name": "f"}}], "response_format": {"type": "json_object"},
            "messages": [{"role": "user", "content": "hi"},
                         {"role": "assistant", "content": None, "tool_calls": [{"id": "c"}]},
                         {"role": "tool", "content": "7", "tool_call_id": "c"}]}
    assert refused_fields(body) == ["n", "logprobs", "top_logprobs", "seed", "top_k", "tools", "response_format",
                                    "messages.1.tool_calls", "messages.2.tool_call_id"]
    with pytest.raises(InvalidRequest, match=r"cannot honour n, logprobs, .*messages.2.tool_call_id") as exc:
        check_engine_can_honour(body)
    assert exc.value.param == "n" and exc.value.status == 400

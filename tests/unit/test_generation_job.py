"""A job's context need and how an unasked max_tokens fits the backend that takes it."""

from __future__ import annotations

from gateway.requests.job import GenerationJob


def test_context_need_and_fit() -> None:
    asked = GenerationJob("r", "p", prompt_tokens=1000, max_tokens=500)
    assert asked.context_tokens == 1500
    assert asked.for_context(1200) is asked            # the client's max_tokens is never changed
    unasked = GenerationJob("r", "p", prompt_tokens=1000, max_tokens=256, max_tokens_asked=False)
    assert unasked.context_tokens == 1001               # any backend with room for one token will do
    assert unasked.for_context(4096) is unasked
    assert unasked.for_context(1100).max_tokens == 100  # vLLM's default: the room left
    assert unasked.for_context(0) is unasked            # unknown context: as asked of the gateway

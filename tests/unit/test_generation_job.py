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


def test_traced_copy_keeps_every_field() -> None:
    job = GenerationJob("r", "p", prompt_tokens=10, max_tokens=5, temperature=0.3, kind="text", body={"a": 1},
                        whole=True, token_ids=(1, 2), top_p=0.9, seed=7, stop=("x",), session="s", tenant="t",
                        cache_salt="c", model="m", choices=2, tracestate="old", image_places=(3,))
    traced = job.traced("00-" + "1" * 32 + "-" + "2" * 16 + "-01", "k=v")
    assert traced is not job and job.traceparent == "" and job.tracestate == "old"   # the original unchanged
    assert (traced.traceparent, traced.tracestate) == ("00-" + "1" * 32 + "-" + "2" * 16 + "-01", "k=v")
    for name in GenerationJob.__slots__:
        if name not in ("traceparent", "tracestate"):
            assert getattr(traced, name) == getattr(job, name), name

"""The simulated engine's prefix cache: prefill for uncached tokens only, pinned running blocks, eviction
when the KV fills, vLLM's counters in the load report and in the scraped metrics."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest

from backends.batcher import ContinuousBatcher, Sequence
from backends.executors import GenerateInput
from backends.sim_executor import SimulatedExecutor
from common import perf_model
from common.metric_tables import parse
from common.prefix_blocks import EnginePrefixCache, block_hashes, content_digest, prompt_blocks, salt_seed
from tests.snapshots import catalog

MODEL, GPU = catalog().model("llava-1.5-7b"), catalog().gpu("A100-80GB")
SYSTEM = "".join(f"system prompt line {k:04d} " for k in range(80))   # 1,920 bytes: 30 blocks


def seq(name: str, prompt: str, max_tokens: int = 2) -> Sequence:
    tokens = len(prompt.encode()) // 4
    return Sequence(name, tokens, max_tokens, max_tokens, blocks=block_hashes(prompt, max_blocks=tokens // 16))


def run(batcher: ContinuousBatcher, s: Sequence) -> float:
    """Submit `s` alone and run it to its end; returns the duration of the step that prefilled it."""
    batcher.submit(s)
    first = batcher.step().duration_s
    while not batcher.idle:
        batcher.step()
    return first


def test_a_repeated_prefix_is_prefilled_once() -> None:
    batcher = ContinuousBatcher(MODEL, GPU, perf_model.kv_capacity_bytes(MODEL, GPU), prefix_cache=EnginePrefixCache())
    a = seq("a", SYSTEM + "first question " * 20)
    b = seq("b", SYSTEM + "second question " * 20)
    assert run(batcher, a) == pytest.approx(perf_model.prefill_seconds(MODEL, GPU, a.prompt_tokens))
    assert b.prompt_tokens - 30 * 16 > 0
    assert run(batcher, b) == pytest.approx(perf_model.prefill_seconds(MODEL, GPU, b.prompt_tokens - 30 * 16))
    assert (a.cached_tokens, b.cached_tokens) == (0, 30 * 16)
    assert batcher.prefix_counters == (a.prompt_tokens + b.prompt_tokens, 30 * 16)


def test_without_a_cache_every_token_is_a_query_and_none_a_hit() -> None:
    batcher = ContinuousBatcher(MODEL, GPU, perf_model.kv_capacity_bytes(MODEL, GPU))
    a, b = seq("a", SYSTEM), seq("b", SYSTEM)
    run(batcher, a)
    assert run(batcher, b) == pytest.approx(perf_model.prefill_seconds(MODEL, GPU, b.prompt_tokens))
    assert batcher.prefix_counters == (a.prompt_tokens + b.prompt_tokens, 0)


def test_a_running_sequences_blocks_are_pinned_and_free_blocks_are_evicted_when_kv_fills() -> None:
    block = perf_model.kv_bytes(MODEL, 16)
    cache = EnginePrefixCache()
    batcher = ContinuousBatcher(MODEL, GPU, 200 * block, prefix_cache=cache)
    holder = seq("holder", SYSTEM, max_tokens=50)      # runs for 50 steps, holding the system prompt
    batcher.submit(holder)
    batcher.step()
    sharer = seq("sharer", SYSTEM + "more " * 40)
    batcher.submit(sharer)
    batcher.step()
    assert sharer.cached_tokens == 30 * 16               # pinned by `holder`: a hit
    unrelated = "".join(f"unrelated {k:05d} " for k in range(100))   # 1,600 bytes: 25 blocks, 400 tokens
    run_alongside(batcher, seq("other", unrelated))
    again = seq("again", unrelated)
    run_alongside(batcher, again)
    # cached in the free KV once `other` ended; as in vLLM v1, at most the prompt less one token, in whole
    # blocks: the last block is computed again
    assert again.cached_tokens == 384
    # a reservation of every free block: the cached free blocks go, the pinned ones stay
    free_tokens = batcher.kv_free_bytes // perf_model.kv_bytes(MODEL, 1)
    batcher.submit(Sequence("hog", 16, free_tokens - 16, 2))
    batcher.step()
    assert batcher.kv_free_bytes == 0 and len(cache.free) == 0
    assert cache.match(again.blocks, again.prompt_tokens) == 0
    assert cache.match(holder.blocks, holder.prompt_tokens) == (holder.prompt_tokens - 1) // 16 * 16


def run_alongside(batcher: ContinuousBatcher, s: Sequence) -> None:
    """Run `s` to its end while others keep running."""
    batcher.submit(s)
    while s.kv_reserved or s in batcher.waiting or not s.done:
        batcher.step()


@asynccontextmanager
async def stepping(executor: SimulatedExecutor) -> AsyncIterator[None]:
    """The executor's step loop, running in the background for as long as the block lasts."""
    async def steps() -> None:
        while True:
            if executor.has_work:
                await executor.run_step()
            await asyncio.sleep(0)

    stepper = asyncio.create_task(steps())
    try:
        yield
    finally:
        stepper.cancel()


def test_the_executor_reports_vllm_counters_in_its_load() -> None:
    async def main() -> tuple[int, int]:
        executor = SimulatedExecutor(MODEL, GPU, perf_model.kv_capacity_bytes(MODEL, GPU), time_scale=0.0)

        async def ask(name: str, prompt: str) -> None:
            request = GenerateInput(name, len(prompt.encode()) // 4, 2, prompt=prompt)
            async for _ in executor.generate(request):
                pass

        async with stepping(executor):
            await ask("a", SYSTEM + "question")
            await ask("b", SYSTEM + "answered")
        load = executor.load()
        return load.prefix_cache_queries, load.prefix_cache_hits

    queries, hits = asyncio.run(main())
    assert (queries, hits) == (2 * (len(SYSTEM) + 8) // 4, 30 * 16)


def test_prompts_share_blocks_only_within_a_cache_salt() -> None:
    """vLLM's `cache_salt`: the same prompt under another salt is no hit, under the same one it is; the
    gateway's index names the blocks as the engine does (no salt: the unsalted chain)."""
    assert block_hashes(SYSTEM, salt=salt_seed("tenant:a")) != block_hashes(SYSTEM, salt=salt_seed("tenant:b"))
    assert block_hashes(SYSTEM, salt=salt_seed("")) == block_hashes(SYSTEM)
    assert prompt_blocks(SYSTEM, (), 480, salt=salt_seed("x")) == block_hashes(SYSTEM, max_blocks=30,
                                                                                salt=salt_seed("x"))

    async def main() -> list[int]:
        executor = SimulatedExecutor(MODEL, GPU, perf_model.kv_capacity_bytes(MODEL, GPU), time_scale=0.0)
        hits = []
        async with stepping(executor):
            for name, salt in (("a", "tenant:a"), ("b", "tenant:b"), ("c", "tenant:a"), ("d", "")):
                before = executor.load().prefix_cache_hits
                request = GenerateInput(name, len(SYSTEM) // 4 + 2, 2, prompt=SYSTEM + f"q {name}", cache_salt=salt)
                async for _ in executor.generate(request):
                    pass
                hits.append(executor.load().prefix_cache_hits - before)
        return hits

    assert asyncio.run(main()) == [0, 0, 30 * 16, 0]


def test_the_executor_caches_image_tokens_by_the_images_content() -> None:
    """The same text after another image is no hit; after the same image, all of it but the last token is."""
    cat, dog = (content_digest(b"cat"), 576, 0), (content_digest(b"dog"), 576, 0)
    question = "what is in this picture? " * 8   # 200 bytes: 50 tokens

    async def main() -> list[int]:
        executor = SimulatedExecutor(MODEL, GPU, perf_model.kv_capacity_bytes(MODEL, GPU), time_scale=0.0)
        hits = []

        async def ask(name: str, image: tuple[int, int, int]) -> None:
            request = GenerateInput(name, 576 + 50, 2, prompt=question, images=[image])
            before = executor.load().prefix_cache_hits
            async for _ in executor.generate(request):
                pass
            hits.append(executor.load().prefix_cache_hits - before)

        async with stepping(executor):
            for name, image in (("a", cat), ("b", dog), ("c", cat)):
                await ask(name, image)
        return hits

    assert asyncio.run(main()) == [0, 0, 576 + 48]   # whole 16-token blocks: 36 of the image, 3 of the text


def test_scraped_vllm_prefix_counters_are_read() -> None:
    text = """\
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 1.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 0.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.5
# TYPE vllm:prefix_cache_queries counter
vllm:prefix_cache_queries_total{engine="0",model_name="m"} 1000.0
vllm:prefix_cache_queries_total{engine="1",model_name="m"} 500.0
# TYPE vllm:prefix_cache_hits counter
vllm:prefix_cache_hits_total{engine="0",model_name="m"} 600.0
vllm:prefix_cache_hits_total{engine="1",model_name="m"} 100.0
"""
    m = parse("vllm", text)
    assert (m.prefix_cache_queries, m.prefix_cache_hits) == (1500, 700)
    assert (parse("sglang", text).prefix_cache_queries, parse("vllm", "").prefix_cache_queries) == (0, 0)

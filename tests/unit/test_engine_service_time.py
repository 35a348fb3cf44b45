"""A simulated engine slowed by `time_scale` reports T̄_service in its own seconds (the ones the gateway
measures its first tokens and decode steps in), not the model's: else the gateway's wait for KV on a
full cache (over / K · T̄_service) comes out `time_scale` times short."""

from __future__ import annotations

import asyncio

import pytest

from backends.executors import GenerateInput
from backends.sim_executor import SimulatedExecutor
from common import perf_model
from common.service_time import prior_service_s
from tests.snapshots import catalog
from tests.unit.test_engine_prefix_cache import stepping

MODEL, GPU = catalog().model("llava-1.5-7b"), catalog().gpu("A100-80GB")


def served(time_scale: float) -> tuple[float, float]:
    """T̄_service as the engine reports it before any request and after one request of 300 tokens and 4 out."""
    async def main() -> tuple[float, float]:
        executor = SimulatedExecutor(MODEL, GPU, perf_model.kv_capacity_bytes(MODEL, GPU), time_scale=time_scale)
        before = executor.load().mean_service_s
        async with stepping(executor):
            async for _ in executor.generate(GenerateInput("r-0", 300, 4, prompt="x" * 1200)):
                pass
        after = executor.load().mean_service_s
        assert before is not None and after is not None
        return before, after

    return asyncio.run(main())


def test_the_reported_service_time_is_in_the_engines_seconds() -> None:
    prior = prior_service_s(MODEL, GPU)
    slow_before, slow_after = served(0.004)
    fast_before, fast_after = served(0.002)
    assert slow_before == pytest.approx(0.004 * prior) and fast_before == pytest.approx(0.002 * prior)
    # The same request, the same model seconds: the completion moves each by its own scale.
    assert slow_after != slow_before
    assert slow_after == pytest.approx(2 * fast_after)

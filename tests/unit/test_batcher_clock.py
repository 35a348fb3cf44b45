"""The batcher's busy clock: service times in performance-model seconds, whatever the engine's clock."""

from __future__ import annotations

import pytest

from backends.batcher import ContinuousBatcher, Sequence
from common import perf_model
from common.service_time import updated_mean_service
from tests.snapshots import catalog


def test_service_time_is_the_model_time_from_admission_to_the_last_token() -> None:
    model, gpu = catalog().model("llava-1.5-7b"), catalog().gpu("A100-80GB")
    batcher = ContinuousBatcher(model, gpu, perf_model.kv_capacity_bytes(model, gpu))
    first = Sequence("a", prompt_tokens=100, max_tokens=3, target_tokens=3)
    batcher.submit(first)
    durations = [batcher.step().duration_s]                     # admits and prefills `a`
    late = Sequence("b", prompt_tokens=50, max_tokens=2, target_tokens=2)
    batcher.submit(late)                                      # admitted one step later
    finished: dict[str, float] = {}
    while not batcher.idle:
        step = batcher.step()
        durations.append(step.duration_s)
        finished |= {s.id: batcher.service_s(s) for s in step.finished}
    assert batcher.busy_s == pytest.approx(sum(durations), rel=1e-12)
    assert finished["a"] == pytest.approx(sum(durations[:3]), rel=1e-12)    # its three steps
    assert finished["b"] == pytest.approx(sum(durations[1:3]), rel=1e-12)   # admitted at step 2, done at step 3
    alone = perf_model.prefill_seconds(model, gpu, 100) + 2 * perf_model.decode_step_seconds(model, gpu, 1, 101)
    assert finished["a"] > alone   # sharing steps with `b` made it slower than alone


def test_mean_service_time_starts_at_the_prior_and_moves_by_a_fifth_of_a_clipped_sample() -> None:
    prior = 10.0
    assert updated_mean_service(prior, 20.0) == pytest.approx(12.0)
    assert updated_mean_service(prior, 0.01) == pytest.approx(10.0 + 0.2 * (2.5 - 10.0))   # clipped to prior / 4
    assert updated_mean_service(prior, 1000.0) == pytest.approx(10.0 + 0.2 * (40.0 - 10.0))   # clipped to prior · 4

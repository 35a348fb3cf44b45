"""The serial engine times requests exactly by the paper's formulas: prefill 2·P·L/F, decode 2·P/B per token."""

from __future__ import annotations

import numpy as np
import pytest

from common.catalog import load_catalog
from loadtest.sim import capacity
from loadtest.sim.engines import EngineSpec, Recorder, SerialEngine
from loadtest.sim.workloads import Lengths


def _lengths(prompts: list[int], outputs: list[int]) -> Lengths:
    n = len(prompts)
    zeros = np.zeros(n, dtype=np.int64)
    return Lengths(np.array(prompts), zeros, zeros, np.array(outputs), np.full(n, 512))


@pytest.mark.parametrize("gpu", ["H100", "A100-80GB", "L40S"])
def test_one_request(gpu: str) -> None:
    catalog = load_catalog()
    model, profile = catalog.model("llama-2-70b"), catalog.gpu(gpu)
    rec = Recorder.for_lengths(_lengths([1000], [300]))
    engine = SerialEngine(EngineSpec("g", model, profile, capacity.kv_capacity(model, profile), 1.0), rec)
    finish = engine.submit(0, 10.0)
    prefill = 2 * model.params * 1000 / profile.flops
    decode = 300 * 2 * model.params / profile.bandwidth_bytes_s
    assert rec.first_token[0] == pytest.approx(10.0 + prefill, rel=1e-12)
    assert finish == pytest.approx(10.0 + prefill + decode, rel=1e-12)
    done, nxt = engine.on_event(finish)
    assert done == [0] and nxt is None and rec.finish[0] == finish


def test_requests_run_one_at_a_time_in_fifo_order() -> None:
    catalog = load_catalog()
    model, gpu = catalog.model("llama-2-70b"), catalog.gpu("L40S")
    rec = Recorder.for_lengths(_lengths([500, 200], [100, 64]))
    engine = SerialEngine(EngineSpec("g", model, gpu, capacity.kv_capacity(model, gpu), 1.0), rec)
    first_end = engine.submit(0, 0.0)
    assert engine.submit(1, 0.5) is None                          # busy: queued
    assert engine.snapshot().queue_depth == 2
    assert engine.snapshot().kv_free_bytes < engine.snapshot().kv_total_bytes
    assert first_end is not None
    _, second_end = engine.on_event(first_end)
    assert rec.admitted[1] == first_end                           # starts exactly when the first finishes
    assert second_end == pytest.approx(first_end + capacity.serial_service_s(model, gpu, 200, 64), rel=1e-12)


def test_service_time_starts_at_the_prior_and_the_first_completion_moves_it_by_a_fifth() -> None:
    """As the engines measure T̄_service (common.service_time.updated_mean_service)."""
    catalog = load_catalog()
    model, gpu = catalog.model("llama-2-70b"), catalog.gpu("H100")
    rec = Recorder.for_lengths(_lengths([100], [64]))
    engine = SerialEngine(EngineSpec("g", model, gpu, capacity.kv_capacity(model, gpu), 100.0), rec)
    assert engine.snapshot().mean_service_s == 100.0
    end = engine.submit(0, 0.0)
    assert end is not None
    engine.on_event(end)
    # admitted at 0: its service time is `end`; no single sample replaces the prior
    assert engine.snapshot().mean_service_s == pytest.approx(100.0 + 0.2 * (max(end, 25.0) - 100.0))

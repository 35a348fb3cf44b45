"""Same seed, same numbers; another seed, other numbers; traces are shared across policies and loads."""

from __future__ import annotations

import numpy as np
import pytest

from loadtest.sim.experiments import THREE_TIER
from loadtest.sim.modality import VlmRunSpec, run_vlm
from loadtest.sim.simulator import RunSpec, run
from loadtest.sim.workloads import make_trace

TIMING = {"wall_s", "cpu_s"}


def _metrics(out: dict) -> dict:
    return {k: v for k, v in out.items() if k not in TIMING}


@pytest.mark.parametrize("mode", ["serial", "continuous"])
@pytest.mark.parametrize("policy", ["power_of_two", "batch_aware"])
def test_same_seed_same_result(mode: str, policy: str) -> None:
    spec = RunSpec(THREE_TIER, policy, mode=mode, n_requests=300, seed=7)
    assert _metrics(run(spec)) == _metrics(run(spec))
    other = RunSpec(THREE_TIER, policy, mode=mode, n_requests=300, seed=8)
    assert _metrics(run(other))["throughput_tok_s"] != _metrics(run(spec))["throughput_tok_s"]


def test_modality_run_is_deterministic() -> None:
    spec = VlmRunSpec("2×4090 vision + 2×A100 + stealing", rate=100.0, n_requests=300, seed=1)
    assert _metrics(run_vlm(spec)) == _metrics(run_vlm(spec))


def test_lengths_do_not_depend_on_rate_or_arrival_process() -> None:
    """Common random numbers: every load level and arrival process replays the same requests."""
    a = make_trace("sharegpt", "poisson", 1.0, 500, seed=4)
    b = make_trace("sharegpt", "bursty", 9.0, 500, seed=4)
    assert np.array_equal(a.lengths.input_tokens, b.lengths.input_tokens)
    assert np.array_equal(a.lengths.output_tokens, b.lengths.output_tokens)
    assert not np.array_equal(a.arrival_s, b.arrival_s)

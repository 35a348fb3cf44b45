"""The arrival rate the planner judges plans at."""

from __future__ import annotations

import numpy as np
import pytest

from common.catalog import load_catalog
from loadtest.planner.space import trace_rate
from loadtest.planner.workload import Description, described_trace
from loadtest.sim.workloads import Trace

MODEL = load_catalog().model("llava-1.5-7b")


def test_the_rate_of_a_trace_is_finite_or_refused() -> None:
    trace = described_trace(Description(20.0), MODEL, 200, seed=0)
    assert trace_rate(trace) == pytest.approx(20.0)
    one = described_trace(Description(20.0), MODEL, 1, seed=0)
    at_once = Trace(np.zeros(3), described_trace(Description(20.0), MODEL, 3, seed=0).lengths)
    for trace in (one, at_once):
        with pytest.raises(ValueError, match="no arrival rate"):
            trace_rate(trace)

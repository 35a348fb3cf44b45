"""The live gateway and the simulator replay one small trace: both conserve requests and tokens, and
their throughputs agree within a bound that survives a shared, noisy machine.

A tiny version of `python -m loadtest.consistency` (docs/CONSISTENCY.md): 40 requests at 0.7× load,
engines at time_scale 2, so the whole test (start-up, warm-up, replay, shutdown) stays near 30 s.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from common.catalog import load_catalog
from gateway.requests.tokens import BYTES_PER_TOKEN, count_text_tokens
from loadtest.consistency import (
    CLUSTER,
    arrival_rate,
    conservation_errors,
    measure,
    parse_args,
    replay_trace,
    run_live,
    run_sim,
)
from loadtest.live_replay import prompt_text

N_REQUESTS, LOAD, TIME_SCALE, SEED = 40, 0.7, 2.0, 1
# 40 requests make a 0.7 s arrival window and a ~4 s drain, so the makespan is the finish of one long
# request; a few milliseconds of timing difference can route it to another GPU tier, which moved
# throughput by -33% in one of six seeds (docs/CONSISTENCY.md). A bound past one such flip still
# catches a clock converted wrongly (×2 here) or a gateway that serialises requests.
THROUGHPUT_BOUND = 0.50

pytestmark = pytest.mark.timeout(90)


def test_live_and_simulator_conserve_requests_and_agree_on_throughput(tmp_path: Path) -> None:
    catalog = load_catalog()
    trace = replay_trace(arrival_rate(LOAD, catalog), N_REQUESTS, SEED)
    sim = run_sim(trace, catalog)
    live, diagnostics = run_live(trace, TIME_SCALE, SEED, tmp_path)

    assert conservation_errors(trace, live, sim) == []
    assert live.completed.sum() == sim.completed.sum() == N_REQUESTS
    assert int(live.tokens.sum()) == int(sim.tokens.sum()) == int(trace.lengths.output_tokens.sum())
    assert set(np.unique(live.backend)) <= {b for b, _ in CLUSTER}

    gpu_of = dict(CLUSTER)
    live_tps, sim_tps = measure(live, gpu_of)["throughput_tok_s"], measure(sim, gpu_of)["throughput_tok_s"]
    diff = (live_tps - sim_tps) / sim_tps
    assert abs(diff) <= THROUGHPUT_BOUND, (
        f"live {live_tps:.0f} tok/s vs sim {sim_tps:.0f} tok/s ({diff:+.1%}); live diagnostics {diagnostics}"
    )


def test_replayed_prompts_are_their_trace_lengths_and_share_no_prefix_block() -> None:
    """The trace shares nothing, and the engines cache prefixes: each replayed prompt is its own from its
    first block on, and the gateway counts it as exactly the trace's prompt tokens."""
    tags = [f"c1-{i}-{k}" for i, k in enumerate((3, 17, 0, 250, 9, 41))]
    prompts = [prompt_text(512, tag) for tag in tags]
    assert [count_text_tokens(p) for p in prompts] == [512] * len(tags)
    assert len({p[:16 * BYTES_PER_TOKEN] for p in prompts}) == len(tags)   # the first 16-token block differs
    assert count_text_tokens(prompt_text(3, "a-long-request-id")) == 3


@pytest.mark.parametrize(("args", "message"), [
    # each ended in a numpy or ZeroDivisionError traceback and exit 1, the code of a failed check
    (["--loads", "-1"], "argument --loads: must be positive, not -1"),
    (["--loads", "0"], "argument --loads: must be positive, not 0"),
    (["--requests", "0"], "argument --requests: must be at least 2, not 0"),
    (["--time-scale", "0"], "argument --time-scale: must be positive, not 0"),
])
def test_the_check_refuses_arguments_it_cannot_run_in_one_line(
        capsys: pytest.CaptureFixture[str], args: list[str], message: str) -> None:
    with pytest.raises(SystemExit) as exit_:
        parse_args(args)
    assert exit_.value.code == 2
    assert capsys.readouterr().err.strip().endswith(f"error: {message}")

"""The autoscaler's live check (loadtest/planner/scaling_live_check.py) compares like with like: the live
gateway's backends.yaml is one the gateway loads, with every duration of the scaler and of the SLO in the
engines' slowed time, and its trace is one the simulated engines can replay request for request."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from backends.sim_executor import NATURAL_MAX_TOKENS, NATURAL_MIN_TOKENS
from common.catalog import load_catalog
from gateway.config.autoscaling import LanguageScaling
from gateway.config.cluster import LaunchSpec, load_cluster
from loadtest.live_replay import request_id_for
from loadtest.planner.bursty import BurstyShape
from loadtest.planner.scaling_live_check import (
    FIXED_IDS,
    SCALED_KEYS,
    LiveRun,
    Seen,
    backends_yaml,
    parse_args,
    scaling_config,
    short_trace,
)
from testkit.harness import write_config


def test_the_live_fleet_loads_with_every_duration_in_the_engines_time(tmp_path: Path) -> None:
    args = parse_args(["--time-scale", "4", "--spare", "2"])
    cluster = load_cluster(write_config(tmp_path, backends_yaml(args)))
    live, model = cluster.raw.gateway.autoscaling, scaling_config(args, 1.0)
    assert live.mode == model.mode == "manage"
    for key in SCALED_KEYS:
        assert getattr(live, key) == pytest.approx(4 * getattr(model, key)), key
    pools, model_pools = live.scaled(), model.scaled()
    language, model_language = pools["language"], model_pools["language"]
    assert isinstance(language, LanguageScaling) and isinstance(model_language, LanguageScaling)
    assert language.ttft_slo_s == pytest.approx(4 * model_language.ttft_slo_s)
    assert [(p, pools[p].min, pools[p].max, len(pools[p].gpus)) for p in ("vision", "language")] == [
        ("vision", 1, 3, 2), ("language", 1, 3, 2)]
    assert cluster.raw.gateway.routing.itl_target_ms == pytest.approx(4 * 100)
    assert not cluster.raw.gateway.overload.enabled      # the simulated fleets run without the overload queue
    launches = {b.id: b.launch for b in cluster.raw.backends}
    assert all(isinstance(launch, LaunchSpec) and launch.time_scale == 4.0 for launch in launches.values())
    assert set(launches) == set(FIXED_IDS.values())


def test_every_request_of_the_trace_can_be_replayed_exactly() -> None:
    model = load_catalog().model("llava-1.5-7b")
    shape = replace(BurstyShape(), duration_s=60, text_rps=3, image_rps=1, burst_every_s=30, burst_s=(10, 20))
    trace = short_trace(shape, model, seed=3)
    out = trace.lengths.output_tokens
    assert trace.n > 100 and out.max() <= NATURAL_MAX_TOKENS and out.min() >= NATURAL_MIN_TOKENS
    assert (trace.lengths.max_output_tokens >= out).all()
    for i in range(0, trace.n, 25):   # the engine stops after exactly the trace's answer
        request_id_for(int(out[i]), f"s-{i}")


def test_the_live_bill_runs_from_launch_to_removal_or_the_last_completion() -> None:
    seen = {"l4-vision-0": Seen("vision", 0.0, 0.0), "a100-80gb-0": Seen("language", 0.0, 0.0),
            "language-auto-0": Seen("language", 10.0, 12.5, 40.0),     # added, drained and removed
            "language-auto-1": Seen("language", 50.0, 51.0)}           # still there at the end
    run = LiveRun(outcome=None, errors=[], wrong_token_counts=0, seen=seen,  # type: ignore[arg-type]
                  steps={}, end_s=100.0, warnings=[], timeline=[])
    assert run.gpu_seconds() == {"vision": 100.0, "language": 100.0 + 30.0 + 50.0}
    assert sorted(run.startups_s()) == [1.0, 2.5]

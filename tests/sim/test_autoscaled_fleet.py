"""Pools run by the gateway's scaler in the simulator (loadtest/planner/autoscaled.py): an image burst grows
the vision pool (several engines a step), quiet shrinks it back (as many as it spares), the drain before a stop loses
nothing; static pools never change; the bursty benchmark's command runs end to end on a tiny trace."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from gateway.config.autoscaling import AutoscalingConfig, Pool
from loadtest.planner.autoscaled import Fleet, FleetResult, run_fleet
from loadtest.planner.space import Slo
from loadtest.sim.workloads import Lengths, Trace
from testkit.harness import ROOT
from tests.snapshots import catalog

MODEL = "qwen2.5-vl-7b"
GPUS: dict[Pool, str] = {"vision": "L4", "language": "A100-80GB"}
SLO = Slo(2.0, 0.1)


def burst_trace() -> Trace:
    """60 s of light text, 60 s of image requests (four full-HD images each: about 0.5 s of L4 encode per
    request, at 8 requests/s), then 240 s of light text."""
    rng = np.random.default_rng(7)
    phases = [(0, 60, 2.0, False), (60, 120, 8.0, True), (120, 360, 1.0, False)]
    times, image = [], []
    for start, end, rate, images in phases:
        t = np.sort(rng.uniform(start, end, int((end - start) * rate)))
        times.append(t)
        image.append(np.full(len(t), images))
    arrival, has_image = np.concatenate(times), np.concatenate(image)
    n = len(arrival)
    per_image = catalog().model(MODEL).image_tokens(1920, 1080)
    images = np.where(has_image, 4, 0)
    text = np.where(has_image, 20, rng.integers(100, 800, n))
    out = rng.integers(20, 60, n)
    return Trace(arrival, Lengths(text, images * per_image, images, out, np.full(n, 64)))


def scaling() -> AutoscalingConfig:
    return AutoscalingConfig.model_validate({
        "mode": "manage", "interval_s": 1, "up_delay_s": 2, "down_delay_s": 20,
        "pools": {"vision": {"min": 1, "max": 6, "gpus": ["L4"] * 5},
                  "language": {"min": 1, "max": 3, "gpus": ["A100-80GB"] * 2}}})


def run(fleet: Fleet, trace: Trace) -> FleetResult:
    return run_fleet(fleet, trace, catalog().model(MODEL), catalog(), SLO)


def test_a_burst_grows_the_vision_pool_and_quiet_drains_it_back_losing_nothing() -> None:
    trace = burst_trace()
    result = run(Fleet("autoscaled", GPUS, {"vision": 1, "language": 1}, scaling(), startup_s=5.0), trace)
    vision = np.array([row[1] for row in result.timeline])
    times = np.array([row[0] for row in result.timeline])
    assert vision[times < 60].max() == 1                  # light text: one encoder is enough
    assert vision[(times >= 60) & (times < 130)].max() >= 3   # the burst grows the pool
    assert result.steps["vision+"] >= 2 and result.steps["vision-"] >= 2
    # several engines a step both ways (the default max_step, 4): up for the burst, down for what quiet spares
    assert np.diff(vision).max() == 4 and -4 <= np.diff(vision).min() < -1
    assert vision[-1] == 1                                # back to min once the burst is over
    # the drain before each stop: every request completed, none sent to an engine that was draining
    assert result.lost == 0 and result.outcome.completed == trace.n and result.routed_while_draining == 0
    # a scaled engine is paid from its launch to its stop: less than the pool's peak for the whole run
    assert result.gpu_seconds["vision"] < result.peak_engines["vision"] * result.end_s
    assert result.gpu_seconds["vision"] > result.end_s    # but more than the one fixed engine alone


def test_static_pools_never_change_and_pay_for_every_engine_the_whole_run() -> None:
    trace = burst_trace()
    result = run(Fleet("static", GPUS, {"vision": 2, "language": 1}), trace)
    assert result.timeline == [] and sum(result.steps.values()) == 0
    assert result.lost == 0 and result.outcome.completed == trace.n
    assert result.gpu_seconds == {"vision": pytest.approx(2 * result.end_s), "language": pytest.approx(result.end_s)}
    prices = {p: catalog().gpu(g).price_per_hour for p, g in GPUS.items()}
    assert result.dollars == pytest.approx(sum(result.gpu_seconds[p] * prices[p] / 3600 for p in GPUS))
    with pytest.raises(ValueError, match="outside"):
        Fleet("autoscaled", GPUS, {"vision": 7, "language": 1}, scaling())


def test_the_benchmark_command_runs_end_to_end_on_a_tiny_trace(tmp_path: Path) -> None:
    out = tmp_path / "bursty.json"
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks", "bursty-autoscaling", "--seeds", "0", "--duration", "240",
         "--text-rps", "3", "--image-rps", "1", "--startup", "5", "--down-delay", "30", "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    for fleet in ("static-peak", "static-mean", "autoscaled"):
        assert fleet in done.stdout
    assert "targets:" in done.stdout
    run0 = json.loads(out.read_text())["runs"][0]
    assert set(run0["fleets"]) == {"static-peak", "static-mean", "autoscaled"}
    assert run0["fleets"]["autoscaled"]["lost"] == 0
    assert {"within_2_points_of_peak", "saves_30pct_gpu_seconds", "10_points_above_mean"} <= set(run0["verdict"])
    refused = subprocess.run([sys.executable, "-m", "benchmarks", "bursty-autoscaling", "--model", "llama-2-7b",
                              "--duration", "60", "--out", str(tmp_path / "no.json")],
                             cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2 and "takes no images" in refused.stderr

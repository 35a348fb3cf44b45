"""The per-backend calibration (common.calibration): bounded, and converging on synthetic engines."""

from __future__ import annotations

import random

import pytest

from common.calibration import (
    DECODE_FLOOR_BOUNDS,
    STALL_FACTOR_BOUNDS,
    STALL_PER_PROMPT_BOUNDS,
    TTFT_BOUNDS,
    TTFT_PRIOR,
    RidgeFit,
    ttft_fit,
)
from common.itl_slack import InterTokenSlack
from common.speed_estimator import BackendSpeed


def test_a_fit_converges_on_a_linear_engine_with_noise() -> None:
    rng = random.Random(1)
    fit = RidgeFit((1.0, 1.0), ((0.0, 4.0), (0.0, 4.0)))
    for _ in range(400):
        x = (rng.uniform(0.0, 2.0), rng.uniform(0.0, 1.0))
        fit.add(x, (1.7 * x[0] + 0.5 * x[1]) * rng.uniform(0.98, 1.02))
    # the prior keeps a little of the weight (2 samples against the ~100 the forgetting keeps)
    assert fit.coefficients[0] == pytest.approx(1.7, rel=0.05)
    assert fit.coefficients[1] == pytest.approx(0.5, abs=0.1)
    assert fit.observed_mean == pytest.approx(fit.predicted_mean, rel=0.1)


def test_a_feature_that_never_varies_keeps_its_prior() -> None:
    fit = ttft_fit()
    for k in range(100):
        fit.add((0.2 + 0.01 * (k % 7), 0.03, 0.0, 0.0), 2.0 * (0.2 + 0.01 * (k % 7)) + 0.03)
    assert fit.coefficients[2:] == TTFT_PRIOR[2:]    # in-flight and KV wait never seen: as the prior says
    assert fit.coefficients[0] > 1.4


def test_coefficients_stay_in_their_bounds_whatever_is_observed() -> None:
    rng = random.Random(2)
    fit = ttft_fit()
    for _ in range(300):
        x = tuple(rng.uniform(0.0, 1.0) for _ in range(4))
        fit.add(x, rng.choice([0.0, 1e-6, 1e3, 1e9]))
        assert all(lo <= c <= hi for c, (lo, hi) in zip(fit.coefficients, TTFT_BOUNDS, strict=True))
        assert 0.0 <= fit.predict(x) <= 4.0 * sum(x)


def test_one_outlier_moves_a_settled_fit_little() -> None:
    fit = RidgeFit((1.0,), ((0.0, 10.0),))
    for _ in range(60):
        fit.add((1.0,), 1.0)
    fit.add((1.0,), 1000.0)   # a stall: counted as 4x the prediction, one sample among ~50
    assert fit.coefficients[0] < 1.1


Observed = list[tuple[int, float, int, float]]


def _stalled_engine(rng: random.Random, s0: float, kappa: float, c: float, n: int) -> Observed:
    """n requests decoding beside others' prompts: (tokens, ΔC, ΔN, decode time), decode time = s0·(M − 1) +
    κ·ΔC + c·ΔN with 2% noise; the stalls observed through an `InterTokenSlack`, as the state table does."""
    slack = InterTokenSlack(0.1)
    out = []
    for _ in range(n):
        mark = slack.mark()
        for _ in range(rng.randint(0, 6)):   # prompts dispatched while this one decodes
            slack.add(rng.randint(16, 3400), 20, 1e-4, s0)
        stall, prompts = slack.stalls_since(mark)
        tokens = rng.randint(4, 200)
        decode = (s0 * (tokens - 1) + kappa * stall + c * prompts) * rng.uniform(0.98, 1.02)
        out.append((tokens, stall, prompts, decode))
    return out


@pytest.mark.parametrize(("s0", "kappa", "c"), [(0.015, 1.0, 0.0), (0.012, 1.4, 0.012), (0.035, 0.8, 0.030)])
def test_the_decode_model_learns_an_engines_step_and_stalls(s0: float, kappa: float, c: float) -> None:
    """Priors far off (a datasheet step 5-10x too fast, κ = 1, c = 0): after a few hundred requests the
    model predicts decode times within a few percent, and its unstalled step within 15%."""
    speed = BackendSpeed(1e-4, 0.003, 1.0)
    for tokens, stall, prompts, decode in _stalled_engine(random.Random(3), s0, kappa, c, 400):
        speed.completed(500, tokens, decode, (stall, prompts))
    assert speed.decode_model.coefficients[0] == pytest.approx(s0, rel=0.15)
    assert speed.decode_floor_s <= speed.decode.value   # ŝ includes the stalls, s0 does not
    errors = [abs(speed.decode_model.predict((tokens - 1, stall, prompts)) - decode) / decode
              for tokens, stall, prompts, decode in _stalled_engine(random.Random(5), s0, kappa, c, 200)]
    assert sum(errors) / len(errors) < 0.05


def test_the_decode_model_stays_in_its_bounds() -> None:
    speed = BackendSpeed(1e-4, 0.003, 1.0)
    rng = random.Random(4)
    for _ in range(200):
        stalls = (rng.uniform(0.0, 2.0), rng.randint(0, 8))
        speed.completed(100, rng.randint(2, 50), rng.choice([0.0, 1e-4, 500.0]), stalls)
        s0, kappa, c = speed.decode_model.coefficients
        assert DECODE_FLOOR_BOUNDS[0] <= s0 <= DECODE_FLOOR_BOUNDS[1]
        assert STALL_FACTOR_BOUNDS[0] <= kappa <= STALL_FACTOR_BOUNDS[1]
        assert STALL_PER_PROMPT_BOUNDS[0] <= c <= STALL_PER_PROMPT_BOUNDS[1]


def test_the_stall_clock_counts_calibrated_stalls_and_its_uncalibrated_twin() -> None:
    s = InterTokenSlack(0.1)
    deadline = s.add(100, 11, 1e-3, 0.02, stall_factor=1.5, stall_per_prompt_s=0.01)
    assert deadline == pytest.approx(1.5 * 0.1 + 0.01 + 10 * (0.1 - 0.02))
    mark = s.mark()
    s.add(200, 1, 1e-3, 0.02, stall_factor=1.5, stall_per_prompt_s=0.01)
    assert s.stalls_since(mark) == (pytest.approx(0.2), 1)   # what was predicted, uncalibrated
    assert s.slacks() == pytest.approx((10 * 0.08 - 1.5 * 0.2 - 0.01,))

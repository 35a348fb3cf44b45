"""The learned per-backend speed: warm-up, outliers, convergence (common.speed_estimator)."""

from __future__ import annotations

import random
import statistics
from collections import deque

import pytest

from common.speed_estimator import BackendSpeed, RobustEstimate, SpeedParams, prior_speed
from tests.snapshots import catalog

PARAMS = SpeedParams()


def test_a_first_sample_does_not_replace_the_prior() -> None:
    est = RobustEstimate(1.0, PARAMS)
    est.add(0.01)   # a 2-token warm-up request: 100x faster than the prior
    assert est.value == pytest.approx(0.8 * 1.0 + 0.2 * 0.25)   # clipped to prior / 4, weighted 1 / (4 + 1)
    assert 0.8 < est.value < 1.0


def test_the_prior_weighs_k0_samples_and_fades() -> None:
    est = RobustEstimate(1.0, PARAMS)
    for _ in range(4):
        est.add(2.0)
    assert est.prior_share == pytest.approx(0.5)
    assert est.value == pytest.approx(1.5)
    for _ in range(32):
        est.add(2.0)
    assert est.prior_share == pytest.approx(0.1)
    assert est.value == pytest.approx(0.1 * 1.0 + 0.9 * 2.0)


@pytest.mark.parametrize("window", [1, 2, 5, 32])
def test_the_estimate_is_the_formula_over_the_last_window_of_clipped_samples(window: int) -> None:
    """The window kept sorted gives the very estimates of the formula with `statistics.median` over
    the last `window` clipped samples: repeated values, old values leaving, odd and even counts."""
    params = SpeedParams(window=window)
    est, rng = RobustEstimate(1.0, params), random.Random(window)
    recent: deque[float] = deque(maxlen=window)
    value = 1.0
    for n in range(1, 400):
        sample = rng.choice([0.5, 1.0, 2.0, rng.uniform(0.0, 8.0), rng.uniform(0.9, 1.1)])
        est.add(sample)
        recent.append(min(value * params.clip, max(value / params.clip, sample)))
        w = params.prior_weight / (params.prior_weight + n)
        value = w * 1.0 + (1.0 - w) * statistics.median(recent)
        assert est.value == value, n


def test_outliers_do_not_move_the_median() -> None:
    rng = random.Random(1)
    est = RobustEstimate(0.05, PARAMS)
    for _ in range(64):
        est.add(0.05 * rng.uniform(0.95, 1.05))
    before = est.value
    for _ in range(5):   # stalls, a KV-full wait: 100x the true value
        est.add(5.0)
    assert est.value == pytest.approx(before, rel=0.05)


def test_converges_to_a_speed_far_from_the_datasheet_prior() -> None:
    """The engine prefills 3.5x slower than the peak the prior assumes; estimates follow within 10%."""
    model, gpu = catalog().model("llava-1.5-7b"), catalog().gpu("L40S")
    speed = prior_speed(model, gpu)
    true_p, true_step = 3.5 * speed.prefill.prior, 6.0 * speed.decode.prior
    rng = random.Random(7)
    for _ in range(200):
        ahead = rng.randint(100, 4000)
        speed.first_token(true_step + ahead * true_p * rng.uniform(0.9, 1.1), ahead)
        tokens = rng.randint(2, 200)
        speed.completed(ahead, tokens, (tokens - 1) * true_step * rng.uniform(0.9, 1.1))
    assert speed.prefill.value == pytest.approx(true_p, rel=0.1)
    assert speed.decode.value == pytest.approx(true_step, rel=0.1)


def test_short_prompts_do_not_teach_the_prefill_rate() -> None:
    speed = BackendSpeed(1e-4, 0.02, 1.0)
    speed.first_token(0.5, 10)   # mostly step overhead and network: no sample
    assert speed.prefill.samples == 0
    speed.first_token(0.12, 1000)
    assert speed.prefill.samples == 1


def test_a_first_token_that_waited_for_kv_does_not_teach_the_prefill_rate() -> None:
    """A full cache holds the request until others finish: its TTFT is the cache's turnover, not prefill."""
    speed = BackendSpeed(1e-4, 0.02, 1.0)
    no_wait = (0.1, 0.02, 0.2, 0.0)      # the first-token features at dispatch: W_kv (last) = 0
    waited = (0.1, 0.02, 0.2, 1.5)       # the dispatch predicted 1.5 s of waiting for KV
    for _ in range(20):
        speed.first_token(2.0, 1000, waited)
    assert speed.prefill.samples == 0
    assert speed.prefill.value == pytest.approx(1e-4)
    assert speed.ttft_model.samples == 20   # the first-token model still learns the wait (its a4)
    speed.first_token(0.12, 1000, no_wait)
    assert speed.prefill.samples == 1


def test_service_time_is_prefill_and_decode_not_queueing() -> None:
    speed = BackendSpeed(1e-3, 0.02, 1.0)
    # 30 s in the queue before this request's first token: none of it is service
    speed.first_token(30.0 + 0.5, 500)
    speed.completed(500, 11, 0.2)
    sample = 500 * speed.prefill.value + 0.2
    assert speed.service_s == pytest.approx(1.0 + 0.2 * (sample - 1.0))
    assert speed.service_s < 2.0

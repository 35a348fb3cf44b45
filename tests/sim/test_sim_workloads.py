"""Workload shapes and arrival processes match their stated definitions."""

from __future__ import annotations

import numpy as np
import pytest

from loadtest.sim.workloads import (
    COCO_IMAGE_TOKENS,
    MAX_IMAGES,
    image_counts,
    lengths,
    on_off_arrivals,
    poisson_arrivals,
)

N = 20_000


def test_paper_text_workloads() -> None:
    uniform = lengths("uniform", N, 0).input_tokens
    assert uniform.min() >= 128 and uniform.max() <= 4096
    assert (lengths("short_heavy", N, 0).input_tokens < 512).mean() == pytest.approx(0.8, abs=0.02)
    assert (lengths("long_heavy", N, 0).input_tokens >= 2048).mean() == pytest.approx(0.8, abs=0.02)
    bimodal = lengths("bimodal", N, 0).input_tokens
    assert ((bimodal <= 512) | (bimodal >= 2048)).all()
    share = lengths("sharegpt", N, 0)
    assert share.input_tokens.max() + 512 <= 4096 and np.median(share.input_tokens) == pytest.approx(350, rel=0.1)
    for w in ("uniform", "sharegpt"):
        out = lengths(w, N, 0).output_tokens
        assert out.min() >= 64 and out.max() <= 512 and out.mean() == pytest.approx(288, rel=0.02)


def test_multimodal_workloads() -> None:
    coco = lengths("coco", N, 0)
    assert (coco.image_tokens == COCO_IMAGE_TOKENS).all() and (coco.output_tokens <= 128).all()
    mixed = lengths("mm_mixed", N, 0)
    has_image = mixed.images > 0
    assert has_image.mean() == pytest.approx(0.5, abs=0.02)
    assert (mixed.output_tokens[has_image] <= 128).all()
    assert (mixed.image_tokens == mixed.images * COCO_IMAGE_TOKENS).all()


def test_image_counts_follow_a_truncated_pareto_tail() -> None:
    k = image_counts(np.random.default_rng(0), 200_000)
    assert k.min() == 1 and k.max() == MAX_IMAGES
    for m in (2, 3, 4):                                   # P(K ≥ m) = m^-1.5 below the cap
        assert (k >= m).mean() == pytest.approx(m ** -1.5, rel=0.03)


@pytest.mark.parametrize("arrivals", [poisson_arrivals, on_off_arrivals])
def test_arrival_rate_matches_its_mean(arrivals: object) -> None:
    t = arrivals(np.random.default_rng(1), 5.0, 50_000)  # type: ignore[operator]
    assert (np.diff(t) >= 0).all()
    assert len(t) / t[-1] == pytest.approx(5.0, rel=0.05)


def test_on_off_arrivals_are_burstier_than_poisson() -> None:
    def dispersion(t: np.ndarray) -> float:
        counts = np.bincount((t / 10.0).astype(int))   # arrivals per 10 s window
        return float(counts.var() / counts.mean())

    rng = np.random.default_rng(2)
    assert dispersion(on_off_arrivals(rng, 5.0, 50_000)) > 3 * dispersion(poisson_arrivals(rng, 5.0, 50_000))

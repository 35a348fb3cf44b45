"""The bursty multimodal trace (loadtest/planner/bursty.py): seeded, heavy-tailed, with image bursts and a
text-only share that moves over time, every request within the model's context."""

from __future__ import annotations

import numpy as np
import pytest

from loadtest.planner.bursty import BurstyShape, BurstyTrace, bursty_trace
from tests.snapshots import catalog

SHAPE = BurstyShape()      # the benchmark's: 30 minutes of arrivals


@pytest.fixture(scope="module")
def trace() -> BurstyTrace:
    return bursty_trace(SHAPE, catalog().model("qwen2.5-vl-7b"), seed=3)


def test_one_seed_gives_one_trace_and_another_seed_another(trace: BurstyTrace) -> None:
    again = bursty_trace(SHAPE, catalog().model("qwen2.5-vl-7b"), seed=3)
    assert np.array_equal(trace.trace.arrival_s, again.trace.arrival_s) and trace.bursts == again.bursts
    assert np.array_equal(trace.trace.lengths.input_tokens, again.trace.lengths.input_tokens)
    other = bursty_trace(SHAPE, catalog().model("qwen2.5-vl-7b"), seed=4)
    assert other.trace.n != trace.trace.n or not np.array_equal(other.trace.arrival_s, trace.trace.arrival_s)
    assert np.all(np.diff(trace.trace.arrival_s) >= 0) and trace.trace.arrival_s[-1] < SHAPE.duration_s


def test_arrivals_are_heavy_tailed(trace: BurstyTrace) -> None:
    """Counts per second far more dispersed than a Poisson stream's (variance = mean), with a fat right tail;
    images per image request Pareto-tailed."""
    per_second = np.histogram(trace.trace.arrival_s, np.arange(0, SHAPE.duration_s + 1))[0]
    assert per_second.var() / per_second.mean() > 3
    z = (per_second - per_second.mean()) / per_second.std()
    assert float(np.mean(z**3)) > 0.5           # skewed to the right: the busy seconds are the outliers
    assert per_second.max() > 3 * per_second.mean()
    images = trace.trace.lengths.images[trace.trace.lengths.images > 0]
    assert np.mean(images >= 2) == pytest.approx(2**-SHAPE.images_alpha, abs=0.05)
    assert images.max() == SHAPE.max_images


def test_image_bursts_are_present_and_carry_the_image_load(trace: BurstyTrace) -> None:
    assert len(trace.bursts) >= 5
    assert all(SHAPE.burst_min_x <= b.factor <= SHAPE.burst_max_x for b in trace.bursts)
    t, image = trace.trace.arrival_s, trace.trace.lengths.images > 0
    seconds = np.arange(int(SHAPE.duration_s)) + 0.5
    in_burst = np.zeros(len(seconds), dtype=bool)
    for b in trace.bursts:
        in_burst |= (seconds >= b.start_s) & (seconds < b.end_s)
    inside = in_burst[t.astype(int)]
    covered = float(in_burst.sum())
    rate_in = (image & inside).sum() / covered
    rate_out = (image & ~inside).sum() / (SHAPE.duration_s - covered)
    assert rate_in > 2 * rate_out
    # the text stream does not burst with the images
    text_in = (~image & inside).sum() / covered
    text_out = (~image & ~inside).sum() / (SHAPE.duration_s - covered)
    assert 0.5 < text_in / text_out < 2


def test_the_text_only_share_moves_over_time(trace: BurstyTrace) -> None:
    share = trace.text_share(300.0)
    assert share.max() - share.min() > 0.25
    overall = float(np.mean(trace.trace.lengths.images == 0))
    assert 0.4 < overall < 0.9


def test_requests_fit_the_context_and_bad_shapes_are_refused() -> None:
    for name in ("qwen2.5-vl-7b", "llava-1.5-7b"):
        model = catalog().model(name)
        lengths = bursty_trace(BurstyShape(duration_s=300), model, seed=1).trace.lengths
        assert int((lengths.input_tokens + lengths.max_output_tokens).max()) <= model.max_context
        image = lengths.images > 0
        assert np.all(lengths.image_tokens[image] > 0) and np.all(lengths.image_tokens[~image] == 0)
        assert np.all(lengths.output_tokens <= lengths.max_output_tokens)
    with pytest.raises(ValueError, match="takes no images"):
        bursty_trace(SHAPE, catalog().model("llama-2-7b"), seed=0)
    with pytest.raises(ValueError, match="text_swing"):
        BurstyShape(text_swing=1.5)
    with pytest.raises(ValueError, match="burst_min_x"):
        BurstyShape(burst_min_x=9.0)

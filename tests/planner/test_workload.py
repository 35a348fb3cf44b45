"""A described workload's prompts against the model's context."""

from __future__ import annotations

import numpy as np
import pytest

from common.catalog import load_catalog
from loadtest.planner.workload import Description, WorkloadError, clipped_prompt_mean, described_lengths

MODEL = load_catalog().model("llava-1.5-7b")


def test_a_mean_prompt_that_does_not_fit_is_refused() -> None:
    with pytest.raises(WorkloadError, match="does not fit"):
        described_lengths(Description(5.0, prompt_tokens=100_000.0), MODEL, 200, seed=0)
    described_lengths(Description(5.0, image_share=1.0, prompt_tokens=100_000.0), MODEL, 200, seed=0)  # no text


@pytest.mark.parametrize("mean", [512.0, 2000.0, 3000.0, 3800.0])
def test_the_clipped_mean_is_what_the_clip_leaves(mean: float) -> None:
    desc = Description(5.0, prompt_tokens=mean)
    sampled = described_lengths(desc, MODEL, 40_000, seed=1).input_tokens.astype(float)
    assert clipped_prompt_mean(desc, MODEL) == pytest.approx(float(np.mean(sampled)), rel=0.02)

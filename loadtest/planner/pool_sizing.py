"""How many engines each pool of a split fleet needs, window by window of a trace: what "sized for the
peak" and "sized for the mean" mean in the bursty benchmark.

A window's need is its demand over one engine's capacity by the planner's bound (`space.slot_capacity`,
for the window's own requests: its mix of text and images, their lengths, the SLO): the language pool's
requests/s over μ of one language GPU, the vision pool's image requests/s over one vision GPU's encode
rate. Sized for the peak is the largest window's need rounded up; for the mean, the time-average need
rounded up (at least one engine each).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import numpy as np

from common.catalog import Catalog, ModelProfile
from gateway.config.autoscaling import Pool
from loadtest.planner.space import Slo, slot_capacity
from loadtest.sim.workloads import Lengths, Trace


@dataclass(frozen=True)
class Sizing:
    window_s: float
    need: dict[Pool, np.ndarray]       # engines each window needs (fractional)

    def peak(self) -> dict[Pool, int]:
        return {p: max(1, math.ceil(float(n.max()) - 1e-9)) for p, n in self.need.items()}

    def mean(self) -> dict[Pool, int]:
        return {p: max(1, math.ceil(float(n.mean()) - 1e-9)) for p, n in self.need.items()}


def window(trace: Trace, mask: np.ndarray) -> Trace:
    """The requests of `mask`, as a trace of their own."""
    x = trace.lengths
    return Trace(trace.arrival_s[mask], Lengths(x.text_tokens[mask], x.image_tokens[mask], x.images[mask],
                                                x.output_tokens[mask], x.max_output_tokens[mask]))


def size_pools(trace: Trace, duration_s: float, model: ModelProfile, catalog: Catalog, gpus: dict[Pool, str],
               slo: Slo, window_s: float = 60.0) -> Sizing:
    """Each window's need per pool (module docstring)."""
    if window_s <= 0 or duration_s < window_s:
        raise ValueError(f"the window ({window_s} s) must be positive and within the trace ({duration_s} s)")
    edges = np.arange(0.0, duration_s + 1e-9, window_s)
    need: dict[Pool, list[float]] = {"vision": [], "language": []}
    for start, end in itertools.pairwise(edges):
        mask = (trace.arrival_s >= start) & (trace.arrival_s < end)
        if not mask.any():
            need["vision"].append(0.0)
            need["language"].append(0.0)
            continue
        sub = window(trace, mask)
        language = slot_capacity(model, catalog.gpu(gpus["language"]), "language", False, sub, slo)
        vision = slot_capacity(model, catalog.gpu(gpus["vision"]), "vision", False, sub, slo)
        images = int((sub.lengths.image_tokens > 0).sum())
        need["language"].append(sub.n / window_s / language.rate if language.rate else math.inf)
        need["vision"].append(images / window_s / vision.encode_rate if images else 0.0)
    return Sizing(window_s, {p: np.array(v) for p, v in need.items()})

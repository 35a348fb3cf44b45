"""A ModServe-like bursty multimodal trace: what pools that grow and shrink are measured on.

ModServe's production traces of multimodal serving show three things a static fleet copes with badly:
arrivals are heavy-tailed (a few short windows carry far more than the mean), image requests come in
bursts of their own (a client uploads a batch, a feature launches), and the share of text-only requests
moves over the day. The trace here has all three, from one seed, built second by second:

    text-only rate   text_rps · (1 + text_swing · sin(2πt / text_period_s + phase)), phase from the seed
    image rate       image_rps between bursts; a burst (starts a Poisson process of mean gap burst_every_s,
                     lengths uniform in burst_s) multiplies it by a Pareto(burst_alpha) factor, at least
                     burst_min_x and at most burst_max_x (bursts that overlap add their excess)
    both             times a log-normal factor per second of mean 1 and spread jitter_sigma (short
                     spikes), then Poisson counts per second, spread uniformly within it
    image request    an 8-48 token instruction and 1 to max_images images (P(K >= k) = k^-images_alpha),
                     each of a size drawn from IMAGE_SIZES (phone photo to full-HD screenshot: a dynamic-
                     resolution encoder charges 256 to 2,691 tokens for them); output 64-128 tokens
    text request     ShareGPT-like prompts (log-normal, median 350 tokens), output 64-512 tokens

Lengths and arrivals come from separate streams of the seed, as the simulator's workloads do.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from common.catalog import ModelProfile
from loadtest.planner.workload import MAX_TRACE_REQUESTS
from loadtest.sim import workloads
from loadtest.sim.workloads import Lengths, Trace

# (width, height, share of images): small photos to full-HD screenshots
IMAGE_SIZES: tuple[tuple[int, int, float], ...] = (
    (448, 448, 0.30), (640, 480, 0.30), (1024, 768, 0.20), (1280, 960, 0.12), (1920, 1080, 0.08))
INSTRUCTION_TOKENS = (8, 48)
MAX_DURATION_S = 604_800.0       # a week: the rates are built second by second, an array of that many seconds


@dataclass(frozen=True)
class BurstyShape:
    """The trace's knobs (module docstring); the defaults are the benchmark's."""

    duration_s: float = 1800.0
    text_rps: float = 10.0
    text_swing: float = 0.6
    text_period_s: float = 1200.0
    image_rps: float = 3.0
    burst_every_s: float = 180.0
    burst_s: tuple[float, float] = (30.0, 120.0)
    burst_alpha: float = 1.5
    burst_min_x: float = 2.0
    burst_max_x: float = 8.0
    jitter_sigma: float = 0.3
    images_alpha: float = 1.5
    max_images: int = 4

    def __post_init__(self) -> None:
        if not (self.duration_s >= 1 and self.text_rps >= 0 and self.image_rps >= 0
                and self.text_rps + self.image_rps > 0):
            raise ValueError("the trace needs a duration of at least 1 s and a positive total rate")
        if self.duration_s > MAX_DURATION_S:
            raise ValueError(f"the trace is built second by second: its duration is {MAX_DURATION_S:,.0f} s at "
                             f"most, not {self.duration_s:g}")
        nominal = (self.text_rps + self.image_rps) * self.duration_s
        if nominal > MAX_TRACE_REQUESTS:
            raise ValueError(f"text_rps + image_rps over the duration make {nominal:,.0f} requests (before bursts); "
                             f"a simulated trace holds at most {MAX_TRACE_REQUESTS:,}: lower the rates or the "
                             "duration")
        if not 0 <= self.text_swing <= 1:
            raise ValueError(f"text_swing must be in [0, 1] (the text rate stays non-negative), not {self.text_swing}")
        if not (1 <= self.burst_min_x <= self.burst_max_x and self.burst_alpha > 0 and self.images_alpha > 0):
            raise ValueError("bursts need 1 <= burst_min_x <= burst_max_x and positive tail indices")
        if not (0 < self.burst_s[0] <= self.burst_s[1] and self.burst_every_s > 0 and self.text_period_s > 0):
            raise ValueError("burst lengths, the mean gap between bursts and the text period must be positive")
        if self.max_images < 1 or self.jitter_sigma < 0:
            raise ValueError("max_images must be at least 1 and jitter_sigma non-negative")


@dataclass(frozen=True)
class Burst:
    start_s: float
    end_s: float
    factor: float          # the image rate's multiple while it lasts


@dataclass(frozen=True)
class BurstyTrace:
    trace: Trace
    bursts: tuple[Burst, ...]
    shape: BurstyShape

    def text_share(self, window_s: float) -> np.ndarray:
        """The text-only share of the requests of each window of `window_s` seconds (NaN for an empty one)."""
        counts, text = self._windows(window_s)
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.asarray(text / counts, dtype=float)

    def rates(self, window_s: float) -> np.ndarray:
        """Requests/s of each window of `window_s` seconds."""
        return self._windows(window_s)[0] / window_s

    def _windows(self, window_s: float) -> tuple[np.ndarray, np.ndarray]:
        edges = np.arange(0.0, self.shape.duration_s + window_s, window_s)
        counts = np.histogram(self.trace.arrival_s, edges)[0].astype(float)
        text = np.histogram(self.trace.arrival_s[self.trace.lengths.images == 0], edges)[0].astype(float)
        return counts, text


def rates_per_second(shape: BurstyShape, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray, tuple[Burst, ...]]:
    """(text rate, image rate) of each second, and the bursts."""
    seconds = math.ceil(shape.duration_s)
    t = np.arange(seconds) + 0.5
    phase = rng.uniform(0, 2 * math.pi)
    text = shape.text_rps * (1 + shape.text_swing * np.sin(2 * math.pi * t / shape.text_period_s + phase))
    excess = np.zeros(seconds)
    bursts: list[Burst] = []
    start = rng.exponential(shape.burst_every_s)
    while start < shape.duration_s:
        length = rng.uniform(*shape.burst_s)
        factor = min(shape.burst_min_x * (1 - rng.random()) ** (-1 / shape.burst_alpha), shape.burst_max_x)
        bursts.append(Burst(start, min(start + length, shape.duration_s), factor))
        excess[(t >= start) & (t < start + length)] += factor - 1
        start += rng.exponential(shape.burst_every_s)
    jitter = np.exp(rng.normal(-shape.jitter_sigma**2 / 2, shape.jitter_sigma, seconds))
    return text * jitter, shape.image_rps * (1 + excess) * jitter, tuple(bursts)


def bursty_trace(shape: BurstyShape, model: ModelProfile, seed: int) -> BurstyTrace:
    """The trace (module docstring); `model` prices the images in tokens and bounds the context."""
    if model.vision is None:
        raise ValueError(f"model {model.name!r} takes no images; the bursty trace needs a vision-language model")
    arrivals = np.random.default_rng([seed, 1])
    text_rate, image_rate, bursts = rates_per_second(shape, arrivals)
    times, kinds = [], []
    for is_image, rate in ((False, text_rate), (True, image_rate)):
        second = np.repeat(np.arange(len(rate)), arrivals.poisson(rate))
        times.append(second + arrivals.random(len(second)))
        kinds.append(np.full(len(second), is_image))
    arrival = np.concatenate(times)
    order = np.argsort(arrival, kind="stable")
    arrival, image = arrival[order], np.concatenate(kinds)[order]
    keep = arrival < shape.duration_s
    arrival, image = arrival[keep], image[keep]
    if len(arrival) < 2:
        raise ValueError("the shape gives fewer than 2 requests; raise the rates or the duration")
    return BurstyTrace(Trace(arrival, _lengths(image, shape, model, np.random.default_rng([seed, 0]))),
                       bursts, shape)


def _lengths(image: np.ndarray, shape: BurstyShape, model: ModelProfile, rng: np.random.Generator) -> Lengths:
    n = len(image)
    counts = np.where(image, workloads.image_counts(rng, n, shape.images_alpha, shape.max_images), 0)
    sizes = np.array([model.image_tokens(w, h) for w, h, _ in IMAGE_SIZES])
    shares = np.array([p for _, _, p in IMAGE_SIZES])
    per_image = rng.choice(sizes, size=(n, shape.max_images), p=shares / shares.sum())
    image_tokens = np.where(np.arange(shape.max_images) < counts[:, None], per_image, 0).sum(axis=1)
    prompts = np.clip(rng.lognormal(math.log(workloads.SHAREGPT_MEDIAN), workloads.SHAREGPT_SIGMA, n), 16,
                      4096 - workloads.TEXT_OUTPUT[1])
    text = np.where(image, rng.integers(INSTRUCTION_TOKENS[0], INSTRUCTION_TOKENS[1] + 1, n), prompts)
    out = np.where(image, rng.integers(workloads.IMAGE_OUTPUT[0], workloads.IMAGE_OUTPUT[1] + 1, n),
                   rng.integers(workloads.TEXT_OUTPUT[0], workloads.TEXT_OUTPUT[1] + 1, n))
    max_out = np.where(image, workloads.IMAGE_OUTPUT[1], workloads.TEXT_OUTPUT[1])
    if int((text + image_tokens + max_out).max()) > model.max_context:
        raise ValueError(f"{shape.max_images} images of up to {sizes.max()} tokens do not fit model "
                         f"{model.name!r}'s context of {model.max_context}; lower max_images")
    return Lengths(text.astype(np.int64), image_tokens.astype(np.int64), counts.astype(np.int64),
                   out.astype(np.int64), max_out.astype(np.int64))

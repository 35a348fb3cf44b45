"""Seeded request traces: request lengths (text and multimodal) and arrival processes.

Lengths and arrival times come from two independent streams of one seed, so every policy, load level
and arrival process at a given seed sees the very same requests (common random numbers: the
comparison between policies is paired, not blurred by sampling noise).

Text workloads follow the capability-weighted paper §4.1 (outputs uniform in [64, 512]); multimodal
ones follow the modality paper §6.1 (COCO images, "describe this image", outputs ≤ 128 tokens) with a
heavy-tailed image count per request for the mixed variant. `chat_mixed` is the streaming chat mix of
the live mixed-tier benchmark (benchmarks/mixed_workload.py): two thirds short prompts (log-normal,
median 200 tokens, 16-1,000), a third long ones (uniform 1,500-3,400), outputs log-normal with median
24 tokens (4-200), each request generating exactly its max_tokens. `shared_prefix` is `chat_mixed`
where 80% of the requests start with one of 32 tenants' system prompts (1,000-2,500 tokens) and ask a
question of their own (log-normal, median 80 tokens): the prompts an engine's prefix cache and the
gateway's prefix index see as shared leading blocks (`Lengths.blocks`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cache

import numpy as np
from numpy.random import Generator

TEXT_OUTPUT = (64, 512)          # paper §4.1: output lengths uniform in [64, 512]
IMAGE_OUTPUT = (64, 128)         # modality paper §6.1: "describe this image", max output 128 tokens
COCO_IMAGE_TOKENS = 576          # LLaVA-1.5 (CLIP ViT-L/14 @ 336 px) tokens per image
IMAGE_COUNT_ALPHA = 1.5          # P(images ≥ k) = k^-α: Pareto tail of images per request
MAX_IMAGES = 6                   # 6 · 576 + prompt + 128 stays inside a 4096-token context
SHAREGPT_MEDIAN, SHAREGPT_SIGMA = 350.0, 1.1   # log-normal prompt lengths, mean ≈ 640 tokens
REFERENCE_SEED = 20240601        # the sample that fixes a workload's mean lengths (and so λ)


@dataclass(frozen=True, slots=True)
class Lengths:
    text_tokens: np.ndarray
    image_tokens: np.ndarray
    images: np.ndarray
    output_tokens: np.ndarray
    max_output_tokens: np.ndarray
    # Shared prefixes (None: every prompt its own): the tenant whose system prompt leads request i's
    # prompt (-1: none) and that prompt's tokens.
    prefix_group: np.ndarray | None = None
    prefix_tokens: np.ndarray | None = None
    input_tokens: np.ndarray = field(init=False)    # text + image tokens: what prefill and KV see

    def __post_init__(self) -> None:
        object.__setattr__(self, "input_tokens", self.text_tokens + self.image_tokens)

    def blocks(self, i: int, block_tokens: int) -> list[int]:
        """Request i's prompt as chained block hashes (common.prefix_blocks' chaining, block_tokens a
        block): its tenant's system prompt's blocks, the same in every request of that tenant, then
        blocks of its own."""
        total = int(self.input_tokens[i]) // block_tokens
        shared = 0
        group = -1
        if self.prefix_group is not None and self.prefix_tokens is not None and self.prefix_group[i] >= 0:
            group = int(self.prefix_group[i])
            shared = min(total, int(self.prefix_tokens[i]) // block_tokens)
        out: list[int] = []
        previous = 0
        for k in range(total):
            previous = hash((previous, group, k) if k < shared else (previous, -1, i, k))
            out.append(previous)
        return out


@dataclass(frozen=True, slots=True)
class Trace:
    arrival_s: np.ndarray
    lengths: Lengths

    @property
    def n(self) -> int:
        return len(self.arrival_s)


def _uniform(rng: Generator, lo: int, hi: int, n: int) -> np.ndarray:
    return rng.integers(lo, hi + 1, size=n)


def _mixture(rng: Generator, n: int, p_first: float, first: tuple[int, int], second: tuple[int, int]) -> np.ndarray:
    pick = rng.random(n) < p_first
    return np.where(pick, _uniform(rng, *first, n), _uniform(rng, *second, n))


def _sharegpt_prompts(rng: Generator, n: int) -> np.ndarray:
    """Conversational prompts: log-normal, heavy right tail, clipped so prompt + 512 fits in 4096."""
    raw = rng.lognormal(np.log(SHAREGPT_MEDIAN), SHAREGPT_SIGMA, n)
    return np.clip(raw, 16, 4096 - TEXT_OUTPUT[1]).astype(np.int64)


def _text(prompts: np.ndarray, rng: Generator) -> Lengths:
    n = len(prompts)
    zeros = np.zeros(n, dtype=np.int64)
    out = _uniform(rng, *TEXT_OUTPUT, n)
    return Lengths(prompts.astype(np.int64), zeros, zeros, out, np.full(n, TEXT_OUTPUT[1], dtype=np.int64))


def image_counts(rng: Generator, n: int, alpha: float = IMAGE_COUNT_ALPHA, cap: int = MAX_IMAGES) -> np.ndarray:
    """Images per image-bearing request: discrete Pareto, P(K ≥ k) = k^-α, truncated at `cap`."""
    u = 1.0 - rng.random(n)                       # in (0, 1], so u^(-1/α) ≥ 1
    return np.minimum(np.floor(u ** (-1.0 / alpha)), cap).astype(np.int64)


def multimodal(
    rng: Generator, n: int, *, image_fraction: float, heavy_tail: bool, tokens_per_image: int = COCO_IMAGE_TOKENS
) -> Lengths:
    """Image requests: short instruction + images, output ≤ 128; the rest ShareGPT-like text requests."""
    has_image = rng.random(n) < image_fraction
    images = image_counts(rng, n) if heavy_tail else np.ones(n, dtype=np.int64)
    images = np.where(has_image, images, 0)
    text = np.where(has_image, _uniform(rng, 8, 48, n), _sharegpt_prompts(rng, n))
    out = np.where(has_image, _uniform(rng, *IMAGE_OUTPUT, n), _uniform(rng, *TEXT_OUTPUT, n))
    max_out = np.where(has_image, IMAGE_OUTPUT[1], TEXT_OUTPUT[1])
    return Lengths(text.astype(np.int64), images * tokens_per_image, images, out, max_out.astype(np.int64))


def chat_mixed(rng: Generator, n: int) -> Lengths:
    """The live mixed-tier benchmark's chat mix (see the module docstring)."""
    long = rng.random(n) < 1 / 3
    short = np.clip(rng.lognormal(5.3, 0.8, n), 16, 1000).astype(np.int64)
    prompts = np.where(long, _uniform(rng, 1500, 3400, n), short)
    out = np.clip(rng.lognormal(3.18, 0.8, n), 4, 200).astype(np.int64)
    zeros = np.zeros(n, dtype=np.int64)
    return Lengths(prompts, zeros, zeros, out, out.copy())


SHARED_TENANTS, SHARED_SHARE = 32, 0.8


def shared_prefix(rng: Generator, n: int) -> Lengths:
    """`chat_mixed` with tenants' system prompts leading 80% of the prompts (see the module docstring)."""
    own = chat_mixed(rng, n)
    system = np.random.default_rng([REFERENCE_SEED, 2]).integers(1000, 2501, SHARED_TENANTS)
    tenant = rng.integers(0, SHARED_TENANTS, n)
    shared = rng.random(n) < SHARED_SHARE
    question = np.clip(rng.lognormal(4.38, 0.8, n), 16, 400).astype(np.int64)
    group = np.where(shared, tenant, -1)
    prefix = np.where(shared, system[tenant], 0)
    text = np.where(shared, prefix + question, own.text_tokens)
    return Lengths(text, own.image_tokens, own.images, own.output_tokens, own.max_output_tokens, group, prefix)


WORKLOADS: dict[str, Callable[[Generator, int], Lengths]] = {
    "uniform": lambda rng, n: _text(_uniform(rng, 128, 4096, n), rng),
    "short_heavy": lambda rng, n: _text(_mixture(rng, n, 0.8, (128, 511), (512, 4096)), rng),
    "long_heavy": lambda rng, n: _text(_mixture(rng, n, 0.8, (2048, 4096), (128, 2047)), rng),
    "bimodal": lambda rng, n: _text(_mixture(rng, n, 0.5, (128, 512), (2048, 4096)), rng),
    "sharegpt": lambda rng, n: _text(_sharegpt_prompts(rng, n), rng),
    "coco": lambda rng, n: multimodal(rng, n, image_fraction=1.0, heavy_tail=False),
    "mm_mixed": lambda rng, n: multimodal(rng, n, image_fraction=0.5, heavy_tail=True),
    "chat_mixed": chat_mixed,
    "shared_prefix": shared_prefix,
}


def lengths(workload: str, n: int, seed: int) -> Lengths:
    return WORKLOADS[workload](np.random.default_rng([seed, 0]), n)


@cache
def mean_lengths(workload: str) -> tuple[float, float, float]:
    """(mean input, mean output, mean max_output) tokens from a fixed large sample: λ is seed-independent."""
    ref = lengths(workload, 50_000, REFERENCE_SEED)
    return float(ref.input_tokens.mean()), float(ref.output_tokens.mean()), float(ref.max_output_tokens.mean())


def poisson_arrivals(rng: Generator, rate: float, n: int) -> np.ndarray:
    return np.cumsum(rng.exponential(1.0 / rate, n))


def on_off_arrivals(
    rng: Generator, rate: float, n: int, *, peak: float = 3.0, on_fraction: float = 0.25, cycle_arrivals: float = 150.0
) -> np.ndarray:
    """Two-state MMPP with mean `rate`: bursts at `peak`·rate for `on_fraction` of the time.

    State sojourns are exponential with means on_fraction·cycle and (1-on_fraction)·cycle, where one
    cycle carries `cycle_arrivals` requests on average; the off state keeps the remaining rate.
    """
    if peak * on_fraction > 1.0:
        raise ValueError("peak · on_fraction must be ≤ 1 so the off-state rate is not negative")
    cycle = cycle_arrivals / rate
    rates = (peak * rate, rate * (1.0 - peak * on_fraction) / (1.0 - on_fraction))
    means = (on_fraction * cycle, (1.0 - on_fraction) * cycle)
    times: list[np.ndarray] = []
    t, state, count = 0.0, 0, 0
    while count < n:
        dur = rng.exponential(means[state])
        k = rng.poisson(rates[state] * dur)
        times.append(t + np.sort(rng.random(k)) * dur)
        count += k
        t += dur
        state = 1 - state
    return np.concatenate(times)[:n]


ARRIVALS: dict[str, Callable[[Generator, float, int], np.ndarray]] = {
    "poisson": poisson_arrivals,
    "bursty": on_off_arrivals,
}


def make_trace(workload: str, arrivals: str, rate: float, n: int, seed: int) -> Trace:
    times = ARRIVALS[arrivals](np.random.default_rng([seed, 1]), rate, n)
    return Trace(times - times[0], lengths(workload, n, seed))

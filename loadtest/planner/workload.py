"""What a plan is sized for: a seeded request trace, from a description or from the gateway's own request log.

A description is what an operator knows of the traffic: an arrival rate, the share of requests that
carry images, and typical prompt and output lengths. It becomes a trace the way the simulator's
workloads do (`loadtest.sim.workloads`): lengths and arrival times from two streams of one seed, so
every plan replays the very same requests (the comparison between plans is paired).

    text request    prompt log-normal (σ = PROMPT_SIGMA) with the described mean, at least 16 tokens
    image request   a short instruction (8-48 tokens) and `images_per_request` images of the model's
                    tokens per image (a dynamic-resolution encoder: a 640×480 photo)
    output          uniform in [mean / 2, 3 · mean / 2] tokens; max_tokens (the KV reservation) is the top
    arrivals        Poisson, or the simulator's on/off bursts ("bursty")

A simulator workload by name (`--workload mm_mixed`) is taken as it is, fitted to the model as a description
is: its images at the model's tokens per image, its prompts clipped to what the context leaves beside the
images and max_tokens. A request log is the gateway's
own JSON lines (`gateway/pipeline/request_log.py`): every served request (`"event": "request"`, status
200) becomes one request arriving at its line's timestamp less its latency, with its prompt and
completion tokens; a request that went through a vision backend carries images, as many as its prompt
tokens hold whole images (at least one: the log does not say how many). A `both` backend encodes its own
images and its line names no vision backend, so on a monolithic cluster an image request reads as text
of the same prompt length (the same prefill; its encode, about a millisecond an image here, is missed).
The log has no max_tokens, so the KV reservation is taken as the completion (a client's max_tokens
reserves more). A prompt longer than the model's context leaves beside the completion is clipped; a request
that does not fit even so (a log of a model with a longer context) is refused, not planned for as one never
served.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import numpy as np

from common.catalog import ModelProfile
from loadtest.sim import workloads
from loadtest.sim.workloads import Lengths, Trace

PROMPT_SIGMA = 0.8                   # log-normal spread of text prompts (ShareGPT-like prompts have 1.1)
MIN_PROMPT_TOKENS = 16
INSTRUCTION_TOKENS = (8, 48)         # the text of an image request ("describe this image" and the like)
PHOTO_SIZE = (640, 480)              # the image a dynamic-resolution encoder is charged for
ARRIVALS = tuple(workloads.ARRIVALS)
# What a simulated trace may be, refused beyond rather than built: a trace of a million requests takes about
# 0.4 GB in each simulation process and minutes a plan; a rate this high is beyond any fleet a plan holds, and
# a trace's span at it is below the simulator's resolution (its goodput would read as the rate itself).
MAX_TRACE_REQUESTS = 1_000_000
MAX_RATE_RPS = 100_000.0
MAX_LOGGED_TOKENS = 2**31 - 1          # a request log's token count beyond this is no request's: far past any context


class WorkloadError(ValueError):
    """A workload the planner cannot use (the message says which input and why)."""


@dataclass(frozen=True)
class Description:
    """The traffic as an operator describes it."""

    rate_rps: float
    image_share: float = 0.0
    prompt_tokens: float = 512.0         # mean text tokens of a text request
    output_tokens: float = 128.0         # mean generated tokens
    images_per_request: int = 1
    arrivals: str = "poisson"

    def __post_init__(self) -> None:
        if not self.rate_rps > 0:
            raise WorkloadError(f"the arrival rate must be positive, not {self.rate_rps}")
        if not 0.0 <= self.image_share <= 1.0:
            raise WorkloadError(f"the image share must be in [0, 1], not {self.image_share}")
        if self.prompt_tokens < MIN_PROMPT_TOKENS or self.output_tokens < 2:
            raise WorkloadError(f"mean prompt tokens must be at least {MIN_PROMPT_TOKENS} and mean output tokens "
                                f"at least 2 (got {self.prompt_tokens} and {self.output_tokens})")
        if self.images_per_request < 1:
            raise WorkloadError(f"images per image request must be at least 1, not {self.images_per_request}")
        if self.arrivals not in ARRIVALS:
            raise WorkloadError(f"unknown arrival process {self.arrivals!r}; known: {', '.join(ARRIVALS)}")


def tokens_per_image(model: ModelProfile) -> int:
    """What one image costs in prompt tokens (0 for a text-only model)."""
    return model.image_tokens(*PHOTO_SIZE)


def output_range(desc: Description) -> tuple[int, int]:
    """The fewest and most output tokens of a request (module docstring); the most is its max_tokens."""
    return max(1, round(desc.output_tokens / 2)), max(2, round(desc.output_tokens * 3 / 2))


def text_room(desc: Description, model: ModelProfile) -> int:
    """The most prompt tokens a text request can have: the context less its max_tokens."""
    return model.max_context - output_range(desc)[1]


def clipped_prompt_mean(desc: Description, model: ModelProfile) -> float:
    """The expected mean text prompt once prompts are clipped to `text_room`: E[min(X, c)] of the log-normal X,
    e^(μ+σ²/2)·Φ((ln c - μ - σ²)/σ) + c·(1 - Φ((ln c - μ)/σ)), so that a caller can say how far below
    the described mean the clip takes it."""
    c, s = text_room(desc, model), PROMPT_SIGMA
    mu = math.log(desc.prompt_tokens) - s**2 / 2
    z = (math.log(c) - mu) / s

    def phi(x: float) -> float:
        return 0.5 * (1 + math.erf(x / math.sqrt(2)))

    return desc.prompt_tokens * phi(z - s) + c * (1 - phi(z))


def described_lengths(desc: Description, model: ModelProfile, n: int, seed: int) -> Lengths:
    """n requests of the description (module docstring); prompts clipped so that every request fits the context.
    A mean prompt that does not fit itself is refused: the clip would leave a trace of another workload."""
    rng = np.random.default_rng([seed, 0])
    per_image = tokens_per_image(model)
    if desc.image_share > 0 and not per_image:
        raise WorkloadError(f"model {model.name!r} takes no images, so the image share must be 0")
    if desc.image_share < 1 and desc.prompt_tokens > text_room(desc, model):
        raise WorkloadError(f"a mean prompt of {desc.prompt_tokens:g} tokens does not fit model {model.name!r}: "
                            f"its context of {model.max_context} tokens less {output_range(desc)[1]} output "
                            f"tokens leaves {text_room(desc, model)}")
    has_image = rng.random(n) < desc.image_share
    images = np.where(has_image, desc.images_per_request, 0).astype(np.int64)
    mu = math.log(desc.prompt_tokens) - PROMPT_SIGMA**2 / 2          # log-normal with the described mean
    prompts = np.maximum(rng.lognormal(mu, PROMPT_SIGMA, n), MIN_PROMPT_TOKENS).astype(np.int64)
    text = np.where(has_image, rng.integers(INSTRUCTION_TOKENS[0], INSTRUCTION_TOKENS[1] + 1, n), prompts)
    low, high = output_range(desc)
    out = rng.integers(low, high + 1, n)
    max_out = np.full(n, high, dtype=np.int64)
    room = model.max_context - images * per_image - max_out
    if int(room.min()) < 1:
        raise WorkloadError(f"{desc.images_per_request} images of {per_image} tokens and {high} output tokens do "
                            f"not fit model {model.name!r}'s context of {model.max_context} tokens")
    return Lengths(np.minimum(text, room).astype(np.int64), images * per_image, images, out.astype(np.int64), max_out)


def described_trace(desc: Description, model: ModelProfile, n: int, seed: int) -> Trace:
    times = workloads.ARRIVALS[desc.arrivals](np.random.default_rng([seed, 1]), desc.rate_rps, n)
    return Trace(at_rate(times - times[0], desc.rate_rps), described_lengths(desc, model, n, seed))


def named_trace(workload: str, model: ModelProfile, rate_rps: float, n: int, seed: int,
                arrivals: str = "poisson") -> tuple[Trace, int]:
    """One of the simulator's workloads (loadtest/sim/workloads.py) at this rate, fitted to the model
    (`fitted_lengths`), and how many of its prompts the fit clipped (for the caller to say so)."""
    if workload not in workloads.WORKLOADS:
        raise WorkloadError(f"unknown workload {workload!r}; known: {', '.join(sorted(workloads.WORKLOADS))}")
    if arrivals not in ARRIVALS:
        raise WorkloadError(f"unknown arrival process {arrivals!r}; known: {', '.join(ARRIVALS)}")
    if not rate_rps > 0:
        raise WorkloadError(f"the arrival rate must be positive, not {rate_rps}")
    trace = workloads.make_trace(workload, arrivals, rate_rps, n, seed)
    lengths = fitted_lengths(trace.lengths, model, workload)
    clipped = int((lengths.text_tokens < trace.lengths.text_tokens).sum())
    return Trace(at_rate(trace.arrival_s, rate_rps), lengths), clipped


def fitted_lengths(lengths: Lengths, model: ModelProfile, workload: str) -> Lengths:
    """A simulator workload's requests as the model takes them: its images at the model's tokens per image
    (the workloads charge LLaVA-1.5's 576), and each text prompt clipped where prompt + image tokens +
    max_tokens would pass the context, as a described workload's are; the live gateway refuses such a request
    (400 context_length_exceeded), so a plan must not count it. Images for a text-only model, or a request
    that does not fit even with a 1-token prompt, are refused: the simulator cannot serve them either."""
    per_image = tokens_per_image(model)
    if lengths.images.any() and not per_image:
        raise WorkloadError(f"model {model.name!r} takes no images, and workload {workload!r} has requests with "
                            "images: give a vision model (--model) or a text workload")
    image_tokens = lengths.images * per_image
    room = model.max_context - image_tokens - lengths.max_output_tokens
    if int(room.min()) < 1:
        worst = int(np.argmin(room))
        raise WorkloadError(f"workload {workload!r} does not fit model {model.name!r}'s context of "
                            f"{model.max_context} tokens: a request of {int(lengths.images[worst])} images of "
                            f"{per_image} tokens and {int(lengths.max_output_tokens[worst])} output tokens")
    text = np.minimum(lengths.text_tokens, room).astype(np.int64)
    prefix = None if lengths.prefix_tokens is None else np.minimum(lengths.prefix_tokens, text)
    return Lengths(text, image_tokens.astype(np.int64), lengths.images, lengths.output_tokens,
                   lengths.max_output_tokens, lengths.prefix_group, prefix)


def at_rate(arrival_s: np.ndarray, rate_rps: float) -> np.ndarray:
    """Arrival times (from 0) stretched so that their mean rate, (n - 1) / span, is exactly `rate_rps`: a sampled
    trace's own rate is off by its noise, and a plan is judged at the rate it was asked for."""
    span = float(arrival_s[-1] - arrival_s[0]) if len(arrival_s) > 1 else 0.0
    if span <= 0:
        return np.arange(len(arrival_s)) / rate_rps
    return np.asarray((arrival_s - arrival_s[0]) * ((len(arrival_s) - 1) / rate_rps / span), dtype=float)


def log_trace(path: Path, model: ModelProfile, rate_rps: float | None = None, limit: int | None = None) -> Trace:
    """The served requests of a gateway request log (module docstring), in arrival order; `rate_rps`
    rescales the arrival times to that mean rate, `limit` keeps the first requests only."""
    rows: list[tuple[float, int, int, bool]] = []
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError as exc:
        raise WorkloadError(f"{path}: cannot read the request log: {exc.strerror}") from None
    for line in lines:
        row = _request_row(line)
        if row is not None:
            rows.append(row)
    if len(rows) < 2:
        raise WorkloadError(f"{path}: {len(rows)} served request lines (\"event\": \"request\", status 200, "
                            "with a timestamp); a trace needs at least 2")
    rows.sort()
    rows = rows[:limit] if limit else rows
    arrival = np.array([r[0] for r in rows])
    arrival -= arrival[0]
    if rate_rps is not None:
        if not rate_rps > 0:
            raise WorkloadError(f"the arrival rate must be positive, not {rate_rps}")
        arrival = at_rate(arrival, rate_rps)
    elif float(arrival[-1]) <= 0:
        raise WorkloadError(f"{path}: every request arrived at the same instant; give the rate to replay them at")
    try:
        return Trace(arrival, _log_lengths(rows, model))
    except WorkloadError as exc:
        raise WorkloadError(f"{path}: {exc}") from None


def _request_row(line: str) -> tuple[float, int, int, bool] | None:
    """(arrival s since the epoch, prompt tokens, completion tokens, had images) of a served request line."""
    try:
        event = json.loads(line)
    except ValueError:
        return None                      # another line of the same stream (a library's, a plain one)
    if not isinstance(event, dict) or event.get("event") != "request" or event.get("status") != 200:
        return None
    try:
        finished = datetime.fromisoformat(str(event["timestamp"]).replace("Z", "+00:00")).timestamp()
        latency = float(event.get("latency_s") or 0.0)
        prompt, completion = int(event.get("prompt_tokens") or 0), int(event.get("completion_tokens") or 0)
    except (KeyError, TypeError, ValueError, OverflowError):     # OverflowError: int() of an Infinity
        return None
    # what the gateway never writes (JSON takes NaN, Infinity and any integer): an arrival that is no time, or
    # a count no context holds (MAX_LOGGED_TOKENS: sums of them stay within the trace's int64)
    if not (math.isfinite(latency) and latency >= 0) or not (0 < prompt <= MAX_LOGGED_TOKENS
                                                             and 0 < completion <= MAX_LOGGED_TOKENS):
        return None
    return finished - latency, prompt, completion, bool(event.get("vision_backends"))


def _log_lengths(rows: list[tuple[float, int, int, bool]], model: ModelProfile) -> Lengths:
    prompt = np.array([r[1] for r in rows], dtype=np.int64)
    out = np.array([r[2] for r in rows], dtype=np.int64)
    per_image = tokens_per_image(model)
    if per_image:
        images = np.where([r[3] for r in rows], np.maximum(1, (prompt - 1) // per_image), 0).astype(np.int64)
    else:
        images = np.zeros(len(rows), dtype=np.int64)
    image_tokens = np.minimum(images * per_image, prompt - 1)
    room = model.max_context - out
    unfit = image_tokens + 1 + out > model.max_context      # beyond the context even with their text clipped
    if unfit.any():
        raise WorkloadError(f"{int(unfit.sum()):,} of its {len(rows):,} served requests do not fit model "
                            f"{model.name}'s context of {model.max_context} tokens (up to {int(out[unfit].max()):,} "
                            "completion tokens): a log of a model with a longer context? plan for that --model")
    text = np.clip(prompt - image_tokens, 1, room - image_tokens)
    return Lengths(text.astype(np.int64), image_tokens.astype(np.int64), images, out, out.copy())

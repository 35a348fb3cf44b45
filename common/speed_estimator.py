"""What each backend actually delivers, learned online from what the router already sees.

Datasheet peaks say what a GPU could do; an engine on it does less (3-4x less prefill in practice),
and a tier's engines differ by configuration. Per backend, from each request it routed there:

    prefill rate  p̂ (s / token)  sample = max(0, TTFT − ŝ) / tokens_ahead
                                   tokens_ahead = prompt tokens this router had sent there and not yet
                                   seen a first token for, the request's own included (chunked
                                   prefill serves them in order), taken only when >= 64 tokens,
                                   the dispatch predicted no wait for KV (W_kv = 0) and at most
                                   half the prompt cached (`StateTable.acquire`)
    decode step   ŝ (s)           sample = (last token − first token) / (completion tokens − 1)
    T̄_service     (s)             sample = prompt tokens · p̂ + (last token − first token): the
                                   request's own prefill and decode, not the time it queued

p̂ and ŝ are each the performance-model prior blended with the median of the last `window` samples:

    estimate = w · prior + (1 − w) · median(window),      w = k0 / (k0 + n)

with n the samples seen so far and k0 = `prior_weight` (4: the prior counts as four samples, weighs
one half after 4 samples and a tenth after 36). A sample is clipped to [estimate / C, estimate · C]
(C = 4) before it enters the window, and the median ignores the rest of an outlier, so neither a
warm-up request nor a stall moves an estimate far; a true change of speed is followed within half a
window. A first token that waited for the engine to admit it (its cache full) says how fast the cache
turned over, not how fast the engine prefills: taken as a prefill sample, on a KV-bound backend it made p̂
8-14x the engine's rate (the cache replay at 2.5x, benchmarks/prefix_affinity.py, which prints the ratio),
and every term priced with p̂ with it; the wait is `marginal_delay`'s T_kv. T̄_service is
`common.service_time` (prior, clipped EWMA). Each backend also calibrates the
router's first-token and decode-time models (`common.calibration`) from the same first tokens and
completions. Pure: numbers in, numbers out; no clock, no I/O.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from common import perf_model
from common.calibration import TTFT_KV_WAIT, decode_fit, ttft_fit
from common.catalog import GpuProfile, ModelProfile
from common.service_time import PRIOR_OUTPUT_TOKENS, PRIOR_PROMPT_TOKENS, prior_service_s, updated_mean_service


@dataclass(frozen=True, slots=True)
class SpeedParams:
    prior_weight: float = 4.0        # k0: the prior counts as this many samples
    window: int = 32                 # samples the median runs over
    clip: float = 4.0                # C
    min_prefill_tokens: int = 64     # fewer tokens ahead: TTFT is mostly step overhead, not prefill


class RobustEstimate:
    """A prior blended with the median of recent clipped samples (see the module docstring).

    The window is also kept sorted (an insertion and a removal a sample), so the median is read, not
    sorted for: every request adds a sample or two."""

    __slots__ = ("_params", "_sorted", "_window", "prior", "samples", "value")

    def __init__(self, prior: float, params: SpeedParams) -> None:
        self.prior = self.value = prior
        self.samples = 0
        self._params = params
        self._window: deque[float] = deque(maxlen=params.window)
        self._sorted: list[float] = []

    def add(self, sample: float) -> None:
        p = self._params
        clipped = min(self.value * p.clip, max(self.value / p.clip, sample))
        window, ordered = self._window, self._sorted
        if len(window) == window.maxlen:   # the oldest leaves the window
            del ordered[bisect_left(ordered, window[0])]
        window.append(clipped)
        insort(ordered, clipped)
        self.samples += 1
        w = p.prior_weight / (p.prior_weight + self.samples)
        self.value = w * self.prior + (1.0 - w) * _median(ordered)

    @property
    def prior_share(self) -> float:
        """The prior's weight w in the estimate now."""
        return self._params.prior_weight / (self._params.prior_weight + self.samples)


def _median(ordered: list[float]) -> float:
    """The median of a sorted, non-empty list, as `statistics.median` gives it."""
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


class BackendSpeed:
    """p̂, ŝ and T̄_service of one backend, and its calibrated first-token and decode models
    (`common.calibration`)."""

    __slots__ = ("_params", "decode", "decode_model", "prefill", "service_s", "service_samples", "ttft_model")

    def __init__(
        self, prefill_s_per_token: float, decode_step_s: float, service_s: float, params: SpeedParams | None = None
    ) -> None:
        self._params = params or SpeedParams()
        self.prefill = RobustEstimate(prefill_s_per_token, self._params)
        self.decode = RobustEstimate(decode_step_s, self._params)
        self.service_s = service_s
        self.service_samples = 0
        self.ttft_model = ttft_fit()
        self.decode_model = decode_fit(decode_step_s)

    def first_token(self, ttft_s: float, tokens_ahead: int, features: Sequence[float] = ()) -> None:
        """A request's first token came `ttft_s` after dispatch with `tokens_ahead` tokens to prefill;
        `features`: the first-token model's, as they were at its dispatch (none: not fitted). No prefill
        sample where they predicted a wait for KV (the engine's admission, not its prefill)."""
        waited = len(features) > TTFT_KV_WAIT and features[TTFT_KV_WAIT] > 0
        if tokens_ahead >= self._params.min_prefill_tokens and not waited:
            self.prefill.add(max(0.0, ttft_s - self.decode.value) / tokens_ahead)
        if features:
            self.ttft_model.add(features, ttft_s)

    def completed(self, prompt_tokens: int, completion_tokens: int, decode_s: float,
                  stalls: tuple[float, int] | None = None) -> None:
        """A request finished: `decode_s` from its first token to its last; `stalls`: (ΔC, ΔN), the
        stall clock's advance and the prompts dispatched there meanwhile (none: not fitted)."""
        if completion_tokens >= 2:
            self.decode.add(decode_s / (completion_tokens - 1))
            if stalls is not None:
                self.decode_model.add((completion_tokens - 1, stalls[0], stalls[1]), decode_s)
        self.service_s = updated_mean_service(self.service_s, prompt_tokens * self.prefill.value + decode_s)
        self.service_samples += 1

    @property
    def decode_floor_s(self) -> float:
        """s0: the decode step without the stalls of other prompts' prefill (at most ŝ)."""
        return min(self.decode_model.coefficients[0], self.decode.value)

    @property
    def stall_factor(self) -> float:
        """κ: a prompt's actual stall on the requests decoding beside it over its predicted L·p̂."""
        return self.decode_model.coefficients[1]

    @property
    def stall_per_prompt_s(self) -> float:
        """c: a fixed stall per prompt on the requests decoding beside it."""
        return self.decode_model.coefficients[2]

    def describe(self) -> dict[str, float | int | list[float]]:
        model = self.decode_model
        return {
            "prefill_s_per_token": self.prefill.value, "prefill_prior_s_per_token": self.prefill.prior,
            "prefill_samples": self.prefill.samples, "decode_step_s": self.decode.value,
            "decode_prior_s": self.decode.prior, "decode_samples": self.decode.samples,
            "service_s": self.service_s, "service_samples": self.service_samples,
            "ttft_coefficients": list(self.ttft_model.coefficients), "ttft_samples": self.ttft_model.samples,
            "ttft_observed_s": self.ttft_model.observed_mean, "ttft_predicted_s": self.ttft_model.predicted_mean,
            "ttft_uncalibrated_s": self.ttft_model.prior_mean,
            "decode_floor_s": self.decode_floor_s, "stall_factor": self.stall_factor,
            "stall_per_prompt_s": self.stall_per_prompt_s, "decode_model_samples": model.samples,
            "decode_observed_s": model.observed_mean, "decode_predicted_s": model.predicted_mean,
            "decode_uncalibrated_s": model.prior_mean,
        }


def prior_speed(model: ModelProfile, gpu: GpuProfile, params: SpeedParams | None = None) -> BackendSpeed:
    """A backend's estimates before any sample: the performance model's unloaded figures."""
    ctx = PRIOR_PROMPT_TOKENS + PRIOR_OUTPUT_TOKENS // 2
    return BackendSpeed(perf_model.prefill_seconds_per_token(model, gpu),
                        perf_model.decode_step_seconds(model, gpu, 1, ctx), prior_service_s(model, gpu), params)

"""T̄_service(i): one definition for the engines, the gateway and the simulator.

T̄_service is a *service* time: from a request's admission into the batch to its last token, without
the time it queued. It starts at the performance model's prior and moves by an EWMA of clipped
samples:

    T̄ ← T̄ + α · (clip(sample, T̄ / C, T̄ · C) − T̄),      α = 0.2, C = 4

so no single sample replaces the prior (a 2-token warm-up request moves it by at most α · (1 − 1/C)
downwards), an outlier moves it by at most α · (C − 1) upwards, and after n samples the prior's
weight is (1 − α)^n (0.11 after 10).
"""

from __future__ import annotations

from common import perf_model
from common.catalog import GpuProfile, ModelProfile

SERVICE_EWMA_ALPHA = 0.2   # weight of the newest completion in T̄_service
SERVICE_CLIP = 4.0         # a sample counts as at most C times (at least 1/C of) the current mean
# The prior before any sample: prefill of a typical prompt plus a typical completion, unloaded.
PRIOR_PROMPT_TOKENS, PRIOR_OUTPUT_TOKENS = 512, 128


def prior_service_s(model: ModelProfile, gpu: GpuProfile) -> float:
    return perf_model.service_seconds(model, gpu, PRIOR_PROMPT_TOKENS, PRIOR_OUTPUT_TOKENS)


def updated_mean_service(mean_s: float, sample_s: float) -> float:
    """T̄_service after one more completed request (`mean_s` starts at the prior)."""
    if mean_s <= 0.0:
        return sample_s
    clipped = min(mean_s * SERVICE_CLIP, max(mean_s / SERVICE_CLIP, sample_s))
    return mean_s + SERVICE_EWMA_ALPHA * (clipped - mean_s)

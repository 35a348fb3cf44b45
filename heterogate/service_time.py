"""T̄_service(i): one definition for the engines, the gateway's fallback and the simulator."""

from __future__ import annotations

SERVICE_EWMA_ALPHA = 0.2   # weight of the newest completion in T̄_service


def updated_mean_service(mean_s: float | None, sample_s: float) -> float:
    """T̄_service(i) after one more completed request; the first sample replaces the prior.

    Engines measure a request from its admission into the batch to its last token, in the performance
    model's seconds (the same unit as the prefill term it is added to), so a time-scaled engine reports
    model time.
    """
    return sample_s if mean_s is None else mean_s + SERVICE_EWMA_ALPHA * (sample_s - mean_s)

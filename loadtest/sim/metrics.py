"""Run metrics, as the capability-weighted paper defines them (§4.1) plus a steady-state view.

throughput_tok_s   generated tokens / (first arrival → last completion): the paper's metric. On a
                   finite trace it also charges the drain after the last arrival.
steady_tok_s       tokens emitted while requests were still arriving / that window: capacity without
                   the drain (a request's tokens are taken as spread evenly from its first to its last).
ttft / e2e         percentiles (and the mean E2E, the paper Oracle's objective) over completed requests.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from loadtest.sim.engines import Recorder
from loadtest.sim.workloads import Trace


def _steady_tokens(trace: Trace, rec: Recorder, done: np.ndarray) -> float:
    window_end = float(trace.arrival_s[-1])
    first, last = rec.first_token[done], rec.finish[done]
    out = trace.lengths.output_tokens[done]
    frac = np.clip((window_end - first) / np.maximum(last - first, 1e-12), 0.0, 1.0)
    emitted = np.where(first <= window_end, 1 + (out - 1) * frac, 0.0)
    return float(emitted.sum()) / max(window_end - float(trace.arrival_s[0]), 1e-12)


def summarize(trace: Trace, rec: Recorder, gpu_names: np.ndarray, prices: list[float]) -> dict[str, Any]:
    arrival = trace.arrival_s
    done = ~np.isnan(rec.finish)
    tokens = float(trace.lengths.output_tokens[done].sum())
    span = float(np.nanmax(rec.finish) - arrival[0]) if done.any() else float("nan")
    ttft = rec.first_token[done] - arrival[done]
    e2e = rec.finish[done] - arrival[done]
    routed = rec.backend[rec.backend >= 0]
    throughput = tokens / span
    out: dict[str, Any] = {
        "n": trace.n,
        "completed": int(done.sum()),
        "rejected": int(rec.rejected.sum()),
        "throughput_tok_s": throughput,
        "steady_tok_s": _steady_tokens(trace, rec, done),
        "ttft_p50_s": float(np.percentile(ttft, 50)),
        "ttft_p95_s": float(np.percentile(ttft, 95)),
        "e2e_mean_s": float(np.mean(e2e)),
        "e2e_p50_s": float(np.percentile(e2e, 50)),
        "e2e_p99_s": float(np.percentile(e2e, 99)),
        "queue_mean_s": float(np.mean(rec.admitted[done] - arrival[done])),
        "makespan_s": span,
        "cost_per_hour": float(sum(prices)),
        "tok_s_per_dollar_hour": throughput / float(sum(prices)),
    }
    for name in sorted(set(gpu_names.tolist())):
        out[f"share_{name}"] = float(np.isin(routed, np.flatnonzero(gpu_names == name)).mean())
    return out

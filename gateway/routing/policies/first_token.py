"""The features of the calibrated first-token model (`common.calibration`), from what a decision reads.

    x = ((B + L)·p̂,  ŝ,  n·ŝ,  W_kv)        TTFT ≈ a · x, a per backend

B: prompt tokens sent there whose first token has not come, L: the request's own prompt tokens to
prefill there, p̂ and ŝ the learned prefill rate and decode step, n the requests in flight there, W_kv
the wait for the cache to turn over, max(0, U + R − K) / K · T̄_service with K the KV capacity in
tokens, U what is held or reserved there and R the request's prompt + max_tokens. One definition for
the policy that predicts with them (`marginal_delay`) and the state table that fits them (from the
snapshot its decision read, at the lease).
"""

from __future__ import annotations

from collections.abc import Sequence

from gateway.routing.policies.candidates import first_lowest
from gateway.routing.policies.contracts import BackendSnapshot, CostTerms, Decision, RequestProfile


def kv_wait_s(b: BackendSnapshot, reserve_tokens: int) -> float:
    """W_kv: 0 where the request's prompt + max_tokens fit beside what is held there, or K is unknown."""
    per_token = b.kv_bytes_per_token
    capacity = b.kv_total_bytes // per_token if per_token else 0
    if not capacity:
        return 0.0
    used = max(capacity - b.kv_free_bytes // per_token, b.kv_reserved_tokens)
    over = used + reserve_tokens - capacity
    return over / capacity * b.mean_service_s if over > 0 else 0.0


def predicted_ttft_s(b: BackendSnapshot, prompt_tokens: int, reserve_tokens: int) -> float:
    """A request's time to first token there, for `prompt_tokens` to prefill there and `reserve_tokens`
    of KV to hold (its prompt + max_tokens): the wait for its KV (`kv_wait_s`, `marginal_delay`'s T_kv),
    then the prompts ahead of it and its own at the learned prefill speed and one decode step
    (`marginal_delay`'s T_first). Queueing for a batch slot is not in it. The overload queue holds a
    request on it, the pipeline bounds a first-token wait by it, `SoonestFirstToken` routes on it and the
    autoscaler compares it with the SLO: a full cache delays a first token as a prefill backlog does."""
    per_token = b.learned_prefill_s_per_token or b.prefill_s_per_token
    return (b.prefill_backlog_tokens + prompt_tokens) * per_token + b.decode_step_s + kv_wait_s(b, reserve_tokens)


def prefill_stall_s(b: BackendSnapshot, prefill_tokens: int) -> float:
    """The stall a prefill of `prefill_tokens` there imposes on the requests decoding there, calibrated
    (κ · L · p̂ + c: the backend's learned stall factor and per-prompt stall). `marginal_delay` prices it;
    the overload queue holds a request whose stall would break an in-flight request's inter-token slack."""
    p = b.learned_prefill_s_per_token or b.prefill_s_per_token
    return b.stall_factor * (prefill_tokens * p) + b.stall_per_prompt_s


def first_token_features(b: BackendSnapshot, prefill_tokens: int, reserve_tokens: int) -> tuple[float, ...]:
    """x for a request that would prefill `prefill_tokens` there and reserve `reserve_tokens` of KV."""
    p = b.learned_prefill_s_per_token or b.prefill_s_per_token
    step = b.decode_step_s
    return ((b.prefill_backlog_tokens + prefill_tokens) * p, step, (b.in_flight + b.foreign_running) * step,
            kv_wait_s(b, reserve_tokens))


class SoonestFirstToken:
    """The backend where the request's first token is predicted soonest (`predicted_ttft_s` of its uncached
    prompt tokens there, its wait for KV counted; ties: the first candidate). Not a pool policy (it
    would pile every request onto the fastest GPU): the pipeline routes a request with it when the
    request's own first token is what counts and the pool's balance is not at stake, a request that
    went past a saturated pool on its tenant's guaranteed concurrency
    (`gateway.admission.guaranteed_first_token`). On a saturated pool every backend is mid-step, and a
    new request waits there for that step's end, then its prefill and one decode step of the batch: so
    a fast GPU's first token comes several times sooner than a slow one's, which the pool's policy
    (balancing queues) does not look at; and on a full cache it waits for running requests to finish.
    An idle backend (nothing in flight or queued there: one kept for a priority class, `min_priority`)
    has no step to finish first and no batch to decode with: its first token comes at the end of the
    prefill, without `predicted_ttft_s`'s decode step (measured on the demo cluster: 3-5 ms on an idle
    A100 against 11 ms on an H100 mid-step, whose decode step alone is shorter than the A100's)."""

    name = "soonest_first_token"

    def choose(self, request: RequestProfile, candidates: Sequence[BackendSnapshot], now: float) -> Decision:
        cached = request.cached_tokens
        reserve = request.input_tokens + request.max_output_tokens
        totals = [predicted_ttft_s(b, request.input_tokens - cached.get(b.id, 0), reserve)
                  - (0.0 if b.queue_depth else b.decode_step_s) for b in candidates]
        costs = tuple([CostTerms(b.id, t, 0.0, 0.0, t) for b, t in zip(candidates, totals, strict=True)])
        return Decision(candidates[first_lowest(totals)], self.name, costs)

"""`marginal_delay`: the backend where a request adds the least delay, its own and what it imposes on others.

For a continuous-batching engine with chunked prefill, a request r (L input tokens, M max new tokens)
sent to backend i:

    h_i     = prompt tokens of r that i's prefix cache is predicted to hold (`RequestProfile.cached_tokens`,
              from `gateway.routing.prefix_index`); L_i = L − h_i, the tokens i would prefill
    p_i     = learned prefill s/token (p̂, `common.speed_estimator`; 2·P / F_i before any sample)
    s_i     = learned decode step (ŝ, the mean inter-token time the engine delivers)
    B_i     = prompt tokens sent to i whose first token has not come (chunked prefill serves them first),
              and other clients' requests the engine reports waiting, at a mean prompt (`state_table`)
    n_i     = requests in flight on i: decoding now, or prefilling ahead of r and so decoding by the
              time r's prefill runs (FIFO chunked prefill serves the backlog first); other clients' running
              there as last reported too
    K_i     = KV cache tokens; U_i = max(K_i − free tokens reported, this router's reservations there)
    R       = L + M, the KV tokens the request can come to hold
    κ_i, c_i = i's calibrated stall (`common.calibration`, fitted on its completed requests' decode
              times): a prompt's prefill there stalls every request decoding beside it by
              S_i = κ_i · L_i · p_i + c_i (κ = 1, c = 0 before any fit, or with `calibrate: false`)
    ρ_i     = the share of the prefix blocks i's cache evicted lately that later prompts asked for again,
              for a backend whose cache is full (`RequestProfile.evicted_reuse`; 0 otherwise)
    σ_i,k   = the k-th smallest inter-token slack of the requests in flight on i (k ≤ 3,
              `common.itl_slack`, in calibrated stall seconds): the stall it can still take before
              its mean inter-token time passes the target (`routing.itl_target_ms`, 100 ms)

    T_first = (B_i + L_i) · p_i + s_i                         its own time to first token
    T_stall = w_stall · n_i · S_i                              its prefill stalls every request decoding then
    T_itl   = w_itl · #{k : σ_i,k < S_i}                       the requests its prefill would make miss the target
    T_evict = w_evict · ρ_i · L_i · p_i                        the recomputation its L_i new blocks cause there
    T_dec   = w_decode · f · M · s_i                           its own decode
    T_kv    = max(0, U_i + R − K_i) / K_i · T̄_service(i)      waiting for the cache to turn over
    cost    = T_first + T_stall + T_itl + T_evict + T_dec + T_kv + veto · 1[R > K_i]

Why this wins on mixed tiers: prefill and decode speed differ by different factors between tiers
(an L40S prefills ~5x slower than an H100 but decodes only ~3x slower). T_first + T_stall sends long
prompts where prefill is cheap and few requests would stall behind them, T_dec sends short prompts
where decode is fast, and every term moves the moment a request is dispatched (B_i, n_i and the
reservations are this router's own counts), so a burst does not herd onto the backend that looked
best at the last scrape. Capacity is not configured: p̂ and ŝ are measured. T_stall counts the harm
of a prefill as delay summed over the requests it stalls; T_itl counts each against its own target:
one long chunked prefill on a slow tier breaks the mean inter-token time of a request with a few
tokens left to generate, not of one with hundreds, so the prompt goes where it breaks none.
A cached prefix enters as the prefill it saves on that backend, h_i · p_i seconds at that backend's
own speed: a hit on a slow tier is weighed against a miss on a fast one in the units of queueing, and
affinity gives way, per backend, once B_i · p_i (the queue) costs more than the recomputation saves.
A full cache is priced too: a prompt placed there evicts as many blocks as it adds, and where the
evicted blocks are asked for again (ρ_i, measured) that is recomputation another request pays there
later. Without T_evict the fastest tier takes every new conversation, its cache turns over faster
than conversations think, and their histories are recomputed. w_evict (16) weighs it far above a
one-for-one recomputation: ρ_i undercounts (a ghost list only as long as the cache, a block brought
back on another backend credited to every one that evicted it) and a lost block costs every later
block of its prompt and the queueing behind it; 16 was picked from 0, 8, 16, 32 and 64 on two seeds of
the multi-turn replay and checked on three others and the other workloads (benchmarks/results/routing_log.md).
T_dec counts a second of the request's own decode as a quarter of a second of waiting (w_decode 0.25):
a stream already faster than its reader gains little from a faster tier, and its inter-token target is
T_itl's; at full weight a fast tier's decode outbid a second of KV wait there, which sent the
hot-prefix replay's first tokens past 2 s on the H100s (94.7% goodput at 2.5x; 99.6% at 0.25, seeds 1-2)
while the engine family's goodput behind the overload queue did not move (benchmarks/results/routing_log.md).
The stall is what each engine really does, not what chunked prefill would do: a prefill-first engine
stalls its decodes for whole prompts and an extra step each (κ > 1, c of a step), which the
uncalibrated L · p̂ undercounts by half for short prompts; the slacks' budgets use the decode step
without stalls (s0), as ŝ already holds the average stall. On the engine family of
benchmarks/routing_family.py this calibration and w_itl 0.8 (from 0.3) took the median goodput gain
over capacity-weighted least-outstanding at 0.9x from +1.4 to +2.4 points on the tuned members
(benchmarks/results/routing_log.md). Near-equal costs (within `tie_tolerance`, 1%, of the lowest) are a tie, drawn
with a seeded rng (`seed`, or one injected), so identical backends share sequential requests.

Reads: request.cached_tokens, request.evicted_reuse, learned_prefill_s_per_token (falls back to prefill_s_per_token),
decode_step_s, in_flight, prefilling, prefill_backlog_tokens, kv_free_bytes, kv_total_bytes, kv_bytes_per_token,
kv_reserved_tokens, mean_service_s, itl_slack_s, stall_factor, stall_per_prompt_s. Parameters: w_stall
(0.2), w_itl (0.8 s a request broken), w_evict (16), w_decode (0.25), output_fraction f (0.5: max_tokens
overstates what is generated), veto (1e6 s), calibrate (true), tie_tolerance (0.01), seed (0). Pure, O(N); its one state
is the rng of the draw among ties. `choose` computes the terms as array operations on the candidates' columns
(`gateway.routing.policies.candidates`), each element the same IEEE arithmetic in the same order as `cost`,
the one-candidate form: the same costs and choices, at N=1024 in tens of microseconds instead of a
millisecond; up to LOOP_UP_TO candidates it loops over `cost`, which is cheaper there. T_kv and the veto
apply only where the request's reservation exceeds a candidate's KV headroom, mostly a few rows: those
are priced one at a time, in the same arithmetic (all rows as arrays past LOOP_UP_TO of them).
Limits: other clients' requests enter n_i and B_i as last reported, B_i's at a mean prompt's length; s_i is
an average over recent requests, so it lags a sudden change of batch size by about one request's decode
time; the stall terms assume FIFO chunked prefill; the slacks take each request's max_tokens as what it
generates and see this router's requests only; the calibration needs completed streamed requests (a backend
that gets none keeps its prior).
"""

from __future__ import annotations

import random
from bisect import bisect_left
from collections.abc import Sequence

import numpy as np
from pydantic import Field

from common.yaml_files import StrictModel
from gateway.routing.policies.candidates import (
    DECODE_STEP,
    IN_FLIGHT,
    ITL_SLACKS,
    KV_CAPACITY,
    KV_HEADROOM,
    KV_USED,
    LOOP_UP_TO,
    PREFILL_BACKLOG,
    SERVICE,
    SPEED_PREFILL,
    STALL_FACTOR,
    STALL_PER_PROMPT,
    Candidates,
    Draw,
    FloatArray,
    near_lowest,
)
from gateway.routing.policies.contracts import BackendSnapshot, CostColumns, CostTerms, Decision, RequestProfile
from gateway.routing.policies.first_token import prefill_stall_s


class MarginalDelayParams(StrictModel):
    w_stall: float = Field(default=0.2, ge=0)
    w_itl: float = Field(default=0.8, ge=0)
    w_evict: float = Field(default=16.0, ge=0)
    w_decode: float = Field(default=0.25, ge=0)
    output_fraction: float = Field(default=0.5, gt=0, le=1)
    veto: float = Field(default=1e6, ge=0)
    calibrate: bool = True          # the backends' calibrated models (False: their priors, the uncalibrated model)
    tie_tolerance: float = Field(default=0.01, ge=0)   # costs within this share of the lowest are a tie
    seed: int = 0                   # of the draw among ties


class MarginalDelay:
    name = "marginal_delay"
    Params = MarginalDelayParams

    def __init__(self, params: MarginalDelayParams | None = None, rng: Draw | None = None) -> None:
        p = params or MarginalDelayParams()
        self.w_stall, self.w_itl, self.w_evict, self.veto = p.w_stall, p.w_itl, p.w_evict, p.veto
        self.decode_share = p.w_decode * p.output_fraction
        self.calibrate, self.tie_tolerance = p.calibrate, p.tie_tolerance
        self.rng = rng or random.Random(p.seed)
        # The weights as 0-d arrays for `choose`: numpy multiplies 64 rows by one in 0.3 µs, by a Python float
        # (whose dtype it settles first, NEP 50) in 0.5, to the same float64 result.
        self._w_stall, self._w_itl, self._w_evict = np.array(p.w_stall), np.array(p.w_itl), np.array(p.w_evict)

    def choose(self, request: RequestProfile, candidates: Sequence[BackendSnapshot], now: float) -> Decision:
        if len(candidates) <= LOOP_UP_TO:   # a few candidates: a loop is cheaper than array operations
            costs = tuple([self.cost(request, b) for b in candidates])
            i = near_lowest([c.total for c in costs], self.rng, self.tie_tolerance)
            return Decision(candidates[i], self.name, costs)
        chosen = Candidates.of(candidates)
        c = chosen.columns
        length, new_tokens = request.input_tokens, request.max_output_tokens
        reserve = length + new_tokens
        # L_i, the tokens each candidate would prefill, less the prefix a few backends hold (their rows only).
        # Scalars enter the array operations as floats: numpy takes an int more slowly, to the same result.
        cached = request.cached_tokens
        fresh: float | FloatArray = chosen.left_of(length, cached) if cached else float(length)
        p, step, in_flight = c[SPEED_PREFILL], c[DECODE_STEP], c[IN_FLIGHT]
        fresh_p = fresh * p
        if self.calibrate:
            stall = c[STALL_FACTOR] * fresh_p + c[STALL_PER_PROMPT]
        else:
            stall = 1.0 * fresh_p + 0.0
        prefill = (c[PREFILL_BACKLOG] + fresh) * p + step + self._w_stall * in_flight * stall
        slacks = c[ITL_SLACKS]
        if np.count_nonzero(slacks[0] < stall):   # else T_itl is 0 everywhere, and x + 0.0 == x
            prefill = prefill + self._w_itl * (slacks < stall).sum(axis=0)
        if request.evicted_reuse:   # full caches: their rows only (0.0 elsewhere, and x + 0.0 == x)
            prefill = prefill + self._w_evict * chosen.column_of(request.evicted_reuse) * fresh_p
        queue = self.decode_share * new_tokens * step   # (f·w·M)·ŝ_i, as in `cost`
        short = (c[KV_HEADROOM] < float(reserve)).nonzero()[0]   # where T_kv or the veto may apply: mostly few
        if len(short) > LOOP_UP_TO:
            return self._decide_kv(chosen, reserve, prefill, queue)
        vetoed = self._kv_rows(c, short.tolist(), reserve, prefill, queue) if len(short) else []
        total = prefill + queue
        oom = None
        if vetoed:
            oom = np.zeros(len(total))
            oom[vetoed] = total[vetoed] = self.veto
        i = near_lowest(total, self.rng, self.tie_tolerance)
        return Decision(chosen[i], self.name, CostColumns(chosen.ids, prefill, queue, oom, total, i))

    def _kv_rows(self, c: FloatArray, rows: list[int], reserve: int, prefill: FloatArray, queue: FloatArray) -> (
        list[int]
    ):
        """T_kv added to `queue` in place at `rows`, those short of KV for the request (K_i known there),
        one element at a time in the arithmetic of `_decide_kv` (the same IEEE results): a few rows cost
        less so than the nine to fourteen array operations over all. Rows that can never hold it get the
        veto's zeros in `prefill` and `queue` and are returned."""
        vetoed = []
        for k in rows:
            capacity = c.item(KV_CAPACITY, k)
            if reserve > capacity:
                prefill[k] = queue[k] = 0.0
                vetoed.append(k)
            elif (over := c.item(KV_USED, k) + reserve - capacity) > 0:
                queue[k] = queue.item(k) + over / capacity * c.item(SERVICE, k)
        return vetoed

    def _decide_kv(self, chosen: Candidates, reserve: int, prefill: FloatArray, queue: FloatArray) -> Decision:
        """`choose` where many candidates' KV cannot take the request now, as array operations: T_kv where
        it must wait for the cache to turn over, the veto where it can never hold it."""
        c = chosen.columns
        capacity = c[KV_CAPACITY]
        over = c[KV_USED] + reserve - capacity
        known = capacity > 0   # K_i reported (0: unknown, no KV terms)
        waits = known & (over > 0)
        if np.count_nonzero(waits):   # .any() costs three times as much on small arrays
            queue = np.where(waits, queue + over / capacity * c[SERVICE], queue)
        total = prefill + queue
        vetoed = known & (reserve > capacity)
        oom = None
        if np.count_nonzero(vetoed):
            oom = np.where(vetoed, self.veto, 0.0)
            prefill, queue = np.where(vetoed, 0.0, prefill), np.where(vetoed, 0.0, queue)
            total = np.where(vetoed, self.veto, total)
        i = near_lowest(total, self.rng, self.tie_tolerance)
        return Decision(chosen[i], self.name, CostColumns(chosen.ids, prefill, queue, oom, total, i))

    def cost(self, request: RequestProfile, b: BackendSnapshot) -> CostTerms:
        """Cost terms: prefill = T_first + T_stall + T_itl, queue = T_dec + T_kv, oom = veto."""
        length, new_tokens = request.input_tokens, request.max_output_tokens
        reserve = length + new_tokens
        kv_per_token = b.kv_bytes_per_token
        capacity = b.kv_total_bytes // kv_per_token if kv_per_token else 0
        if capacity and reserve > capacity:
            return CostTerms(b.id, 0.0, 0.0, self.veto, self.veto)
        p = b.learned_prefill_s_per_token or b.prefill_s_per_token
        step = b.decode_step_s
        stalled = b.in_flight + b.foreign_running   # decoding now, or prefilling before this one: any client's
        fresh = length - request.cached_tokens.get(b.id, 0)   # L_i: what i would prefill
        if self.calibrate:
            stall = prefill_stall_s(b, fresh)
        else:
            stall = 1.0 * (fresh * p) + 0.0
        slacks = b.itl_slack_s   # ascending: those below the stall are the first bisect_left
        broken = bisect_left(slacks, stall) if slacks and slacks[0] < stall else 0
        prefill = (b.prefill_backlog_tokens + fresh) * p + step + self.w_stall * stalled * stall + self.w_itl * broken
        if rho := request.evicted_reuse.get(b.id, 0.0):
            prefill += self.w_evict * rho * (fresh * p)
        queue = self.decode_share * new_tokens * step
        if capacity:
            used = max(capacity - b.kv_free_bytes // kv_per_token, b.kv_reserved_tokens)
            over = used + reserve - capacity
            if over > 0:
                queue += over / capacity * b.mean_service_s
        return CostTerms(b.id, prefill, queue, 0.0, prefill + queue)

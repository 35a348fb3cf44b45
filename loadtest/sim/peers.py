"""The routers an operator would otherwise put in front of the engines, emulated as policies for the simulator.

The routing benchmarks measure the gateway against its peers in one run, on the same requests; the
peers are Rust processes that cannot run on a virtual clock, so they are emulated here from their
documented rules and defaults, as `Policy` objects the discrete-event simulator
(`loadtest.sim.simulator.simulate`, the engine family) drives as it drives the gateway's own.

**sglang-router / SMG `cache_aware`** (`SglangCacheAware`; vllm-router, a fork of it, has the same
policy and defaults). Rules emulated (`cache_aware_pick`, which `benchmarks/prefix_affinity.py` uses
with its own prefix index):

- a worker's load is the number of requests the router has in flight there (its own counter; it
  reads no engine signal);
- the workers are imbalanced when max − min > `balance_abs_threshold` (64) and max >
  `balance_rel_threshold` (1.5) × min: the least loaded worker (the first on a tie);
- otherwise the worker with the longest match between this prompt and the prompts routed to it, if
  that match covers more than `cache_threshold` (0.3) of the prompt; else the least loaded (what the
  policy's code does; its older header comment says the worker with the smallest tree).

Here the match is the gateway's prefix index's prediction (`RequestProfile.cached_tokens`) where the
run has one; without shared prefixes (the engine family's chat mix) the rule is least-outstanding,
unweighted. Left out: the radix tree over characters (blocks of tokens stand for it) and its LRU
eviction (`max_tree_size`, `eviction_interval_secs`), the session-id map, per-model trees, retries.

**vllm-router `power_of_two`** (`VllmPowerOfTwo`), as the live benchmark ran it (`--policy
power_of_two`, `worker_load_check_interval` 1 s; vllm-router's own default, `cache_aware`, is the
rule above):

- every `poll_s` (1 s) the router polls each worker's load: vLLM's `/load`, the requests its API
  server is serving, which behind one router are the router's requests in flight there;
- each request draws two distinct workers at random and goes to the one with the lower polled load
  (the first drawn on a tie). Between polls the loads it compares do not move, whatever it sends.

The simulator has no timers of its own, so a poll happens at the first decision at or after each
multiple of `poll_s`: what the router reads is up to `poll_s` old, plus one gap between arrivals.
A worker the last poll did not see counts the router's in-flight count there, as the router falls
back to. Left out: newer releases add the router's own in-flight count to the polled load (which
damps what a stale poll does); retries and circuit breakers.

Neither peer weighs a worker by its speed: that is what they do, and what the benchmarks measure.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

from gateway.routing.policies.candidates import first_lowest
from gateway.routing.policies.contracts import BackendSnapshot, CostTerms, Decision, RequestProfile


@dataclass(frozen=True, slots=True)
class CacheAwareThresholds:
    """sglang-router's (and SMG's, and vllm-router's) defaults."""

    cache: float = 0.3          # --cache-threshold: the share of the prompt a match must pass
    balance_abs: int = 64       # --balance-abs-threshold
    balance_rel: float = 1.5    # --balance-rel-threshold


def cache_aware_pick(loads: Sequence[int], match: tuple[int, int] | None, prompt_tokens: int,
                     thresholds: CacheAwareThresholds = CacheAwareThresholds()) -> int:
    """The index of the worker `cache_aware` picks. `loads`: requests in flight per worker (at least one
    worker); `match`: (worker index, prompt tokens it matches) of the longest match, or None."""
    least = first_lowest(loads)
    low, high = loads[least], max(loads)
    if high - low > thresholds.balance_abs and high > thresholds.balance_rel * low:
        return least
    if match is not None and prompt_tokens and match[1] / prompt_tokens > thresholds.cache:
        return match[0]
    return least


def _load_costs(candidates: Sequence[BackendSnapshot], loads: Sequence[int]) -> tuple[CostTerms, ...]:
    return tuple(CostTerms(b.id, 0.0, float(n), 0.0, float(n)) for b, n in zip(candidates, loads, strict=True))


class SglangCacheAware:
    """sglang-router's `cache_aware` on the router's own in-flight counts (see the module docstring)."""

    name = "sglang_cache_aware"

    def __init__(self, thresholds: CacheAwareThresholds = CacheAwareThresholds()) -> None:
        self.thresholds = thresholds

    def choose(self, request: RequestProfile, candidates: Sequence[BackendSnapshot], now: float) -> Decision:
        loads = [b.in_flight for b in candidates]
        cached = request.cached_tokens
        match = None
        if cached:
            hits = [cached.get(b.id, 0) for b in candidates]
            best = max(range(len(hits)), key=hits.__getitem__)
            match = (best, hits[best]) if hits[best] else None
        k = cache_aware_pick(loads, match, request.input_tokens, self.thresholds)
        return Decision(candidates[k], self.name, _load_costs(candidates, loads))


class VllmPowerOfTwo:
    """vllm-router's `power_of_two` on loads polled every `poll_s` (see the module docstring)."""

    name = "vllm_power_of_two"

    def __init__(self, seed: int = 0, poll_s: float = 1.0) -> None:
        if poll_s <= 0:
            raise ValueError(f"poll_s must be > 0, not {poll_s}")
        self.poll_s = poll_s
        self._rng = random.Random(seed)
        self._polled: dict[str, int] = {}
        self._next_poll = -math.inf

    def polled(self, candidates: Sequence[BackendSnapshot], now: float) -> list[int]:
        """Each candidate's load as the last poll read it (a poll first if one is due at `now`)."""
        if now >= self._next_poll:
            self._polled = {b.id: b.in_flight for b in candidates}
            self._next_poll = (math.floor(now / self.poll_s) + 1) * self.poll_s
        polled = self._polled
        return [polled.get(b.id, b.in_flight) for b in candidates]

    def choose(self, request: RequestProfile, candidates: Sequence[BackendSnapshot], now: float) -> Decision:
        loads = self.polled(candidates, now)
        if len(candidates) == 1:
            return Decision(candidates[0], self.name, _load_costs(candidates, loads))
        a, b = self._rng.sample(range(len(candidates)), 2)
        k = a if loads[a] <= loads[b] else b
        pair = (candidates[a], candidates[b])
        return Decision(candidates[k], self.name, _load_costs(pair, (loads[a], loads[b])))

"""The mixed-tier benchmark's workload and the cluster capacity it is scaled to.

Heavy-tailed chat prompts: two thirds short (log-normal, median 200 tokens, 16-1,000), one third
long (uniform 1,500-3,400 tokens); outputs log-normal, median 24 tokens, 4-200 (a request always
generates its max_tokens). Open-loop Poisson arrivals. Every prompt starts with distinct text, so
that prefix-cache routing (sglang-router's cache_aware) sees no false sharing.

Capacity: each engine alone is driven to saturation in emulated time (the engine's own `Batcher`,
no sockets: all requests queued at once, throughput up to the 90th-percentile completion), and
the cluster's capacity is the sum over engines. A load of 0.9x is 0.9 times that arrival rate.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import orjson

from benchmarks.emulated_engine import MODEL, Batcher, Seq, TierSpeed

SHORT_SHARE = 2 / 3
_WORDS = "alpha beta gamma delta sigma omega lambda kappa theta zeta".split()


@dataclass(frozen=True, slots=True)
class Request:
    at_s: float              # arrival offset from the start of the run
    prompt_tokens: int
    max_tokens: int
    body: bytes


def lengths(rng: random.Random) -> tuple[int, int]:
    if rng.random() < SHORT_SHARE:
        prompt = int(min(1000, max(16, rng.lognormvariate(5.3, 0.8))))
    else:
        prompt = rng.randint(1500, 3400)
    output = int(min(200, max(4, rng.lognormvariate(3.18, 0.8))))
    return prompt, output


def prompt_text(rng: random.Random, tokens: int, tag: str) -> str:
    """Text the gateway and the engines count as `tokens` tokens (4 bytes a token, 4 per message)."""
    size = 4 * max(1, tokens - 4)
    words = [tag]
    n = len(tag)
    while n < size:
        w = rng.choice(_WORDS)
        words.append(w)
        n += len(w) + 1
    return " ".join(words)[:size]


def trace(n: int, rate_rps: float, seed: int, model: str = MODEL) -> list[Request]:
    rng = random.Random(seed)
    t, out = 0.0, []
    for i in range(n):
        t += rng.expovariate(rate_rps)
        prompt, output = lengths(rng)
        text = prompt_text(rng, prompt, f"r{seed}-{i}-{rng.getrandbits(32):08x}")
        body = orjson.dumps({"model": model, "messages": [{"role": "user", "content": text}],
                             "max_tokens": output, "stream": True})
        out.append(Request(t, prompt, output, body))
    return out


def saturated_rate(tier: TierSpeed, n: int = 600, seed: int = 7) -> float:
    """Requests/s one engine of `tier` completes with an unbounded queue of this workload."""
    rng = random.Random(seed)
    return queue_rate(tier, [lengths(rng) for _ in range(n)])


def queue_rate(tier: TierSpeed, sizes: list[tuple[int, int]]) -> float:
    """Requests/s one engine of `tier` completes with all of `sizes` (prompt, output) queued at once, over
    its first 90% (the tail runs below a full batch), no prefix cache."""
    b = Batcher(tier)
    for prompt, output in sizes:
        b.waiting.append(Seq(prompt, output, 0.0))
    now, done, target = 0.0, 0, int(0.9 * len(sizes))
    while done < target:
        plan = b.plan()
        if plan is None:
            break
        now += plan.duration_s
        done += len(b.apply(plan))
    return done / now

"""Cache-aware routing on mixed tiers, replayed in virtual time: shared-prefix chat, no sharing, a hot prefix.

    nice -n 19 python benchmarks/prefix_affinity.py [--seeds 1 2 3 4 5] [--sessions 600] [--loads 1.0 1.5] \
        [--workloads multiturn nosharing hotprefix] [--targets rr cwlor hg-blind hg-cache ...] [--latency]

The eight emulated engines of the mixed-tier benchmark (benchmarks/emulated_engine.py: 2 x H100, 3 x
A100-80GB, 3 x L40S, chunked prefill, KV 60k / 50k / 24k tokens) with vLLM-like automatic prefix caching
(`common.prefix_blocks.EnginePrefixCache`: running sequences' blocks pinned, free blocks cached and
evicted least recently used first, prefill skipped for the cached prefix, vLLM's query / hit counters),
stepped in emulated time; no sockets. The gateway targets are its real objects on a virtual clock: the
state table (leases, learned speeds, engine reports every --interval-ms), the policy, and the prefix
index fed the engines' counters, as the pipeline wires them. Targets:

    rr          round robin
    cwlor       capacity-weighted least outstanding (weights: each engine's saturated rate on the workload)
    sglang-ca   sglang-router / SMG `cache_aware`, emulated from their documented rules and SMG's defaults
                (loadtest/sim/peers.py): the prompts routed to each worker (the gateway's block index
                standing in for their radix tree, bounded by each engine's KV, which their tree is not);
                loads = requests in flight. Imbalanced (max - min > 64 and max > 1.5 x min): the least
                loaded; else the worker with the longest match if it covers more than 30% of the
                prompt, else the least loaded
    hg-blind    the gateway's default policy without cache awareness (gateway.routing.prefix_cache off)
    hg-cache    the gateway's default: the prefix index from the prompts' text blocks
    hg-noevict  hg-cache without the price of filling a full cache (marginal_delay w_evict 0: T_evict off)
    hg-session  hg-cache, and the clients name their conversation (x-session-id)
    hg-imagesfirst  hg-cache with its index told every image heads the prompt (the index before images
                took their places; the engines still cache them where they are)
    hg-oracle   hg-cache told each engine's exact cache content at routing time in place of the index's
                prediction (a reference; the price of a full cache, ρ_i, still from its index)
    hg-default  hg-cache behind the gateway's overload queue with its defaults (gateway.overload, on by
                default): the gateway as it runs by default. A request it refuses (429) is a miss; a
                refused turn ends its conversation, and its later turns count as misses too
    hg-3shared  three hg-cache replicas behind a round-robin balancer, sharing in-flight counts and their
                prefix indexes through the real Redis (--redis-url; gateway.replicas.shared_state, refreshed
                every 50 ms of virtual time, the spreading layer on, as `--redis-url` runs them)
    hg-3alone   the same three replicas, each on its own view (no Redis)
    hg-noforeign  hg-cache with the requests other clients leave waiting in an engine (--foreign) unpriced:
                the gateway before it read them from the engines' reports (StateTable's foreign backlog)

Workloads (each request's prompt is the chat rendered as the gateway renders it, `role: text` lines):

    multiturn   tenants (--tenants, 32) with system prompts of 1,000-2,500 tokens; conversations arrive
                Poisson, 3-10 turns each; every turn resends the system prompt and the whole history with a
                new user message (16-400 tokens, median 80) and arrives an exponential think time (mean
                3 s) after the previous answer's last token; answers 16-384 tokens (median 96); a
                conversation ends early where the next turn would pass the 4,096-token context
    nosharing   the mixed-tier benchmark's single requests (benchmarks/mixed_workload.py), every prompt distinct
    hotprefix   single requests, 80% of them one tenant's 2,400-token system prompt and a question of
                their own, the rest distinct prompts of the mixed-tier mix
    repeatimage single requests with one image (576 tokens, LLaVA-1.5's) drawn from 200 images of Zipf
                popularity (s = 1.1: the top 10 are a third of the requests) and, 60% of the time, one of 8
                common questions about it (else a question of its own, 16-400 tokens); the engines cache
                image tokens as prefix blocks named by the image's content hash, as the gateway's index does
                (at its place: the image heads the user's message); only the language pool is replayed (no
                encoders)
    imagechat   repeatimage's images and questions after a tenant's system prompt (--tenants, 1,000-2,500
                tokens): system prompt, then the image, then the question, as a chat puts them

--foreign SHARE: other clients send each engine of the fastest tier (the H100s) SHARE of its saturated
rate straight (single requests of the workload's sizes, prompts of their own: no cache hits), as
applications sharing a vLLM deployment do; the gateway sees them only in the engines' reports (waiting,
running). Scored apart: their TTFT p50 / p90 (`foreign_ttft_*`) over those that started before the
gateway's last request ended (`foreign_unstarted`: the others, left out).

Load (--loads, by default per workload: DEFAULT_LOADS) is a multiple of the cache-blind capacity: each
engine alone saturated in emulated time with the workload's requests and no cache (as
benchmarks/mixed_workload.saturated_rate), summed; shared prefixes let a cluster carry more than that.
Every target first serves an unscored warm-up (--warmup conversations at 0.6x, other conversations of
the same tenants) on the same engines, which then serve the scored run (--sessions conversations,
--requests single requests) with what they cached. Per workload, load and target, medians over seeds
(range for goodput): goodput (TTFT <= 2 s and mean inter-token time <= 100 ms), TTFT p50 / p90 / p99,
the engines' prefix hit rate (hit / prompt tokens), prompt tokens prefilled per request, tier shares of
requests, and the largest engine's request share over its capacity share; for the gateway with its
index, the hit rate it predicted against the one the engines reported.

--latency: the gateway's per-request cost of cache-aware routing at N=64 backends (hashing the prompt,
index lookup, the policy's decision, recording; CPU time of the thread), from the multiturn workload's
prompts, with the garbage collector as the gateway runs it (its thresholds, the set-up frozen).

Writes benchmarks/results/prefix_affinity.json and prints the tables docs/ROUTING.md quotes. What the
replay leaves out: network and gateway latency, CPU, scrape jitter (as benchmarks/routing_replay.py).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import gc
import heapq
import itertools
import random
import statistics
import sys
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.emulated_engine import BLOCK_SIZE, MAX_MODEL_LEN, TIERS, Batcher, Seq, TierSpeed  # noqa: E402
from benchmarks.gateway_overhead import git_state, save_report  # noqa: E402
from benchmarks.mixed_workload import lengths, prompt_text, queue_rate  # noqa: E402
from benchmarks.routing_replay import (  # noqa: E402
    CLUSTER,
    ITL_SLO_S,
    LANGUAGE,
    MODEL,
    TTFT_SLO_S,
    Clock,
    Gateway,
    Proxy,
    Router,
)
from common.catalog import load_catalog  # noqa: E402
from common.prefix_blocks import EnginePrefixCache, content_digest, prompt_blocks  # noqa: E402
from gateway.config.cluster import PrefixCacheConfig  # noqa: E402
from gateway.config.sections import OverloadConfig, RedisConfig  # noqa: E402
from gateway.daemon import GC_THRESHOLDS  # noqa: E402
from gateway.replicas.shared_state import SharedState, connect  # noqa: E402
from gateway.routing.backend_entry import Reported  # noqa: E402
from gateway.routing.policies import build_policy  # noqa: E402
from gateway.routing.policies.contracts import RequestProfile  # noqa: E402
from gateway.routing.policies.spreading import Spreading  # noqa: E402
from gateway.routing.prefix_index import PrefixIndex, PrefixQuery  # noqa: E402
from gateway.routing.state_table import StateTable  # noqa: E402
from loadtest.planner.options import at_least, non_negative, positive, unwritable  # noqa: E402
from loadtest.sim.gate import SimGate  # noqa: E402
from loadtest.sim.peers import cache_aware_pick  # noqa: E402

Cluster = Sequence[tuple[str, TierSpeed]]   # (backend id, its engine's tier), registered in this order
MIXED_TIER: Cluster = tuple((eid, TIERS[tier]) for eid, tier in CLUSTER)
RESULTS = ROOT / "benchmarks" / "results" / "prefix_affinity.json"
LATENCY_RESULTS = ROOT / "benchmarks" / "results" / "prefix_affinity_latency.json"
TARGETS = ("rr", "cwlor", "sglang-ca", "hg-blind", "hg-noevict", "hg-cache", "hg-session", "hg-oracle", "hg-default",
           "hg-3shared", "hg-3alone", "hg-imagesfirst", "hg-noforeign")
DEFAULT_TARGETS = TARGETS[:9]   # the replica targets need Redis: named on the command line
REPLICAS, REFRESH_S = 3, 0.05
WORKLOADS = ("multiturn", "nosharing", "hotprefix", "repeatimage", "imagechat")
# Loads (times the cache-blind capacity) by default: shared prefixes carry more than the blind capacity, so
# the multiturn and hot-prefix runs go past it; the no-sharing run is the mixed-tier benchmark's 0.9x and 1.0x.
DEFAULT_LOADS = {"multiturn": [1.0, 1.5, 2.0], "nosharing": [0.9, 1.0], "hotprefix": [2.0, 2.5, 3.0],
                 "repeatimage": [1.0, 1.5, 2.0], "imagechat": [1.0, 1.5, 2.0]}
HOT_SHARE, THINK_MEAN_S, DEFAULT_TENANTS = 0.8, 3.0, 32
IMAGE_POOL, IMAGE_TOKENS, IMAGE_ZIPF, COMMON_QUESTIONS, COMMON_SHARE = 200, 576, 1.1, 8, 0.6
IMAGE_PLACE = len(b"user: ")   # the image heads the user's message, before its question
_IMAGE_WEIGHTS = list(itertools.accumulate(1 / (k + 1) ** IMAGE_ZIPF for k in range(IMAGE_POOL)))
_WORDS = "policy refund order account invoice shipping answer customer ticket window".split()


# -- workloads -----------------------------------------------------------------------------------

def text(rng: random.Random, tokens: int, tag: str) -> str:
    """Text of `tokens` tokens as the gateway counts them (4 bytes a token), starting with `tag`."""
    size = 4 * max(1, tokens)
    words, n = [tag], len(tag)
    while n < size:
        w = rng.choice(_WORDS)
        words.append(w)
        n += len(w) + 1
    return " ".join(words)[:size]


def tokens_of(messages: list[tuple[str, str]]) -> int:
    """The gateway's estimate (gateway.requests.tokens): 4 bytes a token, 4 a message."""
    return sum(max(1, -(-len(t.encode()) // 4)) + 4 if t else 4 for _, t in messages)


def render(messages: list[tuple[str, str]]) -> str:
    return "\n".join(f"{role}: {t}" for role, t in messages)


@dataclass(slots=True)
class Conversation:
    """A client's conversation: its turns arrive one after the other (a think time after each answer)."""

    id: str
    start_s: float
    system: str                                   # "" for none
    turns: list[tuple[str, int]]                  # (user message, output tokens)
    thinks: list[float]                           # seconds before each turn after the first
    replies: list[str] = field(default_factory=list)   # the answers so far, as the client keeps them
    sent: int = 0                                 # turns sent
    images: tuple[tuple[int, int, int], ...] = ()   # (content digest, tokens, place) of its images, every turn

    def tokens(self) -> int:
        """The next turn's prompt tokens: its messages' and its images'."""
        return tokens_of(self.messages()) + sum(tokens for _, tokens, _ in self.images)

    def messages(self) -> list[tuple[str, str]]:
        """The next turn's messages: the system prompt, the history, the new user message."""
        out = [("system", self.system)] if self.system else []
        for k in range(self.sent):
            out += [("user", self.turns[k][0]), ("assistant", self.replies[k])]
        return [*out, ("user", self.turns[self.sent][0])]


def output_tokens(rng: random.Random) -> int:
    return int(min(384, max(16, rng.lognormvariate(4.56, 0.7))))   # median 96


def user_tokens(rng: random.Random) -> int:
    return int(min(400, max(16, rng.lognormvariate(4.38, 0.8))))   # median 80


def tenants(seed: int, n: int) -> list[str]:
    rng = random.Random(seed)
    return [text(rng, rng.randint(1000, 2500), f"tenant-{k}-instructions") for k in range(n)]


def conversations(workload: str, n: int, rate: float, seed: int, tenant_prompts: list[str]) -> list[Conversation]:
    """`n` conversations starting Poisson at `rate` a second (single requests: one turn each)."""
    rng = random.Random(seed)
    t, out = 0.0, []
    hot = text(random.Random(seed), 2400, "hot-tenant-instructions")
    for i in range(n):
        t += rng.expovariate(rate)
        tag = f"s{seed}-{i}-{rng.getrandbits(32):08x}"
        if workload == "multiturn":
            count = rng.randint(3, 10)
            turns = [(text(rng, user_tokens(rng), f"{tag}-q{k}"), output_tokens(rng)) for k in range(count)]
            out.append(Conversation(tag, t, rng.choice(tenant_prompts), turns,
                                    [rng.expovariate(1 / THINK_MEAN_S) for _ in turns]))
        elif workload in ("repeatimage", "imagechat"):
            system = rng.choice(tenant_prompts) if workload == "imagechat" else ""
            picture = rng.choices(range(IMAGE_POOL), cum_weights=_IMAGE_WEIGHTS)[0]
            if rng.random() < COMMON_SHARE:
                q = rng.randrange(COMMON_QUESTIONS)
                question = text(random.Random(q), 40, f"common-question-{q}")
            else:
                question = text(rng, user_tokens(rng), tag)
            place = len(render([("system", system), ("user", "")]).encode()) if system else IMAGE_PLACE
            out.append(Conversation(tag, t, system, [(question, output_tokens(rng))], [0.0],
                                    images=((content_digest(f"image-{picture}".encode()), IMAGE_TOKENS, place),)))
        elif workload == "hotprefix" and rng.random() < HOT_SHARE:
            question = text(rng, user_tokens(rng), tag)
            out.append(Conversation(tag, t, hot, [(question, output_tokens(rng))], [0.0]))
        else:   # a distinct prompt of the mixed-tier mix
            prompt, output = lengths(rng)
            out.append(Conversation(tag, t, "", [(prompt_text(rng, prompt, tag), output)], [0.0]))
    return out


def request_sizes(workload: str, seed: int, tenant_prompts: list[str], n: int = 300) -> list[tuple[int, int]]:
    """(prompt, output) tokens of the workload's requests, every turn of `n` conversations (answers of
    their output length), for the capacity."""
    sizes = []
    rng = random.Random(seed)
    for c in conversations(workload, n, 1.0, seed, tenant_prompts):
        for k, (_, output) in enumerate(c.turns):
            tokens = c.tokens()
            if tokens + output > MAX_MODEL_LEN:
                break
            sizes.append((tokens, output))
            c.replies.append(text(rng, output, "a"))
            c.sent = k + 1
    return sizes


# -- routers -------------------------------------------------------------------------------------

@dataclass(slots=True)
class Request:
    conversation: Conversation
    prompt: str
    tokens: int
    max_tokens: int
    hashes: list[int]
    arrived: float = 0.0


class RoundRobin(Router):
    def __init__(self, engines: list[str]) -> None:
        self._next = itertools.cycle(engines)

    def route(self, r: Request) -> tuple[str, Any]:
        return next(self._next), None


class SglangCacheAware(Router):
    """sglang-router / SMG `cache_aware`, emulated: its rules (`loadtest.sim.peers.cache_aware_pick`, which
    the engine family's emulation uses too) on this router's own block index of what it routed."""

    def __init__(self, engines: dict[str, Batcher]) -> None:
        self.index = PrefixIndex()
        for eid, b in engines.items():
            self.index.add_backend(eid, b.tier.num_blocks * BLOCK_SIZE)
        self.load = dict.fromkeys(engines, 0)
        self.ids = list(engines)

    def route(self, r: Request) -> tuple[str, Any]:
        load = self.load
        query = self.index.lookup(self.index.hashes(r.prompt, (), r.tokens, r.conversation.images), "", r.tokens)
        match = None
        if query.cached:
            matched, hit = max(query.cached.items(), key=lambda kv: kv[1])
            match = (self.ids.index(matched), hit)
        eid = self.ids[cache_aware_pick(list(load.values()), match, r.tokens)]
        self.index.record(query, eid, 0)
        load[eid] += 1
        return eid, eid

    def done(self, handle: Any, tokens: int) -> None:
        self.load[handle] -= 1


class CacheAware(Gateway):
    """The gateway's table and policy (routing_replay.Gateway) and, as the pipeline wires it, the prefix
    index (`mode` "index", "session", "imagesfirst": images hashed as heading the prompt), the engines'
    exact caches in place of its prediction (`mode` "oracle"), or neither ("blind"). With `overload`,
    behind the gateway's overload queue (gateway.pipeline.overload, driven on the virtual clock by
    loadtest/sim/gate.py as the simulator drives it): `route` returns None for a request it holds or
    refuses; `released` and `refused` collect what it let go or refused since the replay last took them."""

    def __init__(self, mode: str, clock: Clock, engines: dict[str, Batcher],
                 params: dict[str, Any] | None = None, overload: OverloadConfig | None = None) -> None:
        super().__init__("marginal_delay", params or {}, clock, [(eid, b.tier.name) for eid, b in engines.items()])
        self.mode, self.engines = mode, engines
        self.gate = None if overload is None else SimGate(
            overload, lambda now: self.table.candidates(LANGUAGE, now), self._let_go, self._refuse)
        self.held: dict[int, tuple[Request, PrefixQuery | None]] = {}
        self.ids = itertools.count()
        self.released: list[tuple[Request, str, Any]] = []
        self.refused: list[Request] = []
        config = PrefixCacheConfig()
        self.index = PrefixIndex(config.block_tokens, config.max_blocks_per_backend) if mode in (
            "index", "session", "imagesfirst", "oracle") else None
        if self.index is not None:
            for entry in self.table.entries():
                self.index.add_backend(entry.id, self.table.kv_capacity(entry)[1] // self.model.kv_bytes_per_token)

    def route(self, r: Request) -> tuple[str, Any] | None:
        profile, query = self._profile(r)
        if self.gate is None:
            return self._place(r, profile, query)
        i = next(self.ids)
        self.held[i] = (r, query)
        if not self.gate.arrive(i, profile, self.clock.now):
            return None
        del self.held[i]
        return self._place(r, profile, query)

    def engine_event(self, completed: int) -> None:
        if self.gate is not None:
            self.gate.engine_event(self.clock.now, completed)

    def next_due(self) -> float | None:
        return self.gate.next_due() if self.gate is not None and self.gate.held else None

    def release(self) -> None:
        if self.gate is not None and self.gate.held:
            self.gate.release(self.clock.now)

    def _let_go(self, i: int, profile: RequestProfile, now: float) -> None:
        r, query = self.held.pop(i)
        self.released.append((r, *self._place(r, profile, query)))

    def _refuse(self, i: int) -> None:
        self.refused.append(self.held.pop(i)[0])

    def _profile(self, r: Request) -> tuple[RequestProfile, PrefixQuery | None]:
        """The request as the policy reads it, and the index's view of its prompt (None without an index)."""
        cached: dict[str, int] = {}
        reuse: Mapping[str, float] = {}
        query = None
        if self.index is not None:
            session = r.conversation.id if self.mode == "session" else ""
            images = r.conversation.images
            if self.mode == "imagesfirst":
                images = tuple((digest, tokens, 0) for digest, tokens, _ in images)
            blocks = self.index.hashes(r.prompt, (), r.tokens, images)
            query = self.index.lookup(blocks, session, r.tokens)
            cached, reuse = dict(query.cached), query.reuse
        if self.mode == "oracle":   # the engines' exact caches in place of the index's prediction (ρ_i its)
            cached = {}
            for eid, b in self.engines.items():
                assert b.cache is not None
                if hit := b.cache.match(r.hashes, r.tokens):
                    cached[eid] = hit
        return RequestProfile(r.conversation.id, r.tokens, r.max_tokens, cached_tokens=cached,
                              evicted_reuse=reuse), query

    def _place(self, r: Request, profile: RequestProfile, query: PrefixQuery | None) -> tuple[str, Any]:
        """Choose (among the backends that take it, behind the overload queue), record, lease."""
        now = self.clock.now
        candidates = self.table.candidates(LANGUAGE, now).fitting(r.tokens + r.max_tokens)
        if self.gate is None:
            backend = self.policy.choose(profile, candidates, now).backend
        else:
            backend = self.gate.route(lambda within: self.policy.choose(profile, within, now), candidates,
                                      profile).backend
        cached = profile.cached_tokens
        if self.index is not None and query is not None:
            entry = self.table.get(backend.id)
            assert entry is not None
            self.index.read(entry)
            self.index.record(query, backend.id, backend.kv_total_bytes // backend.kv_bytes_per_token)
        return backend.id, self.table.acquire(backend.id, r.tokens, r.max_tokens, cached.get(backend.id, 0))

    def report(self, engine_id: str, b: Batcher) -> None:
        per_block = BLOCK_SIZE * self.model.kv_bytes_per_token
        self.seq += 1
        queries, hits = (b.cache.queries, b.cache.hits) if b.cache is not None else (0, 0)
        self.table.apply_heartbeat(engine_id, self.seq, engine_id, Reported(
            seq=self.seq, waiting=len(b.waiting), running=len(b.running), kv_free_bytes=b.free_blocks * per_block,
            kv_total_bytes=b.tier.num_blocks * per_block, max_model_len=MAX_MODEL_LEN, kv_source="engine",
            prefix_cache_queries=queries, prefix_cache_hits=hits))


class Replicas(Router):
    """`REPLICAS` gateways with the prefix index (CacheAware "index") behind a round-robin balancer. With a
    `redis_url` they run as `--redis-url` runs them: the spreading layer on the policy, and a real
    `SharedState` each (in-flight counts and the prefix index through Redis) refreshed every REFRESH_S of
    virtual time, checked at each engine report; without, each routes on its own view."""

    def __init__(self, clock: Clock, engines: dict[str, Batcher], redis_url: str) -> None:
        self.members = [CacheAware("index", clock, engines) for _ in range(REPLICAS)]
        self.clock, self.turn, self.next_refresh = clock, 0, 0.0
        self.loop = asyncio.new_event_loop()
        self.shared: list[SharedState] = []
        self.config = RedisConfig(url=redis_url, key_prefix=f"hgbench:prefix:{uuid.uuid4().hex[:8]}:",
                                  refresh_ms=round(REFRESH_S * 1000), replica_ttl_ms=600_000, timeout_ms=5000)
        self.redis = connect(self.config, redis_url) if redis_url else None
        for k, m in enumerate(self.members):
            if self.redis is not None:
                m.policy = Spreading(m.policy, self.config.spread, seed=f"replica-{k}")
                self.shared.append(SharedState(m.table, self.redis, self.config, f"replica-{k}", prefixes=m.index))

    def route(self, r: Request) -> tuple[str, Any]:
        member = self.members[self.turn % REPLICAS]
        self.turn += 1
        eid, handle = member.route(r)
        return eid, (member, handle)

    def first_token(self, handle: Any) -> None:
        handle[0].first_token(handle[1])

    def done(self, handle: Any, tokens: int) -> None:
        handle[0].done(handle[1], tokens)

    def report(self, engine_id: str, b: Batcher) -> None:
        for m in self.members:
            m.report(engine_id, b)
        if self.shared and self.clock.now >= self.next_refresh:
            for shared in self.shared:
                self.loop.run_until_complete(shared.refresh())
            self.next_refresh = self.clock.now + REFRESH_S

    def close(self) -> None:
        """Withdraw, delete every key of this run, close the client and the loop."""
        if self.redis is not None:
            redis = self.redis

            async def clean() -> None:
                for shared in self.shared:
                    await shared.withdraw()
                keys = [k async for k in redis.scan_iter(match=self.config.key_prefix + "*")]
                if keys:
                    await redis.delete(*keys)
                await redis.aclose()

            self.loop.run_until_complete(clean())
        self.loop.close()


def make_router(target: str, clock: Clock, engines: dict[str, Batcher], rates: dict[str, float],
                redis_url: str = "") -> Router:
    if target in ("hg-3shared", "hg-3alone"):
        return Replicas(clock, engines, redis_url if target == "hg-3shared" else "")
    if target == "rr":
        return RoundRobin(list(engines))
    if target == "sglang-ca":
        return SglangCacheAware(engines)
    if target == "cwlor":
        return Proxy(rates)
    if target == "hg-noevict":
        return CacheAware("index", clock, engines, {"w_evict": 0.0})
    if target == "hg-default":
        return CacheAware("index", clock, engines, overload=OverloadConfig())
    if target == "hg-noforeign":   # the engines' reports of other clients' waiting requests left unpriced
        router = CacheAware("index", clock, engines)
        router.table._note_foreign = lambda entry, reported: None   # type: ignore[method-assign]
        return router
    mode = {"hg-blind": "blind", "hg-cache": "index", "hg-session": "session", "hg-oracle": "oracle",
            "hg-imagesfirst": "imagesfirst"}[target]
    return CacheAware(mode, clock, engines)


# -- the replay ----------------------------------------------------------------------------------

@dataclass(slots=True)
class Outcome:
    engine: str
    prompt: int
    max_tokens: int
    arrived: float
    cached: int = 0
    first: float = float("nan")
    last: float = float("nan")

    @property
    def ttft(self) -> float:
        return self.first - self.arrived

    @property
    def itl(self) -> float:
        return (self.last - self.first) / (self.max_tokens - 1) if self.max_tokens > 1 else 0.0


@dataclass(order=True)
class _Event:
    at: float
    order: int
    kind: str = field(compare=False)
    what: Any = field(compare=False)


def serve(router: Router, engines: dict[str, Batcher], convs: list[Conversation], clock: Clock,
          interval_s: float, seed: int, foreign: Mapping[str, float] | None = None,
          foreign_sizes: Sequence[tuple[int, int]] = (), foreign_out: list[Outcome] | None = None) -> list[Outcome]:
    """Run `convs` (start offsets from now) through `router` onto `engines` until every turn is answered.
    `foreign`: requests/s other clients send straight to these engines (Poisson, sizes drawn from
    `foreign_sizes`), their outcomes appended to `foreign_out`."""
    rng = random.Random(seed)
    other = random.Random(seed + 17)
    foreign_seqs: dict[int, Outcome] = {}
    busy = dict.fromkeys(engines, False)
    start = clock.now
    events: list[_Event] = []
    counter = itertools.count()
    handles: dict[int, tuple[Any, Outcome, Conversation]] = {}
    outcomes: list[Outcome] = []

    def push(at: float, kind: str, what: Any) -> None:
        heapq.heappush(events, _Event(at, next(counter), kind, what))

    def step(eid: str) -> None:
        plan = engines[eid].plan()
        busy[eid] = plan is not None
        if plan is not None:
            push(clock.now + plan.duration_s, "step", (eid, plan))

    def place(r: Request, eid: str, handle: Any) -> None:
        out = Outcome(eid, r.tokens, r.max_tokens, r.arrived)
        outcomes.append(out)
        seq = Seq(r.tokens, r.max_tokens, r.arrived, hashes=r.hashes)
        handles[id(seq)] = (handle, out, r.conversation)
        engines[eid].waiting.append(seq)
        if not busy[eid]:
            step(eid)

    gated = router if isinstance(router, CacheAware) and router.gate is not None else None

    def settle() -> int:
        """Place what the overload queue let go. A refused turn ends its conversation: it and every later
        turn of it count as misses (`Outcome` with no engine). Returns the conversations that ended."""
        if gated is None:
            return 0
        released, gated.released = gated.released, []
        for r, eid, handle in released:
            place(r, eid, handle)
        refused, gated.refused = gated.refused, []
        for r in refused:
            c = r.conversation
            outcomes.extend(Outcome("", r.tokens, r.max_tokens, r.arrived) for _ in range(len(c.turns) - c.sent))
        return len(refused)

    for c in convs:
        push(start + c.start_s, "arrive", c)
    for eid, rate in (foreign or {}).items():
        push(start + other.expovariate(rate), "foreign", eid)
    reporting = [eid for eid in engines]
    for k, eid in enumerate(reporting):
        router.report(eid, engines[eid])
        push(start + interval_s * (k + 1) / len(reporting), "report", eid)
    open_conversations = len(convs)
    while open_conversations:
        due = gated.next_due() if gated is not None else None
        if gated is not None and due is not None and due < events[0].at:   # a held request's start deadline
            clock.now = max(clock.now, due)
            gated.release()
            open_conversations -= settle()
            continue
        ev = heapq.heappop(events)
        clock.now = ev.at
        if ev.kind == "arrive":
            c = ev.what
            messages = c.messages()
            tokens, max_tokens = c.tokens(), c.turns[c.sent][1]
            prompt = render(messages)
            hashes = prompt_blocks(prompt, (), tokens, c.images, block_tokens=BLOCK_SIZE)
            r = Request(c, prompt, tokens, max_tokens, hashes, clock.now)
            routed = router.route(r)
            open_conversations -= settle()   # first those its arrival let go, which were held before it
            if routed is not None:
                place(r, *routed)
        elif ev.kind == "foreign":   # another client's request, straight to the engine
            eid = ev.what
            tokens, max_tokens = other.choice(foreign_sizes)
            seq = Seq(tokens, max_tokens, clock.now)
            foreign_seqs[id(seq)] = out = Outcome(eid, tokens, max_tokens, clock.now)
            if foreign_out is not None:
                foreign_out.append(out)
            engines[eid].waiting.append(seq)
            if not busy[eid]:
                step(eid)
            push(clock.now + other.expovariate((foreign or {})[eid]), "foreign", eid)
        elif ev.kind == "step":
            eid, plan = ev.what
            done = engines[eid].apply(plan)
            for s in plan.first:
                if (mine := foreign_seqs.get(id(s))) is not None:
                    mine.first = mine.last = clock.now
                    continue
                handle, out, _ = handles[id(s)]
                out.first = out.last = clock.now
                out.cached = s.cached
                router.first_token(handle)
            for s in plan.decoded:
                (foreign_seqs.get(id(s)) or handles[id(s)][1]).last = clock.now
            for s in done:
                if foreign_seqs.pop(id(s), None) is not None:
                    continue
                handle, out, c = handles.pop(id(s))
                router.done(handle, s.generated)
                c.replies.append(text(rng, s.generated, "answer"))
                c.sent += 1
                more = c.sent < len(c.turns)
                if more:
                    more = c.tokens() + c.turns[c.sent][1] <= MAX_MODEL_LEN
                if more:
                    push(clock.now + c.thinks[c.sent], "arrive", c)
                else:
                    open_conversations -= 1
            step(eid)
            if gated is not None:
                gated.engine_event(len(done))
                open_conversations -= settle()
        else:
            router.report(ev.what, engines[ev.what])
            push(clock.now + interval_s, "report", ev.what)
            if gated is not None:   # the live gateway re-checks the held requests every heartbeat interval
                gated.release()
                open_conversations -= settle()
    return outcomes


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def largest_share(engines: Iterable[str], rates: dict[str, float]) -> float:
    """The largest engine's share of the requests (`engines`: the one each request went to) over its share
    of the capacity."""
    counts = collections.Counter(engines)
    total, capacity = sum(counts.values()), sum(rates.values())
    return max(counts[e] / total / (rates[e] / capacity) for e in rates) if total else 0.0


def score(outcomes: list[Outcome], rates: dict[str, float], router: Router, cluster: Cluster) -> dict[str, Any]:
    tiers = {eid: tier.name for eid, tier in cluster}
    true_prefill = {eid: tier.prefill_s_per_token for eid, tier in cluster}
    n = len(outcomes)
    good = sum(1 for o in outcomes if o.ttft <= TTFT_SLO_S and o.itl <= ITL_SLO_S)   # a refusal's TTFT is NaN
    served = [o for o in outcomes if o.engine]
    ttft = [o.ttft for o in served]
    shares: dict[str, float] = {}
    for o in served:
        shares[tiers[o.engine]] = shares.get(tiers[o.engine], 0.0) + 1 / len(served)
    prompt = sum(o.prompt for o in served)
    cached = sum(o.cached for o in served)
    row = {"requests": n, "goodput": good / n, "ttft_p50_s": percentile(ttft, 0.5), "ttft_p90_s": percentile(ttft, 0.9),
           "ttft_p99_s": percentile(ttft, 0.99), "hit_rate": cached / prompt,
           "prefilled_per_request": (prompt - cached) / len(served), "tier_shares": shares,
           "max_engine_over_capacity_share": largest_share((o.engine for o in served), rates),
           "refused": n - len(served)}
    if isinstance(router, CacheAware):   # p̂ against the engine's true prefill rate, per engine
        entries = {e.id: e for e in router.table.entries()}
        row["learned_prefill_over_true"] = {
            eid: entries[eid].speed.prefill.value / true_prefill[eid] for eid in rates}
    if isinstance(router, CacheAware) and router.index is not None:
        described = [router.index.describe(eid) for eid in rates]
        queries = sum(d["predicted_query_tokens"] for d in described)
        row["predicted_hit_rate"] = sum(d["predicted_hit_tokens"] for d in described) / queries if queries else 0.0
        reported = sum(d["reported_query_tokens"] for d in described)
        row["reported_hit_rate"] = sum(d["reported_hit_tokens"] for d in described) / reported if reported else 0.0
    return row


def run(workloads: list[str], targets: list[str], seeds: list[int], loads: list[float] | None, sessions: int,
        requests: int, warmup: int, n_tenants: int, interval_s: float, log: Callable[[str], None] = print,
        redis_url: str = "", cluster: Cluster = MIXED_TIER, foreign_share: float = 0.0) -> (
    tuple[list[dict[str, Any]], dict[str, Any]]
):
    """Every target on `cluster` (the mixed-tier benchmark's by default) for each workload, seed and load;
    `foreign_share`: of each fastest-tier engine's saturated rate, what other clients send it directly."""
    rows: list[dict[str, Any]] = []
    capacities: dict[str, Any] = {}
    for workload in workloads:
        for seed in seeds:
            prompts = tenants(seed, n_tenants)
            sizes = request_sizes(workload, 99 + seed, prompts)
            rates = {eid: queue_rate(tier, sizes) for eid, tier in cluster}
            turns = len(sizes) / 300
            capacities[f"{workload}/{seed}"] = {"requests_per_s": sum(rates.values()), "turns": turns}
            count = sessions if workload == "multiturn" else requests
            for load in loads or DEFAULT_LOADS[workload]:
                session_rate = load * sum(rates.values()) / turns
                for target in targets:
                    clock = Clock()
                    engines = {eid: Batcher(tier, cache=EnginePrefixCache(BLOCK_SIZE)) for eid, tier in cluster}
                    router = make_router(target, clock, engines, rates, redis_url)
                    try:
                        if warmup:
                            serve(router, engines, conversations(workload, warmup, 0.6 * session_rate / load,
                                                                 7 + seed, prompts), clock, interval_s, seed)
                            clock.now += 5.0
                        convs = conversations(workload, count, session_rate, 1000 * seed + 1, prompts)
                        fastest = cluster[0][1].name
                        foreign = {eid: foreign_share * rates[eid] for eid, tier in cluster
                                   if tier.name == fastest} if foreign_share else None
                        theirs: list[Outcome] = []
                        row = score(serve(router, engines, convs, clock, interval_s, 2 * seed, foreign, sizes, theirs),
                                    rates, router, cluster)
                        if theirs:
                            started = [o.ttft for o in theirs if o.first == o.first]   # not NaN: it started
                            row |= {"foreign_requests": len(theirs), "foreign_unstarted": len(theirs) - len(started),
                                    "foreign_ttft_p50_s": percentile(started, 0.5),
                                    "foreign_ttft_p90_s": percentile(started, 0.9)}
                    finally:
                        if isinstance(router, Replicas):
                            router.close()
                    row |= {"workload": workload, "load": load, "target": target, "seed": seed}
                    rows.append(row)
                    learned = row.get("learned_prefill_over_true")
                    log(f"{workload} {load}x seed {seed} {target}: goodput {row['goodput']:.1%} ttft p90 "
                        f"{row['ttft_p90_s']:.2f} s hit {row['hit_rate']:.1%} prefilled/req "
                        f"{row['prefilled_per_request']:.0f}"
                        + (f" learned/true prefill s/token {min(learned.values()):.2f}-{max(learned.values()):.2f}"
                           if learned else ""))
    return rows, capacities


def med(rows: list[dict[str, Any]], key: str) -> float:
    return statistics.median(r[key] for r in rows)


def tables(rows: list[dict[str, Any]], workloads: list[str], targets: list[str]) -> str:
    tiers = list(dict.fromkeys(t for _, t in CLUSTER))
    out = []
    foreign = any("foreign_requests" in r for r in rows)
    for workload, load in dict.fromkeys((r["workload"], r["load"]) for r in rows if r["workload"] in workloads):
        out += [f"\n{workload} at {load}x the cache-blind capacity", "",
                "| target | goodput (range) | TTFT p50 / p90 / p99 s | hit rate | prefilled tokens per request | "
                f"tier shares ({' / '.join(tiers)}) | max engine / capacity share | predicted / reported hit rate |"
                + (" other clients' TTFT p50 / p90 s |" if foreign else ""),
                "|---|---:|---:|---:|---:|---|---:|---:|" + ("---:|" if foreign else "")]
        for target in targets:
            rs = [r for r in rows if r["workload"] == workload and r["load"] == load and r["target"] == target]
            if not rs:
                continue
            g = [r["goodput"] for r in rs]
            shares = " / ".join(f"{statistics.median(r['tier_shares'].get(t, 0.0) for r in rs):.0%}" for t in tiers)
            predicted = (f"{med(rs, 'predicted_hit_rate'):.1%} / {med(rs, 'reported_hit_rate'):.1%}"
                         if "predicted_hit_rate" in rs[0] else "")
            out.append(f"| {target} | {statistics.median(g):.1%} ({min(g):.1%}-{max(g):.1%}) | "
                       f"{med(rs, 'ttft_p50_s'):.2f} / {med(rs, 'ttft_p90_s'):.2f} / {med(rs, 'ttft_p99_s'):.2f} | "
                       f"{med(rs, 'hit_rate'):.1%} | {med(rs, 'prefilled_per_request'):.0f} | {shares} | "
                       f"{med(rs, 'max_engine_over_capacity_share'):.2f} | {predicted} |"
                       + (f" {med(rs, 'foreign_ttft_p50_s'):.2f} / {med(rs, 'foreign_ttft_p90_s'):.2f} |"
                          if foreign else ""))
    return "\n".join(out)


# -- routing cost at N=64 ------------------------------------------------------------------------

def latency(n_backends: int = 64, requests: int = 3000, seed: int = 1) -> dict[str, Any]:
    """Per-request µs of the cache-aware routing steps on a table of `n_backends`, multiturn prompts: CPU
    time of this thread (time.thread_time), so that other processes on a shared machine do not count."""
    clock = Clock()
    catalog = load_catalog()
    model = catalog.model(MODEL)
    table = StateTable(model, 0.2, clock=clock)
    per_block = BLOCK_SIZE * model.kv_bytes_per_token
    for k in range(n_backends):
        eid = f"b{k}"
        gpu = catalog.gpu(CLUSTER[k % len(CLUSTER)][1])
        table.register(eid, "language", gpu, address=eid, managed=False, external=True)
        table.apply_heartbeat(eid, 1, eid, Reported(seq=1, kv_free_bytes=3000 * per_block,
                                                    kv_total_bytes=3000 * per_block, max_model_len=MAX_MODEL_LEN,
                                                    kv_source="engine"))
    index = PrefixIndex()
    for entry in table.entries():
        index.add_backend(entry.id, 48_000)
    policy = build_policy("marginal_delay", {})
    rng = random.Random(seed)
    timings: dict[str, list[float]] = {"hash": [], "lookup": [], "choose": [], "record": [], "total": []}
    convs = conversations("multiturn", requests, 1.0, seed, tenants(seed, DEFAULT_TENANTS))
    leases = []
    blocks: list[int] = []
    thresholds = gc.get_threshold()
    gc.collect()
    gc.freeze()   # as the gateway does after start-up (gateway/daemon.py), with its collection thresholds
    gc.set_threshold(*GC_THRESHOLDS)
    try:
        for c in _turns(convs, rng, requests):
            messages = c.messages()
            tokens = tokens_of(messages)
            prompt = render(messages)
            t0 = time.thread_time()
            hashes = index.hashes(prompt, (), tokens)
            t1 = time.thread_time()
            blocks.append(len(hashes))
            query = index.lookup(hashes, "", tokens)
            t2 = time.thread_time()
            profile = RequestProfile(c.id, tokens, 64, cached_tokens=query.cached, evicted_reuse=query.reuse)
            backend = policy.choose(profile, table.candidates(LANGUAGE, clock.now), clock.now).backend
            t3 = time.thread_time()
            index.record(query, backend.id, 48_000)
            t4 = time.thread_time()
            leases.append(table.acquire(backend.id, tokens, 64, query.cached.get(backend.id, 0)))
            if len(leases) > 4 * n_backends:   # a steady number in flight
                table.release(leases.pop(0))
            for key, dt in zip(timings, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t4 - t0), strict=True):
                timings[key].append(dt * 1e6)
    finally:
        gc.set_threshold(*thresholds)
        gc.unfreeze()
    return {"backends": n_backends, "requests": len(timings["total"]),
            "blocks_per_prompt_mean": statistics.mean(blocks),
            **{f"{k}_us": {"p50": percentile(v, 0.5), "p99": percentile(v, 0.99)} for k, v in timings.items()}}


def _turns(convs: list[Conversation], rng: random.Random, n: int) -> Iterator[Conversation]:
    """Conversations at their successive turns, interleaved, until `n` turns."""
    count = 0
    live = list(convs)
    while live and count < n:
        c = live.pop(0)
        yield c
        count += 1
        c.replies.append(text(rng, c.turns[c.sent][1], "answer"))
        c.sent += 1
        if c.sent < len(c.turns) and tokens_of(c.messages()) + c.turns[c.sent][1] <= MAX_MODEL_LEN:
            live.insert(min(len(live), 8), c)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--workloads", nargs="+", choices=WORKLOADS, default=list(WORKLOADS))
    p.add_argument("--targets", nargs="+", choices=TARGETS, default=list(DEFAULT_TARGETS))
    p.add_argument("--seeds", type=at_least(0), nargs="+", default=[1, 2, 3, 4, 5])
    p.add_argument("--loads", type=positive, nargs="+", default=None,
                   help=f"times the cache-blind capacity, for every workload (default: {DEFAULT_LOADS})")
    p.add_argument("--tenants", type=at_least(1), default=DEFAULT_TENANTS,
                   help="tenants with a system prompt of their own")
    p.add_argument("--sessions", type=at_least(1), default=600, help="multiturn: conversations per scored run")
    p.add_argument("--requests", type=at_least(1), default=3000, help="nosharing, hotprefix: requests per scored run")
    p.add_argument("--warmup", type=at_least(0), default=150, help="conversations of the unscored warm-up")
    p.add_argument("--interval-ms", type=positive, default=200, help="engine report interval (heartbeats: 200)")
    p.add_argument("--redis-url", default="redis://127.0.0.1:6379/0", help="hg-3shared: the Redis the replicas share")
    p.add_argument("--foreign", type=non_negative, default=0.0, metavar="SHARE",
                   help="other clients send each H100 this share of its saturated rate directly (default 0)")
    p.add_argument("--latency", action="store_true", help="also the routing cost per request at N=64")
    p.add_argument("--latency-only", action="store_true", help="only that (results: prefix_affinity_latency.json)")
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    started = time.monotonic()
    if args.latency_only:
        args.workloads, args.latency = [], True
        if args.out == RESULTS:
            args.out = LATENCY_RESULTS
    if why := unwritable(args.out):   # found before the runs, not after them
        p.error(f"--out: {why}")
    rows, capacities = run(args.workloads, args.targets, args.seeds, args.loads, args.sessions, args.requests,
                           args.warmup, args.tenants, args.interval_ms / 1000, redis_url=args.redis_url,
                           foreign_share=args.foreign)
    text_tables = tables(rows, args.workloads, args.targets)
    print(text_tables)
    report: dict[str, Any] = {"args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
                              "git": git_state(), "capacities": capacities, "tables": text_tables, "runs": rows}
    if args.latency:
        report["latency"] = lat = latency()
        print(f"\nrouting cost at N={lat['backends']} ({lat['requests']} requests, "
              f"{lat['blocks_per_prompt_mean']:.0f} blocks a prompt): " + ", ".join(
                  f"{k[:-3]} p50 {v['p50']:.0f} / p99 {v['p99']:.0f} us" for k, v in lat.items() if k.endswith("_us")))
    report["wall_s"] = time.monotonic() - started
    save_report(args.out, report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""A seeded family of engine models and mixed-tier clusters, for routing that must hold beyond one engine.

A routing policy tuned on one engine learns that engine's semantics. Each member of this family is a
cluster of mixed tiers whose engines vary what real engines vary:

- **scheduling**: chunked prefill (vLLM v1-like: every step decodes one token for each running
  sequence and spends what is left of `max_batched_tokens` on prefill chunks, oldest first, then
  admits waiting requests into the rest) or prefill-first (vLLM v0-like: a step either prefills whole
  newly admitted prompts, up to `max_batched_tokens`, while every running sequence waits, or decodes);
- **step time** = (base + per_seq · sequences decoding + kv_read · KV tokens attended + prefill ·
  prompt tokens computed) · noise, the noise log-normal with mean 1 and a member's σ (0-15%);
- **limits**: max batch (`max_num_seqs`) and `max_batched_tokens`;
- **KV cache**: reserved whole at admission (prompt + max_tokens, never preempted) or paged (blocks
  of 16 tokens taken as sequences grow; when a running sequence needs a block and none is free,
  the most recently admitted one is preempted: its blocks are freed and it goes back to the head of
  the queue, to recompute its prompt and the tokens it had generated before it continues);
- **tiers**: the fastest tier's speeds are scaled per member (0.8-1.25x); each slower tier decodes
  d times slower and prefills p times slower than it, where the slowest tier's p (its prefill
  ratio) spans 2x-6x over the family and its d 1.5x-3x; KV sizes vary per tier and member;
- **clusters**: 6 to 10 engines of two or three tiers, in several proportions.

`family()` builds the members from one seed; every fourth member (3, 7, 11, 15) is held out from
any tuning and reported apart. `FamilyEngine` runs one engine model in the discrete-event simulator
(`loadtest.sim.simulator.simulate`) against the gateway's live state table and policies, as a
scraped engine (kind: openai) that reports its queue, batch and KV use but no service time.
`saturated_rate` is one engine's capacity on a workload: alone, with every request queued at once.
"""

from __future__ import annotations

import math
import random
from collections import deque
from dataclasses import dataclass, field
from functools import cache
from typing import Any, Literal

import numpy as np

from common import perf_model
from common.catalog import Catalog, load_catalog
from gateway.config.sections import OverloadConfig
from gateway.routing.policies.contracts import Policy
from loadtest.sim import workloads
from loadtest.sim.capacity import queued_rate
from loadtest.sim.engines import Engine, EngineSpec, GatewayState, Recorder
from loadtest.sim.simulator import simulate
from loadtest.sim.workloads import Trace

Scheduling = Literal["chunked", "prefill_first"]
KvAllocation = Literal["reserve", "paged"]
BLOCK_TOKENS = 16
FAMILY_SEED = 26
FAMILY_SIZE = 16
HELD_OUT_EVERY = 4              # members 3, 7, 11, 15: never used to tune anything
MODEL = "llama-2-7b"
# The fastest tier before a member's scaling: a 7B model in a vLLM-like engine on an H100 (measured
# MFU, not the datasheet; benchmarks/emulated_engine.py's H100).
BASE_STEP_S, BASE_PER_SEQ_S, BASE_KV_READ_S, BASE_PREFILL_S = 0.010, 0.00012, 2.0e-8, 0.00006
# Cluster shapes: engines per tier, fastest first.
SHAPES: tuple[tuple[int, ...], ...] = ((2, 3, 3), (4, 4), (1, 2, 5), (3, 3), (2, 2, 2), (2, 6), (3, 2, 3), (1, 3, 4))
TIER_NAMES: tuple[tuple[str, ...], ...] = (("H100", "A100-80GB", "L40S"), ("H200", "A100-80GB", "L4"),
                                           ("B200", "H100", "RTX-4090"), ("H100", "L40S", "L4"))


@dataclass(frozen=True, slots=True)
class TierModel:
    """One tier's speeds (emulated seconds) and KV cache, and the catalog GPU the gateway is told it is."""

    gpu: str
    step_base_s: float
    per_seq_s: float
    kv_read_s: float             # per KV token attended in a step
    prefill_s_per_token: float
    kv_tokens: int


@dataclass(frozen=True, slots=True)
class EngineModel:
    """What an engine does with its requests (the same for every tier of a member)."""

    scheduling: Scheduling
    max_num_seqs: int
    max_batched_tokens: int
    kv_allocation: KvAllocation
    noise_sigma: float


@dataclass(frozen=True, slots=True)
class Member:
    name: str
    engine: EngineModel
    tiers: tuple[TierModel, ...]          # fastest first
    counts: tuple[int, ...]               # engines per tier
    held_out: bool
    prefill_ratio: float                  # the slowest tier's prefill slowdown against the fastest
    decode_ratio: float                   # its decode slowdown

    @property
    def engines(self) -> tuple[tuple[str, TierModel], ...]:
        """(backend id, tier) per engine, tier by tier."""
        return tuple((f"{t.gpu.lower()}-{k}", t) for t, n in zip(self.tiers, self.counts, strict=True)
                     for k in range(n))

    def describe(self) -> str:
        e = self.engine
        shape = "+".join(f"{n}x{t.gpu}" for t, n in zip(self.tiers, self.counts, strict=True))
        return (f"{shape}; {e.scheduling.replace('_', '-')} {e.max_batched_tokens} tok, batch {e.max_num_seqs}, "
                f"KV {e.kv_allocation}; prefill {self.prefill_ratio:.1f}x / decode {self.decode_ratio:.1f}x; "
                f"noise {e.noise_sigma:.0%}")


def family(seed: int = FAMILY_SEED, size: int = FAMILY_SIZE) -> list[Member]:
    """The seeded family: each engine property is spread over the members (not left to chance), the
    combinations are drawn from the seed."""
    rng = random.Random(seed)
    prefill_ratios = [2.0 + 4.0 * k / (size - 1) for k in range(size)]
    rng.shuffle(prefill_ratios)
    members = []
    for k in range(size):
        prefill_ratio = prefill_ratios[k]
        decode_ratio = rng.uniform(1.5, min(3.0, prefill_ratio))
        scheduling: Scheduling = "prefill_first" if k % 3 == 2 else "chunked"
        budget = rng.choice((256, 512, 1024, 2048)) if scheduling == "chunked" else rng.choice((4096, 8192))
        engine = EngineModel(scheduling, rng.choice((48, 128, 256)), budget,
                             "paged" if k % 2 else "reserve", rng.choice((0.0, 0.05, 0.1, 0.15)))
        names = TIER_NAMES[k % len(TIER_NAMES)]
        counts = SHAPES[rng.randrange(len(SHAPES))]
        scale = rng.uniform(0.8, 1.25)
        tiers = []
        for t in range(len(counts)):
            share = t / (len(counts) - 1)          # 0 for the fastest tier, 1 for the slowest
            d, p = decode_ratio ** share, prefill_ratio ** share
            kv = int(rng.uniform(50_000, 80_000) * (rng.uniform(0.3, 0.5) ** share))
            tiers.append(TierModel(names[t] if len(counts) == 3 else names[2 * t], BASE_STEP_S * scale * d,
                                   BASE_PER_SEQ_S * scale * d, BASE_KV_READ_S * scale * d,
                                   BASE_PREFILL_S * scale * p, kv))
        members.append(Member(f"m{k:02d}", engine, tuple(tiers), counts, k % HELD_OUT_EVERY == HELD_OUT_EVERY - 1,
                              prefill_ratio, decode_ratio))
    return members


@dataclass(slots=True, eq=False)
class FamilySeq:
    id: int
    prompt: int
    max_tokens: int              # KV reserved for this many new tokens (reserve mode)
    target: int                  # tokens it generates
    generated: int = 0
    computed: int = 0            # tokens whose KV is computed
    blocks: int = 0
    in_batch: bool = False       # running (admitted, not preempted since, not finished)

    @property
    def need(self) -> int:
        """Tokens to compute before its next token comes: its prompt (and, after a preemption, the tokens
        it had generated) while prefilling; 1 (the last token) while decoding."""
        return self.prompt + self.generated - self.computed


@dataclass(slots=True)
class Step:
    duration_s: float
    admitted: list[FamilySeq] = field(default_factory=list)
    emitted: list[FamilySeq] = field(default_factory=list)     # got a token at the end of the step
    finished: list[FamilySeq] = field(default_factory=list)


class FamilyBatcher:
    """One engine model's continuous batcher: a pure state machine; `step()` runs one step and says how
    long it takes (its effects are applied at once, its tokens count at its end)."""

    def __init__(self, tier: TierModel, model: EngineModel, rng: np.random.Generator) -> None:
        self.tier, self.model, self.rng = tier, model, rng
        self.total_blocks = tier.kv_tokens // BLOCK_TOKENS
        self.free_blocks = self.total_blocks
        self.watermark = max(1, self.total_blocks // 100)   # blocks admission leaves free (paged)
        self.waiting: deque[FamilySeq] = deque()
        self.running: list[FamilySeq] = []
        self.preemptions = 0

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.running

    def fits(self, seq: FamilySeq) -> bool:
        """Whether the sequence could ever run here (alone, its whole context in the cache)."""
        return self._blocks(seq.prompt + seq.max_tokens) + self.watermark <= self.total_blocks

    def step(self) -> Step | None:
        """The next step, or None when there is nothing to run."""
        if self.idle:
            return None
        if self.model.scheduling == "prefill_first":
            return self._prefill_first()
        return self._chunked()

    # -- the two schedulers ------------------------------------------------------------------

    def _chunked(self) -> Step:
        step = Step(0.0)
        budget = self.model.max_batched_tokens
        decoding: list[FamilySeq] = []
        prefilling: list[FamilySeq] = []
        for seq in self.running:
            (decoding if seq.generated and seq.prompt + seq.generated - seq.computed == 1 else prefilling).append(seq)
        work: list[tuple[FamilySeq, int]] = []
        paged = self.model.kv_allocation == "paged"
        for seq in decoding:                       # decodes first
            if seq.in_batch and (not paged or self._grow(seq, 1)):
                work.append((seq, 1))
        budget -= len(work)
        for seq in prefilling:                     # then prefill chunks, in order
            if budget <= 0:
                break
            chunk = min(budget, seq.need)
            if seq.in_batch and (not paged or self._grow(seq, chunk)):
                work.append((seq, chunk))
                budget -= chunk
        while self.waiting and budget > 0 and len(self.running) < self.model.max_num_seqs:
            seq = self.waiting[0]
            chunk = min(budget, seq.need)
            if not self._admit(seq, chunk):
                break
            step.admitted.append(seq)
            work.append((seq, chunk))
            budget -= chunk
        return self._finish(step, work)

    def _prefill_first(self) -> Step:
        step = Step(0.0)
        work: list[tuple[FamilySeq, int]] = []
        tokens = 0
        while self.waiting and len(self.running) < self.model.max_num_seqs:
            seq = self.waiting[0]
            need = seq.need
            if work and tokens + need > self.model.max_batched_tokens:
                break
            if not self._admit(seq, need):
                break
            step.admitted.append(seq)
            work.append((seq, need))
            tokens += need
        if not work:   # nothing admitted: a decode step for every running sequence
            paged = self.model.kv_allocation == "paged"
            for seq in list(self.running):
                if seq.in_batch and (not paged or self._grow(seq, 1)):
                    work.append((seq, 1))
        return self._finish(step, work)

    # -- shared ------------------------------------------------------------------------------

    def _finish(self, step: Step, work: list[tuple[FamilySeq, int]]) -> Step:
        t = self.tier
        decodes = prefill = context = 0
        emitted, finished = step.emitted, step.finished
        for seq, n in work:
            if not seq.in_batch:                    # preempted later in the step
                continue
            if n == 1 and seq.generated and seq.prompt + seq.generated - seq.computed == 1:
                decodes += 1
            else:
                prefill += n
            seq.computed += n
            context += seq.computed
            if seq.computed == seq.prompt + seq.generated:   # its computation is complete: a token comes out
                seq.generated += 1
                emitted.append(seq)
                if seq.generated >= seq.target:
                    finished.append(seq)
        duration = t.step_base_s + t.per_seq_s * decodes + t.kv_read_s * context + t.prefill_s_per_token * prefill
        sigma = self.model.noise_sigma
        if sigma:
            duration *= math.exp(sigma * float(self.rng.standard_normal()) - sigma * sigma / 2)
        step.duration_s = duration
        if finished:
            for s in finished:
                self.free_blocks += s.blocks
                s.blocks = 0
                s.in_batch = False
            self.running = [s for s in self.running if s.in_batch]
        return step

    def _blocks(self, tokens: int) -> int:
        return -(-tokens // BLOCK_TOKENS)

    def _admit(self, seq: FamilySeq, chunk: int) -> bool:
        """Move the queue's head into the batch if its KV is there (paged: for this chunk, above the
        watermark; reserve: for prompt + max_tokens)."""
        if self.model.kv_allocation == "reserve":
            need = self._blocks(seq.prompt + seq.max_tokens) if not seq.blocks else 0
            if need > self.free_blocks:
                return False
        else:
            need = self._blocks(seq.computed + chunk) - seq.blocks
            if need + self.watermark > self.free_blocks:
                return False
        self.waiting.popleft()
        self.free_blocks -= need
        seq.blocks += need
        seq.in_batch = True
        self.running.append(seq)
        return True

    def _grow(self, seq: FamilySeq, tokens: int) -> bool:
        """Blocks for `tokens` more of a running sequence (paged), preempting the most recently
        admitted sequences while none are free; False if `seq` itself was preempted."""
        need = self._blocks(seq.computed + tokens) - seq.blocks
        while need > self.free_blocks:
            victim = self.running.pop()
            self.free_blocks += victim.blocks
            victim.blocks = victim.computed = 0
            victim.in_batch = False
            self.waiting.appendleft(victim)
            self.preemptions += 1
            if victim is seq:
                return False
        self.free_blocks -= need
        seq.blocks += need
        return True


class FamilyEngine(Engine):
    """One engine of a member in the discrete-event simulator (the interface of `engines.Engine`)."""

    def __init__(self, spec: EngineSpec, rec: Recorder, gateway: GatewayState, tier: TierModel,
                 model: EngineModel, rng: np.random.Generator) -> None:
        super().__init__(spec, rec, gateway)
        self.batcher = FamilyBatcher(tier, model, rng)
        self.stepping = False
        self._step: Step | None = None
        self._step_start = 0.0

    def load(self) -> tuple[int, int]:
        return len(self.batcher.waiting), len(self.batcher.running)

    def kv_free_bytes(self) -> int:
        return self.batcher.free_blocks * BLOCK_TOKENS * self.model.kv_bytes_per_token

    def submit(self, i: int, now: float, cached: int = 0) -> float | None:
        lengths = self.rec.lengths
        seq = FamilySeq(i, int(lengths.input_tokens[i]), int(lengths.max_output_tokens[i]),
                        int(lengths.output_tokens[i]))
        if not self.batcher.fits(seq):
            self.rec.rejected[i] = True
            return None
        self._lease(i, now, cached)
        self.batcher.waiting.append(seq)
        self.changed = True
        return None if self.stepping else self._start(now)

    def on_event(self, now: float) -> tuple[list[int], float | None]:
        step = self._step
        assert step is not None
        for seq in step.admitted:
            if np.isnan(self.rec.admitted[seq.id]):
                self.rec.admitted[seq.id] = self._step_start
        for seq in step.emitted:
            if seq.generated == 1:
                self._first_token(seq.id, now)
        done = [seq.id for seq in step.finished]
        for i in done:
            self._finished(i, now)
        self.changed = True
        return done, self._start(now)

    def _start(self, now: float) -> float | None:
        step = self.batcher.step()
        self._step, self.stepping, self._step_start = step, step is not None, now
        self.changed = True
        return None if step is None else now + step.duration_s


def kv_capacity_bytes(tier: TierModel, catalog: Catalog) -> int:
    return tier.kv_tokens * catalog.model(MODEL).kv_bytes_per_token


def build(member: Member, rec: Recorder, gateway: GatewayState, seed: int, catalog: Catalog) -> list[Engine]:
    """The member's engines, registered in `gateway`; step noise seeded by (seed, engine index)."""
    model = catalog.model(MODEL)
    engines: list[Engine] = []
    for k, (backend_id, tier) in enumerate(member.engines):
        gpu = catalog.gpu(tier.gpu)
        spec = EngineSpec(backend_id, model, gpu, kv_capacity_bytes(tier, catalog),
                          perf_model.service_seconds(model, gpu, 512, 128), external=True)
        engines.append(FamilyEngine(spec, rec, gateway, tier, member.engine,
                                    np.random.default_rng([seed, k, 26])))
    return engines


@cache
def saturated_rate(tier: TierModel, engine: EngineModel, workload: str = "chat_mixed", n: int = 400) -> float:
    """Requests/s one engine of `tier` completes with every request of a reference sample queued at once,
    counted while its queue is not empty (its own admission rules, KV and stalls)."""
    catalog = load_catalog()
    lengths = workloads.lengths(workload, n, workloads.REFERENCE_SEED)
    rec = Recorder.for_lengths(lengths)
    model = catalog.model(MODEL)
    gpu = catalog.gpu(tier.gpu)
    spec = EngineSpec("capacity", model, gpu, kv_capacity_bytes(tier, catalog), 1.0, external=True)
    return queued_rate(FamilyEngine(spec, rec, GatewayState(model), tier, engine, np.random.default_rng(7)), rec, n)


def capacity_rps(member: Member, workload: str = "chat_mixed") -> dict[str, float]:
    """Each engine's saturated rate, by backend id (the cluster's capacity is their sum)."""
    return {bid: saturated_rate(tier, member.engine, workload) for bid, tier in member.engines}


# -- one run -------------------------------------------------------------------------------------

TTFT_SLO_S, ITL_SLO_S = 2.0, 0.100
WARMUP_LOAD = 0.6
WARMUP_GAP_S = 5.0


@dataclass(frozen=True, slots=True)
class RunSettings:
    requests: int = 600                 # scored requests a run
    warmup: int = 200                   # unscored requests first, at 0.6x (a running gateway has learned)
    report_interval_s: float = 0.2      # engine figures reach the gateway this often (heartbeats: 200 ms)
    workload: str = "chat_mixed"


def trace_for(member: Member, load: float, seed: int, settings: RunSettings) -> tuple[Trace, int]:
    """The warm-up requests, a gap, then the scored ones at `load` x capacity; returns (trace, first scored)."""
    rate = sum(capacity_rps(member, settings.workload).values())
    scored = workloads.make_trace(settings.workload, "poisson", load * rate, settings.requests, seed)
    if not settings.warmup:
        return scored, 0
    warm = workloads.make_trace(settings.workload, "poisson", WARMUP_LOAD * rate, settings.warmup, 1000 + seed)
    start = float(warm.arrival_s[-1]) + WARMUP_GAP_S
    a, b = warm.lengths, scored.lengths
    lengths = workloads.Lengths(*(np.concatenate((getattr(a, f), getattr(b, f))) for f in (
        "text_tokens", "image_tokens", "images", "output_tokens", "max_output_tokens")))
    return Trace(np.concatenate((warm.arrival_s, start + scored.arrival_s)), lengths), settings.warmup


def run(member: Member, policy: Policy, load: float, seed: int, settings: RunSettings,
        catalog: Catalog | None = None, overload: OverloadConfig | None = None) -> dict[str, Any]:
    """One policy on one member at `load`: goodput (TTFT <= 2 s and mean inter-token time <= 100 ms) over
    the scored requests, TTFT p99, misses by kind, each tier's share of the requests. `overload`: the
    gateway's overload queue with these settings in front of the policy (requests it refuses count as
    misses, `rejected`)."""
    catalog = catalog or load_catalog()
    trace, first = trace_for(member, load, seed, settings)
    rec = Recorder.for_lengths(trace.lengths)
    gateway = GatewayState(catalog.model(MODEL), settings.report_interval_s)
    engines = build(member, rec, gateway, seed, catalog)
    simulate(trace, engines, policy, rec, overload)
    return score(trace, rec, first, [tier.gpu for _, tier in member.engines])


def score(trace: Trace, rec: Recorder, first: int, gpus: list[str]) -> dict[str, Any]:
    arrival, out = trace.arrival_s[first:], trace.lengths.output_tokens[first:]
    ttft = rec.first_token[first:] - arrival
    itl = np.where(out > 1, (rec.finish[first:] - rec.first_token[first:]) / np.maximum(out - 1, 1), 0.0)
    done = ~np.isnan(rec.finish[first:])
    slow, jerky = ~(ttft <= TTFT_SLO_S), ~(itl <= ITL_SLO_S)
    backend = rec.backend[first:]
    names = np.array(gpus)
    shares = {g: float(np.mean(names[backend[backend >= 0]] == g)) for g in dict.fromkeys(gpus)}
    return {
        "goodput": float(np.mean(done & ~slow & ~jerky)),
        "ttft_p99_s": float(np.nanpercentile(ttft, 99)),
        "ttft_misses": int(np.count_nonzero(slow & ~rec.rejected[first:])),
        "itl_misses": int(np.count_nonzero(~slow & jerky)),
        "rejected": int(rec.rejected[first:].sum()),
        "tier_shares": shares,
    }

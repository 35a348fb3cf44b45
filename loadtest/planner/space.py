"""The plans a search may pick, and the cheap capacity bound that decides which of them are worth simulating.

A plan is a count of GPUs per (catalog GPU, role), in one of the stage splits the engines support:

    monolithic   every GPU runs the whole model (`role: both`, or `language` when no request carries
                 images): it encodes its own images, nothing moves between GPUs
    E+PD         a vision pool of one GPU type encodes images (`role: vision`, stealing language work
                 when idle if its decoder fits and stealing is on) and a language pool prefills and decodes

(The engines have no prefill/decode split, so HydraInfer's E+P+D and ED+P are not plans here.)

Plans are rows of a count matrix whose columns are the (GPU, role) slots, so that the bound of tens of
thousands of plans is a few array operations. The bound, from the roofline model (`common.perf_model`):

    per GPU g     b*   = min(max batch, KV tokens / E[prompt + max_tokens], largest batch whose mean
                         inter-token time stays within the SLO: the decode step (weights + b · E[context] KV
                         bytes) / bandwidth plus the prefills sharing it, b · E[prompt] · 2P/F / E[output]
                         (Little's law at full load))
                  work = E[prompt] · 2P/F + E[output] · step(b*) / b* (+ E[image tokens] · encode/token on `both`)
                  μ_g  = 1 / work       requests/s it could complete, each within the inter-token SLO
    per request  feasible when some language GPU of the plan holds its KV reservation, decodes it alone
                 within the inter-token SLO, and prefills it (after the plan's fastest encode of its
                 images) within the TTFT SLO
    per plan     bound = min(λ · feasible share, Σ_g μ_g, λ_text + encode capacity of the vision pool)

It is optimistic by construction (no queueing, no prefill stalls in decode steps, perfect packing), so a
plan whose bound cannot beat the best simulated plan is skipped without simulating it. On a finite trace
an overloaded plan still serves its first requests within the SLO, which a rate bound does not see; the
search raises the bound by a margin for that (`search.Problem.margin`).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np

from backends.scheduling import stealing_limits
from common import perf_model
from common.catalog import Catalog, GpuProfile, ModelProfile
from gateway.config.sections import OverloadConfig
from gateway.routing.policies.stealing import DEFAULT_MAX_BATCH as STEAL_MAX_BATCH
from loadtest.sim import capacity
from loadtest.sim.vlm import ENGINE_DEFAULTS, STEAL_EPISODE_S
from loadtest.sim.workloads import Trace

Role = Literal["language", "vision", "both"]
Split = Literal["monolithic", "E+PD"]
SPLITS: tuple[Split, ...] = ("monolithic", "E+PD")


@dataclass(frozen=True)
class Slo:
    ttft_s: float            # time to first token
    itl_s: float             # mean inter-token time of a request

    def __post_init__(self) -> None:
        if not (self.ttft_s > 0 and self.itl_s > 0):
            raise ValueError(f"SLOs must be positive (TTFT {self.ttft_s} s, inter-token {self.itl_s} s)")

    def overload(self) -> OverloadConfig:
        """The gateway's overload queue held against this TTFT: from half of it, for at most half of it
        (the gateway's defaults for its default 2 s; the written backends.yaml sets the same)."""
        return OverloadConfig(ttft_slo_s=self.ttft_s, hold_above_s=self.ttft_s / 2, max_wait_s=self.ttft_s / 2)


@dataclass(frozen=True)
class Limits:
    """What the plans may spend: a budget in $/hour or an inventory (GPUs per type), and the search's shape."""

    budget_per_hour: float | None = None
    inventory: tuple[tuple[str, int], ...] | None = None
    max_gpus: int = 16
    max_types: int = 3           # GPU types in the language (or monolithic) pool
    max_vision: int = 2          # GPUs in an E+PD vision pool (one type)

    def __post_init__(self) -> None:
        if (self.budget_per_hour is None) == (self.inventory is None):
            raise ValueError("give either a budget ($/hour) or an inventory (GPUs per type), not both or neither")
        if self.budget_per_hour is not None and not self.budget_per_hour > 0:
            raise ValueError(f"the budget must be positive, not {self.budget_per_hour}")
        if self.inventory is not None and (not self.inventory or any(n < 0 for _, n in self.inventory)):
            raise ValueError("an inventory needs at least one GPU type and no negative count")
        if min(self.max_gpus, self.max_types, self.max_vision) < 1:
            raise ValueError("max GPUs, max types and max vision GPUs must each be at least 1")

    def available(self, gpu: str) -> int:
        """GPUs of this type a plan may hold (the GPU cap when there is no inventory)."""
        if self.inventory is None:
            return self.max_gpus
        return dict(self.inventory).get(gpu, 0)


@dataclass(frozen=True, order=True)
class Plan:
    """GPUs per (GPU, role), language pool first; `steal`: its vision GPUs take language work when idle."""

    pools: tuple[tuple[str, Role, int], ...]
    steal: bool = False

    @property
    def split(self) -> Split:
        return "E+PD" if any(role == "vision" for _, role, _ in self.pools) else "monolithic"

    @property
    def gpus(self) -> int:
        return sum(n for _, _, n in self.pools)

    def members(self) -> tuple[tuple[str, Role, bool], ...]:
        """One (GPU, role, steal) per engine, in pool order: what the simulator builds."""
        return tuple((g, role, self.steal and role == "vision") for g, role, n in self.pools for _ in range(n))

    def cost_per_hour(self, catalog: Catalog) -> float:
        return sum(catalog.gpu(g).price_per_hour * n for g, _, n in self.pools)

    def label(self) -> str:
        language = " + ".join(f"{n}×{g}" for g, role, n in self.pools if role != "vision")
        vision = " + ".join(f"{n}×{g}" for g, role, n in self.pools if role == "vision")
        if not vision:
            return language
        return f"{language} | vision {vision}{' (steal)' if self.steal else ''}"


@dataclass(frozen=True)
class Slot:
    gpu: str
    role: Role


@dataclass(frozen=True)
class Space:
    """Every plan within the limits: counts[i, j] GPUs of slot j in plan i."""

    slots: tuple[Slot, ...]
    counts: np.ndarray
    steal: bool

    def __len__(self) -> int:
        return len(self.counts)

    def plan(self, i: int) -> Plan:
        row = self.counts[i]
        pools = tuple((s.gpu, s.role, int(row[j])) for j, s in enumerate(self.slots) if row[j])
        return Plan(pools, self.steal and any(s.role == "vision" and row[j] for j, s in enumerate(self.slots)))

    def cost_per_hour(self, catalog: Catalog) -> np.ndarray:
        return np.asarray(self.counts @ np.array([catalog.gpu(s.gpu).price_per_hour for s in self.slots]),
                          dtype=float)


def decoder_fits(model: ModelProfile, gpu: GpuProfile, role: Role) -> bool:
    return perf_model.kv_capacity_bytes(model, gpu, encoder_loaded=role == "both") > 0


def enumerate_space(
    catalog: Catalog, model: ModelProfile, gpus: Sequence[str], limits: Limits, *, images: bool,
    splits: Sequence[Split] = SPLITS, steal: bool = True,
) -> Space:
    """Every plan of these GPU types within the limits (at most `max_types` types in the language pool)."""
    whole: Role = "both" if images else "language"
    lang = [g for g in gpus if decoder_fits(model, catalog.gpu(g), whole)]
    split_lang = [g for g in gpus if decoder_fits(model, catalog.gpu(g), "language")]
    slots = [Slot(g, whole) for g in lang]
    if images and "E+PD" in splits:
        slots += [Slot(g, "language") for g in split_lang] + [Slot(g, "vision") for g in gpus]
    index = {(s.gpu, s.role): j for j, s in enumerate(slots)}
    prices = {g: catalog.gpu(g).price_per_hour for g in gpus}
    rows: list[list[int]] = []

    def add(pools: dict[tuple[str, Role], int]) -> None:
        row = [0] * len(slots)
        for key, n in pools.items():
            row[index[key]] = n
        rows.append(row)

    if "monolithic" in splits or not images:
        for pool in _pools(lang, prices, limits, {}, 0.0, 0):
            add({(g, whole): n for g, n in pool.items()})
    if images and "E+PD" in splits:
        for v in gpus:
            for nv in range(1, min(limits.max_vision, limits.available(v), limits.max_gpus - 1) + 1):
                used = {v: nv}
                for pool in _pools(split_lang, prices, limits, used, prices[v] * nv, nv):
                    add({**{(g, "language"): n for g, n in pool.items()}, (v, "vision"): nv})
    counts = np.array(rows, dtype=np.int16).reshape(len(rows), len(slots))
    return Space(tuple(slots), counts, steal)


def _pools(
    types: Sequence[str], prices: dict[str, float], limits: Limits, used: dict[str, int], spent: float, gpus: int,
) -> Iterator[dict[str, int]]:
    """Every non-empty multiset of at most `max_types` of these types that fits the limits beside `used`."""
    budget = limits.budget_per_hour if limits.budget_per_hour is not None else float("inf")
    for k in range(1, min(limits.max_types, len(types)) + 1):
        for combo in itertools.combinations(types, k):
            yield from _counts(combo, prices, limits, used, spent, gpus, budget, {})


def _counts(
    combo: Sequence[str], prices: dict[str, float], limits: Limits, used: dict[str, int], spent: float, gpus: int,
    budget: float, chosen: dict[str, int],
) -> Iterator[dict[str, int]]:
    if not combo:
        yield dict(chosen)
        return
    g, rest = combo[0], combo[1:]
    n = 1
    while (gpus + n + len(rest) <= limits.max_gpus and n + used.get(g, 0) <= limits.available(g)
           and spent + n * prices[g] + sum(prices[r] for r in rest) <= budget + 1e-9):
        chosen[g] = n
        yield from _counts(rest, prices, limits, used, spent + n * prices[g], gpus + n, budget, chosen)
        n += 1
    chosen.pop(g, None)


@dataclass(frozen=True)
class SlotCapacity:
    """One GPU in one slot, for this trace and SLO."""

    rate: float               # μ: requests/s of language work it could complete within the inter-token SLO
    encode_rate: float        # image requests/s its encoder could take (vision slots; 0 otherwise)
    decodes: np.ndarray       # per request: its KV reservation fits and it decodes alone within the SLO here
    prefill_s: np.ndarray     # per request: its prefill alone here (inf where it cannot decode here)
    encode_s: np.ndarray      # per request: its images' encode time here


def slot_capacity(
    model: ModelProfile, gpu: GpuProfile, role: Role, steal: bool, trace: Trace, slo: Slo,
) -> SlotCapacity:
    lengths = trace.lengths
    prompt, out = lengths.input_tokens.astype(float), lengths.output_tokens.astype(float)
    reserve = prompt + lengths.max_output_tokens
    images = lengths.image_tokens > 0
    encode_s = lengths.image_tokens * perf_model.encode_seconds(model, gpu, 1)
    encode_rate = 0.0
    if role == "vision" and images.any():
        encode_rate = 1.0 / float(np.mean(encode_s[images]))
    n = len(prompt)
    if role == "vision" and not (steal and decoder_fits(model, gpu, "language")):
        return SlotCapacity(0.0, encode_rate, np.zeros(n, dtype=bool), np.full(n, np.inf), encode_s)
    kv_tokens = capacity.kv_capacity(model, gpu, encoder_loaded=role != "language") / model.kv_bytes_per_token
    p = perf_model.prefill_seconds_per_token(model, gpu)
    max_batch = ENGINE_DEFAULTS.max_batch
    if role == "vision":      # a stealer: the stealing batch cap, and the gateway's bound on what it holds
        max_batch = min(stealing_limits(max_batch, STEAL_EPISODE_S, p)[0], STEAL_MAX_BATCH)
    weights_s = model.weight_bytes / gpu.bandwidth_bytes_s
    kv_s = model.kv_bytes_per_token / gpu.bandwidth_bytes_s
    context = float(np.mean(prompt + out / 2))
    # Little's law: b sequences decoding emit μ·E[out] tokens/s, so a request's mean inter-token time is
    # b / (μ·E[out]) = step(b) + b·E[prompt]·p / E[out]: the decode step plus the prefills that share it.
    stall = float(np.mean(prompt)) * p / float(np.mean(out))
    by_itl = 0.0
    if slo.itl_s > weights_s:
        by_itl = min((slo.itl_s - weights_s) / (context * kv_s + stall), slo.itl_s / (p + stall))
    batch = min(max_batch, kv_tokens / float(np.mean(reserve)), by_itl)
    rate = 0.0
    if batch >= 1:
        step = perf_model.roofline_step_seconds(model.weight_bytes + batch * context * model.kv_bytes_per_token,
                                                gpu.bandwidth_bytes_s, batch, p)
        work = float(np.mean(prompt)) * p + float(np.mean(out)) * step / batch
        if role == "both":
            work += float(np.mean(encode_s))
        rate = 1.0 / work
    decodes = (reserve <= kv_tokens) & (weights_s + (prompt + out / 2) * kv_s <= slo.itl_s)
    return SlotCapacity(rate, encode_rate, decodes, np.where(decodes, prompt * p, np.inf), encode_s)


def bounds(
    space: Space, catalog: Catalog, model: ModelProfile, trace: Trace, slo: Slo,
) -> tuple[np.ndarray, np.ndarray]:
    """Each plan's upper bound on goodput (requests/s within both SLOs) at the trace's rate (module docstring),
    and on the requests/s it could serve at all, whatever the rate (the same without λ · feasible share)."""
    if not len(space):
        return np.zeros(0), np.zeros(0)
    caps = [slot_capacity(model, catalog.gpu(s.gpu), s.role, space.steal, trace, slo) for s in space.slots]
    rate = trace_rate(trace)
    has_image = trace.lengths.image_tokens > 0
    counts = space.counts.astype(float)
    language = counts @ np.array([c.rate for c in caps])
    encode = counts @ np.array([c.encode_rate for c in caps])
    is_vision = np.array([s.role == "vision" for s in space.slots])
    split = (space.counts[:, is_vision] > 0).any(axis=1)
    served = np.where(split, rate * float(np.mean(~has_image)) + encode, np.inf)
    # The feasible share depends only on which slots a plan uses: computed once per distinct set.
    packed = np.ascontiguousarray(np.packbits(space.counts > 0, axis=1))
    keys, inverse = np.unique(packed.view(f"V{packed.shape[1]}").ravel(), return_inverse=True)
    width = len(space.slots)
    used = [np.unpackbits(np.frombuffer(key.tobytes(), np.uint8))[:width] for key in keys]
    shares = np.array([_feasible_share(caps, space.slots, u, has_image, slo.ttft_s) for u in used])
    capacity = np.asarray(np.minimum(language, served), dtype=float)
    return np.minimum(rate * shares[inverse.ravel()], capacity), capacity


def trace_rate(trace: Trace) -> float:
    """Mean arrival rate of a trace (requests/s). A rate needs two arrivals apart in time: an infinite one would
    become an infinite goodput and JSON no parser reads, so a trace without is refused."""
    span = float(trace.arrival_s[-1] - trace.arrival_s[0]) if trace.n > 1 else 0.0
    if not span > 0:
        raise ValueError(f"a trace of {trace.n} request(s) arriving over {span:g} s has no arrival rate: "
                         "it needs at least 2 arriving at different times")
    return (trace.n - 1) / span


def _feasible_share(caps: Sequence[SlotCapacity], slots: Sequence[Slot], used: np.ndarray, has_image: np.ndarray,
                    ttft_s: float) -> float:
    """Share of requests some language GPU of the plan could serve within both SLOs, after the plan's fastest
    encode of its images (a `both` GPU encodes its own, a split plan's vision pool encodes them)."""
    chosen = [j for j in range(len(slots)) if used[j]]
    vision = [j for j in chosen if slots[j].role == "vision"]
    split_encode = np.minimum.reduce([caps[v].encode_s for v in vision]) if vision else np.where(has_image, np.inf, 0)
    ok = np.zeros(len(has_image), dtype=bool)
    for j in chosen:
        encode = caps[j].encode_s if slots[j].role == "both" else split_encode
        ok |= caps[j].decodes & (encode + caps[j].prefill_s <= ttft_s)
    return float(ok.mean())

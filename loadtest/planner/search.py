"""Branch and bound over the plan space: the capacity bound rules plans out, the simulator judges the rest.

The best plan is the cheapest one that sustains the target SLO attainment in simulation
(`Outcome.sustains`); when no plan within the limits does, the one with the highest goodput (then the
cheaper). The search keeps that best plan for each group of plans (by stage split, by a one-type or a
mixed language pool, by both, or one group), so that it can say what the best monolithic and the best
split plan each deliver; the overall best is the best of the groups.

A plan's bound (`space.bounds`) is first raised by a margin: on a trace of T seconds a plan overloaded
by x still meets a TTFT target of s while x·T < s, so plans sustain up to about (1 + s/T) times their
capacity there, and the bound itself is a few percent off the simulated capacity (measured: 0.80-1.08 of
it on 13 one-type and mixed plans of four GPU types, 30 s traces); margin = s/T + BOUND_SLACK. Two
rules rule plans out without simulating them:

    bound      with a best that sustains the target: a plan that costs more, or whose raised bound does
               not reach the target rate; with a best that does not: a plan whose raised bound does not
               beat the best's goodput
    sub-plan   a plan with no more GPUs in any slot than a simulated plan that did not sustain the target
               (fewer GPUs of the same kinds serve no more; this assumes that monotony of the simulator)

In each group the search first simulates, cheapest first, the plans whose capacity bound covers the
whole arrival rate with the margin to spare: the first that sustains the target is a good plan found
early. Then, while a cheaper plan might still sustain it, the most expensive such plan next: if it
fails, all its sub-plans go with it; if it sustains the target, every dearer plan goes. When no plan of
the group sustains the target, plans are taken by bound, highest first. The search thus proves its plan
the best (up to the margin and the monotony) when no candidate is left; it stops earlier at
`max_simulations` or `time_limit_s` and then says how many plans neither rule had ruled out.
Simulations run in parallel on a process pool (pool.py: its workers stop with the search, however it stops), a
batch of `workers` plans at a time, the groups in turn.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from common.catalog import Catalog, ModelProfile
from loadtest.planner.evaluate import Outcome, Policies, simulate
from loadtest.planner.pool import shared, submit_all, worker_pool
from loadtest.planner.space import SPLITS, Limits, Plan, Slo, Space, Split, bounds, enumerate_space, trace_rate
from loadtest.sim.workloads import Trace

BOUND_SLACK = 0.05           # the bound's own error, beside the finite trace's (module docstring)
COST_EPS = 1e-6
GROUPINGS = ("split", "fleet", "split+fleet", "none")


@dataclass(frozen=True)
class Candidate:
    plan: Plan
    cost_per_hour: float
    bound_rps: float


@dataclass(frozen=True)
class Evaluated:
    candidate: Candidate
    outcome: Outcome

    @property
    def plan(self) -> Plan:
        return self.candidate.plan


@dataclass
class SearchResult:
    ranked: list[Evaluated]                 # every simulated plan, best first
    best_by_group: dict[str, Evaluated]
    considered: int                         # plans within the limits
    simulated: int
    ruled_out: int                          # by the bound, never simulated
    ruled_out_subplan: int                  # as sub-plans of plans that failed, never simulated
    left: int                               # neither ruled out nor simulated (max_simulations or time limit)
    seconds: float
    rate_rps: float
    target: float
    timings: dict[str, float] = field(default_factory=dict)

    @property
    def best(self) -> Evaluated | None:
        return self.ranked[0] if self.ranked else None

    @property
    def cpu_s(self) -> float:
        """CPU seconds the simulations took (on a busy machine, wall time says little)."""
        return sum(e.outcome.cpu_s for e in self.ranked)


@dataclass(frozen=True)
class Problem:
    catalog: Catalog
    model: ModelProfile
    trace: Trace
    slo: Slo
    limits: Limits
    gpus: tuple[str, ...]
    target: float = 0.9                      # SLO attainment a plan must sustain
    splits: tuple[Split, ...] = SPLITS
    steal: bool = True
    policies: Policies = field(default_factory=Policies)
    grouping: str = "none"

    @property
    def margin(self) -> float:
        """How much a bound is raised before it rules a plan out (module docstring)."""
        span = float(self.trace.arrival_s[-1] - self.trace.arrival_s[0])
        return BOUND_SLACK + (self.slo.ttft_s / span if span > 0 else 1.0)

    @property
    def images(self) -> bool:
        return bool(self.model.vision is not None and self.trace.lengths.image_tokens.any())


def better(a: Evaluated, b: Evaluated, target: float) -> bool:
    """Whether plan a beats plan b (module docstring)."""
    ma, mb = a.outcome.sustains(target), b.outcome.sustains(target)
    if ma != mb:
        return ma
    ca, cb = a.candidate.cost_per_hour, b.candidate.cost_per_hour
    ga, gb = a.outcome.goodput_rps, b.outcome.goodput_rps
    if ma:
        return ca < cb - COST_EPS or (abs(ca - cb) <= COST_EPS and ga > gb)
    return ga > gb or (ga == gb and ca < cb - COST_EPS)


def _simulate(c: Candidate) -> Evaluated:
    """In a worker: the search's problem came with the fork (`worker_pool(..., shared=problem)`)."""
    p: Problem = shared()
    return Evaluated(c, simulate(c.plan, p.trace, p.model, p.catalog, p.slo, p.policies))


class _Group:
    """The candidates of one group of plans (rows of the space) and what is known of them."""

    def __init__(self, rows: np.ndarray, space: Space, cost: np.ndarray, bound: np.ndarray, capacity: np.ndarray,
                 problem: Problem, rate: float) -> None:
        self.rows, self.space = rows, space
        self.counts = space.counts[rows]
        self.cost, self.bound = cost[rows], bound[rows]
        self.reach = self.bound * (1 + problem.margin)
        self.confident = (capacity[rows] >= rate * (1 + problem.margin)) & (self.bound >= problem.target * rate)
        self.alive = np.ones(len(rows), dtype=bool)
        self.by_bound = 0              # ruled out by the bound rule
        self.by_subplan = 0            # ruled out as the sub-plan of a failed plan
        self.best: Evaluated | None = None
        self.target_rps = problem.target * rate
        self.target = problem.target

    def take(self, k: int) -> list[tuple[int, Candidate]]:
        """The next k candidates (module docstring), marked as taken."""
        out = []
        for _ in range(k):
            i = self._next()
            if i is None:
                break
            self.alive[i] = False
            row = int(self.rows[i])
            out.append((i, Candidate(self.space.plan(row), float(self.cost[i]), float(self.bound[i]))))
        return out

    def _next(self) -> int | None:
        alive = self.alive
        if not alive.any():
            return None
        sustained = self.best is not None and self.best.outcome.sustains(self.target)
        if not sustained and (pick := alive & self.confident).any():
            return int(np.flatnonzero(pick)[np.argmin(self.cost[pick])])
        if sustained:
            return int(np.flatnonzero(alive)[np.argmax(self.cost[alive])])
        return int(np.flatnonzero(alive)[np.argmax(self.bound[alive])])

    def learn(self, i: int, e: Evaluated) -> None:
        """Keep the better plan and rule out what it and the bound show cannot beat it."""
        if self.best is None or better(e, self.best, self.target):
            self.best = e
        if not e.outcome.sustains(self.target):
            sub = self.alive & (self.counts <= self.counts[i]).all(axis=1)
            self.by_subplan += int(sub.sum())
            self.alive &= ~sub
        best = self.best
        if best.outcome.sustains(self.target):
            c = best.candidate.cost_per_hour
            out = (self.cost > c + COST_EPS) | (self.reach < self.target_rps) | (
                (self.cost >= c - COST_EPS) & (self.reach <= best.outcome.goodput_rps))
        else:
            g = best.outcome.goodput_rps
            out = (self.reach < g) | ((self.reach <= g) & (self.cost >= best.candidate.cost_per_hour - COST_EPS))
        out &= self.alive
        self.by_bound += int(out.sum())
        self.alive &= ~out


def search(problem: Problem, *, max_simulations: int = 200, time_limit_s: float = 240.0, workers: int | None = None,
           progress: Callable[[int, int], None] | None = None) -> SearchResult:
    """Find the best plan (module docstring); `progress(simulated, considered)` after each simulation."""
    started = time.perf_counter()
    space = enumerate_space(problem.catalog, problem.model, problem.gpus, problem.limits, images=problem.images,
                            splits=problem.splits, steal=problem.steal)
    enumerated = time.perf_counter()
    rate = trace_rate(problem.trace)
    cost = space.cost_per_hour(problem.catalog)
    bound, capacity = bounds(space, problem.catalog, problem.model, problem.trace, problem.slo)
    names = _group_names(space, problem.grouping)
    groups = {g: _Group(np.flatnonzero(names == g), space, cost, bound, capacity, problem, rate)
              for g in sorted(set(names.tolist()))}
    bounded = time.perf_counter()
    evaluated: list[Evaluated] = []
    workers = workers or min(2, os.cpu_count() or 1)
    with worker_pool(workers, shared=problem) as pool:
        active = list(groups.values())       # in turn, a batch each, so that a cap leaves no group unsearched
        while active and len(evaluated) < max_simulations and time.perf_counter() - started < time_limit_s:
            group = active.pop(0)
            batch = group.take(min(workers, max_simulations - len(evaluated)))
            if not batch:
                continue
            active.append(group)
            for (i, _), future in zip(batch, submit_all(pool, _simulate, [c for _, c in batch]), strict=True):
                e = future.result()
                evaluated.append(e)
                group.learn(i, e)
                if progress:
                    progress(len(evaluated), len(space))
    best = {g: grp.best for g, grp in groups.items() if grp.best is not None}
    return SearchResult(
        _ranked(evaluated, problem.target), best, len(space), len(evaluated),
        sum(g.by_bound for g in groups.values()), sum(g.by_subplan for g in groups.values()),
        sum(int(g.alive.sum()) for g in groups.values()), time.perf_counter() - started, rate, problem.target,
        {"enumerate_s": enumerated - started, "bound_s": bounded - enumerated,
         "simulate_s": time.perf_counter() - bounded})


def _group_names(space: Space, grouping: str) -> np.ndarray:
    """Each plan's group under a grouping of GROUPINGS."""
    n = len(space)
    if grouping not in ("split", "fleet", "split+fleet"):
        return np.full(n, "all plans", dtype=object)
    slots = space.slots
    used = space.counts > 0
    vision = np.array([s.role == "vision" for s in slots])
    split = np.where(used[:, vision].any(axis=1), "E+PD", "monolithic").astype(object)
    language = sorted({s.gpu for s in slots if s.role != "vision"})
    types = sum((used[:, [j for j, s in enumerate(slots) if s.gpu == g and s.role != "vision"]].any(axis=1)
                 for g in language), np.zeros(n, dtype=int))
    fleet = np.where(types == 1, "one type", "mixed").astype(object)
    names: dict[str, np.ndarray] = {"split": split, "fleet": fleet, "split+fleet": split + ", " + fleet}
    return names[grouping]


def _ranked(evaluated: list[Evaluated], target: float) -> list[Evaluated]:
    out: list[Evaluated] = []
    for e in evaluated:          # insertion: a few hundred plans at most
        k = next((i for i, o in enumerate(out) if better(e, o, target)), len(out))
        out.insert(k, e)
    return out

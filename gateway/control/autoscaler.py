"""Pools that grow and shrink with their demand (`gateway.autoscaling`, gateway/config/autoscaling.py).

Three parts:

- `Scaler`, pure: from one `PoolDemand` per pool and the clock it is given, the engine count each pool
  should have. A pool's need is its largest signal over that signal's high mark, in engines (vision:
  image tokens waiting; language: prefill backlog tokens, with the image tokens waiting at the vision
  engines, whose prefill comes to this pool as their embeddings arrive, requests held or queued, and the serving
  engines times the best engine's predicted time to first token over the SLO); its pressure is the need
  per serving engine. Need at or above the capacity (the serving engines plus those the scaler added
  that are still starting) starts a high spell; once the spell's need over the capacity, summed over its
  seconds, reaches `up_delay_s` (the plain delay at a need just above the capacity, a fifth of it at
  five times: a surge is met at once, a short or small blip is not), one step gives the engines that
  bring the pressure under 1, at most `max_step`: a burst is met at once, not one engine per start-up.
  The step is sized for the need `lookahead_s` later (about an engine's start-up) at the rate it grew
  during the spell, since what arrives while the new engines load waits for them. Engines on their way
  count as capacity, so while they start no other step is taken unless the need grows beyond them. One
  engine fewer when the need averaged over the last `down_delay_s` (no step settling in that time: an
  added engine not yet healthy, a removed one still draining), spread over the engines left of the
  desired count (in export mode nothing applies the steps, so it may be above the engines there), is at
  `low_mark` or less and the need now fits on them: the load after the removal decides, so a large pool
  sheds an engine its others can cover and a spike in a calm minute counts for its share. Each step
  starts both delays again. The count stays between the pool's `min` and `max`, never above what the
  inventory's GPUs allow nor below the engines the scaler may not remove.
- `pool_demand`, pure too: a pool's `PoolDemand` as a state table shows it, with what only the caller
  knows (requests waiting at admission, its own steps under way, the GPUs it may add and engines it may
  remove). The loop below and the bursty benchmark's simulator (loadtest/planner/autoscaled.py) both
  read demand through it and decide through `Scaler`.
- `Autoscaler`, the loop the daemon runs every `interval_s`: it reads the demand from the state table
  and the admission queue, asks the scaler, and in `manage` mode applies the step through
  gateway/control/fleet.py: a copy of the pool's template backend on each of the next free GPUs of the
  inventory the step asks for, or the removal (drain first: no new requests, those in flight finish; then the engine
  stops) of the engines it added last. It removes only engines it added. In both modes /metrics carries
  `heterogate_pool_desired_replicas{pool}`, `heterogate_pool_replicas{pool}` and
  `heterogate_pool_pressure{pool}`, for an autoscaler outside the gateway (deploy/k8s/keda-scaledobject.yaml).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import math
import time
from collections import Counter, deque
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field

import structlog
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from gateway.config.autoscaling import (
    POOL_ROLES,
    AutoscalingConfig,
    LanguageScaling,
    Pool,
    PoolScaling,
    VisionScaling,
    pick_template,
)
from gateway.control.fleet import Fleet
from gateway.requests.errors import RequestError
from gateway.routing.backend_entry import BackendEntry
from gateway.routing.policies.first_token import predicted_ttft_s
from gateway.routing.state_table import StateTable
from gateway.runtime import Runtime

log = structlog.get_logger("autoscaler")


@dataclass(frozen=True)
class PoolDemand:
    """What one pool holds and is asked for, as read at one instant."""

    engines: int                 # in the pool, not draining (starting ones included)
    serving: int                 # of them, healthy
    arriving: int = 0            # the scaler's own steps under way: engines added, not yet healthy
    leaving: int = 0             # ... and engines removed, still draining
    backlog_tokens: int = 0      # vision: image tokens waiting to be encoded; language: prefill backlog tokens,
                                 # with the image tokens waiting at the vision engines (their prefill to come)
    queued: int = 0              # language: requests the engines hold (Q_i) plus those waiting at admission
    predicted_ttft_s: float | None = None   # language: the best serving engine's, None without one
    addable: int | None = None   # GPUs left in the inventory (None: no bound, the engines run elsewhere)
    removable: int | None = None   # engines the scaler may take away (None: any)


@dataclass(frozen=True)
class Decision:
    pool: Pool
    current: int       # engines now (PoolDemand.engines)
    desired: int
    pressure: float
    reason: str        # why desired moved this time ("" when it did not)


def need(scaling: PoolScaling, demand: PoolDemand) -> float:
    """The engines the pool's demand asks for: its largest signal over that signal's high mark (the
    predicted first token as it would be on the serving engines, times their number)."""
    if isinstance(scaling, VisionScaling):
        return demand.backlog_tokens / scaling.image_tokens_per_engine
    assert isinstance(scaling, LanguageScaling)
    signals = [demand.backlog_tokens / scaling.prefill_tokens_per_engine, demand.queued / scaling.queue_per_engine]
    if demand.predicted_ttft_s is not None:
        signals.append(demand.serving * demand.predicted_ttft_s / scaling.ttft_slo_s)
    return max(signals)


def pressure(scaling: PoolScaling, demand: PoolDemand) -> float:
    """The pool's need per serving engine: its largest signal over its high mark (inf: demand and no
    serving engine)."""
    wanted = need(scaling, demand)
    if demand.serving == 0:
        return math.inf if wanted else 0.0
    return wanted / demand.serving


def pool_members(table: StateTable, pool: Pool) -> list[BackendEntry]:
    """The pool's engines in `table`: its roles', not draining (starting ones included)."""
    roles = POOL_ROLES[pool]
    return [e for e in table.entries() if e.role in roles and not table.is_draining(e.id)]


def pool_demand(table: StateTable, pool: Pool, scaling: PoolScaling, *, waiting: int = 0, arriving: int = 0,
                leaving: int = 0, addable: int | None = None, removable: int | None = None) -> PoolDemand:
    """The pool's demand as `table` shows it now: its members not draining (starting ones included), the
    healthy ones, and their backlogs; for the language pool also the requests they hold plus `waiting`
    (at admission) and the best healthy engine's predicted time to first token. The language pool's
    backlog counts the image tokens waiting at every vision engine (draining ones too): those prompts
    reach its prefill backlog only once encoded, and a pool that waits for them grows a start-up late
    in an image burst (docs/PLANNING.md). A `both` engine's own images are not added: its lease holds
    them already."""
    members = pool_members(table, pool)
    serving = [e for e in members if table.is_healthy(e)]
    snaps = [table.snapshot(e) for e in members]
    if pool == "vision":
        return PoolDemand(len(members), len(serving), arriving, leaving, sum(s.vision_backlog for s in snaps),
                          addable=addable, removable=removable)
    assert isinstance(scaling, LanguageScaling)
    prompt, reserve = scaling.ttft_prompt_tokens, scaling.ttft_prompt_tokens + scaling.ttft_max_tokens
    ttfts = [predicted_ttft_s(table.snapshot(e), prompt, reserve) for e in serving]
    coming = sum(table.snapshot(e).vision_backlog for e in table.entries() if e.role == "vision")
    return PoolDemand(len(members), len(serving), arriving, leaving,
                      sum(s.prefill_backlog_tokens for s in snaps) + coming,
                      sum(s.queue_depth for s in snaps) + waiting, min(ttfts, default=None),
                      addable=addable, removable=removable)


@dataclass
class _PoolState:
    desired: int | None = None
    last: float | None = None        # the previous decision's clock
    high_since: float | None = None
    high_need: float = 0.0           # the need when the high spell began: its growth over the spell
    high_load_s: float = 0.0         # the spell's pressure on the capacity, integrated over its seconds
    calm: deque[float] = field(default_factory=deque)   # the need at each tick since the last step settled
    calm_since: float | None = None

    def end_high(self) -> None:
        self.high_since, self.high_load_s = None, 0.0

    def end_calm(self) -> None:
        self.calm_since = None
        self.calm.clear()

    def restart(self) -> None:
        """A step was taken: both delays start again."""
        self.end_high()
        self.end_calm()


class Scaler:
    """The decisions, from demand snapshots and an injected clock (no I/O); the rules are the module
    docstring's. Why these: a fixed up delay makes a burst queue for the time that filters blips, and a
    fixed low mark on the engines there now keeps an engine whose share the others could carry (and
    restarts its delay at every spike of backlog); the pressure-seconds and the average load after the
    removal answer both with the same two delays."""

    def __init__(self, config: AutoscalingConfig, clock: Callable[[], float] = time.monotonic) -> None:
        self._pools = config.scaled()
        self._up_delay_s = config.up_delay_s
        self._down_delay_s = config.down_delay_s
        self._lookahead_s = config.lookahead_s
        self._interval_s = config.interval_s
        self._clock = clock
        self._state = {pool: _PoolState() for pool in self._pools}

    @property
    def pools(self) -> Mapping[Pool, PoolScaling]:
        return self._pools

    def decide(self, demand: Mapping[Pool, PoolDemand]) -> dict[Pool, Decision]:
        now = self._clock()
        return {pool: self._decide(pool, d, now) for pool, d in demand.items() if pool in self._pools}

    def settle(self, pool: Pool, engines: int) -> None:
        """The step could not be applied: the pool's desired count is what it has."""
        self._state[pool] = _PoolState(desired=engines)

    def _decide(self, pool: Pool, d: PoolDemand, now: float) -> Decision:
        scaling, st = self._pools[pool], self._state[pool]
        reachable = scaling.max if d.addable is None else d.engines + d.addable   # the inventory's bound, even on min
        floor = min(scaling.min if d.removable is None else max(scaling.min, d.engines - d.removable), reachable)
        ceiling = max(min(scaling.max, reachable), floor)
        desired = min(max(d.engines if st.desired is None else st.desired, floor), ceiling)
        wanted = need(scaling, d)
        capacity = d.serving + d.arriving      # engines on their way count: no second step for the same demand
        self._observe(st, d, wanted, capacity, now)
        reason = ""
        if st.high_since is not None and st.high_load_s >= self._up_delay_s and desired < ceiling:
            target, why = self._step_up(scaling, st, d, wanted, capacity, now)
            if min(target, ceiling) > desired:   # not a step already asked for (export mode: nothing applies it)
                if target > ceiling:   # the log says why the pool gets fewer than the need asks for
                    why += (f"; {target} wanted, capped at {ceiling} "
                            f"({'max' if ceiling == scaling.max else 'the GPUs the inventory has left'})")
                desired, reason = min(target, ceiling), why
        elif desired > floor:
            fewer, reason = self._step_down(scaling, st, wanted, now, _serving_at(d, desired),
                                            min(scaling.max_step, desired - floor))
            desired -= fewer
        if reason:
            st.restart()
        st.desired = desired
        return Decision(pool, d.engines, desired, pressure(scaling, d), reason)

    def _observe(self, st: _PoolState, d: PoolDemand, wanted: float, capacity: int, now: float) -> None:
        """The tick's need into the high spell (need at or above the capacity) or the calm window."""
        elapsed = now - st.last if st.last is not None else 0.0
        st.last = now
        if wanted > 0 and wanted >= capacity:
            if st.high_since is None:
                st.high_since, st.high_need, st.high_load_s = now, wanted, 0.0
            else:
                st.high_load_s += elapsed * (wanted / capacity if capacity else math.inf)
        else:
            st.end_high()
        if d.arriving or d.leaving:
            st.end_calm()   # the down delay starts again once the step settled
            return
        if st.calm_since is None:
            st.calm_since = now
        st.calm.append(wanted)
        while len(st.calm) > max(1, round(self._down_delay_s / self._interval_s)):
            st.calm.popleft()

    def _step_up(self, scaling: PoolScaling, st: _PoolState, d: PoolDemand, wanted: float, capacity: int,
                 now: float) -> tuple[int, str]:
        """The fewest engines under the high mark for the need `lookahead_s` on, at its growth over the spell."""
        assert st.high_since is not None
        spell = now - st.high_since
        growth = max(wanted - st.high_need, 0.0) / spell if spell > 0 else 0.0
        ahead = wanted + growth * self._lookahead_s
        step = min(math.floor(ahead) + 1 - capacity, scaling.max_step)
        reason = (f"need {wanted:.2f} engines, {ahead:.2f} in {self._lookahead_s:g}s, at or above the "
                  f"{capacity} serving or starting for {spell:.1f}s (pressure-seconds {st.high_load_s:.1f})")
        return d.engines + step, reason

    def _step_down(self, scaling: PoolScaling, st: _PoolState, wanted: float, now: float, serving: int,
                   most: int) -> tuple[int, str]:
        """How many engines fewer now, at most `most` (0: none), and why: after a full calm window, the
        most whose going leaves engines that carry the window's average need at the low mark or less and
        the need now under the high mark. `serving`: the engines serving at the desired count, which
        the ones removed are taken from."""
        if st.calm_since is None or now - st.calm_since < self._down_delay_s or st.high_since is not None:
            return 0, ""
        mean = sum(st.calm) / len(st.calm)
        fewer = 0
        while fewer < most and _carries(serving - fewer - 1, mean, wanted, scaling.low_mark):
            fewer += 1
        if not fewer:
            return 0, ""
        left = serving - fewer
        return fewer, (f"need {mean:.2f} engines on average over {self._down_delay_s:g}s: "
                       f"{mean / left if left else 0.0:.2f} on the {left} left, at or below {scaling.low_mark}")


def _serving_at(d: PoolDemand, desired: int) -> int:
    """The engines that would serve at the desired count: those serving now, less those not serving (still
    starting, failing) kept as they are, plus or minus the difference. The desired count, not the engines
    now, is what a step down is taken from: in export mode nothing applies the steps, so after a burst the
    desired count stays above the engines there, and counted from those it could come down only at no
    demand at all (never while an engine serves: its predicted first token is demand)."""
    return max(d.serving + desired - d.engines, 0)


def _carries(engines: int, mean: float, wanted: float, low_mark: float) -> bool:
    """Whether `engines` carry an average need of `mean` at `low_mark` or less and the need now under the
    high mark (none carry any need)."""
    if engines < 1:
        return mean == 0 and wanted == 0
    return mean / engines <= low_mark and wanted < engines


class Autoscaler:
    """The loop: demand read from the gateway, the scaler's step applied through the fleet (`manage`
    with a fleet that takes changes), or only exported (`export`, or no fleet)."""

    def __init__(self, runtime: Runtime, fleet: Fleet | None, config: AutoscalingConfig,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._runtime = runtime
        self._fleet = fleet if config.mode == "manage" else None
        self._config = config
        self.scaler = Scaler(config, clock)
        self.decisions: dict[Pool, Decision] = {}
        self._added: dict[Pool, dict[str, str]] = {pool: {} for pool in self.scaler.pools}   # id -> GPU, in order
        self._arriving: set[str] = set()   # added, not yet healthy
        self._leaving: dict[str, Pool] = {}   # removed, still in the table
        self._numbers = itertools.count()

    @property
    def table(self) -> StateTable:
        return self._runtime.table

    def collector(self) -> Collector:
        return _PoolCollector(self)

    async def run(self, stop: asyncio.Event) -> None:
        log.info("autoscaler_started", mode=self._config.mode, pools=list(self.scaler.pools),
                 applies=self._fleet is not None)
        while not stop.is_set():
            await self.tick()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self._config.interval_s)

    async def tick(self) -> dict[Pool, Decision]:
        """Read, decide, apply one step per pool. Applying, it holds the fleet from the reading on, so the
        step is computed against the fleet as the last change (a reload, an admin call) left it, and none
        comes between its decision and its changes."""
        if self._fleet is None:
            return self._step()
        async with self._fleet.exclusive():
            return self._step()

    def _step(self) -> dict[Pool, Decision]:
        self._forget_settled()
        self.decisions = self.scaler.decide({pool: self.demand(pool) for pool in self.scaler.pools})
        for decision in self.decisions.values():
            if decision.reason:
                log.info("autoscale_decision", pool=decision.pool, engines=decision.current,
                         desired=decision.desired, reason=decision.reason)
            if self._fleet is not None and decision.desired != decision.current:
                self._apply(self._fleet, decision)
        return self.decisions

    def demand(self, pool: Pool) -> PoolDemand:
        added = self._added[pool]
        managing = self._fleet is not None
        return pool_demand(self._runtime.table, pool, self.scaler.pools[pool],
                           waiting=self._runtime.pipeline.admission.waiting,
                           arriving=sum(i in added for i in self._arriving),
                           leaving=sum(p == pool for p in self._leaving.values()),
                           addable=self._free_gpus(pool) if managing else None,
                           removable=len(self._removable(pool)) if managing else None)

    # -- applying a step (manage) ------------------------------------------------------------

    def _forget_settled(self) -> None:
        """Steps that settled leave the books, and so do added engines that left the fleet some other way
        (an admin removal, a SIGHUP reload of a file that does not hold them)."""
        table = self._runtime.table
        for added in self._added.values():
            for backend_id in [i for i in added if table.get(i) is None]:
                del added[backend_id]
        self._arriving = {i for i in self._arriving if (e := table.get(i)) is not None and not table.is_healthy(e)}
        self._leaving = {i: p for i, p in self._leaving.items() if table.get(i) is not None}

    def _removable(self, pool: Pool) -> list[str]:
        """The engines the scaler added to the pool that still serve, in the order added. One an admin call
        drained or removes is out of the pool's engines already: removing it again would count it twice."""
        table = self._runtime.table
        return [i for i in self._added[pool] if not table.is_draining(i)]

    def _free_gpus(self, pool: Pool) -> int:
        return len(self._free(pool))

    def _free(self, pool: Pool) -> list[str]:
        """The inventory's GPUs no engine added by the scaler holds, in the inventory's order."""
        used = Counter(self._added[pool].values())
        free = []
        for gpu in self.scaler.pools[pool].gpus:
            if used[gpu]:
                used[gpu] -= 1
            else:
                free.append(gpu)
        return free

    def _apply(self, fleet: Fleet, decision: Decision) -> None:
        """The step, one engine at a time; a refusal settles the pool at the engines reached."""
        pool, engines = decision.pool, decision.current
        try:
            while engines != decision.desired:
                if decision.desired > engines:
                    self._add(fleet, pool)
                    engines += 1
                else:
                    self._remove(fleet, pool)
                    engines -= 1
        except RequestError as exc:
            log.error("autoscale_refused", pool=pool, engines=engines, desired=decision.desired, error=exc.message)
            self.scaler.settle(pool, engines)

    def _add(self, fleet: Fleet, pool: Pool) -> None:
        gpu = self._free(pool)[0]
        template = pick_template(pool, self.scaler.pools[pool], fleet.config.raw.backends)
        taken = {b.id for b in fleet.config.raw.backends}
        backend_id = next(i for n in self._numbers if (i := f"{pool}-auto-{n}") not in taken)
        fleet.add({**template.model_dump(mode="json"), "id": backend_id, "gpu": gpu}, scaled=True)
        self._added[pool][backend_id] = gpu
        self._arriving.add(backend_id)
        log.info("autoscale_added", pool=pool, backend=backend_id, gpu=gpu, template=template.id)

    def _remove(self, fleet: Fleet, pool: Pool) -> None:
        backend_id = self._removable(pool)[-1]
        fleet.remove(backend_id)
        del self._added[pool][backend_id]
        self._arriving.discard(backend_id)
        self._leaving[backend_id] = pool
        log.info("autoscale_removing", pool=pool, backend=backend_id)


class _PoolCollector(Collector):
    """The scaler's last decision per pool, and the engines each pool holds now, read at scrape time: a
    step applied, or an admin call's drain, shows at once, not a tick (`interval_s`) later."""

    def __init__(self, autoscaler: Autoscaler) -> None:
        self._autoscaler = autoscaler

    def collect(self) -> Iterator[Metric]:
        desired = GaugeMetricFamily("heterogate_pool_desired_replicas", "Engines the autoscaler wants in the pool "
                                    "(gateway.autoscaling)", labels=["pool"])
        current = GaugeMetricFamily("heterogate_pool_replicas", "Engines in the pool, not draining", labels=["pool"])
        load = GaugeMetricFamily("heterogate_pool_pressure", "The pool's largest demand signal over its high mark "
                                 "(1 or more: high)", labels=["pool"])
        for pool, decision in self._autoscaler.decisions.items():
            desired.add_metric([pool], decision.desired)
            current.add_metric([pool], len(pool_members(self._autoscaler.table, pool)))
            load.add_metric([pool], decision.pressure)
        yield from (desired, current, load)

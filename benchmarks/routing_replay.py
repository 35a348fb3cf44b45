"""Virtual-time replay of the mixed-tier benchmark: the same engines, workload and goodput, no sockets.

    nice -n 19 python benchmarks/routing_replay.py [--seeds 1 2 3 4] [--requests 3000] [--loads 0.9 1.0] \
        [--targets cwlor marginal_delay] [--params '{"w_stall": 0.3}'] [--interval-ms 500]

A deterministic discrete-event replay of benchmarks/mixed_tier.py: the eight emulated engines are
their own `Batcher`s (benchmarks/emulated_engine.py) stepped in emulated time; the gateway is its
real `StateTable` (leases, learned speed, KV reports every --interval-ms, the scrape interval) on a
virtual clock, with the real policy object choosing among `table.candidates`; cwlor and lor are the
proxies' rules (benchmarks/lor_proxy.py, cwlor weighted by each engine's saturated rate). The
workload is mixed_workload.trace at fractions of the summed saturated rate. As in the live
benchmark, each target first serves an unscored warm-up run (--warmup requests at 0.6x) and keeps
what it learned; every target gets the same request sequence per seed and load. What the replay
leaves out: network and gateway latency, the client's and the gateway's CPU, scrape jitter.

Goodput = share of requests with TTFT <= 2 s and mean inter-token time <= 100 ms. Prints, per target
and load, the median goodput over seeds with the range, TTFT p99, misses split by kind (TTFT,
inter-token) and tier, and each target's goodput minus cwlor's per seed; writes
benchmarks/results/routing_replay.json. A tuning aid: a few seconds a run, not a substitute for
the live benchmark.
"""

from __future__ import annotations

import argparse
import heapq
import json
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.emulated_engine import BLOCK_SIZE, MAX_MODEL_LEN, TIERS, Batcher, Seq  # noqa: E402
from benchmarks.gateway_overhead import git_state, save_report  # noqa: E402
from benchmarks.mixed_workload import Request, saturated_rate, trace  # noqa: E402
from common.catalog import load_catalog  # noqa: E402
from gateway.routing.backend_entry import Lease, Reported  # noqa: E402
from gateway.routing.policies import build_policy  # noqa: E402
from gateway.routing.policies.contracts import RequestProfile  # noqa: E402
from gateway.routing.state_table import StateTable  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "routing_replay.json"
CLUSTER = (("h100-0", "H100"), ("h100-1", "H100"), ("a100-0", "A100-80GB"), ("a100-1", "A100-80GB"),
           ("a100-2", "A100-80GB"), ("l40s-0", "L40S"), ("l40s-1", "L40S"), ("l40s-2", "L40S"))
MODEL = "llava-1.5-7b"
TTFT_SLO_S, ITL_SLO_S = 2.0, 0.100
LANGUAGE = ("language", "both")


@dataclass(slots=True)
class Outcome:
    engine: str = ""
    prompt: int = 0
    max_tokens: int = 0
    arrived: float = 0.0
    first: float = float("nan")
    last: float = float("nan")

    @property
    def ttft(self) -> float:
        return self.first - self.arrived

    @property
    def itl(self) -> float:
        return (self.last - self.first) / (self.max_tokens - 1) if self.max_tokens > 1 else 0.0


class Clock:
    now = 0.0

    def __call__(self) -> float:
        return self.now


class Router:
    """A target: picks an engine, hears of first tokens and ends. `report` is the engines' metrics."""

    def route(self, r: Request) -> tuple[str, Any]:
        raise NotImplementedError

    def first_token(self, handle: Any) -> None:
        pass

    def done(self, handle: Any, tokens: int) -> None:
        pass

    def report(self, engine_id: str, b: Batcher) -> None:
        pass


class Proxy(Router):
    """benchmarks/lor_proxy.py's rules: argmin (outstanding + 1) / weight (lor: weight 1)."""

    def __init__(self, weights: dict[str, float]) -> None:
        self.weights = weights
        self.outstanding = dict.fromkeys(weights, 0)

    def route(self, r: Request) -> tuple[str, Any]:
        eid = min(self.weights, key=lambda e: (self.outstanding[e] + 1) / self.weights[e])
        self.outstanding[eid] += 1
        return eid, eid

    def done(self, handle: Any, tokens: int) -> None:
        self.outstanding[handle] -= 1


class Gateway(Router):
    """The gateway's state table and a policy, on the replay's clock."""

    def __init__(self, policy: str, params: dict[str, Any], clock: Clock,
                 cluster: Sequence[tuple[str, str]] = CLUSTER) -> None:
        """`cluster`: (backend id, catalog GPU) of each engine, registered in that order."""
        catalog = load_catalog()
        self.model = catalog.model(MODEL)
        self.table = StateTable(self.model, 0.2, clock=clock)
        self.policy = build_policy(policy, params)
        self.clock = clock
        self.seq = 0
        for eid, gpu in cluster:
            self.table.register(eid, "language", catalog.gpu(gpu), address=eid, managed=False, external=True)

    def route(self, r: Request) -> tuple[str, Any]:
        profile = RequestProfile(str(id(r)), r.prompt_tokens, r.max_tokens)
        candidates = self.table.candidates(LANGUAGE, self.clock.now).fitting(r.prompt_tokens + r.max_tokens)
        eid = self.policy.choose(profile, candidates, self.clock.now).backend.id
        return eid, self.table.acquire(eid, r.prompt_tokens, r.max_tokens)

    def first_token(self, handle: Any) -> None:
        self.table.first_token(handle)

    def done(self, handle: Any, tokens: int) -> None:
        lease: Lease = handle
        self.table.release(lease, tokens)

    def report(self, engine_id: str, b: Batcher) -> None:
        per_block = BLOCK_SIZE * self.model.kv_bytes_per_token
        self.seq += 1
        self.table.apply_heartbeat(engine_id, self.seq, engine_id, Reported(
            seq=self.seq, waiting=len(b.waiting), running=len(b.running), kv_free_bytes=b.free_blocks * per_block,
            kv_total_bytes=b.tier.num_blocks * per_block, max_model_len=MAX_MODEL_LEN, kv_source="engine"))


@dataclass(order=True)
class _Event:
    at: float
    order: int
    kind: str = field(compare=False)
    what: Any = field(compare=False)


def serve(router: Router, requests: list[Request], clock: Clock, interval_s: float) -> list[Outcome]:
    """Replay `requests` (arrival offsets from now) through `router` onto idle engines, to the last token."""
    engines = {eid: Batcher(TIERS[tier]) for eid, tier in CLUSTER}
    busy: dict[str, bool] = dict.fromkeys(engines, False)
    start = clock.now
    events: list[_Event] = []
    counter = iter(range(1 << 62))
    handles: dict[int, tuple[Any, Outcome]] = {}
    outcomes: list[Outcome] = []

    def push(at: float, kind: str, what: Any) -> None:
        heapq.heappush(events, _Event(at, next(counter), kind, what))

    def step(eid: str) -> None:
        plan = engines[eid].plan()
        busy[eid] = plan is not None
        if plan is not None:
            push(clock.now + plan.duration_s, "step", (eid, plan))

    for r in requests:
        push(start + r.at_s, "arrive", r)
    for k, eid in enumerate(engines):
        router.report(eid, engines[eid])
        push(start + interval_s * (k + 1) / len(engines), "report", eid)
    pending = len(requests)
    while pending:
        ev = heapq.heappop(events)
        clock.now = ev.at
        if ev.kind == "arrive":
            r = ev.what
            eid, handle = router.route(r)
            out = Outcome(eid, r.prompt_tokens, r.max_tokens, clock.now)
            outcomes.append(out)
            seq = Seq(r.prompt_tokens, r.max_tokens, clock.now)
            handles[id(seq)] = (handle, out)
            engines[eid].waiting.append(seq)
            if not busy[eid]:
                step(eid)
        elif ev.kind == "step":
            eid, plan = ev.what
            done = engines[eid].apply(plan)
            for s in plan.first:
                handle, out = handles[id(s)]
                out.first = out.last = clock.now
                router.first_token(handle)
            for s in plan.decoded:
                handles[id(s)][1].last = clock.now
            for s in done:
                handle, out = handles.pop(id(s))
                router.done(handle, s.generated)
                pending -= 1
            step(eid)
        else:
            router.report(ev.what, engines[ev.what])
            push(clock.now + interval_s, "report", ev.what)
    return outcomes


def score(outcomes: list[Outcome]) -> dict[str, Any]:
    tiers = dict(CLUSTER)
    misses: dict[str, int] = {}
    good = 0
    for o in outcomes:
        slow, jerky = o.ttft > TTFT_SLO_S, o.itl > ITL_SLO_S
        if not (slow or jerky):
            good += 1
            continue
        key = f"{'ttft' if slow else 'itl'}:{tiers[o.engine]}"
        misses[key] = misses.get(key, 0) + 1
    ttft = sorted(o.ttft for o in outcomes)
    shares: dict[str, float] = {}
    for o in outcomes:
        shares[tiers[o.engine]] = shares.get(tiers[o.engine], 0.0) + 1 / len(outcomes)
    return {"goodput": good / len(outcomes), "ttft_p99_s": ttft[min(len(ttft) - 1, int(0.99 * len(ttft)))],
            "misses": misses, "tier_shares": shares}


def make_router(target: str, params: dict[str, Any], clock: Clock, rates: dict[str, float]) -> Router:
    if target == "cwlor":
        return Proxy(rates)
    if target == "lor":
        return Proxy(dict.fromkeys(rates, 1.0))
    return Gateway(target, params, clock)


def run(targets: list[str], seeds: list[int], loads: list[float], n: int, warmup: int, interval_s: float,
        params: dict[str, Any], log: Callable[[str], None] = print) -> list[dict[str, Any]]:
    rates = {eid: saturated_rate(TIERS[tier]) for eid, tier in CLUSTER}
    capacity = sum(rates.values())
    rows = []
    for seed in seeds:
        for load in loads:
            requests = trace(n, load * capacity, seed=1000 * seed + int(load * 100))
            for target in targets:
                clock = Clock()
                router = make_router(target, params, clock, rates)
                if warmup:
                    serve(router, trace(warmup, 0.6 * capacity, seed=7 + seed), clock, interval_s)
                    clock.now += 5.0
                row = score(serve(router, requests, clock, interval_s)) | {"target": target, "seed": seed,
                                                                            "load": load}
                rows.append(row)
                log(f"seed {seed} {load}x {target}: goodput {row['goodput']:.1%} ttft p99 {row['ttft_p99_s']:.2f} s "
                    f"misses {row['misses']}")
    return rows


def summary(rows: list[dict[str, Any]], targets: list[str], loads: list[float]) -> str:
    lines = ["| target | load | goodput median (range) | TTFT p99 median s | misses per run (itl L40S / itl other / "
             "ttft) | Δ goodput vs cwlor per seed (points) |", "|---|---|---:|---:|---|---|"]
    for target in targets:
        for load in loads:
            rs = [r for r in rows if r["target"] == target and r["load"] == load]
            base = {r["seed"]: r["goodput"] for r in rows if r["target"] == "cwlor" and r["load"] == load}
            g = [r["goodput"] for r in rs]
            itl_slow = statistics.mean(r["misses"].get("itl:L40S", 0) for r in rs)
            itl_other = statistics.mean(sum(v for k, v in r["misses"].items() if k.startswith("itl") and
                                            not k.endswith("L40S")) for r in rs)
            ttft = statistics.mean(sum(v for k, v in r["misses"].items() if k.startswith("ttft")) for r in rs)
            delta = " ".join(f"{(r['goodput'] - base[r['seed']]) * 100:+.1f}" for r in rs
                             if r["seed"] in base and target != "cwlor")
            lines.append(f"| {target} | {load}x | {statistics.median(g):.1%} ({min(g):.1%}-{max(g):.1%}) "
                         f"| {statistics.median(r['ttft_p99_s'] for r in rs):.2f} "
                         f"| {itl_slow:.1f} / {itl_other:.1f} / {ttft:.1f} | {delta} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--targets", nargs="+", default=["cwlor", "marginal_delay"],
                   help="cwlor, lor, or gateway policy names")
    p.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3, 4])
    p.add_argument("--loads", type=float, nargs="+", default=[0.9, 1.0])
    p.add_argument("--requests", type=int, default=3000, help="requests per run")
    p.add_argument("--warmup", type=int, default=200, help="requests of the unscored warm-up run")
    p.add_argument("--interval-ms", type=float, default=500, help="metrics report interval (scrape: 500, agent: 200)")
    p.add_argument("--params", type=json.loads, default={}, help="policy parameters (JSON) for gateway targets")
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    started = time.monotonic()
    rows = run(args.targets, args.seeds, args.loads, args.requests, args.warmup, args.interval_ms / 1000, args.params)
    text = summary(rows, args.targets, args.loads)
    print(text)
    args_json = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    save_report(args.out, {"wall_s": time.monotonic() - started, "args": args_json, "git": git_state(), "table": text,
                           "runs": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

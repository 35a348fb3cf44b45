"""Every routing policy over a seeded family of engine models and mixed-tier clusters, against the proxy.

    nice -n 19 python -m benchmarks.routing_family [--members m00 m01 ...] [--loads 0.6 0.9 1.0 1.2] \
        [--seeds 11 12 13 14 15 16] [--requests 600] [--warmup 200] [--targets cwlor marginal_delay ...] \
        [--variant NAME=POLICY:JSON ...] [--gate NAME=TARGET:JSON ...] [--jobs 2] \
        [--out benchmarks/results/routing_family.json]

The family (loadtest/sim/family.py): 16 members, each a cluster of 6-10 engines of two or three
tiers whose engines differ in scheduling (chunked prefill or prefill-first), step time, batch and
token limits, KV allocation (reserved, or paged with preemption and recompute), the tiers' prefill
and decode ratios (the slowest tier's prefill 2x-6x slower than the fastest's) and step-time noise.
Members m03, m07, m11 and m15 are held out: no setting of any policy was chosen on them.

Each run is the discrete-event simulator with the gateway's own state table (leases, learned speed,
slacks; the engines' queue, batch and KV figures reach it every 200 ms, as heartbeats do) and the
gateway's own policy objects. A run serves an unscored warm-up (200 requests at 0.6x), then the
scored requests at the load (x the summed capacity of the member's engines, each saturated alone);
every target sees the same requests per member, load and seed. Goodput = share of the scored
requests with TTFT <= 2 s and mean inter-token time <= 100 ms.

Targets: `cwlor` (the proxy: capacity-weighted least-outstanding, weights = each engine's saturated
rate), `lor` (unweighted), the peers `sglang-ca` (sglang-router's `cache_aware`) and `vllm-p2`
(vllm-router's `power_of_two` on loads polled every 1 s), emulated from their documented rules
(loadtest/sim/peers.py), `default` (the gateway as configured by default: its default policy
behind its overload queue, gateway/pipeline/overload.py, when that is on by default), and every
language policy of the registry by name (without the overload queue); `--variant
name=policy:{"param": value}` adds a policy with parameters; `--gate name=target:{"setting": value}`
adds a target (a policy or a variant) behind the gateway's overload queue with those settings
(gateway.config.sections.OverloadConfig, enabled; `{}`: its defaults). Prints, per load, each member's proxy
goodput and every other target's goodput minus the proxy's (points, mean over seeds), tuned and
held-out members apart, with the median and the worst member of each group, then TTFT p99 per
member; with `default` and a peer among the targets, per load the goodput of `default`, the proxy and
the peers and `default` minus the best of those (points); writes every run's figures (one run a line)
to the results file.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import time
from collections.abc import Iterable
from dataclasses import asdict
from multiprocessing import get_context
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from pydantic import ValidationError  # noqa: E402

from benchmarks.gateway_overhead import git_state  # noqa: E402
from common.catalog import load_catalog  # noqa: E402
from common.errors import ConfigError  # noqa: E402
from gateway.config.cluster import RoutingConfig  # noqa: E402
from gateway.config.sections import OverloadConfig  # noqa: E402
from gateway.routing.policies import build_policy  # noqa: E402
from gateway.routing.policies.contracts import Policy  # noqa: E402
from loadtest.planner.options import at_least, positive, unwritable  # noqa: E402
from loadtest.sim.family import Member, RunSettings, capacity_rps, family, run  # noqa: E402
from loadtest.sim.peers import SglangCacheAware, VllmPowerOfTwo  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "routing_family.json"
PROXY = "cwlor"
DEFAULT = "default"   # the gateway as configured by default: its default policy behind its default overload queue
SGLANG, VLLM = "sglang-ca", "vllm-p2"   # the peers, emulated (loadtest/sim/peers.py)
PEERS = (SGLANG, VLLM)
DEFAULT_TARGETS = (PROXY, "lor", "marginal_delay", DEFAULT, *PEERS, "heteroserve", "batch_aware", "shortest_queue",
                   "power_of_two", "round_robin", "capacity_proportional")
LOADS = (0.6, 0.9, 1.0, 1.2)
SEEDS = (11, 12, 13, 14, 15, 16)   # the settings of the default policy were chosen on seeds 1-6 (tuned members)
Cell = tuple[str, float, int, str]    # member, load, seed, target
Variants = dict[str, tuple[str, dict[str, Any]]]   # name -> (policy, its parameters)
Gates = dict[str, tuple[str, OverloadConfig | None]]   # name -> (target, the overload queue's settings)


def make_policy(target: str, variants: dict[str, tuple[str, dict[str, Any]]], member: Member, seed: int) -> Policy:
    if target in (PROXY, "lor"):
        weights = capacity_rps(member) if target == PROXY else {}
        return build_policy("least_outstanding", {"weights": weights})
    if target == SGLANG:
        return SglangCacheAware()
    if target == VLLM:
        return VllmPowerOfTwo(seed)
    name, params = variants.get(target, (target, {}))
    if name == "power_of_two":
        params = {"seed": seed, **params}
    return build_policy(name, params)


_STATE: dict[str, Any] = {}


def _init(members: list[Member], settings: RunSettings, variants: Variants, gates: Gates) -> None:
    _STATE.update(members={m.name: m for m in members}, settings=settings, variants=variants, gates=gates,
                  catalog=load_catalog())


def _run_cell(cell: Cell) -> tuple[Cell, dict[str, Any]]:
    name, load, seed, target = cell
    member = _STATE["members"][name]
    base, overload = _STATE["gates"].get(target, (target, None))
    policy = make_policy(base, _STATE["variants"], member, seed)
    return cell, run(member, policy, load, seed, _STATE["settings"], _STATE["catalog"], overload)


def run_all(members: list[Member], loads: Iterable[float], seeds: Iterable[int], targets: list[str],
            settings: RunSettings, variants: Variants, jobs: int, gates: Gates | None = None) -> dict[Cell, Any]:
    cells = [(m.name, load, seed, t) for m in members for load in loads for seed in seeds for t in targets]
    gates = gates or {}
    if jobs <= 1:
        _init(members, settings, variants, gates)
        return dict(map(_run_cell, cells))
    with get_context("fork").Pool(jobs, _init, (members, settings, variants, gates)) as pool:
        return dict(pool.imap_unordered(_run_cell, cells, chunksize=4))


def _mean(xs: Iterable[float]) -> float:
    return statistics.fmean(list(xs))


def tables(results: dict[Cell, Any], members: list[Member], loads: Iterable[float], seeds: list[int],
           targets: list[str]) -> str:
    others = [t for t in targets if t != PROXY]
    out = []
    for load in loads:
        def goodput(m: str, t: str, load: float = load) -> float:
            return _mean(results[(m, load, s, t)]["goodput"] for s in seeds)

        def delta(m: str, t: str, load: float = load) -> float:
            return 100 * _mean(results[(m, load, s, t)]["goodput"] - results[(m, load, s, PROXY)]["goodput"]
                               for s in seeds)

        def p99(m: str, t: str, load: float = load) -> float:
            return _mean(results[(m, load, s, t)]["ttft_p99_s"] for s in seeds)

        head = "| member | held out | proxy goodput | " + " | ".join(f"Δ {t}" for t in others) + " |"
        rule = "|---|---|---:|" + "---:|" * len(others)
        out += [f"\n### {load}x: goodput minus the proxy's (points, mean of {len(seeds)} seeds)\n", head, rule]
        for group, held in (("tuned", False), ("held out", True)):
            names = [m.name for m in members if m.held_out == held]
            if not names:
                continue
            for n in names:
                out.append(f"| {n} | {'yes' if held else ''} | {goodput(n, PROXY):.1%} | "
                           + " | ".join(f"{delta(n, t):+.1f}" for t in others) + " |")
            out.append(f"| **median, {group}** | | {statistics.median(goodput(n, PROXY) for n in names):.1%} | "
                       + " | ".join(f"{statistics.median(delta(n, t) for n in names):+.1f}" for t in others) + " |")
            out.append(f"| **worst, {group}** | | | "
                       + " | ".join(f"{min(delta(n, t) for n in names):+.1f}" for t in others) + " |")
        def refused(m: str, t: str, load: float = load) -> float:
            return _mean(results[(m, load, s, t)]["rejected"] for s in seeds)

        out += [f"\n{load}x: TTFT p99 of the requests served (s) / scored requests refused (429) a run, "
                "mean of seeds\n",
                "| member | " + " | ".join(targets) + " |", "|---|" + "---:|" * len(targets)]
        for m in members:
            out.append(f"| {m.name}{' (held out)' if m.held_out else ''} | "
                       + " | ".join(f"{p99(m.name, t):.2f} / {refused(m.name, t):.0f}" for t in targets) + " |")
    return "\n".join(out)


def peer_table(results: dict[Cell, Any], members: list[Member], loads: Iterable[float], seeds: list[int],
               targets: list[str]) -> str:
    """Per load, `default`'s goodput against the best of the proxy and the peers in the run: each member's
    goodput (mean of the seeds), and `default` minus the best of the others (points), with the median and
    the worst member of each group (tuned, held out)."""
    others = [PROXY, *(t for t in PEERS if t in targets)]
    if DEFAULT not in targets or len(others) == 1:
        return ""
    shown = [DEFAULT, *others]
    out = []
    for load in loads:
        def goodput(m: str, t: str, load: float = load) -> float:
            return _mean(results[(m, load, s, t)]["goodput"] for s in seeds)

        def margin(m: str) -> float:
            return 100 * (goodput(m, DEFAULT) - max(goodput(m, t) for t in others))

        out += [f"\n### {load}x: {DEFAULT} against the best of {', '.join(others)} (goodput, mean of "
                f"{len(seeds)} seeds)\n", "| member | " + " | ".join(shown) + " | Δ default − best |",
                "|---|" + "---:|" * (len(shown) + 1)]
        for group, held in (("tuned", False), ("held out", True)):
            names = [m.name for m in members if m.held_out == held]
            if not names:
                continue
            for n in names:
                out.append(f"| {n}{' (held out)' if held else ''} | "
                           + " | ".join(f"{goodput(n, t):.1%}" for t in shown) + f" | {margin(n):+.1f} |")
            out.append(f"| **median, {group}** | "
                       + " | ".join(f"{statistics.median(goodput(n, t) for n in names):.1%}" for t in shown)
                       + f" | {statistics.median(margin(n) for n in names):+.1f} |")
            out.append(f"| **worst, {group}** | " + " | ".join("" for _ in shown)
                       + f" | {min(margin(n) for n in names):+.1f} |")
    return "\n".join(out)


def _cpu_s() -> float:
    """CPU seconds of this process and of its finished workers."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


CELL_COLUMNS = ("member", "load", "seed", "target", "goodput", "ttft_p99_s", "ttft_misses", "itl_misses", "rejected",
                "tier_shares")


def cell_row(cell: Cell, result: dict[str, Any]) -> list[Any]:
    """One run as a row of CELL_COLUMNS, figures rounded to what the tables show and a little more."""
    shares = {tier: round(v, 4) for tier, v in result["tier_shares"].items()}
    return [*cell, round(result["goodput"], 5), round(result["ttft_p99_s"], 4), result["ttft_misses"],
            result["itl_misses"], result["rejected"], shares]


def save(path: Path, report: dict[str, Any]) -> None:
    """The results file: the report's header indented, its cells one run a line (thousands of runs)."""
    cells = report.pop("cells")
    head = json.dumps(report, indent=1)
    rows = ",\n".join(json.dumps(row) for row in cells)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f'{head[:-2]},\n "cells": [\n{rows}\n ]\n}}\n')
    print(f"wrote {path} ({report['wall_s']:.0f} s)")


def parse_variants(specs: list[str]) -> Variants:
    """NAME=POLICY:JSON each; ValueError naming the one that is not."""
    variants = {}
    for spec in specs:
        name, _, rest = spec.partition("=")
        policy, _, params = rest.partition(":")
        if not (name and policy):
            raise ValueError(f"{spec!r}: write NAME=POLICY or NAME=POLICY:JSON")
        try:
            parsed = json.loads(params) if params else {}
        except json.JSONDecodeError as exc:
            raise ValueError(f"{spec!r}: its JSON: {exc}") from None
        if not isinstance(parsed, dict):
            raise ValueError(f"{spec!r}: its JSON must be an object of settings")
        variants[name] = (policy, parsed)
    return variants


def default_gateway() -> tuple[str, OverloadConfig | None]:
    """The `default` target: the default language policy, behind the overload queue if it is on by default."""
    overload = OverloadConfig()
    return RoutingConfig().policy, overload if overload.enabled else None


def parse_gates(specs: list[str]) -> Gates:
    """NAME=TARGET:JSON: TARGET behind the overload queue, enabled, with the JSON's settings."""
    return {name: (target, OverloadConfig(**{**params, "enabled": True}))
            for name, (target, params) in parse_variants(specs).items()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--members", nargs="+", default=None, help="member names (default: all)")
    p.add_argument("--loads", type=positive, nargs="+", default=list(LOADS))
    p.add_argument("--seeds", type=at_least(0), nargs="+", default=list(SEEDS), help="default: seeds no tuning used")
    p.add_argument("--requests", type=at_least(1), default=600, help="scored requests a run")
    p.add_argument("--warmup", type=at_least(0), default=200, help="unscored requests first, at 0.6x")
    p.add_argument("--interval-ms", type=positive, default=200, help="engine figures reach the gateway this often")
    p.add_argument("--targets", nargs="+", default=None, help=f"default: {' '.join(DEFAULT_TARGETS)} (variants too)")
    p.add_argument("--variant", action="append", default=[], metavar="NAME=POLICY:JSON")
    p.add_argument("--gate", action="append", default=[], metavar="NAME=TARGET:JSON",
                   help="TARGET behind the overload queue with these settings")
    p.add_argument("--jobs", type=at_least(1), default=min(2, os.cpu_count() or 1))
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    if why := unwritable(args.out):   # found before the runs, not after them
        p.error(f"--out: {why}")
    known = {m.name for m in family()}
    if unknown := [name for name in args.members or () if name not in known]:
        p.error(f"--members: no member {', '.join(map(repr, unknown))}; known: {', '.join(sorted(known))}")
    try:
        variants, gates = parse_variants(args.variant), {DEFAULT: default_gateway(), **parse_gates(args.gate)}
        targets = [*(args.targets or DEFAULT_TARGETS),
                   *(v for v in [*variants, *gates] if v not in (args.targets or ()))]
        for target in targets:   # each policy built once here: a bad name is one line now, not a worker's traceback
            base = gates.get(target, (target, None))[0]
            if base not in (PROXY, "lor", *PEERS):
                name, params = variants.get(base, (base, {}))
                build_policy(name, params)
    except (ValueError, ConfigError, ValidationError) as exc:
        p.error(" ".join(str(exc).split()))
    if PROXY not in targets:
        targets.insert(0, PROXY)
    members = [m for m in family() if args.members is None or m.name in args.members]
    settings = RunSettings(args.requests, args.warmup, args.interval_ms / 1000)
    started, cpu = time.monotonic(), _cpu_s()
    results = run_all(members, args.loads, args.seeds, targets, settings, variants, args.jobs, gates)
    text = tables(results, members, args.loads, args.seeds, targets)
    text += "\n" + peer_table(results, members, args.loads, args.seeds, targets)
    print("\n".join(f"{m.name}{' (held out)' if m.held_out else ''}: {m.describe()}" for m in members))
    print(text)
    cpu_s = _cpu_s() - cpu
    print(f"\n{len(results)} runs, {cpu_s:.0f} s of CPU in all ({cpu_s / len(results):.2f} s a run)")
    save(args.out, {
        "wall_s": time.monotonic() - started, "cpu_s": cpu_s, "git": git_state(),
        "args": {k: str(v) for k, v in vars(args).items()},
        "settings": asdict(settings), "targets": targets, "variants": variants,
        "gates": {name: (target, cfg and cfg.model_dump()) for name, (target, cfg) in gates.items() if name in targets},
        "members": [{"name": m.name, "held_out": m.held_out, "describe": m.describe()} for m in members],
        "table": text, "columns": CELL_COLUMNS, "cells": [cell_row(c, r) for c, r in sorted(results.items())],
    })
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Cache-aware routing over the engine family: does the prefix replay's result hold on clusters it was not tuned on?

    nice -n 19 python -m benchmarks prefix-family [--members m00 m01 ...] [--workloads multiturn hotprefix nosharing] \
        [--loads multiturn=1.0,1.5 ...] [--seeds 1 2] [--targets cwlor sglang-ca hg-blind hg-cache hg-oracle] \
        [--sessions 300] [--requests 1500] [--jobs 2] [--out benchmarks/results/prefix_family.json]
    python -m benchmarks prefix-family --tables-from benchmarks/results/prefix_family.json

benchmarks/prefix_affinity.py replays shared-prefix traffic on one cluster, the mixed-tier benchmark's
eight engines (2 x H100, 3 x A100-80GB, 3 x L40S), and its cache-aware settings (w_evict, the index's
blocks) were chosen there. Here the same replay, workloads and targets run on each member of the
engine family (loadtest/sim/family.py: 16 clusters of 6-10 engines of two or three tiers, the slowest
tier's prefill 2x-6x slower than the fastest's, its decode 1.5x-3x, KV sizes per tier and member,
batch caps of 48-256, token budgets of 256-8,192), with the replay's engine (benchmarks/emulated_engine.py's
`Batcher`, vLLM-like prefix caching) given each member's speeds, KV, limits and scheduling: chunked
prefill, or prefill-first for the family's prefill-first members. Two of the family's engine
properties are not carried over: the KV cache is reserved whole at admission (the family's paged
members preempt; this engine does not) and steps have no noise. Members m03, m07, m11 and m15 are held
out of all tuning, of the cache-aware settings too (no setting was chosen on any member), and are
reported apart.

Per workload and load (x the member's cache-blind capacity, as in prefix_affinity.py), each target's
goodput (TTFT <= 2 s and mean inter-token time <= 100 ms; a request the overload queue refuses is a
miss), mean over seeds per member. The summary gives, with the median and worst member of each group,
the margins of the cache-aware policy alone (hg-cache) over cwlor, sglang-ca, the cache-blind policy
and the oracle, and of the gateway as it runs by default (hg-default: hg-cache behind the overload
queue) over cwlor and sglang-ca, in points; the share of requests hg-default refused; hg-cache's hit
rate against hg-oracle's, its TTFT p90 over sglang-ca's and its busiest engine's request share over
that engine's capacity share. Then every target's goodput per member. Every run's row goes to the
results file.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterable
from multiprocessing import get_context
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import prefix_affinity  # noqa: E402
from benchmarks.emulated_engine import TierSpeed  # noqa: E402
from benchmarks.gateway_overhead import git_state, save_report  # noqa: E402
from loadtest.sim.family import Member, family  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "prefix_family.json"
TARGETS = ("cwlor", "sglang-ca", "hg-blind", "hg-cache", "hg-default", "hg-oracle")
WORKLOADS = ("multiturn", "hotprefix", "nosharing")
DEFAULT_LOADS = {"multiturn": [1.5, 2.0, 2.5], "hotprefix": [2.0, 3.0], "nosharing": [0.9, 1.0]}
Cell = tuple[str, str, int]   # member, workload, seed


def describe(member: Member) -> str:
    """The member as replayed here (its engines' noise and paged KV are not)."""
    e = member.engine
    shape = "+".join(f"{n}x{t.gpu}" for t, n in zip(member.tiers, member.counts, strict=True))
    return (f"{shape}; {e.scheduling.replace('_', '-')} {e.max_batched_tokens} tok, batch {e.max_num_seqs}; "
            f"prefill {member.prefill_ratio:.1f}x / decode {member.decode_ratio:.1f}x")


def member_cluster(member: Member) -> prefix_affinity.Cluster:
    """The member's engines as the replay's engine: its tiers' speeds and KV, its engine's limits and
    scheduling (KV reserved at admission, no step noise)."""
    e = member.engine
    return tuple((eid, TierSpeed(t.gpu, t.step_base_s, t.per_seq_s, t.kv_read_s, t.prefill_s_per_token, t.kv_tokens,
                                 e.max_num_seqs, e.max_batched_tokens, e.scheduling == "prefill_first"))
                 for eid, t in member.engines)


_SETTINGS: dict[str, Any] = {}


def _init(settings: dict[str, Any]) -> None:
    _SETTINGS.update(settings)


def _run_cell(cell: Cell) -> list[dict[str, Any]]:
    name, workload, seed = cell
    s = _SETTINGS
    member = next(m for m in family() if m.name == name)
    rows, _ = prefix_affinity.run([workload], s["targets"], [seed], s["loads"][workload], s["sessions"],
                                  s["requests"], s["warmup"], s["tenants"], s["interval_s"], log=lambda _: None,
                                  cluster=member_cluster(member))
    for row in rows:
        row["member"] = name
    return rows


def run_all(cells: list[Cell], settings: dict[str, Any], jobs: int, log: Any = print) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    if jobs <= 1:
        _init(settings)
        done: Iterable[list[dict[str, Any]]] = map(_run_cell, cells)
        for k, out in enumerate(done):
            rows += out
            log(f"[{k + 1}/{len(cells)}] {cells[k]}")
        return rows
    with get_context("fork").Pool(jobs, _init, (settings,)) as pool:
        for k, out in enumerate(pool.imap_unordered(_run_cell, cells)):
            rows += out
            log(f"[{k + 1}/{len(cells)}] {out[0]['member']} {out[0]['workload']} seed {out[0]['seed']}")
    return rows


def _mean(xs: Iterable[float]) -> float:
    values = list(xs)
    return statistics.mean(values) if values else float("nan")


# The summary's margins: (gateway target, what it is compared with), where both ran.
MARGINS = (("hg-cache", "cwlor"), ("hg-cache", "sglang-ca"), ("hg-cache", "hg-blind"), ("hg-cache", "hg-oracle"),
           ("hg-default", "cwlor"), ("hg-default", "sglang-ca"))


def _summary_row(figure: Callable[[str, str, str], float], ms: list[Member], targets: list[str]) -> str:
    """One group's cells: the margins (median / worst member), hg-default's refusals, hit rates, hg-cache's
    TTFT p90 over sglang-ca's, its busiest engine."""
    def per_member(target: str, key: str) -> list[float]:
        return [figure(m.name, target, key) for m in ms] if target in targets else []

    cells = []
    for mine, other in MARGINS:
        if mine in targets and other in targets:
            margins = [100 * (a - b) for a, b in zip(per_member(mine, "goodput"), per_member(other, "goodput"),
                                                      strict=True)]
            cells.append(f"{statistics.median(margins):+.1f} / {min(margins):+.1f}")
    refused = [100 * r / n for r, n in zip(per_member("hg-default", "refused"), per_member("hg-default", "requests"),
                                            strict=True)]
    if refused:
        cells.append(f"{statistics.mean(refused):.1f}% / {max(refused):.1f}%")
    oracle = per_member("hg-oracle", "hit_rate")
    if oracle:
        cells.append(f"{statistics.median(per_member('hg-cache', 'hit_rate')):.1%} / {statistics.median(oracle):.1%}")
    sglang = per_member("sglang-ca", "ttft_p90_s")
    if sglang:
        ratios = [c / max(1e-9, s) for c, s in zip(per_member("hg-cache", "ttft_p90_s"), sglang, strict=True)]
        cells.append(f"{statistics.median(ratios):.2f}x")
    busiest = per_member("hg-cache", "max_engine_over_capacity_share")
    cells.append(f"{statistics.median(busiest):.2f} / {max(busiest):.2f}")
    return " | ".join(cells) + " |"


def tables(rows: list[dict[str, Any]], members: list[Member], targets: list[str]) -> str:
    """The margin summary per workload and load (tuned and held-out apart), then goodput per member."""
    groups = (("tuned", [m for m in members if not m.held_out]), ("held out", [m for m in members if m.held_out]))
    cases = list(dict.fromkeys((r["workload"], r["load"]) for r in rows))
    heads = [f"{mine} − {other}" for mine, other in MARGINS if mine in targets and other in targets]
    heads += ["refused by hg-default, mean / most"] if "hg-default" in targets else []
    heads += ["hit rate hg-cache / hg-oracle, median"] if "hg-oracle" in targets else []
    heads += ["TTFT p90 hg-cache / sglang-ca, median"] if "sglang-ca" in targets else []
    heads += ["hg-cache's busiest engine / its capacity share, median / most"]
    out = ["Goodput margins (points; each member's mean over seeds), median / worst member", "",
           "| workload | load | members | " + " | ".join(heads) + " |", "|---|---:|---|" + "---:|" * len(heads)]
    per_case: dict[tuple[str, float], Callable[[str, str, str], float]] = {}
    for workload, load in cases:
        runs = [r for r in rows if (r["workload"], r["load"]) == (workload, load)]

        def figure(member: str, target: str, key: str, runs: list[dict[str, Any]] = runs) -> float:
            return _mean(r[key] for r in runs if (r["member"], r["target"]) == (member, target))

        per_case[(workload, load)] = figure
        for group, ms in groups:
            if ms:
                out.append(f"| {workload} | {load}x | {group} ({len(ms)}) | " + _summary_row(figure, ms, targets))
    for (workload, load), figure in per_case.items():
        out += ["", f"{workload} at {load}x: goodput per member (mean over seeds)", "",
                "| member | engines | " + " | ".join(targets) + " |", "|---|---|" + "---:|" * len(targets)]
        for _, ms in groups:
            for m in ms:
                out.append(f"| {m.name}{' (held out)' if m.held_out else ''} | {describe(m)} | " + " | ".join(
                    f"{figure(m.name, t, 'goodput'):.1%}" for t in targets) + " |")
    return "\n".join(out)


def parse_loads(specs: list[str]) -> dict[str, list[float]]:
    loads = {w: list(v) for w, v in DEFAULT_LOADS.items()}
    for spec in specs:
        workload, _, values = spec.partition("=")
        if workload not in WORKLOADS or not values:
            raise SystemExit(f"--loads {spec!r}: expected WORKLOAD=LOAD[,LOAD...] with WORKLOAD one of {WORKLOADS}")
        loads[workload] = [float(v) for v in values.split(",")]
    return loads


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    members = family()
    p.add_argument("--members", nargs="+", choices=[m.name for m in members], default=[m.name for m in members])
    p.add_argument("--workloads", nargs="+", choices=WORKLOADS, default=list(WORKLOADS))
    p.add_argument("--loads", nargs="*", default=[], metavar="WORKLOAD=L1,L2",
                   help=f"loads per workload, x the cache-blind capacity (default: {DEFAULT_LOADS})")
    p.add_argument("--targets", nargs="+", choices=prefix_affinity.TARGETS[:9], default=list(TARGETS))
    p.add_argument("--seeds", type=int, nargs="+", default=[1, 2])
    p.add_argument("--sessions", type=int, default=300, help="multiturn: conversations per scored run")
    p.add_argument("--requests", type=int, default=1500, help="hotprefix, nosharing: requests per scored run")
    p.add_argument("--warmup", type=int, default=100, help="conversations of the unscored warm-up")
    p.add_argument("--tenants", type=int, default=prefix_affinity.DEFAULT_TENANTS)
    p.add_argument("--interval-ms", type=float, default=200, help="engine report interval")
    p.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1))
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--tables-from", type=Path, help="print the tables of a results file of this benchmark, run nothing")
    args = p.parse_args(argv)
    if args.tables_from:
        report = json.loads(args.tables_from.read_text())
        ran = set(report["members"])
        print(tables(report["runs"], [m for m in members if m.name in ran], report["args"]["targets"]))
        return 0
    if "hg-cache" not in args.targets:
        p.error("--targets must include hg-cache (the tables give its margins)")
    started = time.monotonic()
    chosen = [m for m in members if m.name in args.members]
    settings = {"targets": args.targets, "loads": parse_loads(args.loads), "sessions": args.sessions,
                "requests": args.requests, "warmup": args.warmup, "tenants": args.tenants,
                "interval_s": args.interval_ms / 1000}
    cells = [(m.name, w, seed) for w in args.workloads for m in chosen for seed in args.seeds]
    rows = run_all(cells, settings, args.jobs)
    text = tables(rows, chosen, args.targets)
    print(text)
    save_report(args.out, {"args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
                           "git": git_state(), "members": {m.name: describe(m) for m in chosen},
                           "tables": text, "runs": rows, "wall_s": time.monotonic() - started})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

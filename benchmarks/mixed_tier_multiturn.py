"""The mixed-tier benchmark's shared-prefix chat, live: `python -m benchmarks mixed-tier --workload multiturn`
(or `--workload hotprefix`).

The eight emulated engines of benchmarks/mixed_tier.py with vLLM-like prefix caching
(`emulated_engine.py --prefix-caching`), and real clients holding conversations: the workload of
benchmarks/prefix_affinity.py's `multiturn` (32 tenants with system prompts of 1,000-2,500 tokens;
conversations of 3-10 turns, user messages of 16-400 tokens, answers of 16-384), started open-loop,
Poisson. Each conversation's next turn is its system prompt, every earlier user message and the
assistant reply the client actually received (the streamed content), and the new message; it is sent
an exponential think time (mean 3 s) after the reply's last token, and a conversation ends early where
the next turn would pass the 4,096-token context, or at its first failed turn.
`--workload hotprefix` runs prefix_affinity.py's hot-prefix stress instead: single requests, 80% of them
one tenant's 2,400-token system prompt and a question of their own, the others distinct prompts of the
mixed-tier mix (--sessions is then the requests of a run); its targets are goodput >= cwlor's and no
engine above 2x its capacity share of the requests.

Targets: rr and cwlor (benchmarks/lor_proxy.py), vllm-router and sglang-router with `--policy
cache_aware` (`vllm-router-ca`, `sglang-router-ca`), and the gateway's default policy with cache-aware
routing off (`hg-blind`: gateway.routing.prefix_cache.enabled false) and on (`hg-cache`, its default),
and on without the price of filling a full cache (`hg-noevict`: marginal_delay's w_evict 0) or with the
request's own decode at full weight (`hg-decode1`: w_decode 1, the default before 0.25), or without the
overload queue (`hg-noqueue`: gateway.overload.enabled false), or pricing stalls with the uncalibrated
model (`hg-nocal`: marginal_delay's calibrate false).

Load: a multiple of the cache-blind capacity, as prefix_affinity.py counts it: each engine alone
saturated in emulated time with the workload's requests and no cache, summed; conversations arrive at
load x capacity / (turns per conversation). Round k replays prefix_affinity.py's seed k + 1 (the same
tenants and conversations; that seed's capacity), so the replay's numbers for the same seed are the
virtual-time reference: with --oracle, hg-cache and hg-oracle (the default policy told each engine's
exact cache content) replayed on the same conversations, without warm-up, beside the live run.
The results file is written after every round (`"complete": false`) and at the end.

Before each run the engines' prefix caches are emptied (vLLM's `POST /reset_prefix_cache`), so every
target starts from cold caches, and the tenants' system prompts start with a tag naming the run (same
length), so that nothing the routers remember of earlier runs (the gateway's index, the peers' trees:
the same conversations at the other load) matches: without it, a router told of blocks that the reset
dropped mispredicts, and the gateway, which corrects its index by the engines' reported hits, then
trusts it less (docs/ROUTING.md, "Live, against the real routers"). The gateways first serve one
unscored warm-up (--warmup
conversations of other clients at 0.6x: they learn the backends' speeds from traffic); the other
targets learn nothing that a run keeps. Scored per run: goodput (TTFT <= 2 s and mean inter-token
time <= 100 ms, over every turn sent), TTFT p50 / p90 / p99, the hit rate (the engines' summed
`vllm:prefix_cache_hits_total` over `vllm:prefix_cache_queries_total`, read before and after the run),
prompt tokens prefilled per request (queries - hits, over the turns sent) and tier shares (the engine
each reply names in its `system_fingerprint`). Cells are medians over rounds. With `--timeline S`, every
S seconds of each gateway's runs (warm-up included) its /admin/backends per backend: in flight, prefill
backlog, and its prefix index's blocks, capacity, keep_i, ρ_i and predicted / reported tokens (`timeline`
of each run, `warmup_timelines`): how the index's view moved within a run, not only where it ended.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import signal
import statistics
import tempfile
import time
import urllib.request
from collections.abc import Callable, Coroutine
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from benchmarks import loadgen
from benchmarks.emulated_engine import MAX_MODEL_LEN, MODEL, TIERS
from benchmarks.gateway_overhead import git_state, save_report
from benchmarks.mixed_tier import (
    CLUSTER,
    DEFAULT_POLICY,
    ROOT,
    SETTLE_S,
    Engines,
    Outcome,
    Target,
    medians,
    one,
    paused,
    score,
    start_engines,
    start_gateway,
    start_peers,
    start_proxies,
)
from benchmarks.mixed_workload import Request, queue_rate
from benchmarks.prefix_affinity import (
    DEFAULT_TENANTS,
    Conversation,
    conversations,
    largest_share,
    request_sizes,
    tenants,
)
from benchmarks.prefix_affinity import run as replay

RESULTS = ROOT / "benchmarks" / "results"   # mixed_tier_<workload>.json
TARGETS = ("rr", "cwlor", "vllm-router-ca", "sglang-router-ca", "hg-blind", "hg-noevict", "hg-decode1", "hg-noqueue",
           "hg-nocal", "hg-cache")
GATEWAYS: dict[str, dict[str, Any]] = {   # the gateway targets: their `gateway:` settings
    "hg-blind": {"routing": {"prefix_cache": {"enabled": False}}},
    "hg-noevict": {"routing": {"params": {DEFAULT_POLICY: {"w_evict": 0.0}}}},
    "hg-decode1": {"routing": {"params": {DEFAULT_POLICY: {"w_decode": 1.0}}}},
    "hg-noqueue": {"overload": {"enabled": False}},
    "hg-nocal": {"routing": {"params": {DEFAULT_POLICY: {"calibrate": False}}}},
    "hg-cache": {},
}
PEERS = ("rr", "cwlor", "vllm-router-ca", "sglang-router-ca")
SIZING_CONVERSATIONS = 300   # prefix_affinity.request_sizes' default: the conversations the capacity is measured on


# -- the workload --------------------------------------------------------------------------------

def blind_capacity(workload: str, seed: int, prompts: list[str]) -> tuple[dict[str, float], float]:
    """(tier -> saturated requests/s without a cache, turns per conversation) for prefix_affinity's seed."""
    sizes = request_sizes(workload, 99 + seed, prompts, SIZING_CONVERSATIONS)
    rates = {tier: queue_rate(TIERS[tier], sizes) for tier in {t for _, t in CLUSTER}}
    return rates, len(sizes) / SIZING_CONVERSATIONS


def salted(convs: list[Conversation], run: int) -> list[Conversation]:
    """The conversations' system prompts led by a tag naming the run, as long as before (cut at the end):
    every prompt's block chain starts there, so no router's memory of an earlier run (the same
    conversations at another load, or another round's) matches this one's, and the engines, emptied,
    match nothing either."""
    tag = f"run{run:05d}-"
    for c in convs:
        if c.system:
            c.system = tag + c.system[:-len(tag)]
    return convs


def body(c: Conversation) -> bytes:
    """The conversation's next turn as a streamed chat request."""
    return orjson.dumps({"model": MODEL, "messages": [{"role": r, "content": t} for r, t in c.messages()],
                         "max_tokens": c.turns[c.sent][1], "stream": True})


async def converse(session: aiohttp.ClientSession, url: str, c: Conversation, start: float, time_scale: float,
                   outcomes: list[Outcome]) -> None:
    """Hold one conversation: each turn after the previous reply's last token and a think time, carrying
    the replies received."""
    loop = asyncio.get_running_loop()
    await asyncio.sleep(max(0.0, start + c.start_s - loop.time()))
    while True:
        max_tokens = c.turns[c.sent][1]
        out = await one(session, url, Request(0.0, c.tokens(), max_tokens, body(c)), keep_text=True)
        outcomes.append(out)
        if out.error:
            return
        c.replies.append(out.text)
        c.sent += 1
        if c.sent >= len(c.turns) or c.tokens() + c.turns[c.sent][1] > MAX_MODEL_LEN:
            return
        await asyncio.sleep(c.thinks[c.sent] / time_scale)


async def hold(url: str, convs: list[Conversation], time_scale: float) -> list[Outcome]:
    """Every conversation, started at its offset (real seconds) from now; the turns' outcomes."""
    timeout = aiohttp.ClientTimeout(total=300, connect=5)
    outcomes: list[Outcome] = []
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout) as session:
        start = asyncio.get_running_loop().time()
        await asyncio.gather(*(converse(session, url + "/v1/chat/completions", c, start, time_scale, outcomes)
                               for c in convs))
    return outcomes


# -- the engines' counters -----------------------------------------------------------------------

def prefix_counters(engines: Engines) -> tuple[int, int]:
    """(queries, hits) in tokens, summed over the engines' /metrics."""
    queries = hits = 0
    for url in engines.urls.values():
        with urllib.request.urlopen(url + "/metrics", timeout=10) as resp:
            for line in resp.read().decode().splitlines():
                if line.startswith("vllm:prefix_cache_queries_total"):
                    queries += int(float(line.rsplit(" ", 1)[1]))
                elif line.startswith("vllm:prefix_cache_hits_total"):
                    hits += int(float(line.rsplit(" ", 1)[1]))
    return queries, hits


def reset_prefix_caches(engines: Engines) -> None:
    for url in engines.urls.values():
        with urllib.request.urlopen(urllib.request.Request(url + "/reset_prefix_cache", method="POST"), timeout=10):
            pass


def run_one(t: Target, engines: Engines, make: Callable[[], list[Conversation]], time_scale: float,
            timeline_s: float = 0.0) -> dict[str, Any]:
    """One scored run of `t`: cold caches, the conversations `make` builds, the engines' counters around it
    (and, every `timeline_s` seconds where above 0, what a gateway's /admin/backends says)."""
    convs = make()
    t.signal(signal.SIGCONT)
    time.sleep(SETTLE_S)
    reset_prefix_caches(engines)
    (q0, h0), cpu0, started = prefix_counters(engines), sum(loadgen.cpu_ticks(p) for p in t.pids), time.monotonic()
    points: list[dict[str, Any]] = []
    watch = timeline_s > 0 and t.name.startswith("hg-")
    outcomes = asyncio.run(watched(hold(t.url, convs, time_scale), t.url, timeline_s, points) if watch
                           else hold(t.url, convs, time_scale))
    wall = time.monotonic() - started
    cpu = (sum(loadgen.cpu_ticks(p) for p in t.pids) - cpu0) / loadgen.CLK_TCK
    q1, h1 = prefix_counters(engines)
    state = {"learned": learned(t.url)} if t.name.startswith("hg-") else {}
    if watch:
        state["timeline"] = points
    t.signal(signal.SIGSTOP)
    queries, hits = q1 - q0, h1 - h0
    return score(outcomes, time_scale) | {
        "requests": len(outcomes), "conversations": len(convs), "wall_s": wall,
        "prefix_queries": queries, "prefix_hits": hits, "hit_rate": hits / queries if queries else 0.0,
        "prefilled_per_request": (queries - hits) / len(outcomes), "router_cores": cpu / wall,
        "max_engine_over_capacity_share": largest_share((o.engine for o in outcomes if not o.error), engines.rates),
        "router_cpu_ms_per_req": cpu / len(outcomes) * 1000} | state


# What `learned` keeps of each backend in /admin/backends: its learned_speed fields, and its own fields
LEARNED = ("prefill_s_per_token", "prefill_samples", "decode_step_s", "decode_samples", "decode_floor_s",
           "stall_factor", "stall_per_prompt_s", "decode_model_samples", "service_s")
IDLE = ("breaker", "in_flight", "prefilling", "prefill_backlog_tokens", "kv_reserved_tokens", "kv_free_bytes")


def admin_backends(url: str) -> list[dict[str, Any]]:
    with urllib.request.urlopen(url + "/admin/backends", timeout=10) as resp:
        backends: list[dict[str, Any]] = orjson.loads(resp.read())["data"]
    return backends


def learned(url: str) -> dict[str, dict[str, Any]]:
    """A gateway's learned speeds per backend after a run (/admin/backends): what its routing priced with,
    and what it counts there once every reply is in (in flight, backlog, reservations: 0 unless leaked)."""
    backends = admin_backends(url)
    return {b["id"]: {k: b["learned_speed"][k] for k in LEARNED} | {k: b[k] for k in IDLE}
            | {"prefix_cache": b["prefix_cache"]} for b in backends}


TIMELINE = ("in_flight", "prefill_backlog_tokens")
INDEX = ("blocks", "capacity_blocks", "keep", "evicted_reuse", "predicted_query_tokens", "predicted_hit_tokens",
         "reported_query_tokens", "reported_hit_tokens")


async def watched(run: Coroutine[Any, Any, list[Outcome]], url: str, every_s: float,
                  points: list[dict[str, Any]]) -> list[Outcome]:
    """`run` (a hold), with the gateway's per-backend state read every `every_s` seconds into `points`:
    {"t": seconds since the start, backend: [in flight, prefill backlog, then INDEX's fields]}."""
    task = asyncio.ensure_future(run)
    start = time.monotonic()
    while not task.done():
        await asyncio.wait([task], timeout=every_s)
        backends = await asyncio.to_thread(admin_backends, url)
        points.append({"t": round(time.monotonic() - start, 2)} | {
            b["id"]: [b[k] for k in TIMELINE] + [b["prefix_cache"].get(k) for k in INDEX] for b in backends})
    return task.result()


# -- the virtual-time reference ------------------------------------------------------------------

def replay_reference(workload: str, seeds: list[int], loads: list[float], sessions: int) -> list[dict[str, Any]]:
    """prefix_affinity.py's hg-cache and hg-oracle on the same seeds, loads and conversations, no warm-up."""
    rows, _ = replay([workload], ["hg-cache", "hg-oracle"], seeds, loads, sessions, sessions, 0, DEFAULT_TENANTS, 0.2,
                     log=lambda line: print("replay", line, flush=True))
    return rows


# -- tables --------------------------------------------------------------------------------------

KEYS = ("goodput", "ttft_p50_s", "ttft_p90_s", "ttft_p99_s", "itl_p50_ms", "itl_p99_ms", "hit_rate",
        "prefilled_per_request", "requests", "router_cores", "max_engine_over_capacity_share")


def summarise(runs: list[dict[str, Any]]) -> dict[str, dict[str, dict[str, Any]]]:
    out = medians(runs, KEYS)
    for r in runs:
        cell = out[r["target"]][r["load"]]
        cell.setdefault("goodput_by_round", {})[r["round"]] = r["goodput"]
        cell.setdefault("ttft_p90_by_round", {})[r["round"]] = r["ttft_p90_s"]
        cell.setdefault("hit_rate_by_round", {})[r["round"]] = r["hit_rate"]
    return out


def oracle_rates(reference: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """load -> replay target -> median hit rate over the seeds."""
    out: dict[str, dict[str, float]] = {}
    for key in {(f"{r['load']}x", r["target"]) for r in reference}:
        rs = [r["hit_rate"] for r in reference if (f"{r['load']}x", r["target"]) == key]
        out.setdefault(key[0], {})[key[1]] = statistics.median(rs)
    return out


def table(summary: dict[str, dict[str, dict[str, Any]]], loads: list[str],
          oracle: dict[str, dict[str, float]]) -> str:
    order = ("H100", "A100-80GB", "L40S")
    lines = ["| load | target | goodput (range) | TTFT p50 / p90 / p99 s | ITL p50 / p99 ms | hit rate "
             "| prefilled tokens / request | tier shares (H100 / A100 / L40S) | max engine / capacity share "
             "| errors | router cores | rounds |",
             "|---:|---|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|"]
    for load in loads:
        for target, cells in summary.items():
            c = cells.get(load)
            if c is None:
                continue
            g = list(c["goodput_by_round"].values())
            shares = " / ".join(f"{c['tier_shares'].get(t, 0.0):.0%}" for t in order)
            lines.append(
                f"| {load} | {target} | {c['goodput']:.1%} ({min(g):.1%}-{max(g):.1%}) "
                f"| {c['ttft_p50_s']:.2f} / {c['ttft_p90_s']:.2f} / {c['ttft_p99_s']:.2f} "
                f"| {c['itl_p50_ms']:.0f} / {c['itl_p99_ms']:.0f} | {c['hit_rate']:.1%} "
                f"| {c['prefilled_per_request']:.0f} | {shares} | {c['max_engine_over_capacity_share']:.2f} "
                f"| {c['errors']} | {c['router_cores']:.2f} "
                f"| {c['rounds']} |")
        for name, rate in sorted(oracle.get(load, {}).items()):
            lines.append(f"| {load} | *replay {name}* | | | | {rate:.1%} | | | | | | |")
    return "\n".join(lines)


def targets_met(summary: dict[str, dict[str, dict[str, Any]]], loads: list[str],
                oracle: dict[str, dict[str, float]], ours: str = "hg-cache") -> list[dict[str, Any]]:
    """The issue's targets at each load: goodput >= the best peer's, TTFT p90 <= 0.5x sglang-router
    cache_aware's, hit rate within 5 points of the (replayed) oracle's (multiturn); goodput >= cwlor's and
    no engine above 2x its capacity share (hotprefix)."""
    out = []
    for load in loads:
        c = summary.get(ours, {}).get(load)
        if c is None:
            continue
        peers = {p: summary[p][load] for p in PEERS if load in summary.get(p, {})}
        row: dict[str, Any] = {"load": load}
        if peers:
            best = max(peers, key=lambda p: peers[p]["goodput"])
            row["goodput"] = {"ours": c["goodput"], "best_peer": best, "peer": peers[best]["goodput"],
                              "met": c["goodput"] >= peers[best]["goodput"]}
        if "sglang-router-ca" in peers:
            theirs = peers["sglang-router-ca"]["ttft_p90_s"]
            row["ttft_p90"] = {"ours": c["ttft_p90_s"], "sglang_ca": theirs, "met": c["ttft_p90_s"] <= 0.5 * theirs}
        if "cwlor" in peers:
            row["vs_cwlor"] = {"ours": c["goodput"], "cwlor": peers["cwlor"]["goodput"],
                               "met": c["goodput"] >= peers["cwlor"]["goodput"]}
        row["max_engine_over_capacity_share"] = {"ours": c["max_engine_over_capacity_share"],
                                                 "met": c["max_engine_over_capacity_share"] <= 2.0}
        if "hg-oracle" in oracle.get(load, {}):
            o = oracle[load]["hg-oracle"]
            row["hit_rate"] = {"ours": c["hit_rate"], "replay_oracle": o, "met": c["hit_rate"] >= o - 0.05}
        out.append(row)
    return out


def main(args: argparse.Namespace) -> int:
    started, load_start = time.monotonic(), os.getloadavg()
    wanted = list(TARGETS if not args.only else [t for t in TARGETS if t in args.only])
    seeds = [k + 1 for k in range(args.rounds)]
    prompts = {s: tenants(s, DEFAULT_TENANTS) for s in seeds}
    sizing = {s: blind_capacity(args.workload, s, prompts[s]) for s in seeds}
    capacity = {s: sum(sizing[s][0][tier] for _, tier in CLUSTER) * args.time_scale for s in seeds}
    runs: list[dict[str, Any]] = []
    # the reference first (a minute of CPU), so that every partial results file has it
    reference = replay_reference(args.workload, seeds, args.loads, args.sessions) if args.oracle else []
    oracle = oracle_rates(reference)
    loads = [f"{x}x" for x in args.loads]

    def write(runs: list[dict[str, Any]], names: list[str], complete: bool) -> None:
        """The results file: after each round (complete False), then once more at the end."""
        summary = summarise(runs)
        summary = {name: summary[name] for name in names if name in summary}
        text = table(summary, loads, oracle)
        met = targets_met(summary, loads, oracle)
        if complete:
            print(text)
            for row in met:
                print(row["load"], {k: v for k, v in row.items() if k != "load"})
        save_report(args.out or RESULTS / f"mixed_tier_{args.workload}.json", {
            "wall_s": time.monotonic() - started, "complete": complete, "workload": args.workload,
            "rounds": len({r["round"] for r in runs}), "conversations_per_run": args.sessions, "loads": args.loads,
            "time_scale": args.time_scale, "capacity_rps": capacity,
            "turns_per_conversation": {s: sizing[s][1] for s in seeds}, "engine_rates": rates,
            "slo": {"ttft_s": 2.0 / args.time_scale, "itl_s": 0.1 / args.time_scale},
            "warmup_conversations": args.warmup, "cpus": os.cpu_count(),
            "load_average": {"start": load_start, "end": os.getloadavg()},
            "git": git_state(), "table": text, "targets_met": met, "summary": summary,
            "replay_reference": reference, "runs": runs, "warmup_timelines": warmups,
        })

    with tempfile.TemporaryDirectory() as tmp, ExitStack() as stack:
        engines = start_engines(stack, Path(tmp), args.time_scale, prefix_caching=True, tier_rates=sizing[1][0])
        rates = engines.rates
        targets = start_proxies(stack, Path(tmp), engines, set(wanted))
        targets += start_peers(stack, Path(tmp), engines, set(wanted))
        for name, settings in GATEWAYS.items():
            if name in wanted:
                targets.append(start_gateway(stack, Path(tmp), engines, name, DEFAULT_POLICY, settings))
        targets.sort(key=lambda t: wanted.index(t.name))
        print(f"cache-blind capacity {', '.join(f'seed {s}: {c:.1f}' for s, c in capacity.items())} req/s, "
              f"turns a conversation {', '.join(f'{sizing[s][1]:.2f}' for s in seeds)}; "
              f"targets: {', '.join(t.name for t in targets)}", flush=True)

        salts = itertools.count(1)
        warmups: dict[str, Any] = {}

        def make(seed: int, load: float, n: int, conv_seed: int) -> Callable[[], list[Conversation]]:
            rate = load * capacity[seed] / sizing[seed][1]
            return lambda: salted(conversations(args.workload, n, rate, conv_seed, prompts[seed]), next(salts))

        with paused(targets):
            for t in targets:
                if args.warmup and t.name.startswith("hg-"):
                    row = run_one(t, engines, make(1, 0.6, args.warmup, 8), args.time_scale, args.timeline)
                    warmups[t.name] = row.get("timeline")
                    print(f"warm-up {t.name}: goodput {row['goodput']:.1%} hit {row['hit_rate']:.1%} "
                          f"errors {row['errors']}", flush=True)
            for i, seed in enumerate(seeds):
                order = targets if i % 2 == 0 else targets[::-1]
                for load in args.loads:
                    for t in order:
                        row = run_one(t, engines, make(seed, load, args.sessions, 1000 * seed + 1), args.time_scale,
                                      args.timeline)
                        row.update(target=t.name, load=f"{load}x", round=i, seed=seed, capacity_rps=capacity[seed])
                        runs.append(row)
                        print(f"round {i + 1}/{len(seeds)} {load}x {t.name}: goodput {row['goodput']:.1%} "
                              f"ttft p50/p90/p99 {row['ttft_p50_s']:.2f}/{row['ttft_p90_s']:.2f}/"
                              f"{row['ttft_p99_s']:.2f} s hit {row['hit_rate']:.1%} prefilled/req "
                              f"{row['prefilled_per_request']:.0f} errors {row['errors']} ({row['wall_s']:.0f} s)",
                              flush=True)
                write(runs, [t.name for t in targets], False)
        names = [t.name for t in targets]
    write(runs, names, True)
    return 0

"""Tenants' fair share on the demo cluster: two tenants of weight 3:1 saturating it, and a third one's light traffic.

    flock /tmp/heterogate-heavy.lock python -m benchmarks tenants-fair-share [--duration 60] [--warmup 20] \
        [--time-scale 1.0] [--depth 4] [--policy shortest_queue] [--concurrency 48] [--light-rate 4] \
        [--light-min-in-flight 8] [--max-tokens 48] [--rounds 1] [--guaranteed-by-policy] [--no-baseline] \
        [--reserve ID [ID ...]]

The demo cluster (configs/backends.yaml: 2 x H100, 3 x A100-80GB, 3 x L40S, 2 x RTX 4090 that steal), its
simulated engines at --time-scale, behind one gateway whose admission queue holds requests once every
language backend has --depth in flight (gateway.admission.saturated_queue_depth). The language pool is
routed by --policy, shortest_queue by default: the queue forms only once every language backend is at
the depth, and the default policy (marginal_delay) leaves the L40S idle at this load, so with it the
pool never counts as saturated and nothing waits (every tenant gets what its clients ask for). Three
tenants of one priority class, each with its own API key:

    heavy-3   weight 3, --concurrency closed-loop clients, non-streamed chat requests
    heavy-1   weight 1, the same
    light     weight 1, min_in_flight --light-min-in-flight, Poisson arrivals at --light-rate per second,
              streamed (TTFT measured at the client: request sent to first content chunk); its requests
              go past the saturated pool to the backend of the soonest predicted first token
              (gateway.admission.guaranteed_first_token), or with --guaranteed-by-policy where the
              pool's policy sends them

--reserve keeps the named backends for the light tenant: they get `min_priority: 1` and the light tenant
priority class 1, so the heavy tenants' requests never go there (and count the pool as saturated
without them), and the light tenant's go to an idle one first (an idle backend's first token ends
its prefill). The idle phase runs the same config.

Phases, each on a freshly started gateway:

    idle      the light tenant alone: the TTFT it gets from an idle cluster
    tenants   the heavy tenants saturate the cluster, beside the light one
    baseline  the same traffic with the three keys as plain gateway.auth keys (no tenants: one flow in
              the queue's deadline order), unless --no-baseline

Each phase runs its traffic for --warmup s (its connections opened: no cold start in the window), then
measures --duration s. idle and tenants run --rounds times in turn (a p99 of a few hundred samples on a
shared host moves with a handful of stalls); the targets are read on the medians of the rounds.

Throughput of a tenant: prompt + completion tokens (the engines' usage) of its requests that ended in
the measured window, per second; also requests per second. Targets (issue 28): heavy-3 / heavy-1 within
3 +- 10%; the light tenant's TTFT p99 under load within 1.5x of the idle one (each round's loaded p99
over its own idle p99). The light tenant's TTFT is also given per GPU kind of the backend that served
it. Prints a table and writes benchmarks/results/tenants_fair_share.json (or --out).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import aiohttp  # noqa: E402
import orjson  # noqa: E402

from benchmarks.gateway_overhead import git_state, save_report  # noqa: E402
from testkit.harness import demo_config, run_gateway  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "tenants_fair_share.json"
MODEL = "llava-1.5-7b"
KEYS = {"heavy-3": "sk-bench-heavy-3", "heavy-1": "sk-bench-heavy-1", "light": "sk-bench-light"}
WEIGHTS = {"heavy-3": 3, "heavy-1": 1, "light": 1}
ADMIN_KEY = "sk-bench-admin"
PROMPT = "Summarise the trade-offs of serving one model on mixed GPU tiers. " * 6


@dataclass
class Tally:
    """What one tenant's clients saw."""

    ended: list[tuple[float, int, int]] = field(default_factory=list)   # (end time, prompt, completion) of 200s
    ttft_s: list[float] = field(default_factory=list)                   # streamed requests sent in the window
    ttft_backend: list[str] = field(default_factory=list)               # ... and the backend that served each
    statuses: Counter[int] = field(default_factory=Counter)


def gateway_config(tmp: Path, tenants: bool, args: argparse.Namespace) -> Path:
    for name, key in (*KEYS.items(), ("admin", ADMIN_KEY)):
        (tmp / f"{name}.keys").write_text(key + "\n")
    (tmp / "cluster.token").write_text("bench-cluster-token\n")
    auth: dict[str, Any] = {"admin_keys_file": str(tmp / "admin.keys"),
                            "cluster_token_file": str(tmp / "cluster.token")}
    section: dict[str, Any] = {"teams": {}}
    if tenants:
        section["teams"] = {name: {"api_keys_file": str(tmp / f"{name}.keys"), "weight": WEIGHTS[name]}
                            for name in KEYS}
        section["teams"]["light"]["min_in_flight"] = args.light_min_in_flight
        if args.reserve:   # the light tenant's class is the one the reserved backends are kept for
            section["teams"]["light"]["priority"] = 1
    else:   # the same keys, no tenants: every request in the default tenant
        (tmp / "plain.keys").write_text("".join(k + "\n" for k in KEYS.values()))
        auth["api_keys_file"] = str(tmp / "plain.keys")
    reserved = {bid: {"min_priority": 1} for bid in args.reserve} if tenants else {}
    return demo_config(tmp, time_scale=args.time_scale, per_backend=reserved, auth=auth, tenants=section,
                       admission={"saturated_queue_depth": args.depth, "max_waiting": 4096, "max_wait_s": 600,
                                  "guaranteed_first_token": not args.guaranteed_by_policy})


async def one(session: aiohttp.ClientSession, url: str, tenant: str, tally: Tally, args: argparse.Namespace,
              stream: bool, window: tuple[float, float]) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": args.max_tokens,
            "stream": stream, **({"stream_options": {"include_usage": True}} if stream else {})}
    headers = {"authorization": f"Bearer {KEYS[tenant]}"}
    sent = time.monotonic()
    first: float | None = None
    usage: dict[str, int] = {}
    async with session.post(f"{url}/v1/chat/completions", json=body, headers=headers) as resp:
        tally.statuses[resp.status] += 1
        backend = resp.headers.get("x-heterogate-backend", "")
        if resp.status != 200:
            await resp.read()
            await asyncio.sleep(0.05)   # a refused client does not spin
            return
        if stream:
            async for line in resp.content:
                if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                    continue
                event = orjson.loads(line[6:])
                if first is None and event.get("choices") and event["choices"][0]["delta"].get("content"):
                    first = time.monotonic()
                usage = event.get("usage") or usage
        else:
            usage = (await resp.json(loads=orjson.loads))["usage"]
    end = time.monotonic()
    if window[0] <= end <= window[1]:
        tally.ended.append((end, usage.get("prompt_tokens", 0), usage.get("completion_tokens", 0)))
    if stream and first is not None and window[0] <= sent <= window[1]:
        tally.ttft_s.append(first - sent)
        tally.ttft_backend.append(backend)


async def closed_loop(session: aiohttp.ClientSession, url: str, tenant: str, tally: Tally, args: argparse.Namespace,
                      window: tuple[float, float], stop: asyncio.Event) -> None:
    while not stop.is_set():
        await one(session, url, tenant, tally, args, False, window)


async def poisson(session: aiohttp.ClientSession, url: str, tally: Tally, args: argparse.Namespace,
                  window: tuple[float, float], rng: random.Random) -> None:
    """The light tenant: arrivals from the warm-up's start to the window's end, each streamed."""
    tasks = []
    while (now := time.monotonic()) < window[1]:
        tasks.append(asyncio.create_task(one(session, url, "light", tally, args, True, window)))
        await asyncio.sleep(min(rng.expovariate(args.light_rate), max(0.0, window[1] - now)))
    await asyncio.gather(*tasks)


async def drive(url: str, args: argparse.Namespace, heavy: bool) -> dict[str, Tally]:
    tallies = {name: Tally() for name in KEYS}
    start = time.monotonic() + args.warmup
    window = (start, start + args.duration)
    stop = asyncio.Event()
    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    timeout = aiohttp.ClientTimeout(total=900)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        loops = [asyncio.create_task(closed_loop(session, url, name, tallies[name], args, window, stop))
                 for name in ("heavy-3", "heavy-1") if heavy for _ in range(args.concurrency)]
        await poisson(session, url, tallies["light"], args, window, random.Random(args.seed))
        stop.set()
        await asyncio.gather(*loops)
    return tallies


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def by_gpu(t: Tally) -> dict[str, dict[str, float | int | None]]:
    """TTFT p50 / p99 and samples per GPU kind of the backend that served (h100-0 -> h100)."""
    groups: dict[str, list[float]] = {}
    for ttft, backend in zip(t.ttft_s, t.ttft_backend, strict=True):
        groups.setdefault(backend.rsplit("-", 1)[0], []).append(ttft)
    return {gpu: {"p50_s": percentile(v, 0.5), "p99_s": percentile(v, 0.99), "samples": len(v)}
            for gpu, v in sorted(groups.items())}


def summarise(tallies: dict[str, Tally], duration_s: float) -> dict[str, dict[str, Any]]:
    out = {}
    for name, t in tallies.items():
        tokens = sum(p + c for _, p, c in t.ended)
        out[name] = {
            "tokens_per_s": tokens / duration_s, "requests_per_s": len(t.ended) / duration_s,
            "ttft_p50_s": percentile(t.ttft_s, 0.5), "ttft_p99_s": percentile(t.ttft_s, 0.99),
            "ttft_mean_s": statistics.fmean(t.ttft_s) if t.ttft_s else None, "ttft_samples": len(t.ttft_s),
            "statuses": {str(k): v for k, v in sorted(t.statuses.items())},
            "ttft_p99_s_by_gpu": by_gpu(t),
        }
    return out


def run_phase(name: str, args: argparse.Namespace, tenants: bool, heavy: bool) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix=f"tenants-{name}-") as tmp:
        config = gateway_config(Path(tmp), tenants, args)
        with run_gateway(config, "--policy", args.policy, admin_key=ADMIN_KEY, timeout=180) as gw:
            tallies = asyncio.run(drive(gw.url, args, heavy))
    summary = summarise(tallies, args.duration)
    print(f"  {name}: " + ", ".join(f"{t} {s['tokens_per_s']:.0f} tok/s" for t, s in summary.items()), flush=True)
    return {"phase": name, "tenants": tenants, "heavy": heavy, "by_tenant": summary}


def ratio(phase: dict[str, Any], key: str) -> float | None:
    a, b = phase["by_tenant"]["heavy-3"][key], phase["by_tenant"]["heavy-1"][key]
    return a / b if b else None


def light_p99(phase: dict[str, Any]) -> float | None:
    p99: float | None = phase["by_tenant"]["light"]["ttft_p99_s"]
    return p99


def over_idle(loaded: dict[str, Any], idle: dict[str, Any]) -> float | None:
    a, b = light_p99(loaded), light_p99(idle)
    return a / b if a and b else None


def median(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


def labelled(report: dict[str, Any]) -> list[tuple[str, dict[str, Any], float | None]]:
    """(label, phase, the light tenant's idle TTFT p99 of its round) for every phase run, in order."""
    rows = []
    for i, r in enumerate(report["rounds"], 1):
        idle = light_p99(r["idle"])
        suffix = f" #{i}" if len(report["rounds"]) > 1 else ""
        rows += [(name + suffix, r[name], idle) for name in ("idle", "tenants")]
    if report["baseline"] is not None:
        rows.append(("baseline", report["baseline"], light_p99(report["rounds"][0]["idle"])))
    return rows


def table(report: dict[str, Any]) -> str:
    lines = [f"{'phase':11s} {'heavy-3 tok/s':>13s} {'heavy-1 tok/s':>13s} {'ratio tok':>9s} {'ratio req':>9s} "
             f"{'light tok/s':>11s} {'light TTFT p50':>14s} {'p99':>7s} {'p99/idle':>8s} {'429s':>5s}"]
    for name, phase, idle in labelled(report):
        s = phase["by_tenant"]

        def ms(v: float | None) -> str:
            return f"{v * 1000:.0f} ms" if v is not None else "-"

        p99 = s["light"]["ttft_p99_s"]
        refused = sum(t["statuses"].get("429", 0) for t in s.values())
        rt, rr = ratio(phase, "tokens_per_s"), ratio(phase, "requests_per_s")
        lines.append(
            f"{name:11s} {s['heavy-3']['tokens_per_s']:13.0f} {s['heavy-1']['tokens_per_s']:13.0f} "
            f"{'-' if rt is None else f'{rt:.2f}':>9s} {'-' if rr is None else f'{rr:.2f}':>9s} "
            f"{s['light']['tokens_per_s']:11.0f} {ms(s['light']['ttft_p50_s']):>14s} {ms(p99):>7s} "
            f"{'-' if p99 is None or not idle else f'{p99 / idle:.2f}x':>8s} {refused:5d}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--duration", type=float, default=60.0, help="measured window of each phase, s")
    p.add_argument("--warmup", type=float, default=20.0, help="each phase's traffic before its window, s")
    p.add_argument("--time-scale", type=float, default=1.0, help="the simulated engines' clock (1: real time)")
    p.add_argument("--depth", type=int, default=4, help="gateway.admission.saturated_queue_depth")
    p.add_argument("--policy", default="shortest_queue", help="the language pool's routing policy")
    p.add_argument("--concurrency", type=int, default=48, help="closed-loop clients of each heavy tenant")
    p.add_argument("--light-rate", type=float, default=4.0, help="the light tenant's requests per second")
    p.add_argument("--light-min-in-flight", type=int, default=8,
                   help="the light tenant's guaranteed concurrency (gateway.tenants.teams.light.min_in_flight)")
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--rounds", type=int, default=1, help="idle and tenants phases, in turn, this many times")
    p.add_argument("--guaranteed-by-policy", action="store_true",
                   help="route the light tenant's guaranteed requests by --policy (guaranteed_first_token off)")
    p.add_argument("--reserve", nargs="+", default=[], metavar="ID",
                   help="backends kept for the light tenant (min_priority: 1, the light tenant's priority 1)")
    p.add_argument("--no-baseline", action="store_true", help="skip the phase without tenants")
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    t0 = time.monotonic()
    load_before = os.getloadavg()
    rounds = [{"idle": run_phase("idle", args, tenants=True, heavy=False),
               "tenants": run_phase("tenants", args, tenants=True, heavy=True)} for _ in range(args.rounds)]
    baseline = None if args.no_baseline else run_phase("baseline", args, tenants=False, heavy=True)
    loaded = [r["tenants"] for r in rounds]
    report = {
        "benchmark": "tenants_fair_share",
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "git": git_state(), "wall_s": time.monotonic() - t0, "rounds": rounds, "baseline": baseline,
        "host": {"cpus": os.cpu_count(), "load_average_1m": {"before": load_before[0], "after": os.getloadavg()[0]}},
        "weight_ratio_tokens": median([ratio(t, "tokens_per_s") for t in loaded]),
        "weight_ratio_requests": median([ratio(t, "requests_per_s") for t in loaded]),
        "heavy_tokens_per_s": median([sum(t["by_tenant"][h]["tokens_per_s"] for h in ("heavy-3", "heavy-1"))
                                      for t in loaded]),
        "light_ttft_p99_s": {name: median([light_p99(r[name]) for r in rounds]) for name in ("idle", "tenants")},
        "light_ttft_p99_over_idle": median([over_idle(r["tenants"], r["idle"]) for r in rounds]),
    }
    print(table(report))
    print(f"targets (medians of {args.rounds} round(s)): heavy-3 / heavy-1 tokens {report['weight_ratio_tokens']} "
          f"(3 +- 10%: 2.70-3.30); light TTFT p99 over idle {report['light_ttft_p99_over_idle']} (<= 1.5)")
    save_report(args.out, report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

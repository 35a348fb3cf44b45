"""Routing on a mixed-GPU cluster: every router in front of the same emulated engines, in one run.

    flock /tmp/heterogate-heavy.lock python benchmarks/mixed_tier.py [--quick] [--rounds 3] [--requests 500]

Eight emulated vLLM-like engines (benchmarks/emulated_engine.py): 2 x H100, 3 x A100-80GB, 3 x L40S
tiers with continuous batching, KV capacity, vLLM /metrics and /v1/models. Load: open-loop Poisson
streaming chat requests of the heavy-tailed mix in benchmarks/mixed_workload.py, at fractions of the
cluster's measured capacity (the sum of each engine's saturated rate). Targets:

    rr / lor / cwlor          benchmarks/lor_proxy.py: round robin, least outstanding, and capacity-
                              weighted least outstanding (weights = the engines' measured rates)
    vllm-router               PyPI, --policy power_of_two (installed by benchmarks/front_door.py)
    sglang-router             PyPI, default policy (cache_aware)
    hg-<policy>               the gateway, each language policy, engines as `kind: openai` backends
                              with gateway-side scraping (`scrape: {engine: vllm}`), default settings
    hg-<default>-agent        the gateway's default policy fed by one heartbeat agent per engine

Goodput = share of requests with TTFT <= 2 s and mean inter-token time <= 100 ms (divided by
--time-scale). Every target first serves one unscored warm-up run (--warmup requests at the lowest
load): a gateway learns its backends' speeds from traffic, and a long-running one has. Each round
then replays one request sequence per load to every target (targets alternate order between
rounds); targets not under test are paused (SIGSTOP) so that their background scraping does not
load the machine, and get a second after resuming to catch up. Gateways keep what they learned
across runs. Loads default to 0.6x, 0.9x and 1.0x: runs start from idle engines, so short runs at
0.6x-0.9x end before queues build up and every good router scores ~100%; 1.0x separates them.
Cells are medians over rounds with the range (min-max) beside them; the comparison that the issue
asks for (the default policy, scraping and agent, against capacity-weighted least-outstanding) runs
every round together with lor and the two PyPI routers, the other targets in the first round only
unless --all-rounds. A second table pairs the default policy with cwlor round by round. Writes
benchmarks/results/mixed_tier.json (--quick: mixed_tier_quick.json) and prints the tables
docs/ROUTING.md quotes.

--workload multiturn: shared-prefix conversations on the same engines with prefix caches, against
rr, cwlor, vllm-router and sglang-router with `--policy cache_aware` and the gateway with and without
cache-aware routing (benchmarks/mixed_tier_multiturn.py; benchmarks/results/mixed_tier_multiturn.json).
--workload hotprefix: the hot-prefix stress (one tenant's system prompt in 80% of single requests) on
the same engines (benchmarks/results/mixed_tier_hotprefix.json).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import os
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import aiohttp  # noqa: E402
import orjson  # noqa: E402

from benchmarks import loadgen  # noqa: E402
from benchmarks.emulated_engine import MODEL, TIERS  # noqa: E402
from benchmarks.front_door import ensure_peers, process, wait_http  # noqa: E402
from benchmarks.gateway_overhead import git_state, save_report  # noqa: E402
from benchmarks.mixed_workload import Request, saturated_rate, trace  # noqa: E402
from gateway.config.cluster import RoutingConfig  # noqa: E402
from gateway.routing.policies import REGISTRY  # noqa: E402
from testkit.harness import free_port, free_ports, run_gateway, write_config  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "mixed_tier.json"
QUICK_RESULTS = ROOT / "benchmarks" / "results" / "mixed_tier_quick.json"   # --quick leaves the full run's alone
CLUSTER = (("h100-0", "H100"), ("h100-1", "H100"), ("a100-0", "A100-80GB"), ("a100-1", "A100-80GB"),
           ("a100-2", "A100-80GB"), ("l40s-0", "L40S"), ("l40s-1", "L40S"), ("l40s-2", "L40S"))
VISION_POLICIES = {"encode_cost", "least_image_tokens"}
DEFAULT_POLICY = RoutingConfig().policy
TTFT_SLO_S, ITL_SLO_S = 2.0, 0.100
SETTLE_S = 1.0


@dataclass
class Target:
    name: str
    url: str
    pids: list[int]
    every_round: bool = True

    def signal(self, sig: int) -> None:
        for pid in self.pids:
            os.kill(pid, sig)


@dataclass
class Outcome:
    ttft_s: float = float("nan")
    itl_s: float = float("nan")          # mean inter-token time of the request
    tokens: int = 0
    engine: str = ""
    error: str = ""
    text: str = ""                       # the reply's content, where asked for (keep_text)


@dataclass
class Engines:
    urls: dict[str, str] = field(default_factory=dict)    # engine id -> base URL
    rates: dict[str, float] = field(default_factory=dict)  # engine id -> saturated requests/s


# -- processes --------------------------------------------------------------------------------

def start_engines(stack: ExitStack, tmp: Path, time_scale: float, prefix_caching: bool = False,
                  tier_rates: dict[str, float] | None = None) -> Engines:
    """The emulated engines; `tier_rates`: each tier's saturated requests/s in emulated time (default: on
    the mixed workload, benchmarks/mixed_workload.saturated_rate)."""
    ports = dict(zip((eid for eid, _ in CLUSTER), free_ports(len(CLUSTER)), strict=True))
    args = [a for eid, tier in CLUSTER for a in ("--engine", f"{eid}:{tier}:{ports[eid]}")]
    proc = stack.enter_context(process(
        [sys.executable, str(ROOT / "benchmarks" / "emulated_engine.py"), "--time-scale", str(time_scale),
         *(["--prefix-caching"] if prefix_caching else []), *args], tmp / "engines.log"))
    engines = Engines()
    tiers = {t for _, t in CLUSTER}
    rates = {tier: (tier_rates[tier] if tier_rates else saturated_rate(TIERS[tier])) * time_scale for tier in tiers}
    for eid, tier in CLUSTER:
        engines.urls[eid] = f"http://127.0.0.1:{ports[eid]}"
        engines.rates[eid] = rates[tier]
        wait_http(engines.urls[eid] + "/v1/chat/completions", proc)
    return engines


def start_proxies(stack: ExitStack, tmp: Path, engines: Engines, wanted: set[str]) -> list[Target]:
    out = []
    for policy in [p for p in ("cwlor", "lor", "rr") if p in wanted]:
        port = free_port()
        backends = [a for eid, url in engines.urls.items() for a in ("--backend", f"{url}={engines.rates[eid]:.3f}")]
        proc = stack.enter_context(process(
            [sys.executable, str(ROOT / "benchmarks" / "lor_proxy.py"), "--port", str(port), "--policy", policy,
             *backends], tmp / f"proxy-{policy}.log"))
        wait_http(f"http://127.0.0.1:{port}/v1/chat/completions", proc)
        out.append(Target(policy, f"http://127.0.0.1:{port}", [proc.pid]))
    return out


def start_peers(stack: ExitStack, tmp: Path, engines: Engines, wanted: set[str]) -> list[Target]:
    """vllm-router (power_of_two) and sglang-router (its default, cache_aware) as `vllm-router` and
    `sglang-router`; both with `--policy cache_aware` as `vllm-router-ca` and `sglang-router-ca`."""
    if not wanted & {"vllm-router", "sglang-router", "vllm-router-ca", "sglang-router-ca"}:
        return []
    bin_dir = ensure_peers()
    vllm, sglang = [str(bin_dir / "vllm-router"), "--log-level", "warning"], [
        str(bin_dir / "python"), "-m", "sglang_router.launch_router", "--log-level", "warn"]
    out = []
    for name, cmd in (
        ("vllm-router", [*vllm, "--policy", "power_of_two"]),
        ("sglang-router", sglang),
        ("vllm-router-ca", [*vllm, "--policy", "cache_aware"]),
        ("sglang-router-ca", [*sglang, "--policy", "cache_aware"]),
    ):
        if name not in wanted:
            continue
        port = free_port()
        proc = stack.enter_context(process(
            [*cmd, "--host", "127.0.0.1", "--port", str(port), "--prometheus-port", str(free_port()),
             "--worker-urls", *engines.urls.values()], tmp / f"{name}.log"))
        wait_http(f"http://127.0.0.1:{port}/v1/chat/completions", proc)
        out.append(Target(name, f"http://127.0.0.1:{port}", [proc.pid]))
    return out


def gateway_config(engines: Engines, scrape: bool, settings: dict[str, Any] | None = None) -> dict[str, Any]:
    """`settings`: of the `gateway:` section (none: its defaults)."""
    tiers = dict(CLUSTER)
    return {"model": MODEL, **({"gateway": settings} if settings else {}),
            "backends": [
        {"id": eid, "kind": "openai", "role": "language", "gpu": tiers[eid], "address": url,
         **({"scrape": {"engine": "vllm"}} if scrape else {"agent": True})}
        for eid, url in engines.urls.items()]}


def start_gateways(stack: ExitStack, tmp: Path, engines: Engines, policies: list[str]) -> list[Target]:
    return [start_gateway(stack, tmp, engines, f"hg-{policy}", policy) for policy in policies]


def start_gateway(stack: ExitStack, tmp: Path, engines: Engines, name: str, policy: str,
                  settings: dict[str, Any] | None = None) -> Target:
    """One gateway scraping the engines, with these `gateway:` settings."""
    where = tmp / name
    where.mkdir()
    config = write_config(where, gateway_config(engines, scrape=True, settings=settings))
    gw = stack.enter_context(run_gateway(config, "--policy", policy))
    return Target(name, gw.url, [gw.process.pid])


def start_agent_gateway(stack: ExitStack, tmp: Path, engines: Engines, policy: str) -> Target:
    where = tmp / f"hg-{policy}-agent"
    where.mkdir()
    config = write_config(where, gateway_config(engines, scrape=False))
    gw = stack.enter_context(run_gateway(config, "--policy", policy, healthy=0))
    tiers = dict(CLUSTER)
    pids = [gw.process.pid]
    for eid, url in engines.urls.items():
        proc = stack.enter_context(process(
            [sys.executable, "-m", "backends.agent", "--engine", "vllm", "--address", url, "--backend-id", eid,
             "--gpu", tiers[eid], "--model", MODEL, "--gateway", f"127.0.0.1:{gw.grpc_port}", "--log-level",
             "warning"], where / f"agent-{eid}.log"))
        pids.append(proc.pid)
    gw.wait_until(lambda: sum(b["healthy"] for b in gw.backends()) == len(engines.urls), timeout=60)
    return Target(f"hg-{policy}-agent", gw.url, pids)


@contextmanager
def paused(targets: list[Target]) -> Iterator[None]:
    """Every target stopped (SIGSTOP) outside its own runs; all resumed on the way out so they can stop."""
    for t in targets:
        t.signal(signal.SIGSTOP)
    try:
        yield
    finally:
        for t in targets:
            try:
                t.signal(signal.SIGCONT)
            except ProcessLookupError:
                pass


# -- load -------------------------------------------------------------------------------------

async def one(session: aiohttp.ClientSession, url: str, r: Request, keep_text: bool = False) -> Outcome:
    """One streamed request; `keep_text`: also the reply's content, as the client reads it (Outcome.text)."""
    loop = asyncio.get_running_loop()
    out = Outcome()
    t0 = loop.time()
    first = last = 0.0
    parts: list[str] = []
    try:
        async with session.post(url, data=r.body, headers={"content-type": "application/json"}) as resp:
            if resp.status != 200:
                out.error = f"HTTP {resp.status}: {(await resp.read())[:120]!r}"
                return out
            async for line in resp.content:
                if not line.startswith(b"data:"):
                    continue
                if b'"error"' in line:
                    out.error = line[:160].decode(errors="replace")
                    break
                if b'"content"' not in line:
                    continue
                now = loop.time()
                if not out.tokens:
                    first = now
                    out.engine = str(orjson.loads(line[5:]).get("system_fingerprint", ""))
                if keep_text:
                    parts.append(orjson.loads(line[5:])["choices"][0]["delta"].get("content") or "")
                out.tokens += 1
                last = now
    except (aiohttp.ClientError, TimeoutError) as exc:
        out.error = f"{type(exc).__name__}: {exc}"
    out.text = "".join(parts)
    if out.tokens:
        out.ttft_s = first - t0
        out.itl_s = (last - first) / (out.tokens - 1) if out.tokens > 1 else 0.0
    if not out.error and out.tokens < r.max_tokens:
        out.error = f"stream ended after {out.tokens} of {r.max_tokens} tokens"
    return out


async def drive(url: str, requests: list[Request]) -> list[Outcome]:
    loop = asyncio.get_running_loop()
    timeout = aiohttp.ClientTimeout(total=120, connect=5)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout) as session:
        start = loop.time()
        tasks = []
        for r in requests:
            delay = start + r.at_s - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.ensure_future(one(session, url + "/v1/chat/completions", r)))
        return list(await asyncio.gather(*tasks))


def run_one(t: Target, requests: list[Request], time_scale: float) -> dict[str, Any]:
    t.signal(signal.SIGCONT)
    time.sleep(SETTLE_S)
    before, started = sum(loadgen.cpu_ticks(p) for p in t.pids), time.monotonic()
    outcomes = asyncio.run(drive(t.url, requests))
    wall = time.monotonic() - started
    cpu = (sum(loadgen.cpu_ticks(p) for p in t.pids) - before) / loadgen.CLK_TCK
    t.signal(signal.SIGSTOP)
    return score(outcomes, time_scale) | {"router_cpu_s": cpu, "router_cores": cpu / wall,
                                          "router_cpu_ms_per_req": cpu / len(requests) * 1000}


def score(outcomes: list[Outcome], time_scale: float) -> dict[str, Any]:
    ok = [o for o in outcomes if not o.error]
    ttft_slo, itl_slo = TTFT_SLO_S / time_scale, ITL_SLO_S / time_scale
    good = sum(1 for o in ok if o.ttft_s <= ttft_slo and o.itl_s <= itl_slo)
    ttft = sorted(o.ttft_s for o in ok)
    itl = sorted(o.itl_s for o in ok)
    tiers = dict(CLUSTER)
    shares: dict[str, float] = {}
    for o in ok:
        tier = tiers.get(o.engine, "?")
        shares[tier] = shares.get(tier, 0.0) + 1 / len(outcomes)
    errors = [o.error for o in outcomes if o.error]
    return {
        "goodput": good / len(outcomes), "errors": len(errors), "error_examples": errors[:3],
        # by kind: the HTTP status (or the exception's name), so deliberate refusals (429) show apart
        "errors_by_kind": dict(collections.Counter(e.split(":")[0] for e in errors)),
        "ttft_p50_s": loadgen.percentile(ttft, 50), "ttft_p90_s": loadgen.percentile(ttft, 90),
        "ttft_p99_s": loadgen.percentile(ttft, 99),
        "itl_p50_ms": loadgen.percentile(itl, 50) * 1000, "itl_p99_ms": loadgen.percentile(itl, 99) * 1000,
        "tier_shares": shares,
    }


# -- summary ----------------------------------------------------------------------------------

def medians(runs: list[dict[str, Any]], keys: tuple[str, ...]) -> dict[str, dict[str, dict[str, Any]]]:
    """target -> load -> the rounds' runs, as one cell: medians of `keys`, errors summed, tier shares
    averaged, the round count."""
    out: dict[str, dict[str, dict[str, Any]]] = {}
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in runs:
        groups.setdefault((r["target"], r["load"]), []).append(r)
    for (target, load), rs in groups.items():
        cell: dict[str, Any] = {k: statistics.median(r[k] for r in rs) for k in keys}
        cell["errors"] = sum(r["errors"] for r in rs)
        cell["rounds"] = len(rs)
        tiers = {t for r in rs for t in r["tier_shares"]}
        cell["tier_shares"] = {t: statistics.mean(r["tier_shares"].get(t, 0.0) for r in rs) for t in sorted(tiers)}
        out.setdefault(target, {})[load] = cell
    return out


def summarise(runs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """target -> load -> medians over rounds (errors summed, shares averaged), goodput's range and rounds."""
    out = medians(runs, ("goodput", "ttft_p50_s", "ttft_p99_s", "itl_p50_ms", "itl_p99_ms", "router_cores",
                         "router_cpu_ms_per_req"))
    for r in runs:
        cell = out[r["target"]][r["load"]]
        cell["goodput_min"] = min(cell.get("goodput_min", r["goodput"]), r["goodput"])
        cell["goodput_max"] = max(cell.get("goodput_max", r["goodput"]), r["goodput"])
        cell.setdefault("goodput_by_round", {})[r["round"]] = r["goodput"]
        cell.setdefault("ttft_p99_by_round", {})[r["round"]] = r["ttft_p99_s"]
    return out


def reference_load(loads: list[str]) -> str:
    """The load the latency, share and CPU columns are quoted at: 0.9x when run, else the highest."""
    return "0.9x" if "0.9x" in loads else loads[-1]


def _goodput(cell: dict[str, Any]) -> str:
    if cell["rounds"] == 1:
        return f"{cell['goodput']:.1%}"
    return f"{cell['goodput']:.1%} ({cell['goodput_min']:.1%}-{cell['goodput_max']:.1%})"


def table(summary: dict[str, dict[str, Any]], loads: list[str], capacity_shares: dict[str, float]) -> str:
    ref, hi = reference_load(loads), loads[-1]
    head = ("| target | " + " | ".join(f"goodput @{x} (range)" for x in loads)
            + f" | TTFT p50 / p99 @{ref} s | TTFT p99 @{hi} s | ITL p50 / p99 @{ref} ms | errors "
            f"| tier shares @{ref} (H100 / A100 / L40S) | router cores @{ref} | rounds |")
    lines = [head, "|---|" + "---:|" * len(loads) + "---:|---:|---:|---:|---|---:|---:|"]
    order = ("H100", "A100-80GB", "L40S")
    ideal = " / ".join(f"{capacity_shares[t]:.0%}" for t in order)
    for target, cells in summary.items():
        if any(x not in cells for x in loads):
            continue
        b = cells[ref]
        shares = " / ".join(f"{b['tier_shares'].get(t, 0.0):.0%}" for t in order)
        lines.append(
            f"| {target} | " + " | ".join(_goodput(cells[x]) for x in loads)
            + f" | {b['ttft_p50_s']:.2f} / {b['ttft_p99_s']:.2f} | {cells[hi]['ttft_p99_s']:.2f} "
            f"| {b['itl_p50_ms']:.0f} / {b['itl_p99_ms']:.0f} | {sum(cells[x]['errors'] for x in loads)} "
            f"| {shares} | {b['router_cores']:.2f} | {b['rounds']} |")
    lines.append("| " + " | ".join(["*capacity shares*", *[""] * (len(loads) + 4), ideal, "", ""]) + " |")
    return "\n".join(lines)


def paired(summary: dict[str, dict[str, Any]], loads: list[str], baseline: str = "cwlor") -> str:
    """Each HeteroGate target run every round against `baseline`, round by round (same requests):
    goodput and TTFT p99 differences, and how many rounds it was ahead, level or behind."""
    lines = [f"| target − {baseline} | load | goodput Δ per round (points) | ahead / level / behind "
             "| TTFT p99 Δ per round s |", "|---|---|---|---|---|"]
    base = summary.get(baseline, {})
    for target, cells in summary.items():
        if not target.startswith("hg-"):
            continue
        for x in loads:
            a, b = cells.get(x), base.get(x)
            if a is None or b is None or a["rounds"] < 2:
                continue
            rounds = sorted(set(a["goodput_by_round"]) & set(b["goodput_by_round"]))
            d = [(a["goodput_by_round"][i] - b["goodput_by_round"][i]) * 100 for i in rounds]
            dp = [a["ttft_p99_by_round"][i] - b["ttft_p99_by_round"][i] for i in rounds]
            ahead, behind = sum(v > 0 for v in d), sum(v < 0 for v in d)
            lines.append(f"| {target} | {x} | {' '.join(f'{v:+.1f}' for v in d)} "
                         f"| {ahead} / {len(d) - ahead - behind} / {behind} | {' '.join(f'{v:+.2f}' for v in dp)} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--quick", action="store_true", help="1 round, 160 requests a run, fewer targets")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--requests", type=int, default=500, help="requests per run")
    p.add_argument("--warmup", type=int, default=None,
                   help="requests of each target's unscored first run (default 200; multiturn: conversations of "
                        "each gateway's, default 40)")
    p.add_argument("--workload", choices=("mixed", "multiturn", "hotprefix"), default="mixed",
                   help="mixed: the distinct-prompt mix above; multiturn: shared-prefix conversations on engines "
                        "with prefix caches (benchmarks/mixed_tier_multiturn.py); hotprefix: one tenant's prefix "
                        "in 80%% of single requests, on the same engines")
    p.add_argument("--loads", type=float, nargs="+", default=None,
                   help="fractions of capacity (default: 0.6 0.9 1.0; multiturn: 0.9 1.5 of the cache-blind one; "
                        "hotprefix: 1.0 2.5)")
    p.add_argument("--sessions", type=int, default=None,
                   help="multiturn: conversations per run (default 150); hotprefix: requests per run (default 600)")
    p.add_argument("--no-oracle", dest="oracle", action="store_false",
                   help="multiturn: skip the virtual-time reference (prefix_affinity.py's hg-cache and hg-oracle)")
    p.add_argument("--out", type=Path, help="results file (default: benchmarks/results/mixed_tier[_multiturn].json)")
    p.add_argument("--time-scale", type=float, default=1.0, help="emulated seconds per real second")
    p.add_argument("--all-rounds", action="store_true", help="baseline gateway policies in every round too")
    p.add_argument("--no-peers", action="store_true", help="leave vllm-router and sglang-router out")
    p.add_argument("--only", nargs="+", help="run only these targets (names as in the table)")
    p.add_argument("--timeline", type=float, default=0.0, metavar="SECONDS",
                   help="multiturn, hotprefix: read each gateway's /admin/backends every SECONDS during its runs "
                        "(warm-up included) and keep what its prefix index and leases held (`timeline` of a run)")
    p.add_argument("--policies", nargs="+", help="gateway policies to run (default: every language policy)")
    args = p.parse_args(argv)
    if args.workload in ("multiturn", "hotprefix"):
        from benchmarks import mixed_tier_multiturn  # it builds on this module's set-up

        multiturn = args.workload == "multiturn"
        args.loads = args.loads or ([0.9, 1.5] if multiturn else [1.0, 2.5])
        args.sessions = args.sessions or (150 if multiturn else 600)
        args.warmup = (40 if multiturn else 200) if args.warmup is None else args.warmup
        return mixed_tier_multiturn.main(args)
    args.loads = args.loads or [0.6, 0.9, 1.0]
    args.warmup = 200 if args.warmup is None else args.warmup
    rounds, n = (1, 160) if args.quick else (args.rounds, args.requests)
    policies = [DEFAULT_POLICY, *sorted(set(REGISTRY) - VISION_POLICIES - {DEFAULT_POLICY})]
    if args.quick:
        policies = list(dict.fromkeys([DEFAULT_POLICY, "heteroserve", "batch_aware"]))
    if args.policies:
        policies = args.policies
    wanted = {"cwlor", "lor", "rr", *(() if args.no_peers else ("vllm-router", "sglang-router")),
              *(f"hg-{p}" for p in policies), f"hg-{DEFAULT_POLICY}-agent"}
    if args.only:
        wanted &= set(args.only)
    started = time.monotonic()
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp, ExitStack() as stack:
        engines = start_engines(stack, Path(tmp), args.time_scale)
        capacity = sum(engines.rates.values())
        targets = start_proxies(stack, Path(tmp), engines, wanted)
        targets += start_peers(stack, Path(tmp), engines, wanted)
        targets += start_gateways(stack, Path(tmp), engines, [p for p in policies if f"hg-{p}" in wanted])
        if f"hg-{DEFAULT_POLICY}-agent" in wanted:
            targets.append(start_agent_gateway(stack, Path(tmp), engines, DEFAULT_POLICY))
        every = {"cwlor", "lor", "vllm-router", "sglang-router", f"hg-{DEFAULT_POLICY}", f"hg-{DEFAULT_POLICY}-agent"}
        for t in targets:
            t.every_round = t.name in every
        print(f"capacity {capacity:.1f} req/s; targets: {', '.join(t.name for t in targets)}", flush=True)
        with paused(targets):
            if args.warmup:
                warm = trace(args.warmup, min(args.loads) * capacity, seed=7)
                for t in targets:
                    row = run_one(t, warm, args.time_scale)
                    print(f"warm-up {t.name}: goodput {row['goodput']:.1%} errors {row['errors']}", flush=True)
            for i in range(rounds):
                order = targets if i % 2 == 0 else targets[::-1]
                for load in args.loads:
                    requests = trace(n, load * capacity, seed=1000 * i + int(load * 100))
                    for t in order:
                        if i and not (t.every_round or args.all_rounds):
                            continue
                        row = run_one(t, requests, args.time_scale)
                        row.update(target=t.name, load=f"{load}x", round=i)
                        runs.append(row)
                        print(f"round {i + 1}/{rounds} {load}x {t.name}: goodput {row['goodput']:.1%} "
                              f"ttft p99 {row['ttft_p99_s']:.2f} s errors {row['errors']}", flush=True)
        names = [t.name for t in targets]
    summary = summarise(runs)
    summary = {name: summary[name] for name in names if name in summary}
    loads = [f"{x}x" for x in args.loads]
    tier_rate: dict[str, float] = {}
    for eid, tier in CLUSTER:
        tier_rate[tier] = tier_rate.get(tier, 0.0) + engines.rates[eid]
    shares = {t: r / capacity for t, r in tier_rate.items()}
    text = table(summary, loads, shares)
    versus = paired(summary, loads)
    print(text, versus, sep="\n\n")
    save_report(args.out or (QUICK_RESULTS if args.quick else RESULTS), {
        "wall_s": time.monotonic() - started, "quick": args.quick, "rounds": rounds, "requests_per_run": n,
        "loads": args.loads, "time_scale": args.time_scale, "capacity_rps": capacity, "engine_rates": engines.rates,
        "slo": {"ttft_s": TTFT_SLO_S / args.time_scale, "itl_s": ITL_SLO_S / args.time_scale},
        "warmup_requests": args.warmup, "cpus": os.cpu_count(), "git": git_state(), "table": text,
        "versus_cwlor": versus, "summary": summary, "runs": runs,
    })
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

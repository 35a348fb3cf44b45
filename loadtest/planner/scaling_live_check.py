"""The autoscaler's simulation against the live gateway: `python -m loadtest.planner.scaling_live_check`.

The bursty-autoscaling benchmark's tables (docs/PLANNING.md) come from the discrete-event simulator
(loadtest/planner/autoscaled.py), which runs the gateway's own scaler on simulated pools. This runs one
short bursty trace (loadtest/planner/bursty.py's shape, at a lower rate) twice on the same E+PD fleet, a
vision pool and a language pool of one engine each at the start, both autoscaled:

    predicted  `loadtest.planner.autoscaled.run_fleet`: the simulator's fleet, run by `Scaler`
    measured   the real gateway on 127.0.0.1 with `gateway.autoscaling` in manage mode, managed simulated
               engines at `launch.time_scale` s added and drained by the gateway itself, the trace
               replayed open-loop as streamed chat completions (loadtest/planner/live_check.py's replay);
               wall seconds / s are model seconds

and compares SLO attainment, GPU-seconds per pool, the scaler's steps, the pools' peak sizes and requests
lost. Every duration the live gateway is given is s times the simulator's (the scaler's interval, delays
and lookahead, the language pool's TTFT target, the inter-token target), since its engines take s seconds
for one of the model's. An added engine's start-up (launch to healthy) is measured live, and the
simulator is given that start-up, in model seconds: a simulated engine starts in about a second, where a
real one loads weights for tens of seconds; the check is of the scaler's behaviour, not of a start-up time.
The live side's GPU-seconds are counted from /admin/backends, polled every POLL_S of wall time: an engine
from the poll that first lists it (the trace's start for the fixed ones) to the one that no longer does,
or to the last completion, where the simulator's bill stops too. Answers are capped at 256 tokens on both
sides (what a simulated engine's natural completion reaches) and the model is LLaVA-1.5-7B (576 tokens an
image, whatever its size), so that every replayed request is the trace's.

Writes OUT/scaling_live_check.json (OUT: `--out`, results/planner by default; `--out docs/results` replaces
the run docs/PLANNING.md quotes).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from common.catalog import Catalog, ModelProfile, load_catalog
from gateway.config.autoscaling import AutoscalingConfig, Pool, VisionScaling
from loadtest.live_replay import START_DELAY_S
from loadtest.planner.autoscaled import POOLS, Fleet, FleetResult, run_fleet
from loadtest.planner.bursty import BurstyShape, bursty_trace
from loadtest.planner.evaluate import Outcome, outcome
from loadtest.planner.live_check import REQUEST_TIMEOUT_S, add_run_options, stream_trace
from loadtest.planner.space import Slo
from loadtest.sim.engines import Recorder
from loadtest.sim.workloads import Lengths, Trace
from testkit.harness import Gateway, run_gateway, write_config

MODEL = "llava-1.5-7b"
MAX_ANSWER_TOKENS = 256     # backends/sim_executor.py: a simulated engine's natural completion is 16..256 tokens
POLL_S = 0.25               # /admin/backends, wall seconds
MAX_WARNINGS = 50           # the gateway's warnings kept in the results
GPUS: dict[Pool, str] = {"vision": "L4", "language": "A100-80GB"}
FIXED_IDS: dict[Pool, str] = {"vision": "l4-vision-0", "language": "a100-80gb-0"}
SCALED_KEYS = ("interval_s", "up_delay_s", "down_delay_s", "lookahead_s")   # the scaler's durations


@dataclass
class Seen:
    """One backend as the polls of /admin/backends saw it, in model seconds after the trace's start."""

    pool: Pool
    first_s: float
    healthy_s: float | None = None
    gone_s: float | None = None


@dataclass
class LiveRun:
    outcome: Outcome
    errors: list[tuple[float, str]]  # (sent, error) of the requests that failed or ended without [DONE]
    wrong_token_counts: int          # completed requests whose streamed tokens are not the trace's
    seen: dict[str, Seen]
    steps: dict[str, int]            # from the gateway's autoscale_decision log lines: "vision+", "vision-", ...
    end_s: float                     # the last completion
    warnings: list[dict[str, Any]]   # the gateway's log lines of level warning or error
    timeline: list[tuple[float, int, int]] = field(repr=False)   # (t, vision engines, language engines) per poll

    def gpu_seconds(self) -> dict[Pool, float]:
        paid: dict[Pool, float] = {p: 0.0 for p in POOLS}
        for s in self.seen.values():
            stop = self.end_s if s.gone_s is None else min(s.gone_s, self.end_s)
            paid[s.pool] += max(stop - s.first_s, 0.0)
        return paid

    def startups_s(self) -> list[float]:
        """Launch to healthy of each engine the scaler added."""
        return [s.healthy_s - s.first_s for i, s in self.seen.items()
                if i not in FIXED_IDS.values() and s.healthy_s is not None]


def short_trace(shape: BurstyShape, model: ModelProfile, seed: int) -> Trace:
    """The bursty trace with every answer capped at MAX_ANSWER_TOKENS (module docstring)."""
    trace = bursty_trace(shape, model, seed).trace
    ln = trace.lengths
    capped = Lengths(ln.text_tokens, ln.image_tokens, ln.images, np.minimum(ln.output_tokens, MAX_ANSWER_TOKENS),
                     np.minimum(ln.max_output_tokens, MAX_ANSWER_TOKENS))
    return Trace(trace.arrival_s, capped)


def scaling_config(args: argparse.Namespace, scale: float) -> AutoscalingConfig:
    """Both pools between 1 and 1 + --spare engines of their GPU, every duration times `scale` (1: the
    simulator's model seconds)."""
    spare = args.spare
    pools = {
        "vision": {"min": 1, "max": 1 + spare, "gpus": [GPUS["vision"]] * spare,
                   "image_tokens_per_engine": args.image_tokens_per_engine},
        "language": {"min": 1, "max": 1 + spare, "gpus": [GPUS["language"]] * spare,
                     "queue_per_engine": args.queue_per_engine, "ttft_slo_s": args.ttft_slo * scale},
    }
    durations = {k: getattr(args, k) * scale for k in SCALED_KEYS}
    return AutoscalingConfig.model_validate({"mode": "manage", **durations, "pools": pools})


def backends_yaml(args: argparse.Namespace) -> dict[str, Any]:
    scale = args.time_scale
    scaling = scaling_config(args, scale).model_dump(mode="json", exclude_defaults=True)
    return {
        "model": MODEL,
        "gateway": {
            "routing": {"itl_target_ms": round(args.itl_slo * 1000 * scale, 3)},
            "overload": {"enabled": False},     # as the simulated fleets run (autoscaled.DEFAULT_POLICIES)
            "autoscaling": scaling,
        },
        "backends": [{"id": FIXED_IDS[p], "role": p, "gpu": GPUS[p], "launch": {"time_scale": scale}} for p in POOLS],
    }


async def _poll(gw: Gateway, origin: float, scale: float, seen: dict[str, Seen],
                timeline: list[tuple[float, int, int]], stop: asyncio.Event) -> None:
    """Record each backend's first listing, first healthy report and disappearance until `stop`."""
    async with httpx.AsyncClient(timeout=5.0) as client:
        while not stop.is_set():
            with contextlib.suppress(httpx.HTTPError):
                resp = await client.get(f"{gw.url}/admin/backends")
                now = (time.monotonic() - origin) / scale
                listed = {b["id"]: b for b in resp.json()["data"]}
                for backend_id, b in listed.items():
                    s = seen.setdefault(backend_id, Seen(b["role"], max(now, 0.0)))
                    if s.healthy_s is None and b.get("healthy"):
                        s.healthy_s = max(now, 0.0)
                for backend_id, s in seen.items():
                    if backend_id not in listed and s.gone_s is None:
                        s.gone_s = now
                counts = [sum(1 for b in listed.values() if b["role"] == p and not b.get("draining")) for p in POOLS]
                timeline.append((now, counts[0], counts[1]))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), POLL_S)


def _read_log(gw: Gateway) -> tuple[dict[str, int], list[dict[str, Any]]]:
    """The scaler's steps from its autoscale_decision lines ("vision+": steps up, ...), and the gateway's
    warnings and errors (the first MAX_WARNINGS)."""
    steps = {f"{p}{s}": 0 for p in POOLS for s in "+-"}
    warnings: list[dict[str, Any]] = []
    for line in gw.log_path.read_text(errors="replace").splitlines():
        with contextlib.suppress(ValueError):
            event = json.loads(line)
            if not isinstance(event, dict):
                continue
            if event.get("event") == "autoscale_decision":
                change = int(event["desired"]) - int(event["engines"])
                if change:
                    steps[f"{event['pool']}{'+' if change > 0 else '-'}"] += 1
            elif event.get("level") in ("warning", "error") and len(warnings) < MAX_WARNINGS:
                warnings.append(event)
    return steps, warnings


def measure_live(args: argparse.Namespace, trace: Trace, slo: Slo, workdir: Path) -> LiveRun:
    scale = args.time_scale
    config = write_config(workdir, backends_yaml(args))
    started, cpu = time.perf_counter(), time.process_time()
    seen: dict[str, Seen] = {}
    timeline: list[tuple[float, int, int]] = []
    deadline = float(trace.arrival_s[-1]) * scale + REQUEST_TIMEOUT_S

    async def run(gw: Gateway) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, list[str]]:
        origin = time.monotonic() + START_DELAY_S
        stop = asyncio.Event()
        poller = asyncio.create_task(_poll(gw, origin, scale, seen, timeline, stop))
        try:
            return await asyncio.wait_for(stream_trace(gw.url, trace, scale, args.seed, origin), deadline)
        finally:
            stop.set()
            await poller

    with run_gateway(config, "--log-level", "info", healthy=2) as gw:
        try:
            sent, first, finish, tokens, errors = asyncio.run(run(gw))
        except TimeoutError:
            raise RuntimeError(f"live replay still running after {deadline:.0f} s:\n{gw.log_tail()}") from None
        steps, warnings = _read_log(gw)
    for pool, backend_id in FIXED_IDS.items():   # the fixed engines are paid from the trace's start
        seen[backend_id] = replace(seen[backend_id], first_s=0.0) if backend_id in seen else Seen(pool, 0.0, 0.0)
    n = trace.n
    rec = Recorder(trace.lengths, np.full(n, -1, dtype=np.int64), np.full(n, np.nan), first, finish,
                   np.zeros(n, dtype=bool))
    done = ~np.isnan(finish)
    end = float(np.nanmax(finish)) if done.any() else float(trace.arrival_s[-1])
    measured = outcome(Trace(sent, trace.lengths), rec, slo, 0.0, started, cpu)
    failed = [(float(sent[i]), e) for i, e in enumerate(errors) if e]
    wrong = int((tokens[done] != trace.lengths.output_tokens[done]).sum())
    return LiveRun(measured, failed, wrong, seen, steps, end, warnings, timeline)


def predict(args: argparse.Namespace, trace: Trace, model: ModelProfile, catalog: Catalog, slo: Slo,
            startup_s: float) -> FleetResult:
    fleet = Fleet("autoscaled", dict(GPUS), {"vision": 1, "language": 1}, scaling_config(args, 1.0),
                  startup_s=startup_s)
    return run_fleet(fleet, trace, model, catalog, slo)


def compare(predicted: FleetResult, live: LiveRun, requests: int) -> dict[str, Any]:
    peak_live = {p: max((row[k + 1] for row in live.timeline), default=1) for k, p in enumerate(POOLS)}
    gpu_live = live.gpu_seconds()
    return {
        "attainment": {"predicted": predicted.outcome.attainment, "measured": live.outcome.attainment},
        "ttft_p95_s": {"predicted": predicted.outcome.ttft_p95_s, "measured": live.outcome.ttft_p95_s},
        "gpu_seconds": {p: {"predicted": predicted.gpu_seconds[p], "measured": gpu_live[p]} for p in POOLS},
        "steps": {"predicted": predicted.steps, "measured": live.steps},
        "peak_engines": {"predicted": predicted.peak_engines, "measured": peak_live},
        "lost": {"predicted": predicted.lost, "measured": requests - live.outcome.completed},
        "completed": {"predicted": predicted.outcome.completed, "measured": live.outcome.completed},
        "errors_live": live.errors, "wrong_token_counts_live": live.wrong_token_counts,
        "gateway_warnings_live": live.warnings,
        "end_s": {"predicted": predicted.end_s, "measured": live.end_s},
    }


def render(c: dict[str, Any], requests: int) -> str:
    def pair(d: dict[str, Any], fmt: str) -> str:
        return f"{format(d['predicted'], fmt)} / {format(d['measured'], fmt)}"

    rows = [("SLO attainment", pair(c["attainment"], ".1%")), ("TTFT p95 s", pair(c["ttft_p95_s"], ".2f"))]
    rows += [(f"GPU-s {p}", pair(c["gpu_seconds"][p], ",.0f")) for p in POOLS]
    rows += [(f"steps {p} up/down", f"{c['steps']['predicted'][p + '+']}/{c['steps']['predicted'][p + '-']} / "
              f"{c['steps']['measured'][p + '+']}/{c['steps']['measured'][p + '-']}") for p in POOLS]
    rows += [(f"peak engines {p}", f"{c['peak_engines']['predicted'][p]} / {c['peak_engines']['measured'][p]}")
             for p in POOLS]
    rows += [("completed", f"{c['completed']['predicted']} / {c['completed']['measured']} of {requests}"),
             ("lost", f"{c['lost']['predicted']} / {c['lost']['measured']}"),
             ("last completion s", pair(c["end_s"], ".0f"))]
    width = max(len(k) for k, _ in rows)
    return "\n".join([f"{'':{width}}   predicted / measured"] + [f"{k:{width}}   {v}" for k, v in rows])


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m loadtest.planner.scaling_live_check",
                                description=(__doc__ or "").splitlines()[0])
    p.add_argument("--duration", type=float, default=240.0, help="seconds of model time of arrivals")
    p.add_argument("--text-rps", type=float, default=2.0)
    p.add_argument("--image-rps", type=float, default=1.0, help="image requests/s between bursts")
    p.add_argument("--burst-every", type=float, default=80.0, help="mean seconds between image bursts")
    p.add_argument("--spare", type=int, default=3, help="GPUs of each pool's inventory beyond its fixed engine")
    defaults = AutoscalingConfig()   # the gateway's, in model seconds
    for key in SCALED_KEYS:
        p.add_argument("--" + key.removesuffix("_s").replace("_", "-"), dest=key, type=float,
                       default=getattr(defaults, key), help=f"the scaler's {key}, model seconds (default %(default)g)")
    p.add_argument("--queue-per-engine", type=float, default=128.0, help="as the bursty benchmark sets it")
    p.add_argument("--image-tokens-per-engine", type=int, default=VisionScaling(max=1).image_tokens_per_engine,
                   help="the vision pool's high mark (default: the gateway's, %(default)s)")
    add_run_options(p, "scaling_live_check.json", time_scale=2.0)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    catalog = load_catalog()
    model = catalog.model(MODEL)
    slo = Slo(args.ttft_slo, args.itl_slo)
    shape = replace(BurstyShape(), duration_s=args.duration, text_rps=args.text_rps, image_rps=args.image_rps,
                    burst_every_s=args.burst_every, burst_s=(20.0, 40.0), text_period_s=args.duration)
    trace = short_trace(shape, model, args.seed)
    print(f"{trace.n} requests over {args.duration:g} s of model time, {int((trace.lengths.images > 0).sum())} "
          f"with images; time scale {args.time_scale:g}: about {args.duration * args.time_scale / 60:.0f} min",
          flush=True)
    with tempfile.TemporaryDirectory(prefix="scaling-check-") as tmp:
        live = measure_live(args, trace, slo, Path(tmp))
    startups = live.startups_s()
    startup_s = statistics.median(startups) if startups else 0.0
    predicted = predict(args, trace, model, catalog, slo, startup_s)
    result = compare(predicted, live, trace.n)
    print(render(result, trace.n))
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "scaling_live_check.json"
    command = " ".join(["python -m loadtest.planner.scaling_live_check", *(sys.argv[1:] if argv is None else argv)])
    path.write_text(json.dumps({
        "command": command, "model": MODEL, "gpus": GPUS, "requests": trace.n, "shape": asdict(shape),
        "slo": {"ttft_s": slo.ttft_s, "itl_s": slo.itl_s}, "time_scale": args.time_scale,
        "startup_model_s": {"median": startup_s, "each": startups},
        "units": "model seconds (live wall times divided by time_scale)", **result,
        "timeline_live": live.timeline[:: max(1, round(5 / POLL_S))],
    }, indent=1, default=float) + "\n")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

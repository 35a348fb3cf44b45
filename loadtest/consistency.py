"""Live gateway versus simulator on the same cluster and the same trace: `python -m loadtest.consistency`.

The simulator's numbers (docs/BENCHMARKS.md) are only worth what its agreement with the real gateway
is worth. This check runs one seeded Poisson trace twice, with the `heteroserve` policy:

    live  the real gateway on 127.0.0.1 with its managed simulated engines (launch.time_scale = s),
          the trace replayed open-loop over streaming HTTP (loadtest/live_replay.py); wall seconds / s
          gives model seconds;
    sim   the discrete-event simulator (continuous mode) on the same cluster: the same router objects,
          performance model and batcher, in virtual time.

Making the runs the same: each live prompt is sized to the gateway's estimate (4 bytes per token);
each request id is chosen so that the simulated engine stops after exactly the trace's output tokens
(outputs are halved to fit the engines' 16..256-token range) while max_tokens keeps the trace's KV
reservation; and a warm-up completes one request of the prior's shape on every engine before the
replay, so that engines and simulator both start T̄_service from it. Engines report T̄_service in
model seconds (the batcher's busy clock), so the live router needs no correction for the time scale.

It prints both side by side with their relative differences, writes OUT/consistency.json and .csv
(OUT: `--out`, by default results/consistency under the current directory, which git ignores in a
checkout; the results docs/CONSISTENCY.md quotes are replaced only with `--out docs/results`), and
exits 1 when a request is lost, a token count differs, or a metric is outside `TOLERANCE`
(docs/CONSISTENCY.md gives the method, the measured table and why the two differ at all).
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import json
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from backends.sim_executor import NATURAL_MAX_TOKENS
from common import perf_model
from common.catalog import Catalog, GpuProfile, ModelProfile, load_catalog
from common.service_time import PRIOR_OUTPUT_TOKENS, PRIOR_PROMPT_TOKENS
from gateway.routing.policies import build_policy
from loadtest.live_replay import ReplayOutcome, ReplayRequest, replay, replay_client, request_id_for, warm_up
from loadtest.planner.options import at_least, positive
from loadtest.sim import capacity, workloads
from loadtest.sim.engines import BatchEngine, Engine, EngineSpec, GatewayState, Recorder
from loadtest.sim.simulator import simulate
from loadtest.sim.workloads import Lengths, Trace, make_trace
from testkit.harness import run_gateway, write_config

MODEL = "llava-1.5-7b"            # served text-only: no vision pool, so no work stealing either
CLUSTER = (("h100-0", "H100"), ("a100-0", "A100-80GB"), ("a100-1", "A100-80GB"), ("l40s-0", "L40S"),
           ("l40s-1", "L40S"))
WORKLOAD = "sharegpt"
POLICY = "heteroserve"
# ~10 ms of wall time per request on the live path (client, gateway, gRPC, step wake-ups) is 2 ms of
# model time at 5, against TTFTs of ~30 ms; at 2 it showed as +70% TTFT. The replay takes ~50 s.
DEFAULT_TIME_SCALE = 5.0
DEFAULT_LOADS = (0.7, 1.0)
DEFAULT_REQUESTS = 300
# Results go under the current directory unless asked: a run from a checkout must not rewrite tracked files.
DEFAULT_OUT = Path("results/consistency")
RECORDED_OUT = Path("docs/results")    # where the results docs/CONSISTENCY.md quotes are kept
REFERENCE_REQUESTS = 1500          # the saturated sample that fixes μ_i, as capacity.measured_batch_rate
REQUEST_TIMEOUT_S = 120.0          # wall seconds a single streamed request may take
WARM_UP_TIMEOUT_S = 60.0
# Largest |live - sim| / sim accepted per metric; docs/CONSISTENCY.md gives the measured spread and
# its sources (makespan = one long request's finish; the engines' T̄_service is not the simulator's).
TOLERANCE = {
    "throughput_tok_s": 0.15,
    "steady_tok_s": 0.10,
    "ttft_p50_ms": 0.50,
    "ttft_p95_ms": 0.50,
    "e2e_p50_s": 0.20,
    "e2e_p95_s": 0.20,
}
# Client-side signs that the machine, not the gateway, set the pace (wall milliseconds, p95).
BUSY_SEND_LAG_MS, BUSY_LOOP_LAG_MS = 20.0, 10.0


@dataclass(frozen=True)
class Observed:
    """One run's per-request outcomes in model seconds from the run's origin (NaN: never happened)."""

    arrival_s: np.ndarray
    first_token_s: np.ndarray
    finish_s: np.ndarray
    tokens: np.ndarray          # tokens the client received (live) or the engine emitted (sim)
    prompt_tokens: np.ndarray   # what the engine counted (live: the usage event)
    backend: np.ndarray         # backend id per request ("" when it never reached one)
    completed: np.ndarray       # bool: finished without error


def replayable(lengths: Lengths) -> Lengths:
    """The workload's lengths with output and max output halved (64..512 → 32..256).

    A simulated engine ends a completion at a length drawn from its request id, at most
    NATURAL_MAX_TOKENS (256); halving keeps the workload's uniform output shape within that range.
    """
    out, cap = -(-lengths.output_tokens // 2), -(-lengths.max_output_tokens // 2)
    if int(cap.max()) > NATURAL_MAX_TOKENS:
        raise ValueError(f"max output {int(cap.max())} tokens exceeds what a simulated engine can emit")
    return Lengths(lengths.text_tokens, lengths.image_tokens, lengths.images, out, cap)


def saturated_rate(model: ModelProfile, gpu: GpuProfile, lengths: Lengths) -> float:
    """μ_i for these lengths, measured like capacity.measured_batch_rate: completions per second of one
    simulated engine while its waiting queue is non-empty (that function only takes a workload name)."""
    rec = Recorder.for_lengths(lengths)
    engine = BatchEngine(EngineSpec("calibration", model, gpu, capacity.kv_capacity(model, gpu), 1.0), rec)
    nxt: float | None = None
    for i in range(len(lengths.output_tokens)):
        nxt = engine.submit(i, 0.0) or nxt
    while nxt is not None:
        _, nxt = engine.on_event(nxt)
    saturated_until = float(np.nanmax(rec.admitted))
    return float(np.count_nonzero(rec.finish <= saturated_until)) / saturated_until


def arrival_rate(load: float, catalog: Catalog) -> float:
    """load × Σ_i μ_i, the simulator's definition of load (capacity.py), for the replayable lengths."""
    ref = replayable(workloads.lengths(WORKLOAD, REFERENCE_REQUESTS, workloads.REFERENCE_SEED))
    model = catalog.model(MODEL)
    mu = {g: saturated_rate(model, catalog.gpu(g), ref) for g in {g for _, g in CLUSTER}}
    return load * sum(mu[g] for _, g in CLUSTER)


def replay_trace(rate: float, n: int, seed: int) -> Trace:
    """The seeded Poisson trace of the workload, with replayable lengths."""
    base = make_trace(WORKLOAD, "poisson", rate, n, seed)
    return Trace(base.arrival_s, replayable(base.lengths))


def cluster_config(time_scale: float) -> dict[str, Any]:
    """backends.yaml content: every backend a managed simulated language engine on this clock."""
    return {
        "model": MODEL,
        "gateway": {"routing": {"policy": POLICY}},
        "backends": [{"id": bid, "role": "language", "gpu": gpu, "launch": {"time_scale": time_scale}}
                     for bid, gpu in CLUSTER],
    }


def run_sim(trace: Trace, catalog: Catalog) -> Observed:
    """The simulator on the cluster; T̄_service starts from the gateway's prior (state_table), the
    model time of the very request the live warm-up completes on every engine."""
    model = catalog.model(MODEL)
    rec = Recorder.for_lengths(trace.lengths)
    engines: list[Engine] = []
    gateway = GatewayState(model)
    for bid, name in CLUSTER:
        gpu = catalog.gpu(name)
        prior = perf_model.service_seconds(model, gpu, PRIOR_PROMPT_TOKENS, PRIOR_OUTPUT_TOKENS)
        engines.append(BatchEngine(EngineSpec(bid, model, gpu, capacity.kv_capacity(model, gpu), prior), rec, gateway))
    simulate(trace, engines, build_policy(POLICY, {}), rec)
    done = ~np.isnan(rec.finish)
    ids = np.array([bid for bid, _ in CLUSTER] + [""])
    return Observed(trace.arrival_s.copy(), rec.first_token.copy(), rec.finish.copy(),
                    np.where(done, trace.lengths.output_tokens, 0), trace.lengths.input_tokens.copy(),
                    ids[rec.backend], done)     # backend -1 (never routed) picks the trailing ""


def replay_requests(trace: Trace, time_scale: float, seed: int) -> list[ReplayRequest]:
    """Request i at arrival × time_scale, its id chosen so the engine stops at its output length."""
    lengths = trace.lengths
    return [
        ReplayRequest(request_id_for(int(lengths.output_tokens[i]), f"c{seed}-{i}"),
                      float(trace.arrival_s[i]) * time_scale, int(lengths.input_tokens[i]),
                      int(lengths.max_output_tokens[i]))
        for i in range(trace.n)
    ]


def run_live(trace: Trace, time_scale: float, seed: int, workdir: Path) -> tuple[Observed, dict[str, float]]:
    """Start the gateway and its engines, replay the trace, stop them; returns outcomes and diagnostics."""
    requests = replay_requests(trace, time_scale, seed)
    config = write_config(workdir, cluster_config(time_scale))
    deadline_s = float(trace.arrival_s[-1]) * time_scale + REQUEST_TIMEOUT_S + WARM_UP_TIMEOUT_S
    started = time.monotonic()
    with run_gateway(config) as gw:
        try:
            outcomes, lags = asyncio.run(asyncio.wait_for(_warm_and_replay(gw.url, requests), deadline_s))
        except TimeoutError:
            raise RuntimeError(f"live replay still running after {deadline_s:.0f} s:\n{gw.log_tail()}") from None
    errors = [o.error for o in outcomes if o.error]
    if len(errors) == len(outcomes):
        raise RuntimeError(f"no live request completed; the first said: {errors[0]}")
    lag_ms = [(o.sent_s - r.at_s) * 1000 for o, r in zip(outcomes, requests, strict=True)]
    diagnostics = {"wall_s": time.monotonic() - started, "send_lag_p95_ms": float(np.percentile(lag_ms, 95)),
                   "send_lag_max_ms": float(np.max(lag_ms)),
                   "loop_lag_p50_ms": float(np.percentile(lags, 50)) * 1000,
                   "loop_lag_p95_ms": float(np.percentile(lags, 95)) * 1000,
                   "errors": len(errors)}
    return _observed(outcomes, time_scale), diagnostics


async def _warm_and_replay(url: str, requests: list[ReplayRequest]) -> tuple[list[ReplayOutcome], list[float]]:
    async with replay_client(url, len(requests), REQUEST_TIMEOUT_S) as client:
        await warm_up(client, MODEL, len(CLUSTER), PRIOR_PROMPT_TOKENS, PRIOR_OUTPUT_TOKENS, WARM_UP_TIMEOUT_S)
        return await replay(client, MODEL, requests)


def _observed(outcomes: list[ReplayOutcome], time_scale: float) -> Observed:
    def col(name: str) -> np.ndarray:
        return np.array([getattr(o, name) for o in outcomes], dtype=float) / time_scale

    ok = np.array([not o.error for o in outcomes])
    return Observed(col("sent_s"), col("first_token_s"), np.where(ok, col("finish_s"), np.nan),
                    np.array([o.tokens for o in outcomes]), np.array([o.prompt_tokens for o in outcomes]),
                    np.array([o.backend for o in outcomes]), ok)


def measure(obs: Observed, gpu_of: dict[str, str]) -> dict[str, float]:
    """The simulator's metric definitions (loadtest/sim/metrics.py) over completed requests."""
    done = obs.completed
    tokens = float(obs.tokens[done].sum())
    ttft_ms = (obs.first_token_s[done] - obs.arrival_s[done]) * 1000
    e2e = obs.finish_s[done] - obs.arrival_s[done]
    makespan = float(np.max(obs.finish_s[done]) - np.min(obs.arrival_s))
    out = {
        "completed": float(done.sum()),
        "output_tokens": tokens,
        "makespan_s": makespan,
        "throughput_tok_s": tokens / makespan,
        "steady_tok_s": _steady_tok_s(obs),
        "ttft_p50_ms": float(np.percentile(ttft_ms, 50)),
        "ttft_p95_ms": float(np.percentile(ttft_ms, 95)),
        "e2e_p50_s": float(np.percentile(e2e, 50)),
        "e2e_p95_s": float(np.percentile(e2e, 95)),
    }
    gpus = np.array([gpu_of.get(b, "") for b in obs.backend])
    for name in sorted(set(gpu_of.values())):
        out[f"share_{name}"] = float(np.mean(gpus == name))
    return out


def _steady_tok_s(obs: Observed) -> float:
    """Tokens emitted while requests were still arriving / that window (metrics.py's steady_tok_s): a
    request's tokens are taken as spread evenly from its first to its last; no drain, so no tail."""
    done = obs.completed
    start, end = float(np.min(obs.arrival_s)), float(np.max(obs.arrival_s))
    first, last, out = obs.first_token_s[done], obs.finish_s[done], obs.tokens[done]
    frac = np.clip((end - first) / np.maximum(last - first, 1e-12), 0.0, 1.0)
    emitted = np.where(first <= end, 1 + (out - 1) * frac, 0.0)
    return float(emitted.sum()) / max(end - start, 1e-12)


def conservation_errors(trace: Trace, live: Observed, sim: Observed) -> list[str]:
    """Every request completes in both runs, with exactly the trace's prompt and output tokens."""
    errors = []
    for name, obs in (("live", live), ("sim", sim)):
        if not obs.completed.all():
            errors.append(f"{name}: {int((~obs.completed).sum())} of {trace.n} requests did not complete")
        for what, got, want in (("output", obs.tokens, trace.lengths.output_tokens),
                                ("prompt", obs.prompt_tokens, trace.lengths.input_tokens)):
            wrong = np.flatnonzero(got != want)
            if len(wrong):
                i = int(wrong[0])
                errors.append(f"{name}: {len(wrong)} requests with a wrong {what} token count (request {i}: "
                              f"{int(got[i])}, the trace says {int(want[i])})")
    return errors


def compare(live: dict[str, float], sim: dict[str, float]) -> list[dict[str, Any]]:
    """One row per metric: both values, (live - sim) / sim, the tolerance and whether it holds."""
    rows = []
    for metric, sim_value in sim.items():
        diff = (live[metric] - sim_value) / sim_value if sim_value else float("nan")
        bound = TOLERANCE.get(metric)
        rows.append({"metric": metric, "live": live[metric], "sim": sim_value, "rel_diff": diff,
                     "tolerance": bound, "within": None if bound is None else bool(abs(diff) <= bound)})
    return rows


def check(load: float, n: int, seed: int, time_scale: float, catalog: Catalog) -> dict[str, Any]:
    """Both runs at one load; returns the comparison with its verdict."""
    rate = arrival_rate(load, catalog)
    trace = replay_trace(rate, n, seed)
    sim = run_sim(trace, catalog)
    with tempfile.TemporaryDirectory(prefix="consistency-") as tmp:
        live, diagnostics = run_live(trace, time_scale, seed, Path(tmp))
    gpu_of = dict(CLUSTER)
    rows = compare(measure(live, gpu_of), measure(sim, gpu_of))
    errors = conservation_errors(trace, live, sim)
    ok = not errors and all(r["within"] is not False for r in rows)
    return {"load": load, "rate_rps": rate, "n_requests": n, "rows": rows, "conservation_errors": errors,
            "live_diagnostics": diagnostics, "pass": ok}


def render(result: dict[str, Any], time_scale: float) -> str:
    """A plain-text side-by-side table of one load point."""
    d = result["live_diagnostics"]
    head = (f"load {result['load']:.2f}× (λ = {result['rate_rps']:.1f} req/s of model time, "
            f"{result['n_requests']} requests, time_scale {time_scale:g})\n"
            f"live run: {d['wall_s']:.0f} s wall, client loop oversleep p50 {d['loop_lag_p50_ms']:.1f} ms / "
            f"p95 {d['loop_lag_p95_ms']:.1f} ms, send lag p95 {d['send_lag_p95_ms']:.1f} ms")
    lines = [head, f"{'metric':<20}{'live':>12}{'sim':>12}{'diff':>9}{'tolerance':>11}  verdict"]
    for r in result["rows"]:
        bound = "" if r["tolerance"] is None else f"±{r['tolerance']:.0%}"
        verdict = "" if r["within"] is None else ("ok" if r["within"] else "OUTSIDE")
        lines.append(f"{r['metric']:<20}{r['live']:>12.4g}{r['sim']:>12.4g}{r['rel_diff']:>+9.1%}{bound:>11}  "
                     f"{verdict}")
    lines += [f"CONSERVATION: {e}" for e in result["conservation_errors"]]
    if d["send_lag_p95_ms"] > BUSY_SEND_LAG_MS or d["loop_lag_p95_ms"] > BUSY_LOOP_LAG_MS:
        lines.append("WARNING: the client could not keep its own clock; other load on this machine distorts the "
                     "live numbers")
    return "\n".join(lines)


def write_results(out: Path, results: list[dict[str, Any]], meta: dict[str, Any]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    payload = {**meta, "tolerance": TOLERANCE, "runs": results, "pass": all(r["pass"] for r in results)}
    (out / "consistency.json").write_text(json.dumps(payload, indent=2) + "\n")
    with (out / "consistency.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["load", "metric", "live", "sim", "rel_diff", "tolerance", "within"])
        writer.writeheader()
        for r in results:
            writer.writerows({"load": r["load"], **row} for row in r["rows"])


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m loadtest.consistency", description=__doc__.splitlines()[0])
    p.add_argument("--loads", type=positive, nargs="+", default=list(DEFAULT_LOADS), help="× Σ_i μ_i")
    p.add_argument("--requests", type=at_least(2), default=DEFAULT_REQUESTS)
    p.add_argument("--seed", type=at_least(0), default=0)
    p.add_argument("--time-scale", type=positive, default=DEFAULT_TIME_SCALE, help="launch.time_scale of every engine")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT,
                   help=f"where consistency.json/.csv go (default: {DEFAULT_OUT}/ under the current directory; "
                        f"`--out {RECORDED_OUT}` replaces the results docs/CONSISTENCY.md quotes)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    catalog = load_catalog()
    results = []
    for load in args.loads:
        results.append(check(load, args.requests, args.seed, args.time_scale, catalog))
        print(render(results[-1], args.time_scale), end="\n\n", flush=True)
    meta = {"command": " ".join(["python -m loadtest.consistency", *(argv if argv is not None else sys.argv[1:])]),
            "units": "model seconds (live wall times divided by time_scale)",
            "model": MODEL, "cluster": [{"id": b, "gpu": g} for b, g in CLUSTER], "workload": WORKLOAD,
            "outputs": "halved (32..256 tokens)", "arrivals": "poisson", "policy": POLICY, "mode": "continuous",
            "seed": args.seed, "time_scale": args.time_scale}
    write_results(args.out, results, meta)
    print(f"wrote {args.out / 'consistency.json'} and {args.out / 'consistency.csv'}")
    passed = all(r["pass"] for r in results)
    print("PASS: live and simulator agree within tolerance" if passed else "FAIL: see OUTSIDE and CONSERVATION above")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())

"""Regenerate every simulated benchmark: `python -m loadtest.sim.report [--quick] [--out DIR]`.

Runs all experiments (loadtest/sim/experiments.py) on a process pool, then writes
DIR/BENCHMARKS.md, DIR/results/runs.csv (one row per run), DIR/results/summary.json (mean ± std
per cell) and DIR/results/*.png. `--quick` shrinks seeds and trace lengths for a smoke run.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from common.catalog import load_catalog
from loadtest.sim import capacity, plots, sections_extra, sections_routing
from loadtest.sim.experiments import NON_LABEL_KEYS, Settings, aggregate, all_cells, run_all
from loadtest.sim.summary import Summary

QUICK = Settings(seeds=2, n_serial=1500, n_continuous=1500, n_vlm=800)
METRICS = tuple(sorted(NON_LABEL_KEYS))


def _write_csv(path: Path, rows: list[dict[str, Any]]) -> None:
    fields: list[str] = []
    for r in rows:
        fields += [k for k in r if k not in fields]
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        writer.writerows(rows)


def _setup(settings: Settings, wall_s: float, runs: int, cpu_s: float) -> str:
    return f"""# Simulated benchmarks

Regenerate with `python -m loadtest.sim.report --out docs` from the repository root (matplotlib: `pip install -e
'.[sim]'`; without `--out` the report goes to results/sim/, `--quick` a smoke run into a temporary folder).
This run: {runs} distinct simulations, {settings.seeds} seeds per cell, {settings.workers} worker processes,
**{wall_s / 60:.1f} min** of wall time ({cpu_s / 60:.1f} CPU-minutes of simulation)
on this machine ({platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}).
Every number below is mean ± std over the seeds; seeds are paired (every policy replays the same traces).
Raw runs: `results/runs.csv` (beside this file); aggregates: `results/summary.json`.

## How the simulator works and what it assumes

- **Same router, same model.** Each arrival asks the policy object from `gateway.routing.policies.build_policy` to
  choose among `BackendSnapshot`s built from the simulated GPUs (queue_depth = max(in-flight, waiting + running),
  T̄_service = EWMA (α = 0.1) of completed service times with the performance model's estimate as prior,
  prefill_s_per_token from `common.perf_model`, free KV from the engine). Signals are exact and fresh:
  no heartbeat lag.
- **Engines.** `serial` is the paper's simulator: one request at a time, prefill 2·P·L/F, then 2·P/B per output
  token. `continuous` is the shared `backends.batcher.ContinuousBatcher`; virtual time advances by each
  `step()`'s duration.
- **Llama-2-70B KV budget (stated assumption).** Its fp16 weights (138 GB) fit on no single GPU here; like the
  paper we charge no weights to a GPU's HBM, and we give the KV cache {capacity.KV_SHARE_OVERSIZE:.0%} of HBM
  (40 GB on H100/A100, 24 GB on L40S). Decode steps still stream the full 138 GB of weights (2·P/B per token,
  the paper's formula), so each "GPU" is the paper's logical serving unit. LLaVA-1.5-7B fits and uses the
  engine's default (90% of HBM minus weights).
- **Load.** 1.0× = Σ_i μ_i, the sum of per-GPU saturated service rates for the workload (serial: 1/E[S_i] from
  the formulas; continuous: measured on one saturated simulated batcher). Round robin is past its bottleneck
  (N · min μ_i) from 0.5× on, as the paper's flat Uniform curve implies.
- **Workloads.** Outputs U[64, 512] (max_tokens 512) as in the paper; prompts: Uniform U[128, 4096],
  Short-Heavy 80% < 512, Long-Heavy 80% ≥ 2048, Bimodal 50/50, ShareGPT-like log-normal (median 350, mean ≈ 600,
  ≤ 3584). Multimodal: COCO-like (one 576-token image, 8–48 text tokens, outputs U[64, 128]) and a mixed one
  (50% image requests, images per request P(K ≥ k) = k^-1.5 up to 6). Poisson arrivals, or on/off MMPP.
- **Metrics.** tok/s = generated tokens / (first arrival → last completion), the paper's definition; on a finite
  trace it includes the drain after the last arrival, so "steady tok/s" (tokens emitted while requests still
  arrive / that window) is shown beside it. Requests per run: {settings.n_serial} (serial),
  {settings.n_continuous} per 8 GPUs (continuous), {settings.n_vlm} (modality).
"""


def _weaker(s: Summary) -> str:
    def thr(mode: str, policy: str) -> float:
        return s.value("table2", "throughput_tok_s", mode=mode, policy=policy)

    ratio = thr("serial", "heteroserve") / thr("serial", "round_robin")
    margin = (thr("continuous", "batch_aware") / thr("continuous", "heteroserve") - 1) * 100
    optimism = s.value("table2", "oracle_realized_over_predicted", mode="continuous", policy="oracle")
    return f"""## What is weaker than asked, and open points

- The paper's 2.8× is not reached: serial HeteroServe / round robin ({ratio:.2f}×, {(ratio / 2.8 - 1) * 100:+.0f}%)
  lands at the ceiling the paper's own formulas allow; its absolute tok/s exceed its decode formula's limit.
  The other paper-vs-simulation gaps (workload spread, 2-tier +64%, the −45% "no length term" ablation, the
  0.5× ratio, the Shortest-Queue latency lead) are explained next to each table, not closed.
- The Oracle is the greedy per-arrival form of the paper's (mean-latency, future-aware) Oracle: it knows true
  output lengths and each GPU's exact pending work, not future arrivals. Its predictions are exact with serial
  engines; under continuous batching they replay the batcher without later arrivals, and realized latency was
  {optimism:.2f}× the prediction on average (Table 2), so it is a clairvoyant of the present, not an optimum.
  It is not in the load sweep, the bursty runs or the other figures (a continuous-batching oracle run costs
  several plain runs).
- This report covers the simulator only; the live gateway under a Locust load is not part of it.
- `batch_aware`'s throughput margin over heteroserve at 1.0× is small ({margin:+.1f}%) and sensitive to the trace
  length: an earlier configuration with 8,000 requests per run gave +1.3% with 3 of 5 paired seeds won (the other
  two within 0.1%). Treat the 1.0× throughput win as marginal; its clear wins are P95 TTFT (vs every policy),
  steady-state throughput on every seed, and throughput at ≥ 1.25× load. It reads only existing `BackendSnapshot`
  fields; a `waiting` count (engine waiting vs running, which the state table already receives from heartbeats)
  would replace its R̄_i estimate of the queue behind a blocked FIFO head.
- Signals are exact and instantaneous; the live gateway sees heartbeat-delayed engine counts (its in-flight count
  is immediate). A heartbeat-lag knob would bring the simulator closer to the gateway.
- Continuous batching is the shared batcher: whole-prompt prefill per step (no chunked prefill), KV reserved for
  prompt + max tokens at admission, no preemption; engine overheads are absent, so absolute tok/s are roofline
  peaks. Work stealing is simulated as the gateway implements it (route-time candidates, at most
  `stealing.max_batch` language requests held per stealer), not as the paper's pull-based half-batch episodes.
- `loadtest` is in pyproject's `packages.find` (`gateway plan` runs the simulator), so an installed package
  runs the report (`python -m loadtest.sim.report`) from any folder; the tests run from the repository root.
"""


def build_markdown(summary: Summary, rows: list[dict[str, Any]], settings: Settings, wall_s: float) -> str:
    catalog = load_catalog()
    unique = {r["run_id"]: r["cpu_s"] for r in rows}
    sections = [
        _setup(settings, wall_s, len(unique), sum(unique.values())),
        sections_routing.table2(summary, catalog),
        sections_routing.table3(summary, catalog),
        sections_routing.load_sweep(summary),
        sections_routing.heterogeneity(summary, catalog),
        sections_routing.workloads(summary),
        sections_routing.scaling(summary),
        sections_routing.ablation(summary),
        sections_extra.improved_policy(summary, rows),
        sections_extra.modality(summary),
        _weaker(summary),
    ]
    return "\n".join(sections)


def worker_count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {text}")
    return value


def _writable_folder(out: Path) -> str | None:
    """Why the report cannot go to `out` (None: it can, and out/results now exists): checked before the
    simulations, which take minutes, rather than after them."""
    try:
        (out / "results").mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        return f"cannot make {exc.filename or out}: {exc.strerror or exc}"
    return None if os.access(out / "results", os.W_OK) else f"{out / 'results'} is not writable"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2 seeds, short traces: a smoke run")
    parser.add_argument("--out", type=Path, help="where BENCHMARKS.md and results/ go (default: results/sim under "
                        "the current directory, or a temporary folder with --quick; `--out docs`: the tracked report)")
    parser.add_argument("--workers", type=worker_count, default=os.cpu_count() or 1, help="simulation processes")
    args = parser.parse_args(argv)
    quick_out = Path(tempfile.gettempdir()) / "heterogate-sim-quick"
    out: Path = args.out or (quick_out if args.quick else Path("results/sim"))
    problem = plots.missing() or _writable_folder(out)
    if problem:
        print(f"report: {problem}", file=sys.stderr)
        return 2
    try:
        return _report(out, args.quick, args.workers)
    except KeyboardInterrupt:
        print("report: interrupted; the simulations are stopped", file=sys.stderr)
        return 130


def _report(out: Path, quick: bool, workers: int) -> int:
    started = time.perf_counter()
    base = QUICK if quick else Settings()
    settings = Settings(base.seeds, base.n_serial, base.n_continuous, base.n_vlm, workers)
    cells = all_cells(settings)

    def progress(done: int, total: int) -> None:
        if done % 50 == 0 or done == total:
            print(f"  {done}/{total} runs, {time.perf_counter() - started:.0f} s", file=sys.stderr, flush=True)

    rows = run_all(cells, settings.workers, progress)
    summary = Summary(aggregate(rows, METRICS))
    results = out / "results"
    _write_csv(results / "runs.csv", rows)
    (results / "summary.json").write_text(json.dumps(summary.rows, indent=1))
    for figure in plots.FIGURES:
        figure(summary, results)
    wall_s = time.perf_counter() - started
    (out / "BENCHMARKS.md").write_text(build_markdown(summary, rows, settings, wall_s))
    print(f"wrote {out / 'BENCHMARKS.md'} and {results}/ in {wall_s:.0f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

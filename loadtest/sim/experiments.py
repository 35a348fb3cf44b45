"""Every experiment as a grid of cells, run once each on a process pool, then aggregated.

A cell is (experiment, labels, spec). Specs are hashable, so a run shared by several experiments
(e.g. the Table 2 cell is also the 1.0× point of the load sweep) is simulated once. Seeds are paired
across policies: cell (…, seed s) of every policy replays the same trace.
"""

from __future__ import annotations

import os
import signal
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from multiprocessing import get_context
from typing import Any

import numpy as np

from common.catalog import load_catalog
from loadtest.ctrl_c import ctrl_c_in_this_process_only
from loadtest.sim import capacity, oracle
from loadtest.sim.modality import DEPLOYMENTS, VlmRunSpec, a100_rate, run_vlm
from loadtest.sim.simulator import MODES, RunSpec, run

THREE_TIER = ("H100",) * 2 + ("A100-80GB",) * 3 + ("L40S",) * 3
CLUSTERS = {
    "homogeneous 8×A100": ("A100-80GB",) * 8,
    "2-tier 4×H100+4×A100": ("H100",) * 4 + ("A100-80GB",) * 4,
    "3-tier 2×H100+3×A100+3×L40S": THREE_TIER,
}
POLICIES = ("round_robin", "capacity_proportional", "shortest_queue", "power_of_two", "heteroserve", "batch_aware")
TABLE2_POLICIES = (*POLICIES, oracle.NAME)     # + the simulator-only clairvoyant baseline
MODELS = ("llama-2-7b", "llama-2-70b")         # Table 3: model size
TABLE3_POLICIES = ("round_robin", "shortest_queue", "heteroserve", "batch_aware", oracle.NAME)
CORE_POLICIES = ("round_robin", "shortest_queue", "heteroserve", "batch_aware")   # the wider sweeps
LOAD_POLICIES = tuple(p for p in POLICIES if p != "power_of_two")   # the paper's Fig. 4-5 baselines + ours
LOADS = (0.5, 0.75, 1.0, 1.25, 1.5, 2.0)
WORKLOADS = ("uniform", "short_heavy", "long_heavy", "bimodal", "sharegpt")
SIZES = (4, 8, 16, 32)
W2_SWEEP = (0.1, 0.3, 1.0, 3.0, 10.0)
HETEROSERVE_ABLATION = {"full": (), "w2=0 (no queue)": (("w2", 0.0),), "w3=0 (no OOM veto)": (("w3", 0.0),),
                        "w1=0 (no length term)": (("w1", 0.0),)}
BATCH_AWARE_ABLATION = {
    "full": (),
    "w_wait=0 (no admission wait)": (("w_wait", 0.0),),
    "w_step=0 (no bandwidth/step term)": (("w_step", 0.0),),
    "w_prefill=0 (no length term)": (("w_prefill", 0.0),),
    "w_decode=1 (E2E estimate)": (("w_decode", 1.0),),
    "max_batch=1 (serial queue model)": (("max_batch", 1),),
    "size_ewma=1 (R̄ = last request)": (("size_ewma", 1.0),),
}
VLM_POLICIES = ("heteroserve", "batch_aware")      # language pool; the vision pool uses encode_cost
VLM_LOADS = {"saturated (1.3× 4×A100)": 1.3 * 4, "moderate (0.6× 2×A100)": 0.6 * 2}   # × one A100's rate

Spec = RunSpec | VlmRunSpec


@dataclass(frozen=True)
class Settings:
    seeds: int = 5
    n_serial: int = 6000
    n_continuous: int = 7000     # per 8 GPUs; scaling runs keep requests per GPU
    n_vlm: int = 5000
    workers: int = os.cpu_count() or 1


@dataclass(frozen=True)
class Cell:
    experiment: str
    labels: tuple[tuple[str, Any], ...]
    spec: Spec


def scaled_cluster(n: int) -> tuple[str, ...]:
    """The three-tier mix at n GPUs (2:3:3 from 8 up; 1 H100 + 2 A100 + 1 L40S at 4)."""
    if n == 4:
        return ("H100", "A100-80GB", "A100-80GB", "L40S")
    k = n // 8
    return ("H100",) * (2 * k) + ("A100-80GB",) * (3 * k) + ("L40S",) * (3 * k)


def policy_params(policy: str, mode: str) -> tuple[tuple[str, Any], ...]:
    """batch_aware is told the engines' batch cap, as the gateway's config would: 1 for serial GPUs."""
    return (("max_batch", 1),) if policy == "batch_aware" and mode == "serial" else ()


def _text_cells(s: Settings, mode: str) -> Iterator[Cell]:
    n = s.n_serial if mode == "serial" else s.n_continuous

    def cell(experiment: str, policy: str, seed: int, labels: dict[str, Any], params: Any = None, **kw: Any) -> Cell:
        kw.setdefault("gpus", THREE_TIER)
        kw.setdefault("n_requests", n)
        params = policy_params(policy, mode) if params is None else params
        spec = RunSpec(policy=policy, params=params, mode=mode, seed=seed, **kw)
        return Cell(experiment, (("mode", mode), *labels.items()), spec)

    for seed in range(s.seeds):
        for p in TABLE2_POLICIES:
            yield cell("table2", p, seed, {"policy": p})
        for p in POLICIES:
            yield cell("bursty", p, seed, {"policy": p}, arrivals="bursty")
        for p in TABLE3_POLICIES:
            for model in MODELS:
                yield cell("model_size", p, seed, {"policy": p, "model": model}, model=model)
        for p in LOAD_POLICIES:
            for load in LOADS:
                yield cell("load", p, seed, {"policy": p, "load": load}, load=load)
        for p in CORE_POLICIES:
            for name, gpus in CLUSTERS.items():
                yield cell("heterogeneity", p, seed, {"policy": p, "cluster": name}, gpus=gpus)
            for w in WORKLOADS:
                yield cell("workloads", p, seed, {"policy": p, "workload": w}, workload=w)
            for size in SIZES:
                yield cell("scaling", p, seed, {"policy": p, "gpus": size}, gpus=scaled_cluster(size),
                           n_requests=n * size // 8)
        for name, params in HETEROSERVE_ABLATION.items():
            yield cell("ablation_heteroserve", "heteroserve", seed, {"variant": name}, params)
        for w2 in W2_SWEEP:
            yield cell("w2_sweep", "heteroserve", seed, {"w2": w2}, (("w2", w2),) if w2 != 1.0 else ())


def _policy_cells(s: Settings) -> Iterator[Cell]:
    """The improved policy's ablation, under continuous batching (what it is built for)."""
    for seed in range(s.seeds):
        for name, params in BATCH_AWARE_ABLATION.items():
            for load in (1.0, 1.25):
                spec = RunSpec(THREE_TIER, "batch_aware", params, mode="continuous", n_requests=s.n_continuous,
                               seed=seed, load=load)
                yield Cell("ablation_batch_aware", (("variant", name), ("load", load)), spec)


def _vlm_cells(s: Settings, unit_rate: float) -> Iterator[Cell]:
    """Each deployment × language policy × (COCO saturated and moderate, mixed saturated)."""
    saturated = next(iter(VLM_LOADS))
    grid = [(name, "coco", f) for name, f in VLM_LOADS.items()] + [(saturated, "mm_mixed", VLM_LOADS[saturated])]
    for seed in range(s.seeds):
        for deployment in DEPLOYMENTS:
            for policy in VLM_POLICIES:
                for load_name, workload, factor in grid:
                    spec = VlmRunSpec(deployment, factor * unit_rate, n_requests=s.n_vlm, seed=seed,
                                      workload=workload, policy=policy)
                    labels = (("deployment", deployment), ("policy", policy), ("load", load_name),
                              ("workload", workload))
                    yield Cell("modality", labels, spec)


def all_cells(s: Settings) -> list[Cell]:
    cells = [c for mode in MODES for c in _text_cells(s, mode)]
    cells += list(_policy_cells(s))
    cells += list(_vlm_cells(s, a100_rate(load_catalog())))
    return cells


def _run_one(job: tuple[Spec, float]) -> tuple[Spec, dict[str, Any]]:
    spec, rate = job
    return spec, (run_vlm(spec) if isinstance(spec, VlmRunSpec) else run(spec, rate=rate))


def _measure(key: tuple[str, str, str]) -> tuple[tuple[str, str, str], float]:
    catalog = load_catalog()
    model, gpu, workload = key
    return key, capacity.measured_batch_rate(catalog.model(model), catalog.gpu(gpu), workload)


def _rates(specs: list[Spec], pool: Any) -> dict[Spec, float]:
    """Arrival rate of every text run, measuring each continuous-batching μ_i once, in parallel."""
    catalog = load_catalog()
    text = [s for s in specs if isinstance(s, RunSpec)]
    keys = sorted({(s.model, g, s.workload) for s in text if s.mode == "continuous" for g in s.gpus})
    measured: dict[tuple[str, str, str], float] = dict(pool.map(_measure, keys))

    def mu(s: RunSpec, gpu: str) -> float:
        if s.mode == "continuous":
            return measured[(s.model, gpu, s.workload)]
        return capacity.service_rate(catalog.model(s.model), catalog.gpu(gpu), "serial", s.workload)

    return {s: s.load * sum(mu(s, g) for g in s.gpus) for s in text}


def _cost(spec: Spec) -> float:
    """Rough relative run time, to start the longest runs first and keep both cores busy to the end
    (the oracle replays each continuous-batching GPU per arrival: several times a plain run)."""
    if isinstance(spec, VlmRunSpec):
        return spec.n_requests * 0.3
    if spec.mode == "serial":
        return spec.n_requests * 0.15
    return spec.n_requests * (6.0 if spec.policy == oracle.NAME else 1.0)


def _ignore_interrupts() -> None:
    """Ctrl-C at a terminal reaches the whole process group: the parent stops the workers, which would
    otherwise each print a traceback of their own."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def run_all(
    cells: list[Cell], workers: int, progress: Callable[[int, int], None] | None = None
) -> list[dict[str, Any]]:
    """Run every distinct spec once; returns one row per cell (labels, seed, run_id, metrics)."""
    unique = sorted({c.spec for c in cells}, key=_cost, reverse=True)
    results: dict[Spec, dict[str, Any]] = {}
    with ctrl_c_in_this_process_only(), get_context("fork").Pool(workers, initializer=_ignore_interrupts) as pool:
        # leaving the pool terminates its workers
        rates = _rates(unique, pool)
        jobs = [(s, rates.get(s, 0.0)) for s in unique]
        for k, (spec, out) in enumerate(pool.imap_unordered(_run_one, jobs), 1):
            results[spec] = out
            if progress:
                progress(k, len(unique))
    run_id = {spec: k for k, spec in enumerate(unique)}
    return [
        {"experiment": c.experiment, **dict(c.labels), "seed": c.spec.seed, "run_id": run_id[c.spec], **results[c.spec]}
        for c in cells
    ]


def aggregate(rows: list[dict[str, Any]], metrics: tuple[str, ...]) -> list[dict[str, Any]]:
    """Mean and std over seeds of each (experiment, labels) group, in first-seen order: `metrics`, plus the
    share of requests routed to each GPU type (share_<GPU>), whose names depend on the cluster."""
    groups: dict[tuple[tuple[str, Any], ...], list[dict[str, Any]]] = defaultdict(list)
    for r in rows:
        groups[tuple((k, v) for k, v in r.items() if _is_label(k))].append(r)
    out = []
    for key, members in groups.items():
        agg: dict[str, Any] = dict(key)
        agg["seeds"] = len(members)
        shares = sorted({k for r in members for k in r if k.startswith("share_")})
        for m in (*metrics, *shares):
            values = np.array([r[m] for r in members if m in r], dtype=float)
            if len(values):
                agg[m], agg[f"{m}_std"] = float(values.mean()), float(values.std())
        out.append(agg)
    return out


def _is_label(key: str) -> bool:
    return key not in NON_LABEL_KEYS and key not in ("seed", "run_id") and not key.startswith("share_")


NON_LABEL_KEYS = frozenset({
    "n", "completed", "rejected", "throughput_tok_s", "steady_tok_s", "ttft_p50_s", "ttft_p95_s", "e2e_mean_s",
    "e2e_p50_s", "e2e_p99_s", "queue_mean_s", "makespan_s", "cost_per_hour", "tok_s_per_dollar_hour", "events",
    "wall_s", "hardware_usd", "cer_tok_s_per_k_usd", "embedding_mb_per_request", "stage_kv_mb_per_request",
    "stolen_share", "vision_busy_share", "rate_rps", "cpu_s", "oracle_realized_over_predicted",
})

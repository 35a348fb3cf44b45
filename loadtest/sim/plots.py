"""The report's figures (matplotlib, PNG); one function per figure, both engine modes side by side.

matplotlib is the `sim` extra, imported on first use: the report's command line (`--help`, its argument
errors) works without it, and the report checks `missing()` before it runs anything.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

import numpy as np

from loadtest.sim.experiments import (
    CLUSTERS,
    CORE_POLICIES,
    LOAD_POLICIES,
    LOADS,
    MODELS,
    SIZES,
    TABLE2_POLICIES,
    TABLE3_POLICIES,
    VLM_LOADS,
    VLM_POLICIES,
    W2_SWEEP,
    WORKLOADS,
)
from loadtest.sim.modality import DEPLOYMENTS
from loadtest.sim.simulator import MODES
from loadtest.sim.summary import Summary

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

THR = "throughput_tok_s"
EXTRA = "sim"           # pyproject's optional dependencies that bring matplotlib


def missing() -> str | None:
    """What to install to draw the figures (None: nothing)."""
    if importlib.util.find_spec("matplotlib") is None:
        return (f"the figures need matplotlib, the '{EXTRA}' extra: pip install 'heterogate[{EXTRA}]' "
                f"(in a checkout: pip install -e '.[{EXTRA}]')")
    return None


def _pyplot() -> ModuleType:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig: Figure, out: Path, name: str) -> str:
    fig.tight_layout()
    fig.savefig(out / name, dpi=110)
    _pyplot().close(fig)
    return name


def _grouped_bars(ax: Axes, groups: list[str], series: dict[str, tuple[list[float], list[float]]]) -> None:
    width = 0.8 / len(series)
    x = np.arange(len(groups))
    for k, (label, (means, stds)) in enumerate(series.items()):
        ax.bar(x + k * width - 0.4 + width / 2, means, width, yerr=stds, label=label, capsize=2)
    ax.set_xticks(x, groups, rotation=20, ha="right", fontsize=8)


def table2(s: Summary, out: Path) -> str:
    fig, axes = _pyplot().subplots(1, 2, figsize=(11, 4))
    for ax, mode in zip(axes, MODES, strict=True):
        rows = [s.one("table2", mode=mode, policy=p) for p in TABLE2_POLICIES]
        ax.bar(TABLE2_POLICIES, [r[THR] for r in rows], yerr=[r[f"{THR}_std"] for r in rows], capsize=3,
               color=["#999"] * 4 + ["#d62728", "#2ca02c", "#1f77b4"])
        ax.set_title(f"{mode}: 8 GPUs, Llama-2-70B, ShareGPT, 1.0× load")
        ax.set_ylabel("tokens/s")
        ax.tick_params(axis="x", rotation=25, labelsize=8)
    return _save(fig, out, "table2_throughput.png")


def model_size(s: Summary, out: Path) -> str:
    fig, axes = _pyplot().subplots(1, 2, figsize=(11, 4))
    for ax, mode in zip(axes, MODES, strict=True):
        series = {}
        for p in TABLE3_POLICIES:
            rows = [(s.one("model_size", mode=mode, policy=p, model=m),
                     s.value("model_size", THR, mode=mode, policy="round_robin", model=m)) for m in MODELS]
            series[p] = ([r[THR] / rr for r, rr in rows], [r[f"{THR}_std"] / rr for r, rr in rows])
        _grouped_bars(ax, list(MODELS), series)
        ax.margins(y=0.3)                         # headroom for the legend above the bars
        ax.set(title=f"{mode}: Table 3, throughput / round robin", ylabel="× round_robin")
    axes[0].legend(fontsize=7, ncol=3, loc="upper left")
    return _save(fig, out, "model_size.png")


def load_sweep(s: Summary, out: Path) -> str:
    fig, axes = _pyplot().subplots(1, 2, figsize=(11, 4))
    for ax, mode in zip(axes, MODES, strict=True):
        for p in LOAD_POLICIES:
            ax.plot(LOADS, s.values("load", THR, "load", LOADS, mode=mode, policy=p), marker="o", label=p)
        ax.set(title=f"{mode}: throughput vs load", xlabel="load (× Σ μ_i)", ylabel="tokens/s")
    axes[0].legend(fontsize=7)
    return _save(fig, out, "load_sweep.png")


def pareto(s: Summary, out: Path) -> str:
    fig, axes = _pyplot().subplots(1, 2, figsize=(11, 4))
    for ax, mode in zip(axes, MODES, strict=True):
        for p in LOAD_POLICIES:
            ttft = s.values("load", "ttft_p95_s", "load", LOADS, mode=mode, policy=p)
            ax.plot(ttft, s.values("load", THR, "load", LOADS, mode=mode, policy=p), marker="o", label=p)
        ax.set_xscale("log")
        ax.set(title=f"{mode}: throughput vs P95 TTFT (0.5×–2.0×)", xlabel="P95 TTFT (s, log)", ylabel="tokens/s")
    axes[0].legend(fontsize=7)
    return _save(fig, out, "pareto.png")


def heterogeneity(s: Summary, out: Path) -> str:
    fig, axes = _pyplot().subplots(1, 2, figsize=(11, 4))
    names = list(CLUSTERS)
    for ax, mode in zip(axes, MODES, strict=True):
        series = {}
        for p in ("round_robin", "shortest_queue", "heteroserve", "batch_aware"):
            rows = [s.one("heterogeneity", mode=mode, policy=p, cluster=c) for c in names]
            series[p] = ([r["tok_s_per_dollar_hour"] for r in rows], [r["tok_s_per_dollar_hour_std"] for r in rows])
        _grouped_bars(ax, names, series)
        ax.set(title=f"{mode}: cost efficiency", ylabel="tokens/s per $/h")
    axes[0].legend(fontsize=7)
    return _save(fig, out, "heterogeneity.png")


def workloads(s: Summary, out: Path) -> str:
    fig, axes = _pyplot().subplots(1, 2, figsize=(11, 4))
    for ax, mode in zip(axes, MODES, strict=True):
        series = {}
        for p in ("round_robin", "shortest_queue", "heteroserve", "batch_aware"):
            rows = [s.one("workloads", mode=mode, policy=p, workload=w) for w in WORKLOADS]
            series[p] = ([r[THR] for r in rows], [r[f"{THR}_std"] for r in rows])
        _grouped_bars(ax, list(WORKLOADS), series)
        ax.set(title=f"{mode}: throughput by workload", ylabel="tokens/s")
    axes[0].legend(fontsize=7)
    return _save(fig, out, "workloads.png")


def scaling(s: Summary, out: Path) -> str:
    fig, axes = _pyplot().subplots(1, 2, figsize=(11, 4))
    for ax, mode in zip(axes, MODES, strict=True):
        for p in CORE_POLICIES:
            per_gpu = [v / n for v, n in zip(s.values("scaling", THR, "gpus", SIZES, mode=mode, policy=p), SIZES,
                                             strict=True)]
            ax.plot(SIZES, per_gpu, marker="o", label=p)
        ax.set_xscale("log", base=2)
        ax.set(title=f"{mode}: per-GPU throughput", xlabel="GPUs", ylabel="tokens/s per GPU")
    axes[0].legend(fontsize=7)
    return _save(fig, out, "scaling.png")


def ablations(s: Summary, out: Path) -> str:
    fig, axes = _pyplot().subplots(1, 3, figsize=(14, 4))
    variants = [r["variant"] for r in s.where("ablation_heteroserve", mode="serial")]
    series = {}
    for mode in MODES:
        rows = [s.one("ablation_heteroserve", mode=mode, variant=v) for v in variants]
        full = rows[0][THR]
        series[mode] = ([r[THR] / full for r in rows], [r[f"{THR}_std"] / full for r in rows])
    _grouped_bars(axes[0], variants, series)
    axes[0].set(title="heteroserve ablation (throughput / full)")
    axes[0].legend(fontsize=7)
    for mode in MODES:
        axes[1].plot(W2_SWEEP, [v / s.value("w2_sweep", THR, mode=mode, w2=1.0)
                                for v in s.values("w2_sweep", THR, "w2", W2_SWEEP, mode=mode)], marker="o", label=mode)
    axes[1].set_xscale("log")
    axes[1].set(title="w2 sweep (throughput / w2=1)", xlabel="w2")
    axes[1].legend(fontsize=7)
    rows = s.where("ablation_batch_aware", load=1.0)
    axes[2].barh([r["variant"] for r in rows], [r["ttft_p95_s"] for r in rows], color="#2ca02c")
    axes[2].set(title="batch_aware ablation: P95 TTFT at 1.0× (s)")
    axes[2].tick_params(axis="y", labelsize=7)
    return _save(fig, out, "ablations.png")


def modality(s: Summary, out: Path) -> str:
    names = list(DEPLOYMENTS)
    fig, axes = _pyplot().subplots(1, 2, figsize=(12, 4))
    for ax, metric, title in ((axes[0], THR, "LLaVA-1.5-7B, COCO, saturated: tokens/s"),
                              (axes[1], "cer_tok_s_per_k_usd", "cost efficiency: tok/s per $1k hardware (CER)")):
        series = {}
        for p in VLM_POLICIES:
            rows = [s.one("modality", deployment=d, policy=p, load=next(iter(VLM_LOADS)), workload="coco")
                    for d in names]
            series[p] = ([r[metric] for r in rows], [r[f"{metric}_std"] for r in rows])
        _grouped_bars(ax, names, series)
        ax.set_title(title)
    axes[0].legend(fontsize=7, title="language policy")
    return _save(fig, out, "modality.png")


FIGURES = (table2, model_size, load_sweep, pareto, heterogeneity, workloads, scaling, ablations, modality)

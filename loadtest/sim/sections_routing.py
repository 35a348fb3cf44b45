"""Report sections for the capability-weighted routing paper's experiments (§4-§5)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from common.catalog import Catalog
from loadtest.sim import paper
from loadtest.sim.experiments import (
    CLUSTERS,
    CORE_POLICIES,
    LOAD_POLICIES,
    LOADS,
    MODELS,
    POLICIES,
    SIZES,
    TABLE2_POLICIES,
    TABLE3_POLICIES,
    THREE_TIER,
    W2_SWEEP,
    WORKLOADS,
)
from loadtest.sim.simulator import MODES
from loadtest.sim.summary import Summary, cell, fmt, table

THR = "throughput_tok_s"


def _pct(a: float, b: float) -> str:
    return f"{(a / b - 1.0) * 100:+.0f}%"


def table2(s: Summary, catalog: Catalog) -> str:
    parts = ["## Table 2: 8 GPUs (2×H100, 3×A100, 3×L40S), Llama-2-70B, ShareGPT, 1.0× load\n",
             "'routed H100/A100/L40S' = share of requests sent to each GPU type; `oracle` is the clairvoyant "
             "baseline (below).\n"]
    for mode in MODES:
        rr = s.value("table2", THR, mode=mode, policy="round_robin")
        rows = []
        for p in TABLE2_POLICIES:
            r = s.one("table2", mode=mode, policy=p)
            row = [p, cell(r, THR), cell(r, "steady_tok_s"), cell(r, "ttft_p95_s", 1), cell(r, "e2e_mean_s", 1),
                   cell(r, "e2e_p99_s", 1), f"{r[THR] / rr:.2f}×", _shares(r)]
            if mode == "serial":
                ref = paper.TABLE2.get(p)
                row += [fmt(ref[0]), fmt(ref[1], digits=1), fmt(ref[2], digits=1)] if ref else ["–"] * 3
            rows.append(row)
        header = ["policy", "tok/s", "steady tok/s", "P95 TTFT s", "mean E2E s", "P99 E2E s", "× round_robin",
                  "routed H100/A100/L40S"]
        if mode == "serial":
            header += ["paper tok/s", "paper P95 TTFT", "paper P99 E2E"]
        parts.append(f"### {mode} engines\n\n" + table(header, rows) + "\n")
    parts.append(_ratio_note(s, catalog))
    parts.append(_oracle_note(s))
    parts.append("![Table 2](results/table2_throughput.png)\n")
    return "\n".join(parts)


def _shares(r: dict[str, Any]) -> str:
    return " / ".join(f"{r.get(f'share_{g}', 0.0) * 100:.0f}%" for g in ("H100", "A100-80GB", "L40S"))


def _oracle_note(s: Summary) -> str:
    def get(mode: str, policy: str, metric: str = THR) -> float:
        return s.value("table2", metric, mode=mode, policy=policy)

    def rank(mode: str, metric: str) -> str:
        """Where the oracle's `metric` stands among the gateway's policies."""
        others = [get(mode, p, metric) for p in POLICIES]
        value = get(mode, "oracle", metric)
        return "the lowest" if value < min(others) else "the highest" if value > max(others) else "in between"

    def versus(mode: str, metric: str, digits: int = 1) -> str:
        o, h = get(mode, "oracle", metric), get(mode, "heteroserve", metric)
        return f"{o:,.{digits}f} vs heteroserve {h:,.{digits}f}"

    def modes_where(better: Callable[[str], bool]) -> str:
        return " and ".join(f"{m} mode" for m in MODES if better(m)) or "neither mode"

    ref = paper.TABLE2
    mean_holds = modes_where(lambda m: get(m, "heteroserve", "e2e_mean_s") < get(m, "oracle", "e2e_mean_s"))
    thr_holds = modes_where(lambda m: get(m, "heteroserve") > get(m, "oracle"))
    return (
        "**Oracle** (`loadtest/sim/oracle.py`, simulator-only: it reads the engines). Each arrival goes to the GPU "
        "where *its own* completion time is earliest, knowing every request's true output length and each GPU's "
        "exact pending work. Serial engines: queue contents × the paper's formulas, exact (realized / predicted "
        f"latency = {get('serial', 'oracle', 'oracle_realized_over_predicted'):.2f}). Continuous batching: the "
        "GPU's batcher replayed forward from its present state with the newcomer at the tail of the queue, exact "
        "if nothing else arrived; realized latency was on average "
        f"**{get('continuous', 'oracle', 'oracle_realized_over_predicted'):.2f}×** the prediction, because later "
        "arrivals join the batch and their whole-prompt prefills stall its decode steps. The paper's Oracle "
        "minimises *mean* latency and also knows future arrivals; ours is its usual practical form, greedy per "
        "arrival, which neither looks ahead nor counts the delay it causes others.\n\n"
        f"Paper: Oracle {ref['oracle'][0]:,.0f} tok/s, {_pct(ref['oracle'][0], ref['heteroserve'][0])} vs "
        f"HeteroServe. Here, serial: {versus('serial', THR, 0)} tok/s: at 1.0× = Σ_i μ_i every work-conserving "
        "policy runs at the ceiling, and no routing choice raises it, so the paper's metric cannot separate them. "
        f"Its P99 E2E ({versus('serial', 'e2e_p99_s', 0)} s) is {rank('serial', 'e2e_p99_s')} of all; its mean "
        f"E2E ({versus('serial', 'e2e_mean_s')} s, shortest_queue {get('serial', 'shortest_queue', 'e2e_mean_s'):.1f}"
        f" s) is {rank('serial', 'e2e_mean_s')}"
        + (": greedy earliest completion is not the mean-optimal schedule, since it ignores how long its choice "
           "holds the GPU for later arrivals — it sends more requests to the L40S "
           f"({get('serial', 'oracle', 'share_L40S'):.0%} of them vs {get('serial', 'heteroserve', 'share_L40S'):.0%} "
           "for heteroserve), where each holds the GPU several times longer than on an H100, and the requests "
           "behind pay for it (hence the paper's mean objective)"
           if rank("serial", "e2e_mean_s") != "the lowest" else "")
        + f". Continuous: {versus('continuous', THR, 0)} tok/s, {rank('continuous', THR)} on the "
        "paper's metric, which charges the drain after the last arrival (the oracle finishes the last requests "
        f"early); steady tok/s {versus('continuous', 'steady_tok_s', 0)}, mean E2E "
        f"{versus('continuous', 'e2e_mean_s')} s. It accepts a wait for admission (mean "
        f"{versus('continuous', 'queue_mean_s')} s) whenever the replay says a faster GPU's decode makes up for it; "
        "later arrivals then stretch that decode and queue behind it. The paper's ordering (HeteroServe above its "
        f"Oracle) holds here for mean latency in {mean_holds} and for end-to-end tok/s in {thr_holds}.\n"
    )


def _ratio_note(s: Summary, catalog: Catalog) -> str:
    def ratio(mode: str) -> float:
        return s.value("table2", THR, mode=mode, policy="heteroserve") / s.value("table2", THR, mode=mode,
                                                                                policy="round_robin")

    def ttft(mode: str, policy: str) -> float:
        return s.value("table2", "ttft_p95_s", mode=mode, policy=policy)

    bound = paper.uniform_bound(catalog, THREE_TIER, "llama-2-70b", "sharegpt", "serial")
    max_tok_s = paper.serial_max_output_tok_s(catalog, THREE_TIER, "llama-2-70b")
    serial, reported = ratio("serial"), paper.TABLE2["heteroserve"][0]
    measured = s.value("table2", THR, mode="serial", policy="heteroserve")
    verdict = "inside" if abs(serial / paper.RATIO - 1) <= 0.25 else "outside"
    return (
        f"**HeteroServe / round robin (serial, the paper's simulator): {serial:.2f}× vs the paper's {paper.RATIO}× "
        f"({(serial / paper.RATIO - 1) * 100:+.0f}%, {verdict} the ±25% band).** Under continuous batching: "
        f"{ratio('continuous'):.2f}×.\n\n"
        f"Why not 2.8×, with evidence from the paper's own model: (1) once round robin saturates, its throughput is "
        f"N · min_i μ_i (each L40S gets 1/8 of the requests), while any work-conserving policy reaches at most "
        f"Σ_i μ_i; for this cluster and workload that ceiling is **{bound:.2f}×**, the measured {serial:.2f}× sits "
        f"just under it, and 2.8× is above what the stated formulas allow. (2) The paper's absolute numbers do not "
        f"fit its formulas either: with decode 2·P/B per token, eight GPUs can emit at most **{max_tok_s:.0f} output "
        f"tok/s** (all decoding all the time), yet Table 2 reports {reported:,.0f} tok/s "
        f"({reported / max_tok_s:.0f}× that); we measure {measured:.0f}."
        f" (3) The paper's Shortest-Queue ≈ Uniform throughput (2,256 vs 2,222) cannot hold for a work-conserving "
        f"dispatcher: JSQ keeps every GPU busy whenever there is a backlog, so here it lands next to HeteroServe. "
        f"(4) Its latency ordering (Shortest-Queue 3.4 s P95 TTFT, HeteroServe 14.6 s) does not hold either: at "
        f"1.0× = Σ_i μ_i serial queues grow for every policy (P95 TTFT {ttft('serial', 'shortest_queue'):.0f} s for "
        f"shortest_queue, {ttft('serial', 'heteroserve'):.0f} s for heteroserve), and under continuous batching "
        f"heteroserve is far ahead ({ttft('continuous', 'heteroserve'):.1f} s vs "
        f"{ttft('continuous', 'shortest_queue'):.1f} s). Which unstated difference produces the paper's figures "
        f"cannot be told from the text; its stated setup yields the ratios above.\n"
    )


def load_sweep(s: Summary) -> str:
    parts = ["## Load sweep 0.5×–2.0× (Fig. 4) and throughput vs P95 TTFT (Fig. 5)\n"]
    for mode in MODES:
        rows = [[p] + [fmt(v) for v in s.values("load", THR, "load", LOADS, mode=mode, policy=p)]
                for p in LOAD_POLICIES]
        parts.append(f"### {mode}: tok/s\n\n" + table(["policy"] + [f"{x}×" for x in LOADS], rows) + "\n")
        rows = [[p] + [fmt(v, digits=1) for v in s.values("load", "ttft_p95_s", "load", LOADS, mode=mode, policy=p)]
                for p in LOAD_POLICIES]
        parts.append(f"### {mode}: P95 TTFT (s)\n\n" + table(["policy"] + [f"{x}×" for x in LOADS], rows) + "\n")
    hs = s.values("load", THR, "load", (0.5, 1.0, 2.0), mode="serial", policy="heteroserve")
    rr = s.values("load", THR, "load", (0.5, 1.0), mode="serial", policy="round_robin")
    parts.append(
        f"Paper (serial): Uniform 2,147 → 2,222 tok/s and HeteroServe 4,805 → 6,190 → 6,567 tok/s at 0.5× → 1.0× → "
        f"2.0×. Here: round robin {rr[0]:.0f} → {rr[1]:.0f} (flat, as in the paper: it is past its bottleneck "
        f"already at 0.5×), HeteroServe {hs[0]:.0f} → {hs[1]:.0f} → {hs[2]:.0f}. HeteroServe's ratio at 0.5× is "
        f"{hs[0] / rr[0]:.2f}× vs the paper's 2.2×: at 0.5× of Σμ_i every queue-aware policy simply serves the "
        f"offered load, so the gap can only be the arrival-rate ratio; the paper's 2.2× implies a higher offered "
        f"load than its stated λ.\n\n![load sweep](results/load_sweep.png)\n\n![Pareto](results/pareto.png)\n"
    )
    return "\n".join(parts)


def heterogeneity(s: Summary, catalog: Catalog) -> str:
    parts = ["## Heterogeneity scaling and cost efficiency (Fig. 6)\n",
             "Prices from the catalog (configs/gpus.yaml): H100 $3.50/h, A100 $2.21/h, L40S $1.25/h. "
             "'ceiling' = Σ_i μ_i / (N · min_i μ_i) − 1, the most any policy can gain over a saturated round robin "
             "in that engine mode.\n"]
    for mode in MODES:
        rows = []
        for c, gpus in CLUSTERS.items():
            get = {p: s.one("heterogeneity", mode=mode, policy=p, cluster=c) for p in CORE_POLICIES}
            rr, hs, ba = (get[p][THR] for p in ("round_robin", "heteroserve", "batch_aware"))
            ceiling = paper.uniform_bound(catalog, gpus, "llama-2-70b", "sharegpt", mode)
            rows.append([c, fmt(rr), fmt(hs), _pct(hs, rr), f"{paper.HETEROGENEITY_GAIN[c]:+.0f}%",
                         f"{(ceiling - 1) * 100:+.0f}%", fmt(ba), _pct(ba, rr),
                         *[fmt(get[p]["tok_s_per_dollar_hour"], digits=1) for p in ("round_robin", "heteroserve",
                                                                                    "batch_aware")]])
        header = ["cluster", "RR tok/s", "heteroserve", "gain", "paper gain", "ceiling", "batch_aware", "gain",
                  "RR tok/s per $/h", "heteroserve per $/h", "batch_aware per $/h"]
        parts.append(f"### {mode}\n\n" + table(header, rows) + "\n")
    parts.append(
        "The ordering matches the paper (no gain on homogeneous hardware, more with more tiers); the sizes follow "
        "the ceiling, not the paper. With serial engines the ceiling of 4×H100+4×A100 is set by decode bandwidth "
        "(3350 vs 2039 GB/s: +32%); the paper's +64% equals the H100/A100 bandwidth ratio itself, as if every GPU "
        "ran at H100 speed. Continuous batching widens the H100/A100 gap: decode is amortised over the batch, so "
        "prefill (compute, where the H100 is 3.2× the A100) becomes a large share of GPU time, and the measured "
        "per-GPU rates differ more; its ceilings are higher. Cost efficiency: the capability-aware policies make "
        "the mixed clusters as cost-efficient per $/h as the homogeneous A100 cluster under serial engines and "
        "better under continuous batching, while round robin wastes the fast GPUs.\n\n"
        "![heterogeneity](results/heterogeneity.png)\n"
    )
    return "\n".join(parts)


def workloads(s: Summary) -> str:
    parts = ["## Workload robustness (Fig. 7)\n"]
    for mode in MODES:
        rows = []
        for w in WORKLOADS:
            get = {p: s.one("workloads", mode=mode, policy=p, workload=w) for p in CORE_POLICIES}
            rr = get["round_robin"][THR]
            rows.append([w, fmt(rr), fmt(get["shortest_queue"][THR]), fmt(get["heteroserve"][THR]),
                         _pct(get["heteroserve"][THR], rr), f"{paper.WORKLOAD_GAIN[w]:+.0f}%",
                         fmt(get["batch_aware"][THR]), _pct(get["batch_aware"][THR], rr)])
        header = ["workload", "RR", "SQ", "heteroserve", "gain", "paper gain", "batch_aware", "gain"]
        parts.append(f"### {mode}: tok/s\n\n" + table(header, rows) + "\n")
    parts.append(
        "Gains barely depend on the workload here, in either mode, because decode (outputs U[64, 512] in every "
        "workload) dominates service time and round robin is saturated by its slowest GPU whatever the prompts; "
        "only the prefill share changes with prompt length. The paper's spread (+179% ShareGPT … −7% Long-Heavy) "
        "is not reproduced. Its Long-Heavy −7% needs HeteroServe to pile long prompts onto the H100s; at w2 = 1 "
        "the queue term outweighs the prefill saving long before that happens.\n\n![workloads](results/workloads.png)\n"
    )
    return "\n".join(parts)


def scaling(s: Summary) -> str:
    parts = ["## Scaling 4 → 32 GPUs (Fig. 8)\n",
             "Clusters keep the 2:3:3 mix (4 GPUs: 1 H100, 2 A100, 1 L40S), requests per GPU constant, 1.0× load. "
             "Efficiency = per-GPU tok/s at N / per-GPU tok/s at 8 (the 4-GPU mix differs).\n"]
    for mode in MODES:
        rows = []
        for p in CORE_POLICIES:
            vals = s.values("scaling", THR, "gpus", SIZES, mode=mode, policy=p)
            per = [v / n for v, n in zip(vals, SIZES, strict=True)]
            rows.append([p, *[fmt(v) for v in vals], f"{per[-1] / per[1] * 100:.0f}%"])
        header = ["policy", *[f"{n} GPUs" for n in SIZES], "efficiency 32 vs 8"]
        parts.append(f"### {mode}: tok/s\n\n" + table(header, rows) + "\n")
    parts.append(
        f"Paper: {paper.SCALING_EFFICIENCY_32:.0f}% at 32 GPUs. Here scaling is near-linear for queue-aware policies: "
        "the router is O(N) and more GPUs pool the random load better; the only loss is the slowest GPU's drain at "
        "the end of a finite trace.\n\n![scaling](results/scaling.png)\n"
    )
    return "\n".join(parts)


def ablation(s: Summary) -> str:
    rows = []
    for r in s.where("ablation_heteroserve", mode="serial"):
        v = r["variant"]
        full = {m: s.value("ablation_heteroserve", THR, mode=m, variant="full") for m in MODES}
        got = {m: s.value("ablation_heteroserve", THR, mode=m, variant=v) for m in MODES}
        ref = paper.ABLATION.get(v)
        rows.append([v, *[f"{fmt(got[m])} ({_pct(got[m], full[m])})" for m in MODES],
                     "" if ref is None else f"{ref:+.1f}%"])
    sweep = [[f"{w2:g}", *[fmt(s.value("w2_sweep", THR, mode=m, w2=w2)) for m in MODES]] for w2 in W2_SWEEP]
    return (
        "## Ablation (Fig. 9) and w2 sweep (§5.1)\n\n"
        + table(["heteroserve variant", "serial tok/s", "continuous tok/s", "paper"], rows)
        + "\n\n" + table(["w2", "serial tok/s", "continuous tok/s"], sweep) + "\n\n"
        + _ablation_note(s) + "\n\n![ablations](results/ablations.png)\n"
    )


def _ablation_note(s: Summary) -> str:
    sweep = {m: s.values("w2_sweep", THR, "w2", W2_SWEEP, mode=m) for m in MODES}
    spread = {m: (max(v) - min(v)) / max(v) * 100 for m, v in sweep.items()}
    return (
        f"w2 robustness: across w2 ∈ [0.1, 10] throughput varies by {spread['serial']:.1f}% (serial) and "
        f"{spread['continuous']:.1f}% (continuous) — the paper reports within {paper.W2_ROBUSTNESS:.0f}%. "
        "w2 = 0 (device-specific SJF) sends everything to the lowest-prefill GPU until the OOM veto fires: under "
        "serial engines the veto never fires (one request holds a fraction of HBM), so the first H100 (ties go to "
        "the first candidate) takes all work and throughput falls further than the paper's −58%; under continuous "
        "batching the veto turns into a crude spill-over when that H100's cache is full. "
        "w1 = 0 is shortest queue weighted by T̄_service, which here is as "
        "good as the full cost (decode dominates service time), unlike the paper's −45%. w3 = 0 changes nothing "
        "under serial engines, as in the paper (+1.5%)."
    )


def table3(s: Summary, catalog: Catalog) -> str:
    parts = ["## Table 3: model size, Llama-2-7B vs Llama-2-70B (8-GPU three-tier, ShareGPT, 1.0× load)\n",
             "Paper columns: its Table 3 (Uniform = round_robin). Δ = ours / paper − 1; '× RR' = tok/s over round "
             "robin, ours (paper). The paper has one (serial) simulator; its numbers stand beside both modes. "
             "Llama-2-7B's weights fit on every GPU, so its KV cache is the engine default (90% of HBM minus "
             "weights).\n"]
    for mode in MODES:
        rr = {m: s.value("model_size", THR, mode=mode, policy="round_robin", model=m) for m in MODELS}
        rows = []
        for p in TABLE3_POLICIES:
            row, ratios = [p], []
            for m in MODELS:
                r, ref = s.one("model_size", mode=mode, policy=p, model=m), paper.TABLE3.get(p, {}).get(m)
                row += [cell(r, THR), fmt(*ref) if ref else "–", _pct(r[THR], ref[0]) if ref else "–"]
                paper_rr = paper.TABLE3["round_robin"][m][0]
                ratios.append(f"{r[THR] / rr[m]:.2f}×" + (f" ({ref[0] / paper_rr:.2f}×)" if ref else ""))
            rows.append(row + ratios)
        header = ["policy", "7B tok/s", "paper 7B", "Δ", "70B tok/s", "paper 70B", "Δ", "7B × RR", "70B × RR"]
        parts.append(f"### {mode} engines\n\n" + table(header, rows) + "\n")
    parts.append(_table3_note(s, catalog))
    parts.append("![Table 3](results/model_size.png)\n")
    return "\n".join(parts)


def _table3_note(s: Summary, catalog: Catalog) -> str:
    def ratio(mode: str, model: str, policy: str = "heteroserve") -> float:
        return s.value("model_size", THR, mode=mode, policy=policy, model=model) / s.value(
            "model_size", THR, mode=mode, policy="round_robin", model=model)

    def paper_ratio(model: str, policy: str = "heteroserve") -> float:
        return paper.TABLE3[policy][model][0] / paper.TABLE3["round_robin"][model][0]

    def both(mode: str, policy: str = "heteroserve") -> str:
        return " / ".join(f"{ratio(mode, m, policy):.2f}×" for m in MODELS)

    def paper_both(policy: str = "heteroserve") -> str:
        return " / ".join(f"{paper_ratio(m, policy):.2f}×" for m in MODELS)

    gap = {m: (ratio("serial", m) / paper_ratio(m) - 1) * 100 for m in MODELS}
    limit = {m: paper.serial_max_output_tok_s(catalog, THREE_TIER, m) for m in MODELS}
    bound = {mode: " / ".join(f"{paper.uniform_bound(catalog, THREE_TIER, m, 'sharegpt', mode):.2f}×"
                              for m in MODELS) for mode in MODES}
    hs7 = paper.TABLE3["heteroserve"]["llama-2-7b"][0]
    direction = ("larger at 7B — the opposite direction to the paper's"
                 if ratio("continuous", "llama-2-7b") > ratio("continuous", "llama-2-70b")
                 else "larger at 70B, the paper's direction")
    delta = {}
    for mode in MODES:
        gaps = [(s.value("model_size", THR, mode=mode, policy=p, model=m) / ref[0] - 1) * 100
                for p, by_model in paper.TABLE3.items() for m, ref in by_model.items()]
        delta[mode] = f"{min(gaps):+.0f}% … {max(gaps):+.0f}%"
    return (
        f"HeteroServe over round robin (7B / 70B): serial {both('serial')}, continuous {both('continuous')}; paper "
        f"{paper_both()} (serial: {gap['llama-2-7b']:+.0f}% / {gap['llama-2-70b']:+.0f}%). Where it differs, and "
        "why:\n\n"
        "- **The 7B/70B gap.** In the paper's serial model every service time is P · (2L/F_i + 2n/B_i): the "
        "parameter count scales every GPU's time alike and cancels from every ratio, so round robin's bottleneck "
        f"and the Σ_i μ_i ceiling give the same gain for both sizes (ceiling {bound['serial']}), and the measured "
        "serial ratios agree. The paper's larger gain at 70B ('longer per-request service times amplify the cost "
        "of misrouting') cannot come from its stated model. Under continuous batching the size does move the "
        "per-GPU rates (7B's weights fit with room for a larger KV cache; the weight, KV and prefill shares of a "
        f"step change), but only slightly: ceilings {bound['continuous']}, and the measured gain is {direction}.\n"
        "- **Absolute tok/s** are far below the paper's in serial mode for both sizes: eight GPUs decoding "
        f"non-stop at 2·P/B per token emit at most {limit['llama-2-7b']:,.0f} (7B) and {limit['llama-2-70b']:,.0f} "
        f"(70B) tok/s, while the paper reports {hs7:,.0f} for 7B HeteroServe ({hs7 / limit['llama-2-7b']:.0f}× "
        "that). Continuous batching streams the weights once per step for the whole batch, which brings ours "
        f"closer (Δ {delta['continuous']} under continuous batching, {delta['serial']} serial).\n"
        f"- **Shortest-Queue** sits next to HeteroServe here ({both('serial', 'shortest_queue')} serial) rather "
        f"than next to Uniform ({paper_both('shortest_queue')} in the paper): a work-conserving dispatcher keeps "
        "every GPU busy while work waits (Table 2, point 3).\n"
        f"- **Oracle**: the paper's is {paper_both('oracle')} round robin, below HeteroServe; ours "
        f"{both('serial', 'oracle')} (serial) and {both('continuous', 'oracle')} (continuous), for the reasons "
        "given under Table 2.\n"
    )

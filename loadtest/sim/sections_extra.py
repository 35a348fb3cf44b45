"""Report sections beyond the routing paper: the improved policy, bursty arrivals, the modality split."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from gateway.routing.policies.stealing import DEFAULT_MAX_BATCH, DEFAULT_THRESHOLD
from loadtest.sim import paper
from loadtest.sim.experiments import BATCH_AWARE_ABLATION, POLICIES, VLM_POLICIES
from loadtest.sim.modality import DEPLOYMENTS
from loadtest.sim.summary import Summary, cell, fmt, table

THR = "throughput_tok_s"


def paired_wins(rows: list[dict[str, Any]], experiment: str, metric: str, a: dict[str, Any], b: dict[str, Any]) -> int:
    """Seeds on which run `a` has the higher `metric` than run `b` (same seed, same trace)."""
    def by_seed(labels: dict[str, Any]) -> dict[int, float]:
        return {r["seed"]: r[metric] for r in rows
                if r["experiment"] == experiment and all(r.get(k) == v for k, v in labels.items())}
    pa, pb = by_seed(a), by_seed(b)
    return sum(pa[k] > pb[k] for k in pa if k in pb)


def improved_policy(s: Summary, rows: list[dict[str, Any]]) -> str:
    mode = "continuous"
    get = {p: s.one("table2", mode=mode, policy=p) for p in POLICIES}
    ba = get["batch_aware"]
    others = [p for p in POLICIES if p != "batch_aware"]
    seeds = ba["seeds"]

    def wins(metric: str, p: str) -> int:
        return paired_wins(rows, "table2", metric, {"mode": mode, "policy": "batch_aware"}, {"mode": mode, "policy": p})

    lines = [[p, cell(get[p], THR), f"{(ba[THR] / get[p][THR] - 1) * 100:+.1f}%", f"{wins(THR, p)}/{seeds}",
              cell(get[p], "steady_tok_s"), f"{wins('steady_tok_s', p)}/{seeds}", cell(get[p], "ttft_p95_s", 1),
              cell(get[p], "e2e_p99_s", 1)] for p in others]
    lines.append(["**batch_aware**", cell(ba, THR), "", "", cell(ba, "steady_tok_s"), "", cell(ba, "ttft_p95_s", 1),
                  cell(ba, "e2e_p99_s", 1)])
    header = ["policy (continuous, 1.0×)", "tok/s", "batch_aware vs it", "seeds won", "steady tok/s",
              "seeds won (steady)", "P95 TTFT s", "P99 E2E s"]
    return (
        "## Beyond the paper: `batch_aware` (gateway/routing/policies/batch_aware.py)\n\n"
        "HeteroServe's queue term Q_i · T̄_service assumes a serial GPU. Under continuous batching the Q_i requests "
        "run together and a newcomer waits only when the KV cache is full, for part of it to turn over. "
        "`batch_aware` estimates time to first token per GPU: the admission wait from KV occupancy (reserved KV, "
        "plus Q_i · R̄_i tokens queued behind a blocked FIFO head, R̄_i = EWMA of reservations routed there) "
        "times T̄_service, the roofline time of the admitting step (weights + KV over bandwidth — the bandwidth "
        "tier), and the prefill of the prompts it sent there still waiting for a first token plus its own, "
        "(B_i + L) · p_i (p_i learned, 2P/F_i before any sample); KV pressure is soft, the veto only drops "
        "GPUs whose whole cache "
        "cannot hold the request. It reads only existing snapshot fields. In serial mode it is configured with "
        "max_batch = 1 (the engines' batch cap), where it reduces to HeteroServe plus a constant per-GPU step term "
        "(and performs the same).\n\n"
        + table(header, lines) + "\n\n" + _verdict(get, others, wins, seeds) + "\n"
        + _policy_ablation(s) + "\n" + bursty(s)
    )


def _verdict(get: dict[str, dict[str, Any]], others: list[str], wins: Callable[[str, str], int], seeds: int) -> str:
    ba = get["batch_aware"]
    best = max(others, key=lambda p: get[p][THR])
    standing = "higher mean than every other policy" if ba[THR] > get[best][THR] else "NOT the best"
    sq, hs = get["shortest_queue"]["ttft_p95_s"], get["heteroserve"]["ttft_p95_s"]
    noisy = ba[THR] - get[best][THR] < max(ba[f"{THR}_std"], get[best][f"{THR}_std"])
    noise = (
        "This margin is within seed noise: at 1.0× every queue-aware policy serves the offered load and the metric "
        "differs only by the drain after the last arrival, set by the slowest GPU still decoding; the steady-state "
        "column and the load sweep (1.25×–2.0×) are where the gain is clear."
        if noisy else "The margin exceeds the seed-to-seed spread."
    )
    return (
        f"- Throughput at 1.0× (the paper's metric): {standing}; margin over the best other ({best}) "
        f"{(ba[THR] / get[best][THR] - 1) * 100:+.1f}%, won on {wins(THR, best)}/{seeds} paired seeds. {noise}\n"
        f"- P95 TTFT: {ba['ttft_p95_s']:.1f} s vs shortest_queue {sq:.1f} s "
        f"({'beats it' if ba['ttft_p95_s'] <= sq else 'WORSE than it'}) and heteroserve {hs:.1f} s.\n"
        "- The ablation shows every term earning its place on TTFT; w_decode > 0 (an E2E estimate with a decode "
        "term) buys no throughput at 1.0× and costs TTFT, so it defaults to 0.\n"
    )


def _policy_ablation(s: Summary) -> str:
    rows = []
    for v in BATCH_AWARE_ABLATION:
        a, b = s.one("ablation_batch_aware", variant=v, load=1.0), s.one("ablation_batch_aware", variant=v, load=1.25)
        rows.append([v, cell(a, THR), cell(a, "ttft_p95_s", 1), cell(a, "e2e_p99_s", 1), cell(b, THR),
                     cell(b, "ttft_p95_s", 1)])
    header = ["batch_aware variant", "tok/s 1.0×", "P95 TTFT 1.0×", "P99 E2E 1.0×", "tok/s 1.25×", "P95 TTFT 1.25×"]
    return "### Ablation (continuous batching, 8-GPU three-tier, ShareGPT)\n\n" + table(header, rows) + "\n"


def bursty(s: Summary) -> str:
    rows = [[p, *[cell(s.one("bursty", mode=m, policy=p), k, d) for m in ("serial", "continuous")
                  for k, d in ((THR, 0), ("ttft_p95_s", 1))]] for p in POLICIES]
    header = ["policy", "serial tok/s", "serial P95 TTFT", "continuous tok/s", "continuous P95 TTFT"]
    return ("### Bursty arrivals (on/off MMPP: 3× the mean rate 25% of the time, mean 1.0×)\n\n"
            + table(header, rows) + "\n")


def modality(s: Summary) -> str:
    parts = ["## Modality-level split (modality paper §6): LLaVA-1.5-7B\n",
             "Language pool routed by `heteroserve`, vision pool by `encode_cost`, stealing by "
             f"`gateway.routing.policies.stealing.stealers` (τ = {DEFAULT_THRESHOLD}; a stealer holds at most "
             f"{DEFAULT_MAX_BATCH} language requests, and a stealing 4090 runs half the batch cap with a 100 ms "
             "prefill bound per step). Hardware $3k per RTX 4090, $16k per A100; hourly $0.55 / $2.21. "
             "CER = tok/s per $1k of hardware. Saturated = offered 1.3× the 4×A100 capacity (throughput); "
             "moderate = 0.6× the 2×A100 capacity (latency, every deployment keeps up).\n"]
    for workload in ("coco", "mm_mixed"):
        loads = ("saturated (1.3× 4×A100)", "moderate (0.6× 2×A100)") if workload == "coco" else (
            "saturated (1.3× 4×A100)",)
        for load in loads:
            rows = []
            for d, policy in ((d, p) for d in DEPLOYMENTS for p in VLM_POLICIES):
                r = s.one("modality", deployment=d, policy=policy, load=load, workload=workload)
                rows.append([d, policy, cell(r, THR), fmt(r["hardware_usd"]), fmt(r["cer_tok_s_per_k_usd"], digits=1),
                             fmt(r["tok_s_per_dollar_hour"] * 3.6, digits=0), cell(r, "ttft_p50_s", 2),
                             cell(r, "ttft_p95_s", 2), cell(r, "e2e_p99_s", 2),
                             fmt(r["embedding_mb_per_request"], digits=2), fmt(r["stage_kv_mb_per_request"], digits=0),
                             fmt(r["stolen_share"] * 100, digits=0) + "%"])
            header = ["deployment", "language policy", "tok/s", "hardware $", "CER", "tokens per $ (hourly, k)",
                      "P50 TTFT s", "P95 TTFT s", "P99 E2E s", "embedding MB moved / img req",
                      "KV MB a P/D split moves", "stolen"]
            parts.append(f"### {workload}, {load}\n\n" + table(header, rows) + "\n")
    parts.append(_modality_note(s) + "\n![modality](results/modality.png)\n")
    return "\n".join(parts)


def _modality_note(s: Summary) -> str:
    load = "saturated (1.3× 4×A100)"

    def thr(deployment: str, workload: str = "coco", policy: str = "heteroserve") -> float:
        return s.value("modality", THR, deployment=deployment, policy=policy, load=load, workload=workload)

    names = list(DEPLOYMENTS)
    homo, split, steal = (thr(n) for n in names)
    p_homo, p_split, p_steal = (paper.MODALITY[n][0] for n in names)
    cer = {n: thr(n) / (paper.MODALITY[n][1] / 1000) for n in names}
    mixed = {p: (thr(names[1], "mm_mixed", p), thr(names[2], "mm_mixed", p)) for p in VLM_POLICIES}
    stolen = {p: s.value("modality", "stolen_share", deployment=names[2], policy=p, load=load, workload="mm_mixed")
              for p in VLM_POLICIES}
    return (
        f"Paper: 4×A100 {p_homo:,.0f} tok/s (vLLM {paper.VLLM_4XA100:,.0f}), split {p_split:,.0f}, split + stealing "
        f"{p_steal:,.0f} (stealing ×{p_steal / p_split:.2f}; split + stealing / homogeneous {p_steal / p_homo:.2f}). "
        f"Here (heteroserve on the language pool): {homo:,.0f}, {split:,.0f}, {steal:,.0f} (stealing "
        f"×{steal / split:.2f}; {steal / homo:.2f}). The simulated engines run at roofline peak with no engine "
        f"overhead, hence higher absolute tok/s than both of the paper's engines. Split without stealing is "
        f"{split / homo:.2f} of homogeneous (paper {p_split / p_homo:.2f}) because language work dominates (encode "
        f"is ≈1 ms per image on either GPU) and runs on half the A100s; CER moves from {cer[names[0]]:.1f} "
        f"(homogeneous) to {cer[names[1]]:.1f} (split) and {cer[names[2]]:.1f} (split + stealing); the paper has "
        f"93.5 (homogeneous) → 83.1 (split + stealing) for its own engine, i.e. a CER loss where we find a gain. "
        f"Stealing gains ×{steal / split:.2f} here vs the paper's ×{p_steal / p_split:.2f}: a stolen sequence costs "
        "the 4090 only its bandwidth (a real engine also pays mode switches and small-batch inefficiency), and "
        f"each 4090 holds at most {DEFAULT_MAX_BATCH} language requests, the paper's bounded assistance.\n\n"
        "On the mixed workload (50% text requests with outputs up to 512 tokens), stealing "
        + "; ".join(f"{'gains' if with_ > without else 'loses'} with {p} on the language pool ({with_:,.0f} vs "
                    f"{without:,.0f} tok/s without, {stolen[p] * 100:.0f}% of requests on the 24 GB 4090s)"
                    for p, (without, with_) in mixed.items())
        + f". The {DEFAULT_MAX_BATCH}-request bound per stealer is what keeps a router that ranks by prefill "
        "speed or by Q_i · T̄_service (which reads the A100s' large running batches as queues) from flooding "
        "the small-KV stealers, whose requests would then queue behind a cache that fits few of them.\n\n"
        f"Bytes: the embedding hand-off moves ≈4.7 MB per image request versus ≈317 MB of KV that a prefill/decode "
        f"split would move for the same 604-token prompt (ratio ≈67; the paper's 78 counts 704 tokens of context).\n"
    )

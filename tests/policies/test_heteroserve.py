"""`heteroserve`: the properties §3.3-3.5 of the capability-weighted routing paper claims for Eq. 1-4."""

from __future__ import annotations

import dataclasses
import random
from collections import Counter
from collections.abc import Sequence
from typing import Any, cast

import pytest

from gateway.routing.policies import build_policy
from gateway.routing.policies.contracts import BackendSnapshot, CostTerms, Decision, RequestProfile
from gateway.routing.policies.heteroserve import HeteroServe, HeteroServeParams
from gateway.routing.policies.shortest_queue import ShortestQueue
from tests.snapshots import cluster, random_cluster, snapshot

DEMO = {"H100": 2, "A100-80GB": 3, "L40S": 3}   # configs/backends.yaml


def request(tokens: int, rid: str = "r") -> RequestProfile:
    return RequestProfile(request_id=rid, input_tokens=tokens)


def policy(w1: float = 1.0, w2: float = 1.0, w3: float = 100.0) -> HeteroServe:
    return HeteroServe(HeteroServeParams(w1=w1, w2=w2, w3=w3))


def route_with_feedback(p: HeteroServe, backends: list[BackendSnapshot], tokens: int, n: int) -> list[str]:
    """The paper's feedback loop: after each decision the chosen backend's queue grows by one."""
    chosen = []
    for k in range(n):
        d = p.choose(request(tokens, f"r{k}"), backends, now=0.0)
        i = next(j for j, b in enumerate(backends) if b.id == d.backend.id)
        backends[i] = dataclasses.replace(backends[i], queue_depth=backends[i].queue_depth + 1)
        chosen.append(d.backend.id)
    return chosen


def test_defaults_are_the_papers() -> None:
    p = HeteroServe()
    assert (p.w1, p.w2, p.w3) == (1.0, 1.0, 100.0)
    assert p.name == "heteroserve"
    built = build_policy("heteroserve", {"w1": 0.5, "w3": 1000})
    assert isinstance(built, HeteroServe)
    assert (built.w1, built.w2, built.w3) == (0.5, 1.0, 1000.0)


def test_idle_cluster_sends_long_prompt_to_highest_flops_gpu() -> None:
    backends = cluster({"L40S": 1, "A100-80GB": 1, "H100": 1})
    d = HeteroServe().choose(request(4096), backends, now=0.0)
    assert d.backend.gpu == "H100"
    prefill = {c.backend_id: c.prefill for c in d.costs}
    assert prefill["h100-0"] < prefill["l40s-0"] < prefill["a100-80gb-0"]
    # §3.3: a 4096-token prompt costs 2.7x more prefill on an L40S than on an H100.
    assert prefill["l40s-0"] / prefill["h100-0"] == pytest.approx(2.7, abs=0.05)


def test_busy_fast_gpu_loses_to_idle_slower_one() -> None:
    backends = cluster({"H100": 1, "L40S": 1, "A100-80GB": 1})
    backends[0] = dataclasses.replace(backends[0], queue_depth=10)
    d = HeteroServe().choose(request(4096), backends, now=0.0)
    assert d.backend.id == "l40s-0"          # the next-fastest idle GPU
    assert d.costs[0].queue == pytest.approx(10 * backends[0].mean_service_s)


def test_queue_term_spreads_load_through_the_feedback_loop() -> None:
    chosen = route_with_feedback(HeteroServe(), cluster(DEMO), tokens=1024, n=200)
    counts = Counter(chosen)
    assert chosen[:2] == ["h100-0", "h100-1"]      # idle H100s first
    assert set(counts) == {b.id for b in cluster(DEMO)}   # every GPU takes overflow
    per_gpu = {gpu: counts[f"{gpu.lower()}-0"] for gpu in DEMO}
    # Shorter T̄_service drains faster and attracts more: H100 > A100 (2 TB/s) > L40S (0.86 TB/s).
    assert per_gpu["H100"] > per_gpu["A100-80GB"] > per_gpu["L40S"]


def test_without_queue_term_everything_piles_onto_one_gpu() -> None:
    chosen = route_with_feedback(policy(w2=0.0), cluster(DEMO), tokens=1024, n=50)
    assert set(chosen) == {"h100-0"}


def test_oom_veto_excludes_gpu_that_would_otherwise_win() -> None:
    tokens = 4096
    backends = cluster({"A100-80GB": 1, "H100": 1, "L40S": 1})
    kv = backends[1].kv_bytes_per_token
    backends[1] = dataclasses.replace(backends[1], kv_free_bytes=tokens * kv - 1)
    d = HeteroServe().choose(request(tokens), backends, now=0.0)
    assert d.backend.id == "l40s-0"
    assert d.vetoed == ("h100-0",)
    assert d.costs[1].oom == 100.0
    assert d.costs[1].total == pytest.approx(d.costs[1].prefill + 100.0)


def test_request_that_exactly_fits_is_not_vetoed() -> None:
    tokens = 4096
    h100 = snapshot("h100", "H100")
    h100 = dataclasses.replace(h100, kv_free_bytes=tokens * h100.kv_bytes_per_token)
    d = HeteroServe().choose(request(tokens), [snapshot("l40s", "L40S"), h100], now=0.0)
    assert d.backend.id == "h100"
    assert d.vetoed == ()


def test_veto_is_a_penalty_not_an_exclusion() -> None:
    """With every GPU vetoed the cheapest one still wins (Eq. 1 adds w3, it does not filter)."""
    backends = [dataclasses.replace(b, kv_free_bytes=0) for b in cluster({"L40S": 1, "H100": 1})]
    d = HeteroServe().choose(request(100), backends, now=0.0)
    assert d.backend.id == "h100-0"
    assert len(d.vetoed) == 2


def test_cost_terms_match_hand_computed_numbers() -> None:
    # LLaVA-1.5-7B: P = 7.06e9. H100: 989 TFLOPS; L40S: 362 TFLOPS. L_r = 1000.
    h100 = dataclasses.replace(snapshot("h100", "H100"), queue_depth=3, mean_service_s=0.4)
    l40s = dataclasses.replace(snapshot("l40s", "L40S"), queue_depth=0, kv_free_bytes=999 * 524288)
    d = policy(w1=2.0, w2=0.5, w3=100.0).choose(request(1000), [h100, l40s], now=0.0)
    h, lc = d.costs
    assert h.backend_id == "h100" and lc.backend_id == "l40s"
    assert h.prefill == pytest.approx(2 * 2 * 7.06e9 * 1000 / 989e12)   # 0.0285541
    assert h.prefill == pytest.approx(0.028554095, rel=1e-8)
    assert h.queue == pytest.approx(0.5 * 3 * 0.4)                     # 0.6
    assert h.oom == 0.0
    assert h.total == pytest.approx(0.628554095, rel=1e-8)
    assert lc.prefill == pytest.approx(0.078011050, rel=1e-8)          # 2 · 2·7.06e9·1000 / 362e12
    assert lc.queue == 0.0
    assert lc.oom == 100.0                                             # 1000 tokens > 999 free
    assert lc.total == pytest.approx(100.078011050, rel=1e-10)
    assert d.backend.id == "h100"
    assert d.cost == h.total
    assert d.policy == "heteroserve"


def _sjf_choice(tokens: int, backends: Sequence[BackendSnapshot]) -> str:
    times = [tokens * b.prefill_s_per_token for b in backends]
    return backends[times.index(min(times))].id


def test_w2_zero_is_device_specific_shortest_job_first() -> None:
    rng = random.Random(11)
    p = policy(w2=0.0)
    gpus = ["H100", "H200", "A100-80GB", "L40S", "L4", "RTX-4090"]
    for trial in range(200):
        backends = [
            snapshot(f"b{i}", rng.choice(gpus), queue_depth=rng.randint(0, 50))
            for i in range(rng.randint(1, 12))
        ]
        tokens = rng.randint(1, 4096)
        d = p.choose(request(tokens), backends, now=0.0)
        assert d.backend.id == _sjf_choice(tokens, backends), trial
        # Independent of the queues: reshuffling them changes nothing.
        depths = [b.queue_depth for b in backends]
        rng.shuffle(depths)
        reshuffled = [dataclasses.replace(b, queue_depth=q) for b, q in zip(backends, depths, strict=True)]
        assert p.choose(request(tokens), reshuffled, now=0.0).backend.id == d.backend.id


def test_w1_zero_is_shortest_queue() -> None:
    rng = random.Random(12)
    hetero, sq = policy(w1=0.0), ShortestQueue()
    for trial in range(300):
        backends = [
            dataclasses.replace(b, mean_service_s=0.25, kv_free_bytes=b.kv_total_bytes)
            for b in random_cluster(rng, rng.randint(1, 16), max_queue=4)   # small range: many ties
        ]
        r = request(rng.randint(1, 4096))
        assert hetero.choose(r, backends, now=0.0).backend.id == sq.choose(r, backends, now=0.0).backend.id, trial


def algorithm_1(p: HeteroServe, request: RequestProfile, candidates: Sequence[BackendSnapshot]) -> Decision:
    """The paper's Algorithm 1, written as the plain loop, as the reference for the policy."""
    best_i, best = 0, float("inf")
    costs = []
    for i, b in enumerate(candidates):
        c1 = p.w1 * request.input_tokens * b.prefill_s_per_token
        c2 = p.w2 * b.queue_depth * b.mean_service_s
        c3 = p.w3 if request.input_tokens > b.kv_free_bytes / b.kv_bytes_per_token else 0.0
        c = c1 + c2 + c3
        costs.append(CostTerms(b.id, c1, c2, c3, c))
        if c < best:
            best_i, best = i, c
    return Decision(candidates[best_i], "heteroserve", tuple(costs))


def _odd(rng: random.Random, b: BackendSnapshot) -> BackendSnapshot:
    """Ties, empty queues, infinite service times (0 · inf = NaN) and a zero-free KV cache."""
    return dataclasses.replace(
        b,
        queue_depth=rng.choice([0, 0, 1, b.queue_depth]),
        mean_service_s=rng.choice([0.5, 0.5, b.mean_service_s, float("inf")]),
        kv_free_bytes=rng.choice([0, b.kv_free_bytes, b.kv_total_bytes]),
    )


@pytest.mark.parametrize(
    ("w1", "w2", "w3"), [(1, 1, 100), (0, 1, 100), (1, 0, 100), (0, 0, 0), (1, 1, float("inf")), (2.5, 0.1, 7)]
)
def test_matches_algorithm_1_exactly(w1: float, w2: float, w3: float) -> None:
    rng = random.Random(f"{w1}/{w2}/{w3}")
    p = policy(w1, w2, w3)
    for trial in range(120):
        backends = random_cluster(rng, rng.randint(1, 24), max_queue=3)
        if trial % 2:
            backends = [_odd(rng, b) for b in backends]
        r = request(rng.choice([1, 576, rng.randint(1, 32768)]))
        got, want = p.choose(r, backends, now=0.0), algorithm_1(p, r, backends)
        assert got.backend.id == want.backend.id, trial
        assert repr(got.costs) == repr(want.costs), trial    # repr: NaN == NaN


def test_choose_is_pure() -> None:
    backends = random_cluster(random.Random(3), 32)
    before = list(backends)
    p = HeteroServe()
    first = p.choose(request(2048), backends, now=0.0)
    again = p.choose(request(2048), backends, now=123.0)
    assert first == again
    assert backends == before


class CountingSnapshot:
    """Stands in for a BackendSnapshot and counts every attribute read."""

    __slots__ = ("_snap", "reads")

    def __init__(self, snap: BackendSnapshot) -> None:
        self._snap = snap
        self.reads = 0

    def __getattr__(self, name: str) -> Any:
        self.reads += 1
        return getattr(self._snap, name)


@pytest.mark.parametrize("n", [1, 8, 64, 1024])
def test_decision_is_linear_each_candidate_evaluated_once(n: int) -> None:
    wrapped = [CountingSnapshot(b) for b in random_cluster(random.Random(n), n)]
    d: Decision = HeteroServe().choose(request(1500), cast(list[BackendSnapshot], wrapped), now=0.0)
    assert [c.backend_id for c in d.costs] == [w._snap.id for w in wrapped]
    reads = {w.reads for w in wrapped}
    assert len(reads) == 1                      # the same constant work for every candidate ...
    assert 1 <= reads.pop() <= 18               # ... the fields of its columns, read once each
    assert sum(w.reads for w in wrapped) <= 18 * n

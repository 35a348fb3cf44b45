"""The emulated engine's batcher: chunked prefill beside decodes, or prefill-first (whole prompts while decodes wait).

The prefix replay over the engine family (benchmarks/prefix_family.py) gives the family's prefill-first
members this scheduler; a step that mixed decodes into a prefill-first step, or split a prompt, would
replay them as chunked engines and hide what the family is there to show.
"""

from __future__ import annotations

import dataclasses

import pytest

from benchmarks.emulated_engine import TIERS, Batcher, Seq
from benchmarks.prefix_affinity import run
from benchmarks.prefix_family import member_cluster
from loadtest.sim.family import family

H100 = TIERS["H100"]


def test_prefill_first_prefills_whole_prompts_while_decodes_wait() -> None:
    tier = dataclasses.replace(H100, max_batched_tokens=1000, prefill_first=True)
    b = Batcher(tier)
    a = Seq(100, 5, 0.0)
    b.waiting.append(a)
    plan = b.plan()
    assert plan is not None and plan.first == [a] and plan.decoded == []
    assert plan.duration_s == pytest.approx(tier.step_base_s + 100 * (tier.prefill_s_per_token + tier.kv_read_s))
    b.apply(plan)
    long, short = Seq(800, 5, 0.0), Seq(300, 5, 0.0)
    b.waiting.extend((long, short))

    plan = b.plan()   # the running request waits; the two prompts pass the budget together: one step each
    assert plan is not None and plan.first == [long] and plan.decoded == [] and long.prefilled == 800
    # the step reads the new prompt's KV, not the waiting request's (as the engine family's model has it)
    assert plan.duration_s == pytest.approx(tier.step_base_s + 800 * (tier.prefill_s_per_token + tier.kv_read_s))
    b.apply(plan)
    plan = b.plan()
    assert plan is not None and plan.first == [short] and plan.decoded == []
    b.apply(plan)
    plan = b.plan()   # nothing left to prefill: every running sequence decodes
    assert plan is not None and plan.first == [] and plan.decoded == [a, long, short]
    assert plan.duration_s == pytest.approx(tier.step_base_s + 3 * tier.per_seq_s + tier.kv_read_s * (101 + 801 + 301))


def test_chunked_prefill_decodes_beside_the_chunks() -> None:
    tier = dataclasses.replace(H100, max_batched_tokens=256)
    b = Batcher(tier)
    a = Seq(100, 5, 0.0)
    b.waiting.append(a)
    plan = b.plan()
    assert plan is not None
    b.apply(plan)
    long = Seq(800, 5, 0.0)
    b.waiting.append(long)
    plan = b.plan()
    assert plan is not None and plan.decoded == [a] and plan.first == [] and long.prefilled == 255


def test_a_family_member_replays_on_its_own_engines() -> None:
    member = next(m for m in family() if m.engine.scheduling == "prefill_first")
    cluster = member_cluster(member)
    assert [eid for eid, _ in cluster] == [eid for eid, _ in member.engines]
    for (_, speed), (_, tier) in zip(cluster, member.engines, strict=True):
        assert speed.prefill_first and speed.name == tier.gpu and speed.kv_tokens == tier.kv_tokens
        assert speed.prefill_s_per_token == tier.prefill_s_per_token
        assert speed.max_num_seqs == member.engine.max_num_seqs

    rows, _ = run(["multiturn"], ["cwlor", "hg-cache"], [1], [1.0], 12, 0, 4, 4, 0.2, log=lambda _: None,
                  cluster=cluster)
    by_target = {r["target"]: r for r in rows}
    assert set(by_target) == {"cwlor", "hg-cache"}
    gpus = {t.gpu for t in member.tiers}
    for row in rows:
        assert row["requests"] >= 12 and 0.0 <= row["goodput"] <= 1.0
        assert set(row["tier_shares"]) <= gpus
    # Conversations resend their history: the gateway's index predicts hits and the engines report them.
    assert by_target["hg-cache"]["hit_rate"] > 0.3
    assert by_target["hg-cache"]["reported_hit_rate"] > 0.3

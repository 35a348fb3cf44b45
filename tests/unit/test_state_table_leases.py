"""The state table's leases: the router's own prefill backlog and KV reservations, and what they teach."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.config.cluster import load_cluster
from gateway.routing.backend_entry import Reported
from gateway.routing.state_table import StateTable
from gateway.runtime import build_runtime
from tests.config_files import write
from tests.snapshots import catalog


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def table(clock: Clock, external: bool = True) -> StateTable:
    t = StateTable(catalog().model("llava-1.5-7b"), heartbeat_interval_s=0.2, clock=clock)
    t.register("b", "language", catalog().gpu("L40S"), address="http://x", managed=False, external=external)
    t.apply_heartbeat("b", 1, "http://x", Reported(kv_free_bytes=1 << 30, kv_total_bytes=1 << 30))
    return t


def test_backlog_and_reservations_follow_each_lease() -> None:
    clock = Clock()
    t = table(clock)
    a = t.acquire("b", 1000, 100)
    b = t.acquire("b", 500, 50)
    assert (a.tokens_ahead, b.tokens_ahead) == (1000, 1500)
    snap = t.candidates(("language",))[0]
    assert (snap.in_flight, snap.prefilling, snap.prefill_backlog_tokens, snap.kv_reserved_tokens) == (2, 2, 1500, 1650)
    clock.t += 0.4
    t.first_token(a)
    t.first_token(a)   # a second call changes nothing
    snap = t.candidates(("language",))[0]
    assert (snap.in_flight, snap.prefilling, snap.prefill_backlog_tokens) == (2, 1, 500)
    t.release(b)       # abandoned before its first token
    snap = t.candidates(("language",))[0]
    assert (snap.in_flight, snap.prefilling, snap.prefill_backlog_tokens, snap.kv_reserved_tokens) == (1, 0, 0, 1100)
    clock.t += 1.0
    t.release(a, completion_tokens=11)
    snap = t.candidates(("language",))[0]
    assert (snap.in_flight, snap.kv_reserved_tokens) == (0, 0)


def test_first_tokens_and_completions_teach_the_backend_speed() -> None:
    clock = Clock()
    t = table(clock)
    entry = t.get("b")
    assert entry is not None
    prior_step = entry.speed.decode.value
    for _ in range(40):
        lease = t.acquire("b", 2000, 20)
        clock.t += 0.05 + 2000 * 0.3e-3
        t.first_token(lease)
        clock.t += 19 * 0.05
        t.release(lease, completion_tokens=20)
    snap = t.candidates(("language",))[0]
    assert snap.decode_step_s == pytest.approx(0.05, rel=0.15)
    assert snap.decode_step_s > 2 * prior_step
    assert snap.learned_prefill_s_per_token == pytest.approx(0.3e-3, rel=0.25)
    assert snap.prefill_s_per_token < snap.learned_prefill_s_per_token / 3   # the datasheet prior stays apart


def test_a_first_token_of_a_prompt_predicted_cached_teaches_no_prefill_speed() -> None:
    """2,000-token prompts, every other one with 1,900 cached: its first token takes a step, 100 tokens'
    prefill and 0.1 s attending to the cached 1,900 tokens' KV. Over the 100 tokens predicted uncached
    that read as 1.3 ms a token, 4x the 0.3 ms the misses show; such samples are not taken."""
    clock = Clock()
    t = table(clock)
    entry = t.get("b")
    assert entry is not None
    for k in range(40):
        cached = 1900 if k % 2 else 0
        lease = t.acquire("b", 2000, 20, cached)
        clock.t += 0.05 + (2000 - cached) * 0.3e-3 + (0.1 if cached else 0.0)
        t.first_token(lease)
        clock.t += 19 * 0.05
        t.release(lease, completion_tokens=20)
    assert entry.speed.prefill.samples == 20
    assert t.candidates(("language",))[0].learned_prefill_s_per_token == pytest.approx(0.3e-3, rel=0.25)


def test_an_external_engines_latency_figure_is_not_taken_as_service_time() -> None:
    """vLLM's e2e latency includes queueing: the learned service time is used instead."""
    clock = Clock()
    t = table(clock)
    t.apply_heartbeat("b", 2, "http://x", Reported(kv_free_bytes=1 << 30, kv_total_bytes=1 << 30, mean_service_s=60.0))
    entry = t.get("b")
    assert entry is not None
    assert t.candidates(("language",))[0].mean_service_s == entry.speed.service_s != 60.0
    managed = table(clock, external=False)
    managed.apply_heartbeat("b", 2, "", Reported(kv_free_bytes=1 << 30, kv_total_bytes=1 << 30, mean_service_s=3.0))
    assert managed.candidates(("language",))[0].mean_service_s == 3.0


def test_each_lease_holds_an_inter_token_deadline_that_later_prompts_use_up() -> None:
    clock = Clock()
    t = table(clock)
    entry = t.get("b")
    assert entry is not None
    p, step = entry.speed.prefill.value, entry.speed.decode.value
    short = t.acquire("b", 100, 5)      # 4 intervals of the 100 ms default target
    long = t.acquire("b", 2000, 200)
    assert t.candidates(("language",))[0].itl_slack_s == pytest.approx(
        (4 * (0.1 - step) - 2000 * p, 199 * (0.1 - step)))
    t.first_token(short)
    t.release(short, completion_tokens=5)
    assert t.candidates(("language",))[0].itl_slack_s == pytest.approx((199 * (0.1 - step),))
    t.release(long)
    assert t.candidates(("language",))[0].itl_slack_s == ()


def test_the_inter_token_target_is_the_tables() -> None:
    t = StateTable(catalog().model("llava-1.5-7b"), heartbeat_interval_s=0.2, clock=Clock(), itl_target_s=0.05)
    t.register("b", "language", catalog().gpu("H100"), address="http://x", managed=False, external=True)
    t.apply_heartbeat("b", 1, "http://x", Reported(kv_free_bytes=1 << 30, kv_total_bytes=1 << 30))
    entry = t.get("b")
    assert entry is not None
    t.acquire("b", 10, 11)
    assert t.candidates(("language",))[0].itl_slack_s == pytest.approx((10 * (0.05 - entry.speed.decode.value),))


def test_the_gateway_takes_its_inter_token_target_from_the_routing_config(tmp_path: Path) -> None:
    body = "gateway: {routing: {itl_target_ms: 50}}\nbackends:\n  - {id: a, gpu: H100, launch: {}}\n"
    assert build_runtime(load_cluster(write(tmp_path, body), catalog())).table.itl_target_s == 0.05
    default = "backends:\n  - {id: a, gpu: H100, launch: {}}\n"
    assert build_runtime(load_cluster(write(tmp_path, default), catalog())).table.itl_target_s == 0.1


def test_a_lease_of_a_backend_removed_or_replaced_while_it_ran_counts_nowhere() -> None:
    """A drain that ran out of time cuts a request whose backend is then removed (and perhaps added again,
    a SIGHUP restore): its end must neither raise nor take a request off the new entry's counts."""
    clock = Clock()
    t = table(clock)
    lease = t.acquire("b", 1000, 100)
    t.drain("b")
    t.cut("b")
    t.unregister("b")
    t.first_token(lease)
    t.release(lease, completion_tokens=3)   # no KeyError
    assert t.was_cut("b")
    t.register("b", "language", catalog().gpu("L40S"), address="http://x", managed=False, external=True)
    assert not t.was_cut("b")
    fresh = t.acquire("b", 500, 50)
    t.release(lease)   # the old lease again: the new entry keeps its own
    snap = t.candidates(("language",))[0]
    assert (snap.in_flight, snap.kv_reserved_tokens) == (1, 550)
    t.release(fresh)


def test_an_encode_on_an_encoder_removed_or_replaced_while_it_ran_counts_nowhere() -> None:
    """A drain shorter than an encode lets the encoder go while the encode runs: its end must neither
    raise (it did: a KeyError in the dispatch's `finally`, a 500) nor lower the new entry's backlog."""
    clock = Clock()
    t = StateTable(catalog().model("llava-1.5-7b"), heartbeat_interval_s=0.2, clock=clock)
    gpu = catalog().gpu("L40S")
    t.register("enc", "vision", gpu, address="http://x", managed=False, external=True)
    old = t.acquire_vision("enc", 576)
    t.unregister("enc")
    t.release_vision(old, 576)   # no KeyError
    t.register("enc", "vision", gpu, address="http://x", managed=False, external=True)
    t.apply_heartbeat("enc", 1, "http://x", Reported(kv_free_bytes=1 << 30, kv_total_bytes=1 << 30))
    fresh = t.acquire_vision("enc", 1152)
    t.release_vision(old, 576)   # the old encode again: the new entry keeps its own
    entry = t.get("enc")
    assert entry is not None and entry.vision_in_flight_tokens == 1152
    t.release_vision(fresh, 1152)
    assert entry.vision_in_flight_tokens == 0

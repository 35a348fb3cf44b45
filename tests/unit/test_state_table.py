"""Heartbeat ordering in the state table: per sender, so a backend's own engine always wins back its
entry; and what a snapshot says, field by field."""

from __future__ import annotations

import dataclasses

from common import perf_model
from gateway.routing.state_table import PeerLoad, Reported, StateTable
from tests.snapshots import catalog


def table() -> StateTable:
    t = StateTable(catalog().model("llava-1.5-7b"), 0.1, 3, clock=lambda: 1.0)
    t.register("h100-0", "language", catalog().gpu("H100"), address=None, managed=True)
    return t


def test_out_of_order_messages_of_one_sender_are_dropped() -> None:
    t = table()
    assert t.apply_heartbeat("h100-0", 10, "127.0.0.1:7000", Reported(seq=10, pid=1, waiting=3)) is not None
    assert t.apply_heartbeat("h100-0", 9, "127.0.0.1:7000", Reported(seq=9, pid=1, waiting=9)) is None
    assert t.get("h100-0").reported.waiting == 3  # type: ignore[union-attr]


def test_a_backend_whose_heartbeats_were_taken_over_recovers_when_its_own_engine_reports() -> None:
    t = table()
    t.apply_heartbeat("h100-0", 1_000, "127.0.0.1:7000", Reported(seq=1_000, pid=1))
    # another process, started later (so with larger sequence numbers), reports under the same id
    t.apply_heartbeat("h100-0", 5_000, "127.0.0.1:9999", Reported(seq=5_000, pid=2))
    assert t.get("h100-0").address == "127.0.0.1:9999"  # type: ignore[union-attr]
    entry = t.apply_heartbeat("h100-0", 1_001, "127.0.0.1:7000", Reported(seq=1_001, pid=1, waiting=4))
    assert entry is not None and entry.address == "127.0.0.1:7000" and entry.reported.waiting == 4


def test_a_relaunched_backend_is_no_candidate_until_ready_again() -> None:
    t = table()
    t.apply_heartbeat("h100-0", 1, "127.0.0.1:7000", Reported(seq=1, pid=1))
    assert [b.id for b in t.candidates(("language",))] == ["h100-0"]
    t.set_lifecycle("h100-0", "restarting")
    assert not t.candidates(("language",))
    t.set_lifecycle("h100-0", "starting")
    t.apply_heartbeat("h100-0", 2, "127.0.0.1:7001", Reported(seq=2, pid=3))
    assert not t.candidates(("language",))
    t.set_lifecycle("h100-0", "ready")
    assert [b.id for b in t.candidates(("language",))] == ["h100-0"]


def test_an_engine_that_stops_serving_takes_its_queue_with_it() -> None:
    """Its last report's gauges are not left standing (the operator's view, the autoscaler's demand);
    its counters are kept."""
    t = table()
    t.apply_heartbeat("h100-0", 1, "127.0.0.1:7000", Reported(seq=1, pid=1, waiting=5, running=3, vision_backlog=900,
                                                               tokens_generated=4_000, requests_completed=20))
    entry = t.get("h100-0")
    assert entry is not None and t.snapshot(entry).queue_depth == 8 and t.snapshot(entry).vision_backlog == 900
    t.set_lifecycle("h100-0", "restarting")
    snap = t.snapshot(entry)
    assert (snap.queue_depth, snap.vision_backlog, entry.reported.waiting, entry.reported.running) == (0, 0, 0, 0)
    assert (entry.reported.tokens_generated, entry.reported.requests_completed) == (4_000, 20)


def test_a_snapshot_holds_each_signal_in_the_field_of_its_name() -> None:
    """Every input of a snapshot set to a value of its own: each field must show the one it is named for."""
    model, gpu = catalog().model("llava-1.5-7b"), catalog().gpu("L40S")
    t = StateTable(model, 0.1, 3, clock=lambda: 1.0)
    e = t.register("l40s-0", "both", gpu, address=None, managed=True, steal=True)
    per_token = model.kv_bytes_per_token
    t.apply_heartbeat("l40s-0", 1, "127.0.0.1:7000", Reported(
        seq=1, waiting=40, running=50, kv_free_bytes=1_000 * per_token, kv_total_bytes=3_000 * per_token,
        vision_backlog=2, mean_service_s=0.7, max_model_len=4096, kv_source="engine"))
    e.in_flight, e.vision_in_flight_tokens, e.prefilling = 3, 19, 23
    e.prefill_backlog_tokens, e.kv_reserved_tokens = 29, 31
    e.peer = PeerLoad(in_flight=5, vision_tokens=7, prefilling=11, prefill_backlog_tokens=13, kv_reserved_tokens=17)
    e.foreign_running, e.foreign_backlog_tokens = 37, 41   # other clients' requests there
    e.speed.prefill.value, e.speed.decode.value = 1.25e-4, 0.0375
    e.speed.decode_model.coefficients = (0.02, 1.5, 0.004)
    e.slack.add(100, 64, 1e-4, 0.01)
    e.snapshot = None
    got = dataclasses.asdict(t.snapshot(e))
    assert got == {
        "id": "l40s-0", "role": "both", "gpu": "L40S", "tflops": gpu.tflops, "bandwidth_gbs": gpu.bandwidth_gbs,
        "price_per_hour": gpu.price_per_hour, "queue_depth": 90, "in_flight": 8, "kv_free_bytes": 1_000 * per_token,
        "kv_total_bytes": 3_000 * per_token, "kv_bytes_per_token": per_token, "vision_backlog": 26,
        "mean_service_s": 0.7, "prefill_s_per_token": perf_model.prefill_seconds_per_token(model, gpu),
        "weight_bytes": model.weight_bytes, "encode_s_per_token": perf_model.encode_seconds(model, gpu, 1),
        "steal": True, "max_context": 4096, "learned_prefill_s_per_token": 1.25e-4, "decode_step_s": 0.0375,
        "prefilling": 34, "prefill_backlog_tokens": 83, "kv_reserved_tokens": 48, "itl_slack_s": e.slack.slacks(),
        "stall_factor": 1.5, "stall_per_prompt_s": 0.004, "foreign_running": 37,
    }
    assert got["itl_slack_s"]   # a lease's slack is there to be misplaced too


def test_the_table_knows_which_roles_it_has() -> None:
    """The router skips work stealing in a cluster without vision backends: the table must say so, and
    stop saying so as soon as one registers."""
    t = table()
    assert t.has_role(("language", "both")) and not t.has_role(("vision",))
    t.register("l4-0", "vision", catalog().gpu("L4"), address=None, managed=True, steal=True)
    assert t.has_role(("vision",))


def test_backends_kept_for_a_class_are_closed_to_the_classes_below_it() -> None:
    t = table()
    gpu = catalog().gpu("H100")
    t.register("h100-1", "language", gpu, address=None, managed=True, min_priority=1)
    t.register("h100-2", "language", gpu, address=None, managed=True, min_priority=2)
    assert t.closed_to(0) == ("h100-1", "h100-2") and t.closed_to(1) == ("h100-2",) and t.closed_to(2) == ()
    assert t.closed_to(-5) == ("h100-1", "h100-2")
    t.register("h100-2", "language", gpu, address=None, managed=True)   # registered again, open to all
    t.unregister("h100-1")
    assert t.closed_to(0) == ()


def test_a_backend_assumed_alive_stays_a_candidate_past_its_last_heartbeat() -> None:
    """Shared state away: a replica keeps the backends it heard of only through Redis alive. The pool read
    the heartbeat once: each backend it did not route to since dropped out of the candidates while
    /ready and /admin/backends called it healthy, and requests got 503 with a healthy backend held."""
    now = [1.0]
    t = StateTable(catalog().model("llava-1.5-7b"), 0.1, 3, clock=lambda: now[0])
    for backend_id, gpu in (("h100-0", "H100"), ("l40s-0", "L40S")):
        t.register(backend_id, "language", catalog().gpu(gpu), address=None, managed=True)
        t.apply_heartbeat(backend_id, 1, f"{backend_id}:7000", Reported(seq=1, pid=1))
    assert sorted(b.id for b in t.candidates(("language",), now=now[0])) == ["h100-0", "l40s-0"]
    for _ in range(20):   # two seconds of the replica's refresh ticks, well past the miss limit
        now[0] += 0.1
        for backend_id in ("h100-0", "l40s-0"):
            t.assume_alive(backend_id)
        assert t.is_healthy(t.get("l40s-0"))  # type: ignore[arg-type]
        assert sorted(b.id for b in t.candidates(("language",), now=now[0])) == ["h100-0", "l40s-0"]

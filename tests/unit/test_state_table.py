"""Heartbeat ordering in the state table: per sender, so a backend's own engine always wins back its entry."""

from __future__ import annotations

from gateway.state_table import Reported, StateTable
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

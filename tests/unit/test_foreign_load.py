"""Other clients' requests in an engine, as the state table reads them from its reports: what the engine
counts beyond every replica's in flight there; those waiting priced as prefill backlog at the mean prompt
this gateway's requests prefill, the rest running beside its own (n_i). Nothing where the gateway's own
requests account for the engine's count, nothing from a stale report, nothing in the blind snapshot."""

from __future__ import annotations

from gateway.routing.state_table import PeerLoad, Reported, StateTable
from tests.snapshots import catalog


def table() -> StateTable:
    t = StateTable(catalog().model("llava-1.5-7b"), 0.1, 3, clock=lambda: 1.0)
    t.register("h100-0", "language", catalog().gpu("H100"), address=None, managed=False, external=True)
    return t


def test_what_the_engine_counts_beyond_the_gateways_requests_is_other_clients() -> None:
    t = table()
    for prompt in (400, 600):   # two requests of the gateway's, first tokens not yet come: the mean is 500
        t.acquire("h100-0", prompt, 64)
    t.apply_heartbeat("h100-0", 1, "", Reported(seq=1, waiting=5, running=4))   # 9 requests, 2 of them ours
    entry = t.get("h100-0")
    assert entry is not None
    assert (entry.foreign_waiting, entry.foreign_running, entry.foreign_backlog_tokens) == (5, 2, 2_500)
    snap = t.snapshot(entry)
    assert snap.prefill_backlog_tokens == 1_000 + 2_500 and snap.in_flight == 2 + 2 and snap.queue_depth == 9
    assert t._blind(entry).prefill_backlog_tokens == 1_000 and t._blind(entry).in_flight == 2


def test_the_gateways_own_requests_and_its_peers_are_not_foreign() -> None:
    t = table()
    t.acquire("h100-0", 500, 64)
    entry = t.get("h100-0")
    assert entry is not None
    entry.peer = PeerLoad(in_flight=3)   # another replica's three requests there
    t.apply_heartbeat("h100-0", 1, "", Reported(seq=1, waiting=2, running=2))
    assert (entry.foreign_waiting, entry.foreign_running, entry.foreign_backlog_tokens) == (0, 0, 0)


def test_a_stale_report_and_a_stopped_engine_leave_no_foreign_load() -> None:
    t = table()
    t.acquire("h100-0", 500, 64)
    t.apply_heartbeat("h100-0", 1, "", Reported(seq=1, waiting=10**9, running=7))   # the stale-metrics marker
    entry = t.get("h100-0")
    assert entry is not None and (entry.foreign_waiting, entry.foreign_running) == (0, 0)
    t.apply_heartbeat("h100-0", 2, "", Reported(seq=2, waiting=4, running=1))
    assert (entry.foreign_waiting, entry.foreign_running) == (4, 0)
    t.set_lifecycle("h100-0", "restarting")
    assert (entry.foreign_waiting, entry.foreign_running, entry.foreign_backlog_tokens) == (0, 0, 0)

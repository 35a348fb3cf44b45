"""Other clients' requests in an engine, as the state table reads them from its reports: what the engine
counts beyond this gateway's own engine requests and the other replicas' in flight there, the smaller
count of its last two reports; those waiting priced as prefill backlog at the mean prompt this gateway's
requests prefill, the rest running beside its own (n_i). None where the gateway's own requests account
for the engine's count (a request of n choices is n engine requests; one let go that the engine drops a
moment later is in one report at most), none from a stale report, none in the blind snapshot."""

from __future__ import annotations

from gateway.routing.state_table import PeerLoad, Reported, StateTable
from tests.snapshots import catalog

BACKEND = "h100-0"


def table() -> StateTable:
    t = StateTable(catalog().model("llava-1.5-7b"), 0.1, 3, clock=lambda: 1.0)
    t.register(BACKEND, "language", catalog().gpu("H100"), address=None, managed=False, external=True)
    return t


def report(t: StateTable, seq: int, waiting: int, running: int) -> None:
    t.apply_heartbeat(BACKEND, seq, "", Reported(seq=seq, waiting=waiting, running=running))


def foreign(t: StateTable) -> tuple[int, int, int]:
    e = t.get(BACKEND)
    assert e is not None
    return e.foreign_waiting, e.foreign_running, e.foreign_backlog_tokens


def test_what_the_engine_counts_beyond_the_gateways_requests_in_two_reports_is_other_clients() -> None:
    t = table()
    for prompt in (400, 600):   # two requests of the gateway's, first tokens not yet come: the mean is 500
        t.acquire(BACKEND, prompt, 64)
    report(t, 1, 5, 4)   # 9 requests, 2 of them the gateway's: one report is not enough
    assert foreign(t) == (0, 0, 0)
    report(t, 2, 6, 4)
    assert foreign(t) == (6, 1, 3_000)   # 7 then 8 beyond its own: 7, of them 6 waiting (the last report's)
    entry = t.get(BACKEND)
    assert entry is not None
    snap = t.snapshot(entry)
    assert (snap.prefill_backlog_tokens, snap.in_flight, snap.foreign_running, snap.queue_depth) == (4_000, 2, 1, 10)
    blind = t._blind(entry)
    assert (blind.prefill_backlog_tokens, blind.foreign_running) == (1_000, 0)


def test_a_request_of_n_choices_and_a_request_let_go_are_not_foreign() -> None:
    t = table()
    t.acquire(BACKEND, 500, 64, engine_requests=8)   # n = 8: the engine counts eight requests
    gone = t.acquire(BACKEND, 500, 64)
    t.release(gone)   # cancelled: the engine drops it a moment later
    report(t, 1, 9, 0)
    report(t, 2, 8, 0)
    assert foreign(t) == (0, 0, 0)


def test_the_other_replicas_requests_are_not_foreign_whenever_they_are_shared() -> None:
    t = table()
    t.acquire(BACKEND, 500, 64)
    entry = t.get(BACKEND)
    assert entry is not None
    t.set_peer_load(BACKEND, PeerLoad(in_flight=3))   # another replica's three requests there
    report(t, 1, 2, 2)
    report(t, 2, 2, 2)
    assert foreign(t) == (0, 0, 0)
    report(t, 3, 2, 4)   # its two new requests counted before this replica heard of them ...
    report(t, 4, 2, 4)
    assert foreign(t) == (2, 0, 1_000)
    t.set_peer_load(BACKEND, PeerLoad(in_flight=5))   # ... are the other replica's, not other clients'
    assert foreign(t) == (0, 0, 0) and t.snapshot(entry).in_flight == 6


def test_a_stale_report_and_a_stopped_engine_leave_no_foreign_load() -> None:
    t = table()
    t.acquire(BACKEND, 500, 64)
    report(t, 1, 4, 1)
    report(t, 2, 10**9, 7)   # the stale-metrics marker
    assert foreign(t) == (0, 0, 0)
    report(t, 3, 4, 1)
    report(t, 4, 4, 1)
    assert foreign(t)[:2] == (4, 0)
    t.set_lifecycle(BACKEND, "restarting")
    assert foreign(t) == (0, 0, 0)

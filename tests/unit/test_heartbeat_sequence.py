"""Heartbeat sequence numbers order the messages of one sender, and no single message can wedge a
backend: a Control stream orders only its own messages (another stream's are taken, whatever their
seq), and a report that comes on no stream (another replica's, through Redis) far below the last one is
a new count, not a reordered message (gateway.routing.state_table.StateTable.apply_heartbeat)."""

from __future__ import annotations

from gateway.routing.backend_entry import Reported
from gateway.routing.state_table import REORDER_WINDOW, StateTable
from tests.snapshots import catalog

ID, ADDRESS, PID = "ext-0", "127.0.0.1:7001", 4242
TOP = (1 << 64) - 1   # the largest seq the wire carries


def table() -> StateTable:
    t = StateTable(catalog().model("llava-1.5-7b"), 0.1, 3, clock=lambda: 1.0)
    t.register(ID, "language", catalog().gpu("A100-80GB"), address=ADDRESS, managed=False)
    return t


def report(t: StateTable, seq: int, waiting: int, stream: object | None = None) -> bool:
    """One heartbeat of the engine (its pid, its address), on `stream` (None: no stream); whether it was taken."""
    reported = Reported(seq=seq, pid=PID, waiting=waiting)
    if stream is None:
        return t.apply_heartbeat(ID, seq, ADDRESS, reported) is not None
    with t.reporting_on(stream):
        return t.apply_heartbeat(ID, seq, ADDRESS, reported) is not None


def test_a_stream_orders_its_own_messages() -> None:
    t = table()
    assert report(t, 1_000, 1, stream=1)
    assert not report(t, 999, 9, stream=1) and not report(t, 1_000, 9, stream=1)
    assert report(t, 1_001, 2, stream=1)
    assert t.get(ID).reported.waiting == 2  # type: ignore[union-attr]


def test_one_message_with_the_largest_seq_on_another_stream_does_not_wedge_the_backend() -> None:
    t = table()
    assert report(t, 1_000, 1, stream=1)
    assert report(t, TOP, 50, stream=2)       # an impostor with the engine's pid and address
    assert report(t, 1_001, 2, stream=1)      # the engine's next message takes its backend back
    entry = t.get(ID)
    assert entry is not None and (entry.reported.seq, entry.reported.waiting) == (1_001, 2)
    assert not report(t, 1_000, 9, stream=1)  # and its own stream is ordered again


def test_a_report_on_no_stream_far_below_the_last_is_a_new_count() -> None:
    """Another replica's view (through Redis): a reordered report is a few behind, and is dropped; one far
    behind follows a bogus seq (or a restarted count) and is taken, so the bogus one wedges nothing."""
    t = table()
    assert report(t, 5_000, 1)
    assert not report(t, 5_000, 9)                    # the same report read again
    assert not report(t, 5_000 - REORDER_WINDOW, 9)   # a reordered one
    assert report(t, TOP, 50)
    assert report(t, 5_001, 2)
    assert t.get(ID).reported.waiting == 2  # type: ignore[union-attr]
    assert not report(t, 5_000, 9)


def test_a_report_on_no_stream_is_ordered_against_the_streams_own() -> None:
    """A replica reads back through Redis what it published of its own stream's reports: older, dropped;
    and the stream's next message is taken after a report that came on no stream."""
    t = table()
    assert report(t, 1_000, 1, stream=1)
    assert not report(t, 999, 9)
    assert report(t, 1_001, 2)                # newer, from another replica
    assert report(t, 1_002, 3, stream=1)
    assert t.get(ID).reported.waiting == 3  # type: ignore[union-attr]


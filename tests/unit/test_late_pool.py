"""A pool none of whose backends is fresh fails open on those heard from within `fail_open_s`
(`StateTable.candidates`); with a fresh backend, or past the window, the late ones are no candidates."""

from __future__ import annotations

from common.catalog import load_catalog
from gateway.routing.backend_entry import Reported
from gateway.routing.state_table import StateTable

CATALOG = load_catalog()
MODEL, GPU = CATALOG.model("llava-1.5-7b"), CATALOG.gpu("H100")
LANGUAGE = ("language",)


class Clock:
    now = 100.0

    def __call__(self) -> float:
        return self.now


def beat(t: StateTable, backend_id: str) -> None:
    entry = t.get(backend_id)
    assert entry is not None
    seq = entry.reported.seq + 1
    assert t.apply_heartbeat(backend_id, seq, "", Reported(seq=seq)) is not None


def pool(fail_open_s: float) -> tuple[StateTable, Clock]:
    """Two managed engines heard from at 100 s; unhealthy after 3 x 0.1 s of silence."""
    clock = Clock()
    t = StateTable(MODEL, heartbeat_interval_s=0.1, miss_limit=3, clock=clock, fail_open_s=fail_open_s)
    for backend_id in ("a", "b"):
        t.register(backend_id, "language", GPU, address=f"{backend_id}:1", managed=True)
        beat(t, backend_id)
    return t, clock


def ids(t: StateTable, exclude: tuple[str, ...] = ()) -> list[str]:
    return [s.id for s in t.candidates(LANGUAGE, exclude=exclude)]


def test_a_silent_pool_routes_on_the_late_ones_within_the_window() -> None:
    t, clock = pool(fail_open_s=5.0)
    clock.now = 101.0   # both past the miss limit
    assert not any(t.is_healthy(e) for e in t.entries())
    assert ids(t) == ["a", "b"] and t.failing_open
    assert ids(t, exclude=("a",)) == ["b"]   # a failed attempt is not tried again
    clock.now = 105.5   # past the window: none
    assert ids(t) == [] and not t.failing_open


def test_a_fresh_backend_leaves_the_late_ones_out() -> None:
    t, clock = pool(fail_open_s=5.0)
    clock.now = 101.0
    beat(t, "b")
    assert ids(t) == ["b"] and not t.failing_open
    assert ids(t, exclude=("b",)) == ["a"]   # b failed: only late a is left, so it is tried


def test_off_a_silent_pool_has_no_candidates() -> None:
    t, clock = pool(fail_open_s=0.0)
    clock.now = 101.0
    assert ids(t) == [] and not t.failing_open

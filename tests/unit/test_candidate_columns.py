"""The state table's candidates, kept as columns and patched per changed row, against a from-scratch
walk of the table after every kind of signal change; and what they hand out never changes after."""

from __future__ import annotations

import dataclasses
import random

import numpy as np

from common import perf_model
from common.metric_tables import SATURATED_QUEUE
from gateway.routing.backend_entry import SERVING, Lease, Reported
from gateway.routing.policies.candidates import Candidates, column_array
from gateway.routing.policies.contracts import BackendSnapshot, Role
from gateway.routing.state_table import StateTable
from tests.snapshots import MODEL, catalog, snapshot

LANGUAGE: tuple[Role, ...] = ("language", "both")
VISION: tuple[Role, ...] = ("vision",)
INTERVAL_S, MISS_LIMIT = 1.0, 3
GPUS = ("H100", "A100-80GB", "L40S", "L4")


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def reference(table: StateTable, roles: tuple[Role, ...], now: float, exclude: set[str]) -> list[BackendSnapshot]:
    """The table walked in Python, entry by entry, as the gateway did before it kept columns."""
    fresh, stale = [], []
    for e in table.entries():
        if e.role not in roles or e.id in exclude or e.lifecycle not in SERVING:
            continue
        if e.last_heartbeat is not None and now - e.last_heartbeat <= MISS_LIMIT * INTERVAL_S:
            fresh.append(table.snapshot(e))
        elif e.external:
            stale.append(table.snapshot(e))
    if stale and not fresh:   # failing open: the gateway's own counts only (no other clients' load either)
        blind = []
        for b in stale:
            e = table.get(b.id)
            assert e is not None
            kv = perf_model.kv_capacity_bytes(table.model, e.gpu)
            backlog = b.prefill_backlog_tokens - e.foreign_backlog_tokens
            blind.append(dataclasses.replace(b, queue_depth=b.in_flight, kv_free_bytes=kv, kv_total_bytes=kv,
                                             prefill_backlog_tokens=backlog, foreign_running=0))
        return blind
    return fresh + [dataclasses.replace(b, queue_depth=max(SATURATED_QUEUE, b.in_flight), kv_free_bytes=0,
                                        prefill_backlog_tokens=max(SATURATED_QUEUE, b.prefill_backlog_tokens))
                    for b in stale]


def register(table: StateTable, rng: random.Random, k: int) -> None:
    role: Role = rng.choice(["language", "language", "both", "vision"])
    table.register(f"b{k}", role, catalog().gpu(rng.choice(GPUS)), address=None, managed=True,
                   external=rng.random() < 0.3, steal=role == "vision")


def heartbeat(table: StateTable, rng: random.Random, backend_id: str, seq: int) -> None:
    total = rng.randint(1, 1 << 34)
    table.apply_heartbeat(backend_id, seq, "10.0.0.1:1", Reported(
        seq=seq, waiting=rng.randint(0, 20), running=rng.randint(0, 20), kv_free_bytes=rng.randint(0, total),
        kv_total_bytes=total, vision_backlog=rng.randint(0, 3) * 576,
        mean_service_s=rng.choice([0.0, rng.uniform(0.1, 3.0)]), max_model_len=rng.choice([0, 0, 4096, 32_768]),
    ))


def test_candidates_match_a_fresh_walk_after_every_change() -> None:
    rng, clock = random.Random(7), Clock()
    table = StateTable(catalog().model(MODEL), INTERVAL_S, MISS_LIMIT, clock=clock)
    for k in range(12):
        register(table, rng, k)
    handed_out: list[tuple[Candidates, tuple[BackendSnapshot, ...], np.ndarray]] = []
    seq = 0
    leases: list[Lease] = []
    for step in range(600):
        ids = [e.id for e in table.entries()]
        event = rng.randrange(8)
        backend = rng.choice(ids)
        if event <= 2:
            seq += 1
            heartbeat(table, rng, backend, seq)
        elif event == 3:
            leases.append(table.acquire(backend, rng.randint(1, 4000), rng.randint(1, 256)))
            if rng.random() < 0.5:
                table.first_token(leases[-1])
        elif event == 4 and leases:
            table.release(leases.pop(rng.randrange(len(leases))), rng.choice([0, rng.randint(1, 200)]))
        elif event == 5:
            encoding = table.acquire_vision(backend, 576)
            if rng.random() < 0.5:
                table.release_vision(encoding, 576)
        elif event == 6:
            clock.now += rng.choice([0.1, 0.5, 1.5, 4.0])
            if rng.random() < 0.3:   # a launched engine restarts, or is ready again
                table.set_lifecycle(backend, rng.choice(["starting", "ready", "restarting", "stopped"]))
        elif len(ids) < 24:
            register(table, rng, len(ids))
        if step % 100 == 99:   # everyone ready and reporting: the whole pool is handed out as it is
            for backend in ids:
                table.set_lifecycle(backend, "ready")
                seq += 1
                heartbeat(table, rng, backend, seq)
        roles = rng.choice([LANGUAGE, VISION])
        exclude = set(rng.sample(ids, rng.randint(0, 2)))
        got = table.candidates(roles, exclude=exclude)
        want = reference(table, roles, clock.now, exclude)
        assert list(got) == want, step
        assert got.ids == tuple(b.id for b in want), step   # carried from one decision's candidates to the next
        # the shortest context is carried from one decision's candidates to the next, not recomputed
        assert got.smallest_context == min((b.max_context or float("inf") for b in want), default=float("inf"))
        tokens = rng.choice([100, 4096, 4097, 32_768, 40_000])
        assert list(got.fitting(tokens)) == [b for b in want if b.fits(tokens)], step
        # columns are built on first read, so the next patch copies them or leaves them unbuilt: both paths
        if rng.random() < 0.5 or step % 50 == 0:
            np.testing.assert_array_equal(got.columns, column_array(want), err_msg=str(step))
        assert table.language_backlog() == sum(e.reported.waiting for e in table.entries() if e.role != "vision")
        assert table.largest_context() == max(table.context(e)[0] for e in table.entries()
                                              if e.role != "vision" or e.steal)
        if step % 50 == 0:
            handed_out.append((got, tuple(got), got.columns.copy()))
    for candidates, snapshots, columns in handed_out:   # copy-on-write: nothing handed out moved since
        assert tuple(candidates) == snapshots
        np.testing.assert_array_equal(candidates.columns, columns)
        assert not candidates.columns.flags.writeable


def test_a_row_given_another_backend_has_its_id_read_again() -> None:
    a, b, c = (snapshot(name, "H100") for name in "abc")
    first = Candidates([a, b])
    assert first.ids == ("a", "b")
    assert first.replaced([(1, dataclasses.replace(b, queue_depth=7))]).ids == ("a", "b")
    assert first.replaced([(1, c)]).ids == ("a", "c")
    assert first.columns.shape[1] == 2   # the same with columns built
    assert first.replaced([(0, c)]).ids == ("c", "b")


def test_a_snapshot_dropped_anywhere_reaches_the_columns() -> None:
    """Producers drop `entry.snapshot`; the pools must see it without being told separately."""
    clock = Clock()
    table = StateTable(catalog().model(MODEL), INTERVAL_S, MISS_LIMIT, clock=clock)
    table.register("a", "language", catalog().gpu("H100"), address=None, managed=True)
    table.apply_heartbeat("a", 1, "", Reported(seq=1, waiting=2, kv_free_bytes=1 << 30, kv_total_bytes=1 << 31))
    assert table.candidates(LANGUAGE)[0].queue_depth == 2
    entry = table.get("a")
    assert entry is not None
    entry.in_flight = 9
    entry.snapshot = None
    got = table.candidates(LANGUAGE)
    assert got[0].queue_depth == 9
    assert got.columns[1].tolist() == [9.0]


def test_a_context_that_shrinks_or_grows_reaches_the_fit_check() -> None:
    """The shortest context is carried from one set of columns to the next; a row whose context
    changes must reset it, or a request would be sent to a backend it no longer fits."""
    clock = Clock()
    table = StateTable(catalog().model(MODEL), INTERVAL_S, MISS_LIMIT, clock=clock)
    for name in ("a", "b"):
        table.register(name, "language", catalog().gpu("H100"), address=None, managed=True)

    def report(name: str, seq: int, max_model_len: int) -> None:
        table.apply_heartbeat(name, seq, "", Reported(seq=seq, kv_free_bytes=1 << 30, kv_total_bytes=1 << 31,
                                                      max_model_len=max_model_len))

    report("a", 1, 32_768)
    report("b", 1, 32_768)
    assert [b.id for b in table.candidates(LANGUAGE).fitting(8000)] == ["a", "b"]
    report("b", 2, 4096)
    got = table.candidates(LANGUAGE)
    assert got.smallest_context == 4096
    assert [b.id for b in got.fitting(8000)] == ["a"]
    report("b", 3, 32_768)
    got = table.candidates(LANGUAGE)
    assert got.smallest_context == 32_768
    assert [b.id for b in got.fitting(8000)] == ["a", "b"]


def test_failing_open_candidates_follow_each_lease() -> None:
    """Failing open (every candidate an external backend whose metrics went stale), each dispatch
    changes one backend's in-flight count: the candidates handed out next show it, in the snapshots
    and the columns, and those handed out before stay as they were."""
    clock = Clock()
    table = StateTable(catalog().model(MODEL), INTERVAL_S, MISS_LIMIT, clock=clock)
    for name in ("a", "b", "c"):
        table.register(name, "language", catalog().gpu("H100"), address=None, managed=False, external=True)
        table.apply_heartbeat(name, 1, "", Reported(seq=1, kv_free_bytes=1 << 30, kv_total_bytes=1 << 31))
    clock.now += 10 * INTERVAL_S * MISS_LIMIT
    first = table.candidates(LANGUAGE)
    assert table.failing_open and [b.queue_depth for b in first] == [0, 0, 0]
    assert table.candidates(LANGUAGE) is first   # nothing changed: the same object
    lease = table.acquire("b", 100, 16)
    second = table.candidates(LANGUAGE)
    assert [b.queue_depth for b in second] == [0, 1, 0]
    np.testing.assert_array_equal(second.columns, column_array(list(second)))
    assert [b.queue_depth for b in first] == [0, 0, 0] and first.columns[1].tolist() == [0.0, 0.0, 0.0]
    table.release(lease)
    third = table.candidates(LANGUAGE)
    assert [b.queue_depth for b in third] == [0, 0, 0]
    np.testing.assert_array_equal(third.columns, column_array(list(third)))

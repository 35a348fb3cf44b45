"""Per-backend context and KV capacity in the state table: which source wins, and what policies see."""

from __future__ import annotations

from common import perf_model
from common.catalog import load_catalog
from gateway.routing.backend_entry import Reported
from gateway.routing.state_table import StateTable

CATALOG = load_catalog()
MODEL, GPU = CATALOG.model("llava-1.5-7b"), CATALOG.gpu("A100-80GB")
BPT = MODEL.kv_bytes_per_token


class Clock:
    now = 100.0

    def __call__(self) -> float:
        return self.now


def table() -> StateTable:
    t = StateTable(MODEL, heartbeat_interval_s=0.1, clock=Clock())
    t.register("bare", "language", GPU, address="http://a", managed=False, external=True)
    t.register("configured", "language", GPU, address="http://b", managed=False, external=True,
               max_model_len=16_384, kv_capacity_tokens=50_000)
    t.register("vision", "vision", GPU, address="c:1", managed=True)
    return t


def beat(t: StateTable, backend_id: str, **reported: object) -> None:
    entry = t.get(backend_id)
    assert entry is not None
    seq = entry.reported.seq + 1
    assert t.apply_heartbeat(backend_id, seq, "", Reported(seq=seq, **reported)) is not None  # type: ignore[arg-type]


def test_context_is_the_engines_then_the_configured_then_the_catalogs() -> None:
    t = table()
    bare, configured = t.get("bare"), t.get("configured")
    assert bare is not None and configured is not None
    assert t.context(bare) == (MODEL.max_context, "catalog")
    assert t.context(configured) == (16_384, "config")
    assert t.largest_context() == 16_384                # vision backends take no language work
    beat(t, "configured", max_model_len=32_768)
    beat(t, "bare", max_model_len=8192)
    assert t.context(configured) == (32_768, "engine") and t.context(bare) == (8192, "engine")
    assert {s.id: s.max_context for s in t.candidates(("language",))} == {"bare": 8192, "configured": 32_768}
    assert t.largest_context() == 32_768


def test_kv_capacity_is_the_engines_then_the_configured_then_the_estimate() -> None:
    t = table()
    beat(t, "configured", kv_free_bytes=30 * BPT, kv_total_bytes=40 * BPT, kv_source="engine")
    beat(t, "bare", kv_free_bytes=750 * BPT, kv_total_bytes=1000 * BPT, kv_source="estimate")
    configured, bare = t.get("configured"), t.get("bare")
    assert configured is not None and bare is not None
    assert t.kv_capacity(configured) == (30 * BPT, 40 * BPT, "engine")
    assert t.kv_capacity(bare) == (750 * BPT, 1000 * BPT, "estimate")
    # An agent's estimate gives way to the gateway entry's configured capacity, free share kept.
    beat(t, "configured", kv_free_bytes=750 * BPT, kv_total_bytes=1000 * BPT, kv_source="estimate")
    assert t.kv_capacity(configured) == (37_500 * BPT, 50_000 * BPT, "config")
    snap = {s.id: s for s in t.candidates(("language",))}["configured"]
    assert (snap.kv_free_bytes, snap.kv_total_bytes) == (37_500 * BPT, 50_000 * BPT)


def test_without_metrics_the_blind_snapshot_uses_the_configured_capacity() -> None:
    t = table()   # no heartbeat at all: every external backend fails open
    blind = {s.id: s for s in t.candidates(("language",))}
    assert t.failing_open
    assert blind["configured"].kv_total_bytes == 50_000 * BPT
    assert blind["bare"].kv_total_bytes == perf_model.kv_capacity_bytes(MODEL, GPU)

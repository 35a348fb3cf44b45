"""Several models in one state table: each model's pool is the backends that serve it, a backend that
serves two models is in both pools with one load, and contexts and readiness are per model."""

from __future__ import annotations

from common.catalog import load_catalog
from common.itl_slack import DEFAULT_TARGET_S
from gateway.routing.backend_entry import Reported
from gateway.routing.state_table import StateTable

LANGUAGE = ("language", "both")
CATALOG = load_catalog()


def table() -> StateTable:
    llava, llama = CATALOG.model("llava-1.5-7b"), CATALOG.model("llama-2-70b")
    t = StateTable(llava, 0.1, 3, clock=lambda: 100.0, itl_target_s=DEFAULT_TARGET_S)
    t.register("a", "language", CATALOG.gpu("H100"), address="a:1", managed=True, models=["llava"])
    t.register("b", "language", CATALOG.gpu("A100-80GB"), address="b:1", managed=True, models=["llama"],
               profile=llama)
    t.register("c", "language", CATALOG.gpu("L40S"), address="c:1", managed=False, models=["llava", "llama"],
               max_model_len=32768)
    for seq, backend in enumerate("abc"):
        t.apply_heartbeat(backend, seq + 1, f"{backend}:1", Reported(seq=seq + 1), at=100.0)
    return t


def test_each_model_routes_among_its_own_backends() -> None:
    t = table()
    assert [b.id for b in t.candidates(LANGUAGE, model="llava")] == ["a", "c"]
    assert [b.id for b in t.candidates(LANGUAGE, model="llama")] == ["b", "c"]
    assert [b.id for b in t.candidates(LANGUAGE)] == ["a", "b", "c"]   # no model: every backend
    assert not t.candidates(LANGUAGE, model="other")


def test_a_backend_in_two_pools_carries_one_load() -> None:
    t = table()
    lease = t.acquire("c", prompt_tokens=100, max_tokens=10)
    for model in ("llava", "llama"):
        assert next(b for b in t.candidates(LANGUAGE, model=model) if b.id == "c").in_flight == 1
    t.release(lease)
    assert all(b.in_flight == 0 for b in t.candidates(LANGUAGE, model="llama"))


def test_figures_come_from_each_backends_own_model() -> None:
    t = table()
    b = next(s for s in t.candidates(LANGUAGE, model="llama") if s.id == "b")
    llama = CATALOG.model("llama-2-70b")
    assert b.kv_bytes_per_token == llama.kv_bytes_per_token
    assert b.weight_bytes == llama.weight_bytes
    assert b.max_context == llama.max_context
    assert t.largest_context("llava") == 32768                      # c's configured context
    assert t.largest_context("llama") == max(32768, llama.max_context)
    assert t.largest_context("other") == 0


def test_readiness_per_model() -> None:
    t = table()
    assert t.servable(LANGUAGE, model="llava") == 2
    t.drain("a")
    t.drain("c")
    assert t.servable(LANGUAGE, model="llava") == 0
    assert t.servable(LANGUAGE, model="llama") == 1
    assert not t.candidates(LANGUAGE, model="llava")

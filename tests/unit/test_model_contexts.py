"""Each model's context on an upstream that serves several (`StateTable.context(entry, model)`): the
engine's report is its first model's, the others' come from the entry's `max_model_len` or their
catalog model. Every way a model's pool hands the upstream out (fresh, stale beside fresh engines, and
failing open on it alone) carries that model's context, and /v1/models the longest of each model's."""

from __future__ import annotations

from pathlib import Path

from gateway.config.cluster import load_cluster
from gateway.pipeline.dispatch import LANGUAGE_ROLES
from gateway.routing.backend_entry import Reported
from gateway.runtime import Runtime, build_runtime

QWEN, LLAVA = "qwen", "llava-1.5-7b"   # catalog contexts 32,768 and 4,096


def runtime(tmp_path: Path, upstream_extra: str = "") -> Runtime:
    path = tmp_path / "backends.yaml"
    path.write_text(f"model: {LLAVA}\nmodels:\n  - {{name: {QWEN}, catalog: qwen2.5-vl-7b}}\nbackends:\n"
                    f"  - {{id: q0, gpu: H100, model: {QWEN}, launch: {{}}}}\n"
                    f"  - {{id: up, kind: openai, gpu: A100-80GB, address: 'http://10.0.0.5:8000', "
                    f"model: [{LLAVA}, {QWEN}]{upstream_extra}}}\n")
    return build_runtime(load_cluster(path))


def contexts(rt: Runtime, model: str) -> dict[str, int]:
    return {b.id: b.max_context for b in rt.table.candidates(LANGUAGE_ROLES, model=model)}


def test_each_model_reads_its_own_context_however_the_upstream_is_handed_out(tmp_path: Path) -> None:
    rt = runtime(tmp_path)
    t = rt.table
    up = t.get("up")
    assert up is not None
    t.set_reachable("up", True)
    assert contexts(rt, QWEN) == {"up": 32768}   # failing open on the upstream alone (q0 not heard from)
    t.apply_heartbeat("q0", 1, "127.0.0.1:7001", Reported(seq=1, max_model_len=8192))
    assert contexts(rt, QWEN) == {"q0": 8192, "up": 32768}   # the upstream stale beside a fresh engine
    t.apply_heartbeat("up", 1, "", Reported(seq=1, max_model_len=4096))   # the engine says its first model's
    assert contexts(rt, QWEN) == {"q0": 8192, "up": 32768}   # fresh
    assert contexts(rt, LLAVA) == {"up": 4096}
    assert t.context(up) == t.context(up, LLAVA) == (4096, "engine")
    assert t.context(up, QWEN) == (32768, "catalog")
    assert t.largest_context(QWEN) == 32768   # was 8192: the upstream's context read as its first model's
    assert [c["max_model_len"] for c in rt.model_cards()] == [4096, 32768]
    assert {b["id"]: b["model_contexts"] for b in rt.describe_backends()}["up"] == {
        LLAVA: [4096, "engine"], QWEN: [32768, "catalog"]}


def test_a_configured_context_holds_for_every_model_of_the_upstream(tmp_path: Path) -> None:
    t = runtime(tmp_path, ", max_model_len: 16384").table
    up = t.get("up")
    assert up is not None
    assert t.context(up, QWEN) == t.context(up, LLAVA) == (16384, "config")

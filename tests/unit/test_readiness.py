"""Which pools `/ready` waits for: the vision pool only when the cluster serves images and some
language backend needs a separate encoder for them."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.config.cluster import load_cluster
from gateway.daemon import image_warnings
from gateway.routing.backend_entry import Reported
from gateway.runtime import build_runtime, needs_vision_pool

LANG = "{id: l0, role: language, gpu: H100, launch: {}}"
VISION = "{id: v0, role: vision, gpu: L40S, launch: {}}"
BOTH = "{id: b0, role: both, gpu: H100, launch: {}}"
UPSTREAM = "{id: u0, kind: openai, gpu: H100, address: 'http://10.0.0.5:8000'}"


@pytest.mark.parametrize(("model", "backends", "needed"), [
    ("llava-1.5-7b", [LANG, VISION], True),        # the split: language engines wait for encoders
    ("llava-1.5-7b", [LANG], False),               # no encoders: images are not served, text is
    ("llava-1.5-7b", [BOTH, VISION], False),       # monolithic backends encode their own images
    ("llava-1.5-7b", [UPSTREAM, VISION], False),   # the upstream reads images itself
    ("llama-2-7b", [LANG], False),                 # a text model
])
def test_vision_pool_needed(tmp_path: Path, model: str, backends: list[str], needed: bool) -> None:
    path = tmp_path / "backends.yaml"
    path.write_text(f"model: {model}\nbackends:\n" + "".join(f"  - {b}\n" for b in backends))
    assert needs_vision_pool(load_cluster(path)) is needed


def test_ready_names_a_priority_class_that_only_kept_backends_would_serve(tmp_path: Path) -> None:
    """An H100 kept for class 1 and an L40S open to all: with the L40S silent the gateway still serves class
    1, so it stays ready, and names class 0 (the default tenant's) degraded: its requests get 503."""
    path = tmp_path / "backends.yaml"
    (tmp_path / "team.keys").write_text("sk-team\n")
    path.write_text(
        "model: llava-1.5-7b\ngateway:\n  tenants:\n    teams:\n"
        f"      team: {{priority: 1, api_keys_file: {tmp_path / 'team.keys'}}}\n"
        "backends:\n  - {id: h100, gpu: H100, launch: {}, min_priority: 1}\n  - {id: l40s, gpu: L40S, launch: {}}\n")
    runtime = build_runtime(load_cluster(path))
    t = runtime.table
    now = t.clock()
    t.apply_heartbeat("h100", 1, "127.0.0.1:7001", Reported(seq=1), now)
    assert runtime.readiness() == {"ready": True, "healthy_language_backends": 1, "degraded": ["priority:0"]}
    t.apply_heartbeat("l40s", 1, "127.0.0.1:7002", Reported(seq=1), now)
    assert runtime.readiness() == {"ready": True, "healthy_language_backends": 2}


def test_with_several_models_each_models_encoders_are_counted_apart(tmp_path: Path) -> None:
    """qwen's encoder silent, llava's fine: qwen's image requests get 503, and /ready said nothing
    (one count of every model's encoders, and `"vision"` only when all were gone)."""
    path = tmp_path / "backends.yaml"
    path.write_text("model: llava-1.5-7b\nmodels:\n  - {name: qwen, catalog: qwen2.5-vl-7b}\nbackends:\n"
                    "  - {id: l0, role: language, gpu: H100, launch: {}}\n"
                    "  - {id: v0, role: vision, gpu: L40S, launch: {}}\n"
                    "  - {id: q0, role: language, gpu: H100, model: qwen, launch: {}}\n"
                    "  - {id: qv, role: vision, gpu: L40S, model: qwen, launch: {}}\n")
    runtime = build_runtime(load_cluster(path))
    t = runtime.table
    now = t.clock()
    for k, backend in enumerate(("l0", "v0", "q0")):
        t.apply_heartbeat(backend, 1, f"127.0.0.1:{7001 + k}", Reported(seq=1), now)
    ready = runtime.readiness()
    assert ready["models"] == {
        "llava-1.5-7b": {"ready": True, "healthy_language_backends": 1, "healthy_vision_backends": 1},
        "qwen": {"ready": True, "healthy_language_backends": 1, "healthy_vision_backends": 0}}
    assert ready["degraded"] == ["vision:qwen"] and ready["healthy_vision_backends"] == 1
    t.apply_heartbeat("qv", 1, "127.0.0.1:7004", Reported(seq=1), now)
    assert "degraded" not in runtime.readiness()


def test_a_vision_model_nothing_encodes_for_and_an_encoder_nothing_uses_are_named(tmp_path: Path) -> None:
    """Both were accepted without a word: qwen's image requests then waited for an encoder for ever, and the
    vision backend of llava, whose only language backend reads images itself, was a GPU never used."""
    path = tmp_path / "backends.yaml"
    path.write_text("model: llava-1.5-7b\nmodels:\n  - {name: qwen, catalog: qwen2.5-vl-7b}\nbackends:\n"
                    "  - {id: u0, kind: openai, gpu: H100, address: 'http://10.0.0.5:8000'}\n"
                    "  - {id: v0, role: vision, gpu: L40S, launch: {}}\n"
                    "  - {id: q0, role: language, gpu: H100, model: qwen, launch: {}}\n")
    assert image_warnings(load_cluster(path)) == [
        "vision backend(s) v0 of model 'llava-1.5-7b' encode nothing: every language backend of it takes images "
        "itself (role both, or a kind: openai upstream without image_embeds)",
        "model 'qwen' takes images, but no backend encodes them for it (role vision or both, or a kind: openai "
        "upstream without image_embeds): its image requests get 400",
    ]


def test_a_relaunched_engine_shows_its_new_process_not_the_one_that_went(tmp_path: Path) -> None:
    """Killed, its entry said `starting` with the dead engine's pid until the new one reported: a script that
    kills by that pid could hit a recycled one."""
    path = tmp_path / "backends.yaml"
    path.write_text("model: llava-1.5-7b\nbackends:\n  - {id: h100, gpu: H100, launch: {}}\n")
    runtime = build_runtime(load_cluster(path))
    t = runtime.table
    t.note_process("h100", 4100)
    t.set_lifecycle("h100", "ready")
    t.apply_heartbeat("h100", 1, "127.0.0.1:7001", Reported(seq=1, pid=4100))
    assert runtime.describe_backends()[0]["pid"] == 4100
    t.note_exit("h100", "exited with status 137 (killed by SIGKILL)")
    t.set_lifecycle("h100", "restarting")
    assert runtime.describe_backends()[0]["pid"] is None   # nothing runs for it between the two
    t.note_process("h100", 4200)
    t.set_lifecycle("h100", "starting")
    assert runtime.describe_backends()[0]["pid"] == 4200

"""backends.yaml with several models (gateway/config/models.py): names, aliases, which backend serves
which, and the configs that cannot serve refused at load (so by `check-config` too)."""

from __future__ import annotations

from pathlib import Path

from gateway.config.cluster import load_cluster
from tests.config_files import config_error, write
from tests.snapshots import catalog

TWO = """aliases: [llava]
models:
  - {name: llama, catalog: llama-2-7b, aliases: [llama-chat]}
backends:
  - {id: a, gpu: H100, launch: {}}
  - {id: b, gpu: L40S, model: llama, launch: {}}
  - {id: c, kind: openai, gpu: A100-80GB, address: 'http://10.0.0.5:8000', model: [llava-1.5-7b, llama]}
"""


def test_models_names_aliases_and_backends(tmp_path: Path) -> None:
    cfg = load_cluster(write(tmp_path, TWO), catalog())
    assert list(cfg.models.models) == ["llava-1.5-7b", "llama"]
    assert cfg.served_model_name == "llava-1.5-7b"
    assert cfg.models.resolve("llava") is cfg.models.resolve("llava-1.5-7b")
    assert cfg.models.resolve("llama-chat") is cfg.models.models["llama"]
    assert cfg.models.resolve("gpt-4") is None
    assert cfg.models.models["llama"].profile == catalog().model("llama-2-7b")
    assert [m.name for m in cfg.backend_models["a"]] == ["llava-1.5-7b"]   # no `model`: the first model
    assert [m.name for m in cfg.backend_models["c"]] == ["llava-1.5-7b", "llama"]
    assert cfg.model_of("b").catalog == "llama-2-7b"


def test_one_model_configs_are_unchanged(tmp_path: Path) -> None:
    cfg = load_cluster(write(tmp_path, "served_model_name: served\nbackends:\n  - {id: a, gpu: H100, launch: {}}\n"),
                       catalog())
    assert list(cfg.models.models) == ["served"] and cfg.model_of("a").catalog == "llava-1.5-7b"


def test_a_backend_naming_an_unknown_model_is_refused(tmp_path: Path) -> None:
    message = config_error(write(tmp_path, "backends:\n  - {id: a, gpu: H100, model: llava, launch: {}}\n"))
    assert "backends.0 (a).model: no model 'llava' in this cluster (it serves 'llava-1.5-7b')" in message


def test_a_name_given_twice_is_refused(tmp_path: Path) -> None:
    body = "aliases: [x]\nmodels:\n  - {name: llama, catalog: llama-2-7b, aliases: [x]}\n" \
           "backends:\n  - {id: a, gpu: H100, launch: {}}\n  - {id: b, gpu: H100, model: llama, launch: {}}\n"
    assert "models.0 (llama).aliases: model name 'x' is given twice (first by aliases)" in \
        config_error(write(tmp_path, body))
    body = "models:\n  - {name: llama, catalog: llama-2-7b}\n  - {name: llama, catalog: llama-2-70b}\n" \
           "backends:\n  - {id: a, gpu: H100, launch: {}}\n  - {id: b, gpu: H100, model: llama, launch: {}}\n"
    assert "models.1 (llama).name: model name 'llama' is given twice (first by models.0 (llama).name)" in \
        config_error(write(tmp_path, body))


def test_a_model_nobody_serves_is_refused(tmp_path: Path) -> None:
    body = "models:\n  - {name: llama, catalog: llama-2-7b}\nbackends:\n  - {id: a, gpu: H100, launch: {}}\n"
    assert "none takes language work (role language or both) for model 'llama'" in config_error(write(tmp_path, body))


def test_an_engine_serves_one_model(tmp_path: Path) -> None:
    body = "models:\n  - {name: llama, catalog: llama-2-7b}\n" \
           "backends:\n  - {id: a, gpu: H100, model: [llava-1.5-7b, llama], launch: {}}\n"
    assert "an engine serves one model; only a kind: openai upstream may list several" in \
        config_error(write(tmp_path, body))


def test_images_need_a_model_with_an_encoder(tmp_path: Path) -> None:
    body = "models:\n  - {name: llama, catalog: llama-2-7b}\nbackends:\n  - {id: a, gpu: H100, launch: {}}\n" \
           "  - {id: b, gpu: H100, model: llama, launch: {}}\n" \
           "  - {id: v, role: vision, gpu: L40S, model: llama, launch: {}}\n"
    assert "backends.2 (v).role: model 'llama' has no vision encoder" in config_error(write(tmp_path, body))


def test_several_models_and_one_upstream_name_do_not_mix(tmp_path: Path) -> None:
    body = "models:\n  - {name: llama, catalog: llama-2-7b}\nbackends:\n" \
           "  - {id: c, kind: openai, gpu: H100, address: 'http://h:1', model: [llava-1.5-7b, llama], " \
           "upstream_model: m}\n"
    assert "`upstream_model` renames one model" in config_error(write(tmp_path, body))

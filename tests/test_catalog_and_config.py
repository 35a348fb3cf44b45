"""GPU/model catalogs (image token counting) and strict backends.yaml parsing."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
import yaml

from common.catalog import CONFIG_DIR, load_catalog
from common.errors import ConfigError
from gateway.config.cluster import DEFAULT_BACKENDS, load_cluster
from tests.config_files import config_error, write
from tests.snapshots import catalog

QWEN_MAX_TOKENS = 12845056 // (28 * 28)   # 16384


# --- catalog -------------------------------------------------------------------------------------


def test_catalog_names_every_entry_and_holds_the_papers_figures() -> None:
    cat = catalog()
    assert {"H100", "A100-80GB", "L40S", "RTX-4090"} <= set(cat.gpus)
    assert all(name == g.name for name, g in cat.gpus.items())
    assert all(name == m.name for name, m in cat.models.items())
    h100 = cat.gpu("H100")
    assert (h100.tflops, h100.bandwidth_gbs, h100.hbm_gb) == (989, 3350, 80)
    assert (h100.flops, h100.bandwidth_bytes_s, h100.hbm_bytes) == (989e12, 3350e9, 80_000_000_000)
    assert cat.gpu("L40S").tflops == 362
    assert cat.model("llava-1.5-7b").weight_bytes == 14_120_000_000


def test_unknown_catalog_entries_are_config_errors() -> None:
    with pytest.raises(ConfigError, match=r"unknown GPU 'V100'; known: .*H100"):
        catalog().gpu("V100")
    with pytest.raises(ConfigError, match=r"unknown model 'gpt-5'; known: .*llava-1.5-7b"):
        catalog().model("gpt-5")


def test_llava_images_are_always_576_tokens() -> None:
    llava = catalog().model("llava-1.5-7b")
    assert llava.image_tokens(336, 336) == 576
    assert llava.image_tokens(4000, 3000) == 576
    assert catalog().model("llama-2-7b").image_tokens(336, 336) == 0


@pytest.mark.parametrize(
    ("width", "height", "tokens"),
    [
        (1024, 768, 999),   # 1036 x 756 after rounding to 28: 37 · 27
        (640, 480, 391),    # 644 x 476: 23 · 17
        (448, 448, 256),    # exact multiples: 16 · 16
        (20, 30, 6),        # 784 px < min 3136: beta = sqrt(3136/600), ceil -> 56 x 84: 2 · 3
        (10, 10, 4),        # beta = 5.6 -> 56 x 56: 2 · 2
        (8000, 6000, 16170),   # beta = sqrt(48e6/12845056) -> floor to 4116 x 3080: 147 · 110
    ],
)
def test_qwen_dynamic_image_tokens_hand_computed(width: int, height: int, tokens: int) -> None:
    assert catalog().model("qwen2.5-vl-7b").image_tokens(width, height) == tokens


def test_qwen_tiny_image_clamps_up_to_min_pixels() -> None:
    qwen = catalog().model("qwen2.5-vl-7b")
    for w, h in [(1, 1), (5, 40), (28, 28), (40, 5)]:
        assert qwen.image_tokens(w, h) * 28 * 28 >= 3136, (w, h)


def test_qwen_huge_image_clamps_down_to_max_pixels() -> None:
    qwen = catalog().model("qwen2.5-vl-7b")
    for w, h in [(10_000, 10_000), (20_000, 3_000), (3_000, 20_000), (8000, 6000)]:
        tokens = qwen.image_tokens(w, h)
        assert tokens <= QWEN_MAX_TOKENS, (w, h)
        assert tokens >= 0.9 * QWEN_MAX_TOKENS, (w, h)   # clamped to just under the cap, not far below


def test_qwen_token_count_is_symmetric_in_orientation() -> None:
    qwen = catalog().model("qwen2.5-vl-7b")
    assert qwen.image_tokens(1024, 768) == qwen.image_tokens(768, 1024)


def test_bad_catalog_file_names_file_and_field(tmp_path: Path) -> None:
    shutil.copy(CONFIG_DIR / "models.yaml", tmp_path / "models.yaml")
    (tmp_path / "gpus.yaml").write_text("H100:\n  tflops: 989\n  bandwidth_gbs: 3350\n  hbm_gb: 80\n"
                                        "  price_per_hour: 3.5\n  fp4_tflops: 4000\n")
    with pytest.raises(ConfigError) as exc:
        load_catalog(tmp_path)
    assert str(exc.value) == f"{tmp_path / 'gpus.yaml'}: H100.fp4_tflops: Extra inputs are not permitted"


def test_fixed_vision_profile_needs_a_token_count(tmp_path: Path) -> None:
    shutil.copy(CONFIG_DIR / "gpus.yaml", tmp_path / "gpus.yaml")
    (tmp_path / "models.yaml").write_text(
        "m:\n  params: 1e9\n  layers: 2\n  kv_heads: 2\n  head_dim: 64\n  hidden: 128\n"
        "  vision: {mode: fixed, encoder_params: 1e8}\n"
    )
    with pytest.raises(ConfigError, match=r"models\.yaml: m\.vision: .*tokens_per_image"):
        load_catalog(tmp_path)


# --- backends.yaml -------------------------------------------------------------------------------


def test_default_demo_cluster_loads() -> None:
    cfg = load_cluster(DEFAULT_BACKENDS, catalog())
    assert cfg.served_model_name == "llava-1.5-7b"
    assert cfg.settings.routing.policy == "marginal_delay"
    assert cfg.settings.limits.max_prompt_tokens is None and cfg.model.max_context == 4096
    language = [cfg.gpus[b.id].name for b in cfg.raw.backends if b.role == "language"]
    assert sorted(language) == ["A100-80GB"] * 3 + ["H100"] * 2 + ["L40S"] * 3


def test_minimal_external_entry(tmp_path: Path) -> None:
    cfg = load_cluster(write(tmp_path, "backends:\n  - {id: ext-0, gpu: L40S, address: '10.0.0.5:8001'}\n"), catalog())
    (spec,) = cfg.raw.backends
    assert (spec.address, spec.launch, spec.role) == ("10.0.0.5:8001", None, "language")
    assert cfg.gpus["ext-0"].name == "L40S"


def test_unknown_keys_name_file_and_key(tmp_path: Path) -> None:
    path = write(tmp_path, "colour: red\nbackends:\n  - {id: a, gpu: H100, launch: {}, weight: 2}\n")
    msg = config_error(path)
    assert f"{path}: colour: Extra inputs are not permitted" in msg
    assert f"{path}: backends.0 (a).weight: Extra inputs are not permitted" in msg


def test_bad_gpu_name_names_file_field_and_value(tmp_path: Path) -> None:
    path = write(tmp_path, "backends:\n  - {id: a, gpu: H100, launch: {}}\n  - {id: b, gpu: H900, launch: {}}\n")
    msg = config_error(path)
    assert msg.startswith(f"{path}: backends.1 (b).gpu: unknown GPU 'H900'")
    assert "H100" in msg   # lists the known ones


def test_duplicate_backend_id(tmp_path: Path) -> None:
    path = write(tmp_path, "backends:\n  - {id: a, gpu: H100, launch: {}}\n  - {id: a, gpu: L40S, launch: {}}\n")
    msg = config_error(path)
    assert msg.startswith(f"{path}: backends: ")
    assert "duplicate backend id 'a' (entries 0 and 1)" in msg


def test_two_managed_engines_cannot_take_one_port(tmp_path: Path) -> None:
    """The second failed to listen and was restarted for ever, reported ready by the first one's answer to
    its probe."""
    msg = config_error(write(tmp_path, "backends:\n"
                             "  - {id: a, kind: openai, gpu: H100, launch: {command: 'vllm serve m --port {port}', "
                             "port: 8100}}\n"
                             "  - {id: b, kind: openai, gpu: H100, launch: {command: 'vllm serve m --port {port}', "
                             "port: 8100}}\n"))
    assert msg.startswith(f"{tmp_path / 'backends.yaml'}: backends: ")
    assert "duplicate launch.port 8100 (entries 0 and 1)" in msg, msg


def test_entry_needs_launch_or_address(tmp_path: Path) -> None:
    path = write(tmp_path, "backends:\n  - {id: a, gpu: H100, launch: {}}\n  - {id: b, gpu: H100}\n")
    msg = config_error(path)
    assert msg.startswith(f"{path}: backends.1 (b): ")
    assert "`launch`" in msg and "`address`" in msg


@pytest.mark.parametrize("address", ["not-an-address", "10.0.0.7", "10.0.0.7:99999", "10.0.0.7:0",
                                     "http://10.0.0.7:7000", ":::", ":7000", "10.0.0.7:port", "fd00::7:7000"])
def test_an_engines_address_is_host_and_port(tmp_path: Path, address: str) -> None:
    msg = config_error(write(tmp_path, f"backends:\n  - {{id: x, gpu: L40S, address: '{address}'}}\n"))
    assert "backends.0 (x)" in msg and "host:port" in msg and repr(address) in msg


@pytest.mark.parametrize("address", ["10.0.0.7:8000", "http://10.0.0.7:99999", "http://:8000", "ftp://10.0.0.7",
                                     "http://10.0.0.7:x"])
def test_an_openai_address_is_a_base_url(tmp_path: Path, address: str) -> None:
    msg = config_error(write(tmp_path, f"backends:\n  - {{id: x, kind: openai, gpu: L40S, address: '{address}'}}\n"))
    assert "backends.0 (x)" in msg and "base URL" in msg


def test_addresses_that_dial(tmp_path: Path) -> None:
    body = ("backends:\n  - {id: a, gpu: L40S, address: 'gpu-3.internal:7000'}\n"
            "  - {id: b, gpu: L40S, address: '[fd00::7]:7000'}\n"
            "  - {id: e, gpu: L40S, address: 'dns:///engine.svc:7000'}\n"
            "  - {id: c, kind: openai, gpu: L40S, address: 'https://vllm.internal/v1-proxy'}\n"
            "  - {id: d, kind: openai, gpu: L40S, address: 'http://[fd00::7]:8000'}\n")
    cfg = load_cluster(write(tmp_path, body), catalog())
    assert [b.address for b in cfg.raw.backends] == [
        "gpu-3.internal:7000", "[fd00::7]:7000", "dns:///engine.svc:7000", "https://vllm.internal/v1-proxy",
        "http://[fd00::7]:8000"]


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        ("backends: []\n", "backends: List should have at least 1 item"),
        ("backends:\n  - {id: 'a b', gpu: H100, launch: {}}\n",
         r"backends\.0 \(a b\)\.id: String should match pattern"),
        ("backends:\n  - {id: a, gpu: H100, role: decoder, launch: {}}\n", r"backends\.0 \(a\)\.role: Input should be"),
        ("gateway: {heartbeat_interval_ms: 0}\nbackends:\n  - {id: a, gpu: H100, launch: {}}\n",
         r"gateway\.heartbeat_interval_ms: Input should be greater than 0"),
        ("gateway: {routing: {policy: fastest}}\nbackends:\n  - {id: a, gpu: H100, launch: {}}\n",
         r"gateway\.routing(\.policy)?: unknown policy 'fastest'"),
        ("gateway: {routing: {params: {power_of_two: {seeds: 1}}}}\nbackends:\n  - {id: a, gpu: H100, launch: {}}\n",
         r"gateway\.routing\.params\.power_of_two: policy 'power_of_two' parameters: seeds: Extra inputs"),
        ("gateway: {routing: {itl_target_ms: 0}}\nbackends:\n  - {id: a, gpu: H100, launch: {}}\n",
         r"gateway\.routing\.itl_target_ms: Input should be greater than 0"),
    ],
)
def test_field_errors_name_file_and_field(tmp_path: Path, body: str, expected: str) -> None:
    """`expected` is a regular expression for what follows `<file>: ` in the message."""
    path = write(tmp_path, body)
    assert re.search(re.escape(f"{path}: ") + expected, config_error(path))


def test_image_embeds_only_on_openai_backends_of_a_vision_model(tmp_path: Path) -> None:
    engine = write(tmp_path, "backends:\n  - {id: a, gpu: H100, launch: {}, image_embeds: true}\n")
    assert "`image_embeds` apply to kind: openai backends only" in config_error(engine)
    text_model = tmp_path / "text.yaml"
    text_model.write_text("model: llama-2-7b\nbackends:\n"
                          "  - {id: v, kind: openai, gpu: H100, address: 'http://10.0.0.5:8000', image_embeds: true}\n")
    assert config_error(text_model).startswith(f"{text_model}: backends.0 (v).image_embeds: model 'llama-2-7b' has no")


def test_simulated_vision_embeddings_to_an_image_embeds_upstream_are_refused(tmp_path: Path) -> None:
    body = ("backends:\n  - {id: v, role: vision, gpu: L4, launch: {}}\n"
            "  - {id: up, kind: openai, gpu: H100, address: 'http://10.0.0.5:8000', image_embeds: true}\n")
    path = write(tmp_path, body)
    message = config_error(path)
    assert message.startswith(f"{path}: backends.1 (up).image_embeds: vision backend(s) v run the simulated executor")
    path.write_text("model: llava-1.5-7b\ngateway: {simulated_embeddings: true}\n" + body)
    assert load_cluster(path, catalog()).raw.gateway.simulated_embeddings


def test_unknown_model(tmp_path: Path) -> None:
    path = tmp_path / "backends.yaml"
    path.write_text("model: llava-9\nbackends:\n  - {id: a, gpu: H100, launch: {}}\n")
    assert config_error(path).startswith(f"{path}: model: unknown model 'llava-9'")


def test_unreadable_and_invalid_yaml(tmp_path: Path) -> None:
    missing = tmp_path / "nope.yaml"
    assert config_error(missing).startswith(f"{missing}: cannot read")
    broken = tmp_path / "broken.yaml"
    broken.write_text("backends: [\n")
    assert config_error(broken).startswith(f"{broken}: not valid YAML")


def test_a_file_may_name_a_catalog_of_its_own(tmp_path: Path) -> None:
    """`catalog:` (relative to the file) replaces the built-in catalog: its GPUs resolve, the built-in
    ones it lacks do not, and a folder that is not there is named."""
    gpus = yaml.safe_load((CONFIG_DIR / "gpus.yaml").read_text())
    own = tmp_path / "own"
    own.mkdir()
    (own / "gpus.yaml").write_text(yaml.safe_dump({"MI300X": gpus["H100"]}))
    (own / "models.yaml").write_text((CONFIG_DIR / "models.yaml").read_text())
    cfg = load_cluster(write(tmp_path, "catalog: own\nbackends:\n  - {id: m, gpu: MI300X, launch: {}}\n"))
    assert cfg.gpus["m"].name == "MI300X"
    for body, words in (("catalog: own\nbackends:\n  - {id: h, gpu: H100, launch: {}}\n", "unknown GPU 'H100'"),
                        ("catalog: nowhere\nbackends:\n  - {id: m, gpu: H100, launch: {}}\n",
                         "catalog: nowhere is not a folder")):
        with pytest.raises(ConfigError, match=words):
            load_cluster(write(tmp_path, body))


"""`launch:` of kind: openai entries: parsing, the command a launcher runs, its readiness; api keys."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.config.cluster import CommandLaunchSpec, load_cluster
from gateway.control.launchers import CommandLauncher, EngineLauncher, LaunchContext, build_launchers, managed_ports
from gateway.routing.backend_entry import Reported
from gateway.runtime import build_runtime
from tests.config_files import config_error, write
from tests.snapshots import catalog

VLLM = ("backends:\n  - id: h100-vllm\n    kind: openai\n    gpu: H100\n"
        "    launch:\n      command: vllm serve llava-hf/llava-1.5-7b-hf --port {port} --api-key 'two words'\n")


def test_a_managed_vllm_entry_gets_a_port_devices_and_its_command(tmp_path: Path) -> None:
    body = VLLM + "      devices: [0, 1]\n      env: {VLLM_LOGGING_LEVEL: INFO}\n"
    config = load_cluster(write(tmp_path, body), catalog())
    spec = config.raw.backends[0]
    assert isinstance(spec.launch, CommandLaunchSpec) and spec.launch.ready_path == "/health"
    ports = managed_ports(config)
    port = ports["h100-vllm"]
    probed: list[str] = []

    async def probe(url: str) -> bool:
        probed.append(url)
        return True

    context = LaunchContext("127.0.0.1:1", build_runtime(config).table, probe, "warning")
    (launcher,) = build_launchers(config, ports, context)
    assert isinstance(launcher, CommandLauncher)
    plan = launcher.plan()
    assert plan.argv == ["vllm", "serve", "llava-hf/llava-1.5-7b-hf", "--port", str(port), "--api-key", "two words"]
    assert plan.env == {"VLLM_LOGGING_LEVEL": "INFO", "CUDA_VISIBLE_DEVICES": "0,1"}
    assert launcher.address == f"http://127.0.0.1:{port}"


async def test_readiness_is_the_probe_of_the_ready_path(tmp_path: Path) -> None:
    config = load_cluster(write(tmp_path, VLLM + "      port: 8123\n      ready_path: /v1/models\n"), catalog())
    answers = [False, True]
    probed: list[str] = []

    async def probe(url: str) -> bool:
        probed.append(url)
        return answers.pop(0)

    context = LaunchContext("", build_runtime(config).table, probe, "warning")
    (launcher,) = build_launchers(config, managed_ports(config), context)
    assert [await launcher.ready(), await launcher.ready()] == [False, True]
    assert probed == ["http://127.0.0.1:8123/v1/models"] * 2
    assert "--port 8123" in " ".join(launcher.plan().argv)


async def test_an_engine_launcher_is_ready_once_its_engine_heartbeats(tmp_path: Path) -> None:
    config = load_cluster(write(tmp_path, "backends:\n  - {id: e0, gpu: H100, launch: {time_scale: 0.5}}\n"),
                          catalog())
    table = build_runtime(config).table

    async def probe(url: str) -> bool:
        raise AssertionError("engines are not probed over HTTP")

    (launcher,) = build_launchers(config, {}, LaunchContext("127.0.0.1:5555", table, probe, "warning"))
    assert isinstance(launcher, EngineLauncher)
    argv = launcher.plan().argv
    assert argv[1:3] == ["-m", "backends.engine"] and "127.0.0.1:5555" in argv and "0.5" in argv
    table.set_lifecycle("e0", "starting")
    assert not await launcher.ready()
    table.apply_heartbeat("e0", 1, "127.0.0.1:7000", Reported(pid=42))
    assert await launcher.ready()
    assert not table.is_healthy(table.get("e0")), "not a candidate until the supervisor has it ready"  # type: ignore[arg-type]
    table.set_lifecycle("e0", "ready")
    assert table.is_healthy(table.get("e0"))  # type: ignore[arg-type]


@pytest.mark.parametrize(("body", "message"), [
    ("backends:\n  - {id: a, kind: openai, gpu: H100, launch: {}}\n", "a kind: openai `launch` needs `command`"),
    ("backends:\n  - {id: a, gpu: H100, launch: {command: [x, '{port}']}}\n",
     "`launch.command` applies to kind: openai"),
    ("backends:\n  - {id: a, kind: openai, gpu: H100, address: 'http://h:1', launch: {command: [x, '{port}']}}\n",
     "drop `address`"),
    ("backends:\n  - {id: a, kind: openai, gpu: H100, launch: {command: [x, '{port}'], devices: [-1]}}\n",
     "launch.devices.0"),
    ("backends:\n  - {id: a, kind: openai, gpu: H100, launch: {command: [x, '{port}'], startup: 3}}\n",
     "launch.startup"),
    ("backends:\n  - {id: a, kind: openai, gpu: H100, launch: {command: vllm serve m}}\n",
     "the command needs `{port}`"),
    ("backends:\n  - {id: a, gpu: H100, launch: {}, api_key: k}\n", "`api_key` apply to kind: openai"),
])
def test_launch_mistakes_are_config_errors(tmp_path: Path, body: str, message: str) -> None:
    assert message in config_error(write(tmp_path, body))


def test_api_key_env_must_name_a_set_variable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    body = "backends:\n  - {id: up-0, kind: openai, gpu: H100, address: 'http://h:1', api_key_env: HG_TEST_KEY}\n"
    monkeypatch.delenv("HG_TEST_KEY", raising=False)
    error = config_error(write(tmp_path, body))
    assert "backends.0 (up-0).api_key_env" in error and "HG_TEST_KEY is not set" in error
    monkeypatch.setenv("HG_TEST_KEY", "s3cret")
    assert load_cluster(write(tmp_path, body), catalog()).api_keys == {"up-0": "s3cret"}

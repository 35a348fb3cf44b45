"""`gateway check-config FILE [OPTIONS]` and start-up run the same checks (`gateway.cli.validate`): for
every configuration start-up refuses, check-config refuses it with the same message, and where
check-config says OK the gateway starts. Both are the real console script in a subprocess."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import httpx
import pytest

from testkit.harness import finished, free_port, run_gateway, write_config

REPO = Path(__file__).resolve().parent.parent
MODEL = "llava-1.5-7b"
LANGUAGE = {"id": "h100-0", "role": "language", "gpu": "H100", "launch": {"time_scale": 0.1}}
VISION = {"id": "l40s-v", "role": "vision", "gpu": "L40S", "launch": {"time_scale": 0.1}}
UPSTREAM = {"id": "up", "kind": "openai", "role": "language", "gpu": "A100-80GB"}


def start_cli(*args: str, env: dict[str, str] | None = None, cwd: Path = REPO) -> subprocess.Popen[str]:
    """The console script with a clean environment: no HETEROGATE_* or HG_TEST_* variable but `env`'s."""
    exe = shutil.which("gateway", path=str(Path(sys.executable).parent))
    assert exe is not None, "the gateway console script is not installed next to this interpreter"
    environ = {k: v for k, v in os.environ.items() if not k.startswith(("HG_TEST_", "HETEROGATE_"))}
    return subprocess.Popen([exe, *args], cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**environ, **(env or {})})


def finish(proc: subprocess.Popen[str]) -> subprocess.CompletedProcess[str]:
    return finished(proc, 60)


def run_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return finish(start_cli(*args, env=env))


def config(tmp: Path, backends: list[dict[str, Any]], **gateway: Any) -> Path:
    return write_config(tmp, {"model": MODEL, "gateway": gateway, "backends": backends})


REFUSED = [
    pytest.param({"auth": {"api_keys_env": "HG_TEST_UNSET_KEYS"}}, [LANGUAGE], (), {},
                 "gateway.auth.api_keys_env: environment variable HG_TEST_UNSET_KEYS is not set", id="keys-unset"),
    pytest.param({"auth": {"api_keys_env": "HG_TEST_KEYS"}}, [LANGUAGE], (), {"HG_TEST_KEYS": " , "},
                 "gateway.auth.api_keys_env: environment variable HG_TEST_KEYS holds no keys", id="keys-separators"),
    pytest.param({"auth": {"admin_keys_env": "HG_TEST_KEYS"}}, [LANGUAGE], (), {"HG_TEST_KEYS": ","},
                 "gateway.auth.admin_keys_env: environment variable HG_TEST_KEYS holds no keys", id="admin-separators"),
    pytest.param({}, [LANGUAGE], ("--grpc-host", "0.0.0.0"), {},
                 "gateway.auth.cluster_token_file or cluster_token_env is required", id="token-beyond-loopback"),
    pytest.param({"auth": {"api_keys_env": "HG_TEST_KEYS"}}, [LANGUAGE], (), {"HG_TEST_KEYS": "k1"},
                 "gateway.auth.cluster_token_file or cluster_token_env is required", id="token-with-keys"),
    pytest.param({"tls": {"http": {"cert_file": "/nonexistent/tls.crt", "key_file": "/nonexistent/tls.key"}}},
                 [LANGUAGE], (), {}, "gateway.tls.http.cert_file: cannot read /nonexistent/tls.crt", id="tls"),
    pytest.param({}, [VISION], (), {}, "backends: none takes language work", id="vision-only"),
    pytest.param({}, [LANGUAGE], ("--workers", "2"), {}, "--workers 2 needs Redis", id="workers-without-redis"),
    pytest.param({}, [LANGUAGE, {**UPSTREAM, "launch": {"command": ["/nonexistent/vllm", "--port", "{port}"]}}], (),
                 {}, "backends.1 (up).launch.command: '/nonexistent/vllm' is not an executable program here",
                 id="no-such-program"),
    pytest.param({}, [LANGUAGE, {**UPSTREAM, "launch": {"command": ["true", "{port}"], "port": 8777}}],
                 ("--port", "8777"), {}, "backends.1 (up).launch.port: 8777 is one of this gateway's own ports",
                 id="engine-on-the-gateway-port"),
    pytest.param({}, [LANGUAGE, {**UPSTREAM, "address": "http://localhost:8777/v1"}], ("--port", "8777"), {},
                 "backends.1 (up).address: http://localhost:8777/v1 is this gateway's own HTTP door",
                 id="upstream-is-the-gateway"),
]


@pytest.mark.parametrize(("gateway", "backends", "args", "env", "named"), REFUSED)
def test_what_start_up_refuses_check_config_refuses_alike(
    tmp_path: Path, gateway: dict[str, Any], backends: list[dict[str, Any]], args: tuple[str, ...],
    env: dict[str, str], named: str,
) -> None:
    path = config(tmp_path, backends, **gateway)
    ports = ("--port", str(free_port()), "--grpc-port", str(free_port()))
    starting = start_cli("--backends", str(path), *ports, *args, env=env)   # both at once: each takes seconds
    check, start = finish(start_cli("check-config", str(path), *args, env=env)), finish(starting)
    for result in (start, check):
        assert result.returncode == 2, result.stderr
        assert named in result.stderr and "Traceback" not in result.stderr
        assert "engine_launched" not in result.stderr and result.stdout == ""
    assert start.stderr == check.stderr   # the same checks, the same words


def test_what_check_config_accepts_starts_and_warns_alike(tmp_path: Path) -> None:
    """The door on every interface without API keys is allowed, with a warning from both; with the
    token start-up accepts a control port beyond loopback, as check-config said."""
    path = config(tmp_path, [LANGUAGE], heartbeat_interval_ms=100)
    token = {"HETEROGATE_CLUSTER_TOKEN": "parity-token"}
    wide = ("--host", "0.0.0.0", "--grpc-host", "0.0.0.0")
    check = run_cli("check-config", str(path), *wide, env=token)
    assert check.returncode == 0, check.stderr
    assert f"{path}: OK" in check.stdout
    assert "warning: the HTTP door listens on 0.0.0.0, beyond loopback, with no API keys" in check.stderr
    with run_gateway(path, *wide, "--log-level", "warning", env=token, timeout=60) as gw:
        assert httpx.get(f"{gw.url}/health", timeout=5).status_code == 200
        log = gw.log_path.read_text()
        assert "start_up_warning" in log and "beyond loopback, with no API keys" in log


def test_api_keys_without_an_admin_key_are_warned_of() -> None:
    """Tenants' keys and no admin key: every key got 403 on /metrics and /admin/*, and nothing said so."""
    env = {"HG_TEST_KEYS": "sk-team-a", "HETEROGATE_CLUSTER_TOKEN": "parity-token"}
    with tempfile.TemporaryDirectory() as tmp:
        teams = {"tenants": {"teams": {"a": {"api_keys_env": "HG_TEST_KEYS"}}}}
        check = run_cli("check-config", str(config(Path(tmp), [LANGUAGE], **teams)), env=env)
        assert check.returncode == 0, check.stderr
        assert "warning: API keys are on (gateway.auth or gateway.tenants) and no admin key is set" in check.stderr
        admin = {**teams, "auth": {"admin_keys_env": "HG_TEST_ADMIN"}}
        check = run_cli("check-config", str(config(Path(tmp), [LANGUAGE], **admin)),
                        env={**env, "HG_TEST_ADMIN": "sk-x"})
        assert check.returncode == 0 and "warning: API keys" not in check.stderr, check.stderr


def test_check_config_takes_the_file_once() -> None:
    both = run_cli("check-config", "configs/backends.yaml", "--backends", "configs/backends.yaml")
    assert both.returncode == 2 and "give the file to check once" in both.stderr
    by_option = run_cli("check-config", "--backends", "configs/backends.yaml")
    assert by_option.returncode == 0 and "OK" in by_option.stdout

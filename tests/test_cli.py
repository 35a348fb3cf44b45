"""The real `gateway` console script in a subprocess: what an operator or a deploy script sees (output, exit
status), not what main() returns in-process."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

import common
from testkit.harness import free_ports
from tests.replicas.redis_helpers import redis_server

REPO = Path(__file__).resolve().parent.parent
TIMEOUT_S = 60


def gateway(*args: str) -> subprocess.CompletedProcess[str]:
    """Runs in its own session so the test can prove nothing it started (an engine, a server) outlives it;
    a hung command is killed with its whole group and fails the test."""
    return finish(start(*args))


def start(*args: str) -> subprocess.Popen[str]:
    """The console script started, in a session of its own (`finish` waits for it)."""
    exe = shutil.which("gateway", path=str(Path(sys.executable).parent))
    assert exe is not None, "the gateway console script is not installed next to this interpreter"
    return subprocess.Popen([exe, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
                            start_new_session=True)


def finish(proc: subprocess.Popen[str]) -> subprocess.CompletedProcess[str]:
    try:
        stdout, stderr = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise
    assert not group_alive(proc.pid), f"{proc.args} left processes running"
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def test_version_matches_package_and_pyproject() -> None:
    result = gateway("--version")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"heterogate {common.__version__}"
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert pyproject["project"]["version"] == common.__version__


def test_check_config_accepts_the_demo_cluster() -> None:
    result = gateway("check-config", "configs/backends.yaml")
    assert result.returncode == 0, result.stderr
    assert "OK" in result.stdout
    assert "llava-1.5-7b" in result.stdout
    assert "10 backends" in result.stdout


@pytest.mark.parametrize(("backend", "field"), [
    ("{id: bad-0, role: language, gpu: NO-SUCH-GPU, launch: {}}", "backends.0 (bad-0).gpu"),
    ("{id: bad-0, role: language, gpu: H100, launch: {}, colour: blue}", "colour"),
])
def test_check_config_rejects_a_broken_file(tmp_path: Path, backend: str, field: str) -> None:
    bad = tmp_path / "backends.yaml"
    bad.write_text(f"model: llava-1.5-7b\nbackends:\n  - {backend}\n")
    result = gateway("check-config", str(bad))
    assert result.returncode == 2
    assert str(bad) in result.stderr
    assert field in result.stderr
    assert "Traceback" not in result.stderr
    assert result.stdout == ""


@pytest.mark.parametrize(("section", "field"), [
    # each was accepted: a negative image count refused every image request at run time
    ("images: {max_images: -1}", "gateway.images.max_images"),
    ("images: {max_image_bytes: 0}", "gateway.images.max_image_bytes"),
    ("images: {max_image_pixels: -4}", "gateway.images.max_image_pixels"),
    ("images: {fetch_timeout_s: -5}", "gateway.images.fetch_timeout_s"),
    ("limits: {default_max_tokens: 5000}", "default_max_tokens (5000) is above max_tokens (4096)"),
    # accepted, and the floor silently never applied (the timeout caps it)
    ("limits: {first_token_floor_s: 100, first_token_timeout_s: 5}",
     "first_token_floor_s (100) is above first_token_timeout_s (5)"),
])
def test_check_config_rejects_limits_out_of_range(tmp_path: Path, section: str, field: str) -> None:
    bad = tmp_path / "backends.yaml"
    bad.write_text(f"model: llava-1.5-7b\ngateway:\n  {section}\nbackends:\n  - {{id: l4-0, gpu: L4, launch: {{}}}}\n")
    result = gateway("check-config", str(bad))
    assert result.returncode == 2 and field in result.stderr, result.stderr
    assert "Traceback" not in result.stderr


def test_check_config_counts_one_backend_as_one(tmp_path: Path) -> None:
    one = tmp_path / "backends.yaml"   # a cap below the built-in default (256) cuts that default, as before
    one.write_text("model: llava-1.5-7b\ngateway:\n  images: {max_images: 0}   # text only\n"
                   "  limits: {max_tokens: 64}\n"
                   "backends:\n  - {id: l4-0, gpu: L4, launch: {}}\n")
    result = gateway("check-config", str(one))
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"{one}: OK (model llava-1.5-7b, 1 backend)"


def ctrl_c_default() -> None:
    """SIGINT as a terminal leaves it (a test run in the background inherits it ignored)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.parametrize("after_s", [0.2, 0.6, 1.5])
def test_ctrl_c_while_starting_ends_it_without_a_traceback(after_s: float) -> None:
    """Ctrl-C during the imports and checks (a traceback of 40 lines before), or once it serves: one line
    or a clean stop, and nothing left running."""
    exe = shutil.which("gateway", path=str(Path(sys.executable).parent))
    assert exe is not None
    proc = subprocess.Popen([exe, "--backends", "configs/backends.yaml", "--port", "0", "--grpc-port", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
                            start_new_session=True, preexec_fn=ctrl_c_default)
    time.sleep(after_s)
    os.killpg(proc.pid, signal.SIGINT)
    result = finish(proc)
    assert result.returncode in (0, 130), result.stderr[-2000:]
    assert "Traceback" not in result.stderr and "KeyboardInterrupt" not in result.stderr, result.stderr[-2000:]


def test_ctrl_c_while_the_modules_load_is_raised_once_they_have() -> None:
    """A SIGINT inside an extension module's initialisation came out as an ImportError from grpc's Cython
    core, with a traceback (a clean exit asked for above): while the modules load it is only noted. Where
    SIGINT is ignored (a background job), it stays ignored."""
    from gateway.cli import ctrl_c_deferred

    before = signal.signal(signal.SIGINT, signal.default_int_handler)   # as a terminal leaves it
    try:
        loaded = []
        with pytest.raises(KeyboardInterrupt):
            with ctrl_c_deferred():
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(0.05)   # the handler runs here, where KeyboardInterrupt would have been raised
                loaded.append(True)
        assert loaded == [True]
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        with ctrl_c_deferred():   # ignored: nothing raised
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.05)
            loaded.append(True)
        assert loaded == [True, True] and signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, before)


def test_check_config_requires_a_file() -> None:
    result = gateway("check-config")
    assert result.returncode == 2
    assert "file" in result.stderr


@pytest.mark.parametrize("args", [("check-config", "/nonexistent.yaml"), ("--backends", "/nonexistent.yaml"),
                                  ("--no-such-option",), ("demo-upstream", "--port", "x")])
def test_a_refused_command_line_is_one_line(args: tuple[str, ...]) -> None:
    """argparse printed its usage block (nine lines of options) before the line that says what is wrong."""
    result = gateway(*args)
    assert result.returncode == 2 and len(result.stderr.splitlines()) == 1, result.stderr
    assert result.stderr.startswith("gateway") and ": error: " in result.stderr


@pytest.mark.parametrize(("option", "words"), [
    (("--port", "99999"), "a port is 0 to 65535"),
    (("--grpc-port", "70000"), "a port is 0 to 65535"),
    (("--redis-url", "notaurl"), "is no Redis URL"),
])
def test_check_config_and_start_up_refuse_bad_options(option: tuple[str, str], words: str) -> None:
    """What start-up refuses, check-config refuses too, both with exit 2 and no traceback (both at once: each
    takes a second or two to start)."""
    both = [(args, start(*args)) for args in (("check-config", "configs/backends.yaml", *option),
                                              ("--backends", "configs/backends.yaml", *option))]
    for args, proc in both:
        result = finish(proc)
        assert result.returncode == 2, (args, result.stderr)
        assert words in result.stderr and "Traceback" not in result.stderr, result.stderr


@dataclass
class WithoutRedis:
    """Both commands of the tests below, pointed at `port`, where nothing listens (closed again once picked)."""

    port: int
    replica: subprocess.Popen[str]
    workers: subprocess.Popen[str]


@pytest.fixture(scope="module", autouse=True)
def without_redis() -> Iterator[WithoutRedis]:
    """Started with the module: each command tries to reach Redis for start-up's full wait (10 s) before it
    exits, so the two waits overlap each other and the tests above instead of adding up. Each of the tests
    below waits for its own command and checks it."""
    port, http_port, grpc_port = free_ports(3)   # the workers share fixed ports
    runs = WithoutRedis(
        port,
        start("--backends", "configs/backends.yaml", "--port", "0", "--grpc-port", "0",
              "--redis-url", f"redis://ops:hunter2@127.0.0.1:{port}/0"),
        start("--backends", "configs/backends.yaml", "--workers", "2", "--port", str(http_port),
              "--grpc-port", str(grpc_port), "--redis-url", f"redis://127.0.0.1:{port}/0"),
    )
    yield runs
    for proc in (runs.replica, runs.workers):   # a command whose test did not run
        if group_alive(proc.pid):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()


def test_a_replica_that_cannot_reach_redis_exits_naming_it_and_launches_nothing(without_redis: WithoutRedis) -> None:
    """Nothing listens on the port: start-up tries for a while, then exits 1 with the URL (its password
    hidden); no engine was started (`finish` checks that nothing of its process group outlives it)."""
    result = finish(without_redis.replica)
    assert result.returncode == 1, result.stderr
    assert f"cannot reach Redis at redis://ops:***@127.0.0.1:{without_redis.port}/0" in result.stderr
    assert "hunter2" not in result.stderr and "Traceback" not in result.stderr


@pytest.mark.skipif(shutil.which("redis-server") is None, reason="needs the redis-server binary")
def test_a_replica_that_redis_refuses_exits_at_once_saying_why() -> None:
    """A Redis that asks for a password, given none, or a database it does not have: the replica tried
    for its whole start-up wait, then said it could not reach Redis ("HELLO must be called with the client
    already authenticated"), never that a password was missing."""
    with redis_server(password="sekret") as (_, port, _server):
        refused = {f"redis://127.0.0.1:{port}/0": "a password takes it in the URL",
                   f"redis://:sekret@127.0.0.1:{port}/99": "DB index is out of range"}
        for url, words in refused.items():
            result = finish(start("--backends", "configs/backends.yaml", "--port", "0", "--grpc-port", "0",
                                  "--redis-url", url))
            assert result.returncode == 1, result.stderr
            assert "refused this gateway" in result.stderr and words in result.stderr, result.stderr
            assert "sekret" not in result.stderr and "Traceback" not in result.stderr


def test_workers_that_cannot_reach_redis_end_the_command_as_one_replica_does(without_redis: WithoutRedis) -> None:
    """`--workers 2`: each worker cannot start, and the parent exits 1 with them (it restarted them every
    11 s for ever, and a supervisor never saw the failure)."""
    result = finish(without_redis.workers)
    assert result.returncode == 1, result.stderr
    assert "cannot reach Redis" in result.stderr and "Traceback" not in result.stderr


ENGINE = ("--backend-id", "x", "--gpu", "H100", "--model", "llava-1.5-tiny", "--gateway", "127.0.0.1:50061")
AGENT = ("--engine", "vllm", "--backend-id", "x", "--gpu", "H100", "--model", "llava-1.5-7b",
         "--address", "http://127.0.0.1:8001", "--gateway", "127.0.0.1:50061")


@pytest.mark.parametrize(("command", "args", "words"), [
    ("engine", ("--port", "99999"), "a port is 0 to 65535"),      # bound 99999 - 65536 instead
    ("engine", ("--gateway", "127.0.0.1"), "is not host:port"),   # retried port 443 for ever
    ("engine", ("--memory-utilization", "2"), "at most 1"),
    ("engine", ("--max-model-len", "-5"), "not a positive integer"),
    ("engine", ("--max-batch", "0"), "not a positive integer"),
    ("agent", ("--gateway", "nothostport"), "is not host:port"),
    ("agent", ("--scrape-timeout-s", "0"), "not a positive number"),   # every scrape timed out at once
    ("agent", ("--kv-total-tokens", "-1"), "not a positive integer"),
])
def test_engine_and_agent_refuse_values_out_of_range_in_one_line(
    command: str, args: tuple[str, ...], words: str, capsys: pytest.CaptureFixture[str],
) -> None:
    from backends.agent import parse_args as agent_args
    from backends.engine_config import parse_args as engine_args

    parse, base = (engine_args, ENGINE) if command == "engine" else (agent_args, AGENT)
    with pytest.raises(SystemExit) as exit_:
        parse([*base, *args])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and len(err.splitlines()) == 1 and words in err, err
    parse([*base, "--gateway", "[::1]:50061,dns:///gateway.svc:50061"])   # IPv6 and a named target pass


def test_check_config_refuses_a_torch_context_past_the_models(tmp_path: Path) -> None:
    """The engine refused it at every launch, restarted for ever, while check-config said OK."""
    path = tmp_path / "t.yaml"
    path.write_text("model: llava-1.5-tiny\nbackends:\n  - {id: l0, role: both, gpu: H100, launch: "
                    "{executor: torch, random_weights: true, max_model_len: 99999}}\n")
    result = gateway("check-config", str(path))
    assert result.returncode == 2
    assert "launch.max_model_len: 99999 is over the model's context of 1024 tokens" in result.stderr


def test_the_docker_image_copies_every_package_the_wheel_holds() -> None:
    """The image left out loadtest/, so `gateway plan` (the simulator) failed there with a traceback."""
    root = Path(common.__file__).resolve().parent.parent
    packages = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]["include"]
    copied = {line.split()[1] for line in (root / "Dockerfile").read_text().splitlines() if line.startswith("COPY ")}
    assert {p.rstrip("*") for p in packages} <= copied

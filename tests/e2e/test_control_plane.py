"""A gateway that trusts no one by default, as a real process on 127.0.0.1: API keys on, the cluster
token from an environment variable, TLS on the HTTP door and on the gRPC server (front door + control
port), and two managed engines that reach the control port over TLS with the token and the identity
their gateway gave them. Impostor heartbeats are refused with a status and a reason, and routing does
not move. A missing secret stops start-up with an error naming the setting."""

from __future__ import annotations

import asyncio
import datetime
import os
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
import yaml

from common.control_credentials import ControlCredentials
from common.wire import control_pb2, control_pb2_grpc, inference_pb2, inference_pb2_grpc
from testkit.harness import ROOT, Gateway, free_port, run_gateway, write_config
from tests.tls_certs import self_signed

MODEL = "llava-1.5-7b"
USER, ADMIN, TOKEN = "user-key", "admin-key", "cluster-token-e2e"
BACKENDS = ["h100-0", "l40s-0"]
Setup = tuple[Gateway, Path]


def cluster_config(tmp: Path, cert: Path, key: Path) -> Path:
    (tmp / "user.keys").write_text(f"{USER}\n")
    (tmp / "admin.keys").write_text(f"{ADMIN}\n")
    tls = {"cert_file": str(cert), "key_file": str(key)}
    return write_config(tmp, {
        "model": MODEL,
        "gateway": {
            "heartbeat_interval_ms": 100, "heartbeat_miss_limit": 30,   # a loaded machine delays heartbeats
            "auth": {"api_keys_file": str(tmp / "user.keys"), "admin_keys_file": str(tmp / "admin.keys"),
                     "cluster_token_env": "HG_TEST_CLUSTER_TOKEN"},
            "tls": {"http": tls, "grpc": tls},
        },
        "backends": [
            {"id": "h100-0", "role": "language", "gpu": "H100", "launch": {"time_scale": 0.1}},
            {"id": "l40s-0", "role": "language", "gpu": "L40S", "launch": {"time_scale": 0.1}},
        ],
    })


@pytest.fixture(scope="module")
def secured(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Setup]:
    tmp: Path = tmp_path_factory.mktemp("secured")
    cert, key = self_signed(tmp)
    config = cluster_config(tmp, cert, key)
    # healthy=2: both engines heartbeat over TLS with the token and their identity.
    with run_gateway(config, admin_key=ADMIN, https_ca=cert, env={"HG_TEST_CLUSTER_TOKEN": TOKEN}) as gw:
        yield gw, cert


def chat(gw: Gateway) -> httpx.Response:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    return httpx.post(f"{gw.url}/v1/chat/completions", json=body, headers={"authorization": f"Bearer {USER}"},
                      timeout=30, verify=gw.verify)


def test_https_door_round_trip(secured: Setup) -> None:
    gw, _ = secured
    assert gw.url.startswith("https://")
    resp = chat(gw)
    assert resp.status_code == 200, resp.text
    assert resp.headers["x-heterogate-backend"] in BACKENDS
    with pytest.raises(httpx.HTTPError):   # the same port does not answer plaintext HTTP
        httpx.get(gw.url.replace("https://", "http://") + "/health", timeout=5)


def test_grpc_door_over_tls(secured: Setup) -> None:
    gw, cert = secured

    ca = cert.read_bytes()

    async def generate() -> list[inference_pb2.GenerateReply]:
        creds = grpc.ssl_channel_credentials(root_certificates=ca)
        async with grpc.aio.secure_channel(f"127.0.0.1:{gw.grpc_port}", creds) as channel:
            stub = inference_pb2_grpc.InferenceStub(channel)
            request = inference_pb2.GenerateRequest(model=MODEL, prompt="hello", max_tokens=3)
            call = stub.Generate(request, metadata=(("authorization", f"Bearer {USER}"),), timeout=30)
            return [reply async for reply in call]

    replies = asyncio.run(generate())
    assert replies[0].backend in BACKENDS and replies[-1].finish_reason


async def _heartbeat(gw: Gateway, ca: bytes | None, credentials: ControlCredentials, backend_id: str,
                     address: str) -> grpc.aio.AioRpcError | None:
    """One heartbeat claiming `backend_id` at `address` (a saturated queue, to move routing if accepted)."""
    async def one() -> AsyncIterator[control_pb2.BackendState]:
        yield control_pb2.BackendState(backend_id=backend_id, address=address, seq=time.time_ns(),
                                       queue_depth=10_000, kv_free_bytes=0, kv_total_bytes=1)
        await asyncio.Event().wait()   # the stream stays open, as a sender's does, until the gateway answers

    target = f"127.0.0.1:{gw.grpc_port}"
    channel = (grpc.aio.secure_channel(target, grpc.ssl_channel_credentials(ca)) if ca
               else grpc.aio.insecure_channel(target))
    async with channel:
        call = control_pb2_grpc.ControlStub(channel).Connect(one(), metadata=credentials.metadata(), timeout=10)
        try:
            async for _ in call:
                return None
        except grpc.aio.AioRpcError as exc:
            return exc
    return None


def test_impostor_heartbeats_are_refused_and_routing_holds(secured: Setup) -> None:
    gw, cert = secured
    before = {b["id"]: (b["address"], b["pid"]) for b in gw.backends()}
    cases: list[tuple[ControlCredentials, Any, str]] = [
        (ControlCredentials(), grpc.StatusCode.UNAUTHENTICATED, "cluster token"),
        (ControlCredentials(token="guessed"), grpc.StatusCode.UNAUTHENTICATED, "cluster token"),
        (ControlCredentials(token=TOKEN), grpc.StatusCode.PERMISSION_DENIED, "identity"),
        (ControlCredentials(token=TOKEN, identity="guessed"), grpc.StatusCode.PERMISSION_DENIED, "identity"),
    ]
    for creds, code, reason in cases:
        err = asyncio.run(_heartbeat(gw, cert.read_bytes(), creds, "h100-0", "127.0.0.1:1"))
        assert err is not None and err.code() == code, err
        assert reason in (err.details() or "")
    # Plaintext to the TLS control port gets nowhere at all.
    err = asyncio.run(_heartbeat(gw, None, ControlCredentials(token=TOKEN), "h100-0", "127.0.0.1:1"))
    assert err is not None and err.code() == grpc.StatusCode.UNAVAILABLE
    after = {b["id"]: (b["address"], b["pid"]) for b in gw.backends()}
    assert after == before
    gw.wait_until(lambda: all(b["healthy"] for b in gw.backends()), timeout=10)
    replies = [chat(gw) for _ in range(6)]
    assert all(r.status_code == 200 for r in replies), [r.text for r in replies]
    assert {r.headers["x-heterogate-backend"] for r in replies} <= set(BACKENDS)


def start_up_error(tmp: Path, config: Path, *args: str, env: dict[str, str] | None = None) -> str:
    """Run the gateway; it must exit 2 before serving. Returns its stderr."""
    cmd = [sys.executable, "-m", "gateway.cli", "--backends", str(config), "--port", str(free_port()),
           "--grpc-port", str(free_port()), *args]
    environ = {k: v for k, v in os.environ.items() if not k.startswith(("HG_TEST_", "HETEROGATE_"))}
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=60, env={**environ, **(env or {})})
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr and "engine_launched" not in proc.stderr
    return proc.stderr


@pytest.mark.parametrize(("change", "args", "named"), [
    ({"auth": {"cluster_token_env": "HG_TEST_UNSET_TOKEN"}}, (),
     "gateway.auth.cluster_token_env: environment variable HG_TEST_UNSET_TOKEN is not set"),
    ({"auth": {"api_keys_env": "HG_TEST_UNSET_KEYS"}}, (),
     "gateway.auth.api_keys_env: environment variable HG_TEST_UNSET_KEYS is not set"),
    ({}, ("--grpc-host", "0.0.0.0"), "gateway.auth.cluster_token_file or cluster_token_env is required"),
    ({"tls": {"http": {"cert_file": "/nonexistent/tls.crt", "key_file": "/nonexistent/tls.key"}}}, (),
     "gateway.tls.http.cert_file: cannot read /nonexistent/tls.crt"),
])
def test_missing_secrets_stop_start_up(tmp_path: Path, change: dict[str, Any], args: tuple[str, ...],
                                       named: str) -> None:
    config = write_config(tmp_path, {
        "model": MODEL, "gateway": change,
        "backends": [{"id": "h100-0", "role": "language", "gpu": "H100", "launch": {"time_scale": 0.1}}],
    })
    assert named in start_up_error(tmp_path, config, *args)


def test_an_engine_that_cannot_reach_the_control_port_says_why(tmp_path: Path) -> None:
    """A certificate that does not name the address the engines dial: the engines never connect, and each
    logs a warning with gRPC's reason once it has been unreachable a few seconds (it was only a debug line)."""
    cert, key = self_signed(tmp_path, dns="foo.example", ip=None)
    config = cluster_config(tmp_path, cert, key)
    settings = yaml.safe_load(config.read_text())
    del settings["gateway"]["tls"]["http"]   # the HTTP door in plain text: only the control port's name is wrong
    config.write_text(yaml.safe_dump(settings))
    with run_gateway(config, admin_key=ADMIN, healthy=0, env={"HG_TEST_CLUSTER_TOKEN": TOKEN}) as gw:
        warned = gw.wait_until(lambda: [line for line in gw.log_path.read_text().splitlines()
                                        if '"gateway_unreachable"' in line and '"warning"' in line], timeout=40)
        assert all(b["state"] == "starting" for b in gw.backends())
    assert "UNAVAILABLE" in warned[0] and "127.0.0.1" in warned[0]


@pytest.mark.parametrize("flaw", ["key of another certificate", "swapped", "key as the CA"])
def test_grpc_tls_files_that_do_not_load_stop_start_up_and_check_config_naming_them(tmp_path: Path, flaw: str) -> None:
    """grpc reads its key pair only when the port is added and says no more than that it failed: start-up
    blamed the port ("address in use"), and check-config said OK; a key given as the CA let the gateway
    start with every engine it launched unable to connect."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    cert, key = self_signed(tmp_path / "a")
    _, other_key = self_signed(tmp_path / "b")
    grpc_tls = {"cert_file": str(cert), "key_file": str(other_key if flaw == "key of another certificate" else key)}
    if flaw == "swapped":
        grpc_tls = {"cert_file": str(key), "key_file": str(cert)}
    tls: dict[str, Any] = {"grpc": grpc_tls, **({"ca_file": str(key)} if flaw == "key as the CA" else {})}
    config = write_config(tmp_path, {
        "model": MODEL, "gateway": {"tls": tls},
        "backends": [{"id": "h100-0", "role": "language", "gpu": "H100", "launch": {"time_scale": 0.1}}],
    })
    named = ("gateway.tls.ca_file" if flaw == "key as the CA"
             else "gateway.tls.grpc: the certificate and key do not load")
    assert named in start_up_error(tmp_path, config)
    checked = subprocess.run([sys.executable, "-m", "gateway.cli", "check-config", str(config)], cwd=ROOT,
                             capture_output=True, text=True, timeout=60)
    assert checked.returncode == 2 and named in checked.stderr, checked.stderr


@pytest.mark.parametrize("flaw", ["http certificate expired", "grpc certificate not valid yet", "ca expired"])
def test_certificates_out_of_their_dates_stop_start_up_and_check_config(tmp_path: Path, flaw: str) -> None:
    """An expired certificate loaded, and the gateway served a door every client's handshake refuses (an
    expired CA: every engine it launched unable to connect), while check-config said OK."""
    (tmp_path / "good").mkdir()
    (tmp_path / "bad").mkdir()
    cert, key = self_signed(tmp_path / "good")
    dates = ({"starts": datetime.timedelta(hours=2), "ends": datetime.timedelta(days=2)} if "not valid yet" in flaw
             else {"starts": datetime.timedelta(days=-30), "ends": datetime.timedelta(days=-1)})
    bad_cert, bad_key = self_signed(tmp_path / "bad", **dates)
    pair = {"cert_file": str(bad_cert), "key_file": str(bad_key)}
    tls: dict[str, Any] = {
        "http certificate expired": {"http": pair},
        "grpc certificate not valid yet": {"grpc": pair},
        "ca expired": {"grpc": {"cert_file": str(cert), "key_file": str(key)}, "ca_file": str(bad_cert)},
    }[flaw]
    config = write_config(tmp_path, {
        "model": MODEL, "gateway": {"tls": tls},
        "backends": [{"id": "h100-0", "role": "language", "gpu": "H100", "launch": {"time_scale": 0.1}}],
    })
    setting = {"http certificate expired": "gateway.tls.http", "grpc certificate not valid yet": "gateway.tls.grpc",
               "ca expired": "gateway.tls.ca_file"}[flaw]
    named = f"{setting}: the certificate in {bad_cert} " + ("is not valid until" if "not valid yet" in flaw
                                                            else "expired on")
    assert named in start_up_error(tmp_path, config)
    checked = subprocess.run([sys.executable, "-m", "gateway.cli", "check-config", str(config)], cwd=ROOT,
                             capture_output=True, text=True, timeout=60)
    assert checked.returncode == 2 and named in checked.stderr, checked.stderr

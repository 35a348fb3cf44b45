"""The gRPC front door through a grpc.aio client, and API keys on both doors."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common.wire import inference_pb2, inference_pb2_grpc
from testkit.harness import Gateway, run_gateway, write_config

USER, ADMIN = "user-secret", "admin-secret"
MODEL = "llava-1.5-7b"


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    tmp: Path = tmp_path_factory.mktemp("keys")
    (tmp / "user.keys").write_text(f"{USER}\n")
    (tmp / "admin.keys").write_text(f"{ADMIN}\n")
    (tmp / "cluster.token").write_text("cluster-secret\n")   # required with API keys on
    config = write_config(tmp, {
        "model": MODEL,
        "gateway": {"auth": {"api_keys_file": str(tmp / "user.keys"), "admin_keys_file": str(tmp / "admin.keys"),
                             "cluster_token_file": str(tmp / "cluster.token")}},
        "backends": [
            {"id": "h100-0", "role": "language", "gpu": "H100", "launch": {"time_scale": 0.1}},
            {"id": "l40s-0", "role": "language", "gpu": "L40S", "launch": {"time_scale": 0.1}},
        ],
    })
    with run_gateway(config, admin_key=ADMIN) as gw:
        yield gw


def chat(gw: Gateway, key: str | None) -> httpx.Response:
    headers = {"authorization": f"Bearer {key}"} if key else {}
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    return httpx.post(f"{gw.url}/v1/chat/completions", json=body, headers=headers, timeout=30)


def test_http_keys(gateway: Gateway) -> None:
    for key in (None, "wrong"):
        resp = chat(gateway, key)
        assert resp.status_code == 401 and resp.json()["error"]["type"] == "authentication_error"
    assert chat(gateway, USER).status_code == 200
    assert chat(gateway, ADMIN).status_code == 200


def test_admin_endpoints_need_the_admin_key(gateway: Gateway) -> None:
    for path in ("/admin/backends", "/metrics"):
        assert httpx.get(gateway.url + path).status_code == 401
        as_user = httpx.get(gateway.url + path, headers={"authorization": f"Bearer {USER}"})
        assert as_user.status_code == 403 and as_user.json()["error"]["type"] == "permission_error"
        assert httpx.get(gateway.url + path, headers={"authorization": f"Bearer {ADMIN}"}).status_code == 200
    assert httpx.get(gateway.url + "/health").status_code == 200


async def test_grpc_generate_health_and_errors(gateway: Gateway) -> None:
    auth = (("authorization", f"Bearer {USER}"),)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{gateway.grpc_port}") as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        request = inference_pb2.GenerateRequest(
            model=MODEL, messages=[inference_pb2.Message(role="user", text="hello")], max_tokens=4
        )
        replies = [r async for r in stub.Generate(request, metadata=auth, timeout=30)]
        assert replies[0].backend in {"h100-0", "l40s-0"} and replies[0].request_id
        assert replies[-1].finish_reason in {"stop", "length"} and replies[-1].completion_tokens == len(replies)

        completion = inference_pb2.GenerateRequest(model=MODEL, prompt="Once", max_tokens=2)
        assert len([r async for r in stub.Generate(completion, metadata=auth, timeout=30)]) == 2

        bad = {
            grpc.StatusCode.UNAUTHENTICATED: (request, ()),
            grpc.StatusCode.NOT_FOUND: (inference_pb2.GenerateRequest(model="nope", prompt="x"), auth),
            grpc.StatusCode.INVALID_ARGUMENT: (inference_pb2.GenerateRequest(model=MODEL), auth),
        }
        for code, (req, md) in bad.items():
            with pytest.raises(grpc.aio.AioRpcError) as info:
                _ = [r async for r in stub.Generate(req, metadata=md, timeout=30)]
            assert info.value.code() == code and info.value.details()
        with pytest.raises(grpc.aio.AioRpcError) as info:   # neither: the error names the prompt
            _ = [r async for r in stub.Generate(inference_pb2.GenerateRequest(model=MODEL, prompt=""), metadata=auth,
                                                timeout=30)]
        assert "prompt" in info.value.details() and "messages: List" not in info.value.details()
        with pytest.raises(grpc.aio.AioRpcError) as info:   # a float field carries NaN here, unlike JSON
            _ = [r async for r in stub.Generate(inference_pb2.GenerateRequest(model=MODEL, prompt="x",
                                                                              temperature=float("nan"),
                                                                              has_temperature=True),
                                                metadata=auth, timeout=30)]
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "temperature" in info.value.details() and "finite" in info.value.details()

        # the client's request id where it is a sane token, as over HTTP; else a fresh one
        for given, kept in (("job-7:a.b_c", True), ("abc\n", False), ("bad id", False), ("x" * 129, False)):
            named = inference_pb2.GenerateRequest(model=MODEL, prompt="Once", max_tokens=1, request_id=given)
            replies = [r async for r in stub.Generate(named, metadata=auth, timeout=30)]
            assert (replies[0].request_id == given) is kept, replies[0].request_id
            assert replies[0].request_id.isalnum() or kept

        health = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""))
        assert health.status == health_pb2.HealthCheckResponse.SERVING


def test_sighup_reads_the_key_files_again_and_keeps_them_when_the_file_is_bad(tmp_path: Path) -> None:
    """Keys were read at start-up only: a revoked key kept working, and a new one got 401, until a restart."""
    keys = tmp_path / "user.keys"
    keys.write_text("first-key\n")
    (tmp_path / "admin.keys").write_text(f"{ADMIN}\n")
    (tmp_path / "cluster.token").write_text("cluster-secret\n")
    config = write_config(tmp_path, {
        "model": MODEL,
        "gateway": {"auth": {"api_keys_file": str(keys), "admin_keys_file": str(tmp_path / "admin.keys"),
                             "cluster_token_file": str(tmp_path / "cluster.token")}},
        "backends": [{"id": "h100-0", "role": "language", "gpu": "H100", "launch": {"time_scale": 0.1}}],
    })
    with run_gateway(config, admin_key=ADMIN) as gw:
        assert chat(gw, "first-key").status_code == 200 and chat(gw, "second-key").status_code == 401
        keys.write_text("# rotated\nsecond-key\n")
        gw.process.send_signal(signal.SIGHUP)
        gw.wait_until(lambda: chat(gw, "second-key").status_code == 200, timeout=20)
        assert chat(gw, "first-key").status_code == 401
        keys.write_text("# emptied by mistake\n")   # start-up refuses a file without keys: the keys in use stay
        gw.process.send_signal(signal.SIGHUP)
        gw.wait_until(lambda: "keys_reload_refused" in gw.log_path.read_text(), timeout=20)
        assert "holds no keys" in gw.log_tail(20)
        assert chat(gw, "second-key").status_code == 200
        assert httpx.get(f"{gw.url}/admin/backends", headers=gw.admin_headers, timeout=10).status_code == 200

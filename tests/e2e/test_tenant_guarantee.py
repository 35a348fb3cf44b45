"""A tenant's guaranteed concurrency end to end: a real gateway in front of a slow and a fast simulated
engine (an L40S listed first, an H100), a saturated pool (queue depth 1) full of a heavy tenant's
requests, and a light tenant with `min_in_flight: 1`. Its request goes at once, past the heavy tenant's
waiting ones, and to the backend where its first token comes soonest (the H100), not where the pool's
policy sends it (shortest queue: equal depths, so the first listed, the L40S)."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from testkit.harness import Gateway, run_gateway, write_config

pytestmark = pytest.mark.timeout(180)
MODEL = "llava-1.5-7b"
HEAVY, LIGHT, ADMIN = "sk-heavy", "sk-light", "sk-admin"
HEAVY_REQUESTS = 4   # two per backend: each at the depth limit, and two waiting in the admission queue


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    tmp: Path = tmp_path_factory.mktemp("guarantee")
    for name, key in (("heavy", HEAVY), ("light", LIGHT), ("admin", ADMIN)):
        (tmp / f"{name}.keys").write_text(f"{key}\n")
    (tmp / "cluster.token").write_text("cluster-secret\n")
    config = write_config(tmp, {
        "model": MODEL,
        "gateway": {
            "auth": {"admin_keys_file": str(tmp / "admin.keys"), "cluster_token_file": str(tmp / "cluster.token")},
            "admission": {"saturated_queue_depth": 1},
            "overload": {"enabled": False},
            "tenants": {"teams": {
                "heavy": {"api_keys_file": str(tmp / "heavy.keys")},
                "light": {"api_keys_file": str(tmp / "light.keys"), "min_in_flight": 1}}},
        },
        "backends": [   # slowed down: the heavy requests stay under way for seconds
            {"id": "l40s-0", "role": "language", "gpu": "L40S", "launch": {"time_scale": 20}},
            {"id": "h100-0", "role": "language", "gpu": "H100", "launch": {"time_scale": 20}},
        ],
    })
    with run_gateway(config, "--policy", "shortest_queue", admin_key=ADMIN) as gw:
        yield gw


def chat(gw: Gateway, key: str, max_tokens: int, stream: bool = False) -> httpx.Response:
    """A chat request of `key`'s tenant, read whole (streamed: to the end of its first chunk, then left)."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hello there"}], "max_tokens": max_tokens,
            "stream": stream}
    with httpx.stream("POST", f"{gw.url}/v1/chat/completions", json=body, timeout=120,
                      headers={"authorization": f"Bearer {key}"}) as resp:
        if stream:
            next(resp.iter_lines())
        else:
            resp.read()
        return resp


def waiting(gw: Gateway, tenant: str) -> int:
    resp = httpx.get(f"{gw.url}/admin/usage", headers=gw.admin_headers, timeout=10)
    return int(next(t["waiting"] for t in resp.json()["data"] if t["tenant"] == tenant))


def test_a_guaranteed_request_goes_past_the_saturated_pool_to_the_soonest_first_token(gateway: Gateway) -> None:
    with ThreadPoolExecutor(HEAVY_REQUESTS) as pool:
        heavy = [pool.submit(chat, gateway, HEAVY, 32) for _ in range(HEAVY_REQUESTS)]
        gateway.wait_until(lambda: waiting(gateway, "heavy") == HEAVY_REQUESTS - 2)   # both backends saturated
        light = chat(gateway, LIGHT, 4, stream=True)
        assert light.status_code == 200 and light.headers["x-heterogate-backend"] == "h100-0"
        assert waiting(gateway, "heavy") == HEAVY_REQUESTS - 2   # it went first, past theirs
        assert [f.result().status_code for f in heavy] == [200] * HEAVY_REQUESTS

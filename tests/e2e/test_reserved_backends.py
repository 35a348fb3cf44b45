"""A backend kept for a priority class end to end (`min_priority`): a real gateway in front of an L40S
open to everyone and an H100 kept for priority class 1, a saturated pool (queue depth 1) and two
tenants. The batch tenant's requests never reach the H100: with the L40S at the depth limit they wait
in the admission queue although the H100 is idle (saturation is counted over the backends open to
their class). The interactive tenant's request goes at once, past them, to the H100."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from testkit.harness import Gateway, run_gateway, write_config

pytestmark = pytest.mark.timeout(180)
MODEL = "llava-1.5-7b"
BATCH, INTERACTIVE, ADMIN = "sk-batch", "sk-interactive", "sk-admin"
BATCH_REQUESTS = 3   # one under way on the L40S (the depth limit), two waiting


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    tmp: Path = tmp_path_factory.mktemp("reserved")
    for name, key in (("batch", BATCH), ("interactive", INTERACTIVE), ("admin", ADMIN)):
        (tmp / f"{name}.keys").write_text(f"{key}\n")
    (tmp / "cluster.token").write_text("cluster-secret\n")
    config = write_config(tmp, {
        "model": MODEL,
        "gateway": {
            "auth": {"admin_keys_file": str(tmp / "admin.keys"), "cluster_token_file": str(tmp / "cluster.token")},
            "admission": {"saturated_queue_depth": 1, "max_wait_s": 120},
            "overload": {"enabled": False},
            "tenants": {"teams": {
                "batch": {"api_keys_file": str(tmp / "batch.keys")},
                "interactive": {"api_keys_file": str(tmp / "interactive.keys"), "priority": 1}}},
        },
        "backends": [   # slowed down: the batch requests stay under way for seconds
            {"id": "l40s-0", "role": "language", "gpu": "L40S", "launch": {"time_scale": 20}},
            {"id": "h100-0", "role": "language", "gpu": "H100", "launch": {"time_scale": 20}, "min_priority": 1},
        ],
    })
    with run_gateway(config, "--policy", "shortest_queue", admin_key=ADMIN) as gw:
        yield gw


def chat(gw: Gateway, key: str, max_tokens: int) -> httpx.Response:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hello there"}], "max_tokens": max_tokens}
    return httpx.post(f"{gw.url}/v1/chat/completions", json=body, timeout=120,
                      headers={"authorization": f"Bearer {key}"})


def waiting(gw: Gateway, tenant: str) -> int:
    resp = httpx.get(f"{gw.url}/admin/usage", headers=gw.admin_headers, timeout=10)
    return int(next(t["waiting"] for t in resp.json()["data"] if t["tenant"] == tenant))


def test_a_reserved_backend_takes_only_its_class_and_saturation_counts_without_it(gateway: Gateway) -> None:
    assert gateway.backend("h100-0")["min_priority"] == 1 and gateway.backend("l40s-0")["min_priority"] is None
    with ThreadPoolExecutor(BATCH_REQUESTS) as pool:
        batch = [pool.submit(chat, gateway, BATCH, 24) for _ in range(BATCH_REQUESTS)]
        gateway.wait_until(lambda: waiting(gateway, "batch") == BATCH_REQUESTS - 1)
        assert gateway.backend("h100-0")["in_flight"] == 0   # idle, and still not theirs
        interactive = chat(gateway, INTERACTIVE, 4)
        assert interactive.status_code == 200 and interactive.headers["x-heterogate-backend"] == "h100-0"
        assert waiting(gateway, "batch") == BATCH_REQUESTS - 1 or batch[0].done()   # it went past theirs
        done = [f.result() for f in batch]
    assert [r.status_code for r in done] == [200] * BATCH_REQUESTS
    assert {r.headers["x-heterogate-backend"] for r in done} == {"l40s-0"}

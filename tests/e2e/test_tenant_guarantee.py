"""A tenant's place in a saturated pool end to end: real gateways in front of a slow and a fast
simulated engine (an L40S listed first, an H100), slowed down so that requests stay under way for
seconds, a pool saturated at a queue depth of 1, shortest-queue routing.

- Guaranteed concurrency: the pool full of a heavy tenant's requests, a light tenant with
  `min_in_flight: 1`. Its request goes at once, past the heavy tenant's waiting ones, and to the
  backend where its first token comes soonest (the H100), not where the pool's policy sends it
  (shortest queue: equal depths, so the first listed, the L40S).
- A backend kept for a class (`min_priority: 1` on the H100): the batch tenant's requests never reach
  it; with the L40S at the depth limit they wait in the admission queue although the H100 is idle
  (saturation is counted over the backends open to their class). The interactive tenant (class 1)
  goes at once, past them, to the H100."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from testkit.harness import Gateway, long_request_id, run_gateway, write_config

pytestmark = pytest.mark.timeout(180)
MODEL = "llava-1.5-7b"
ADMIN = "sk-admin"
HEAVY_REQUESTS = 4   # two per backend: each at the depth limit, and two waiting in the admission queue
BATCH_REQUESTS = 3   # one under way on the L40S (the depth limit), two waiting
# Tokens of the requests that hold each backend while the light tenant's goes: about 3 s on either (the
# L40S takes ~4x as long per token), so the whole test takes seconds, not the L40S's 10 s per 32 tokens.
HOLD_TOKENS = {"l40s-0": 9, "h100-0": 32}
BATCH_TOKENS = 8     # ~2.6 s each on the L40S, one after the other


def key(tenant: str) -> str:
    return f"sk-{tenant}"


@contextmanager
def saturated_pool(tmp: Path, teams: dict[str, dict[str, Any]], h100: dict[str, Any]) -> Iterator[Gateway]:
    """A gateway whose tenants are `teams` (each with the key `key(name)`), its H100's entry with `h100` added."""
    for name in (*teams, "admin"):
        (tmp / f"{name}.keys").write_text(f"{key(name)}\n")
    (tmp / "cluster.token").write_text("cluster-secret\n")
    config = write_config(tmp, {
        "model": MODEL,
        "gateway": {
            "auth": {"admin_keys_file": str(tmp / "admin.keys"), "cluster_token_file": str(tmp / "cluster.token")},
            "admission": {"saturated_queue_depth": 1, "max_wait_s": 120},
            "overload": {"enabled": False},
            "tenants": {"teams": {name: {"api_keys_file": str(tmp / f"{name}.keys"), **policy}
                                  for name, policy in teams.items()}},
        },
        "backends": [
            {"id": "l40s-0", "role": "language", "gpu": "L40S", "launch": {"time_scale": 20}},
            {"id": "h100-0", "role": "language", "gpu": "H100", "launch": {"time_scale": 20}, **h100},
        ],
    })
    with run_gateway(config, "--policy", "shortest_queue", admin_key=ADMIN) as gw:
        yield gw


@pytest.fixture(scope="module")
def guarantee(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    with saturated_pool(tmp_path_factory.mktemp("guarantee"), {"heavy": {}, "light": {"min_in_flight": 1}}, {}) as gw:
        yield gw


@pytest.fixture(scope="module")
def reserved(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    with saturated_pool(tmp_path_factory.mktemp("reserved"), {"batch": {}, "interactive": {"priority": 1}},
                        {"min_priority": 1}) as gw:
        yield gw


def chat(gw: Gateway, tenant: str, max_tokens: int, stream: bool = False) -> httpx.Response:
    """A chat request of `tenant`'s, read whole (streamed: to the end of its first chunk, then left); its id
    makes the simulated answer at least `max_tokens` long, so it lasts as long as the test counts on."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hello there"}], "max_tokens": max_tokens,
            "stream": stream}
    headers = {"authorization": f"Bearer {key(tenant)}", "x-request-id": long_request_id(max_tokens, tenant)}
    with httpx.stream("POST", f"{gw.url}/v1/chat/completions", json=body, timeout=120, headers=headers) as resp:
        if stream:
            next(resp.iter_lines())
        else:
            resp.read()
        return resp


def waiting(gw: Gateway, tenant: str) -> int:
    resp = httpx.get(f"{gw.url}/admin/usage", headers=gw.admin_headers, timeout=10)
    return int(next(t["waiting"] for t in resp.json()["data"] if t["tenant"] == tenant))


def test_a_guaranteed_request_goes_past_the_saturated_pool_to_the_soonest_first_token(guarantee: Gateway) -> None:
    with ThreadPoolExecutor(HEAVY_REQUESTS) as pool:
        heavy = []
        for backend_id, tokens in HOLD_TOKENS.items():   # shortest queue, equal depths: the L40S first
            heavy.append(pool.submit(chat, guarantee, "heavy", tokens))
            guarantee.wait_until(lambda b=backend_id: guarantee.backend(b)["in_flight"] == 1)
        heavy += [pool.submit(chat, guarantee, "heavy", 4) for _ in range(HEAVY_REQUESTS - 2)]
        guarantee.wait_until(lambda: waiting(guarantee, "heavy") == HEAVY_REQUESTS - 2)   # both backends saturated
        light = chat(guarantee, "light", 4, stream=True)
        assert light.status_code == 200 and light.headers["x-heterogate-backend"] == "h100-0"
        assert waiting(guarantee, "heavy") == HEAVY_REQUESTS - 2   # it went first, past theirs
        assert [f.result().status_code for f in heavy] == [200] * HEAVY_REQUESTS


def test_a_reserved_backend_takes_only_its_class_and_saturation_counts_without_it(reserved: Gateway) -> None:
    assert reserved.backend("h100-0")["min_priority"] == 1 and reserved.backend("l40s-0")["min_priority"] is None
    with ThreadPoolExecutor(BATCH_REQUESTS) as pool:
        batch = [pool.submit(chat, reserved, "batch", BATCH_TOKENS) for _ in range(BATCH_REQUESTS)]
        reserved.wait_until(lambda: waiting(reserved, "batch") == BATCH_REQUESTS - 1)
        assert reserved.backend("h100-0")["in_flight"] == 0   # idle, and still not theirs
        interactive = chat(reserved, "interactive", 4)
        assert interactive.status_code == 200 and interactive.headers["x-heterogate-backend"] == "h100-0"
        assert waiting(reserved, "batch") == BATCH_REQUESTS - 1 or batch[0].done()   # it went past theirs
        done = [f.result() for f in batch]
    assert [r.status_code for r in done] == [200] * BATCH_REQUESTS
    assert {r.headers["x-heterogate-backend"] for r in done} == {"l40s-0"}


def test_a_drain_that_would_leave_only_backends_kept_for_a_higher_class_is_refused(reserved: Gateway) -> None:
    """With the L40S drained only the H100, kept for class 1, would serve: the batch tenant (class 0) could
    be served nowhere, so the drain is refused and the fleet left as it is."""
    refused = httpx.post(f"{reserved.url}/admin/backends/l40s-0/drain", headers=reserved.admin_headers, timeout=10)
    assert refused.status_code == 409 and "class 0" in refused.json()["error"]["message"], refused.text
    assert reserved.backend("l40s-0")["draining"] is False
    assert "degraded" not in httpx.get(f"{reserved.url}/ready", timeout=5).json()

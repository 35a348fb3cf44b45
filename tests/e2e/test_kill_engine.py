"""kill -9 of an engine in the middle of 300 requests: every request completes or gets a clear error;
non-streamed ones all complete; the gateway keeps serving."""

from __future__ import annotations

import asyncio
import json
import os
import signal
from collections import Counter
from pathlib import Path

import httpx

from testkit.harness import demo_config, metric_total, run_gateway

MODEL = "llava-1.5-7b"
TOTAL, CONCURRENCY = 300, 48


async def one(client: httpx.AsyncClient, i: int, outcomes: Counter[str]) -> None:
    stream = i % 3 == 0
    body = {"model": MODEL, "messages": [{"role": "user", "content": "word " * (10 + 40 * (i % 7))}],
            "max_tokens": 24 + i % 40, "stream": stream}
    if not stream:
        resp = await client.post("/v1/chat/completions", json=body)
        ok = resp.status_code == 200 and resp.json()["choices"][0]["message"]["content"]
        outcomes["plain_ok" if ok else f"plain_{resp.status_code}"] += 1
        return
    async with client.stream("POST", "/v1/chat/completions", json=body) as resp:
        if resp.status_code != 200:
            await resp.aread()
            assert "error" in resp.json(), "an error must come with an OpenAI error body"
            outcomes[f"stream_{resp.status_code}"] += 1
            return
        events = [line async for line in resp.aiter_lines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]", "every stream ends with [DONE]"
    errors = [e for e in events if e.startswith('data: {"error"')]
    if errors:
        assert json.loads(errors[0][6:])["error"]["message"]
        outcomes["stream_error_event"] += 1
    else:
        assert json.loads(events[-2][6:])["choices"][0]["finish_reason"] in {"stop", "length"}
        outcomes["stream_ok"] += 1


def test_kill_9_during_load(tmp_path: Path) -> None:
    config = demo_config(tmp_path, time_scale=0.5, heartbeat_interval_ms=100, retry_backoff_s=0.001)
    with run_gateway(config) as gw:
        victim = max((b for b in gw.backends() if b["gpu"] == "H100"), key=lambda b: b["id"])

        async def load() -> Counter[str]:
            outcomes: Counter[str] = Counter()
            limit = asyncio.Semaphore(CONCURRENCY)
            async with httpx.AsyncClient(base_url=gw.url, timeout=60) as client:

                async def bounded(i: int) -> None:
                    async with limit:
                        await one(client, i, outcomes)

                tasks = [asyncio.create_task(bounded(i)) for i in range(TOTAL)]
                while sum(outcomes.values()) < TOTAL // 4:  # noqa: ASYNC110 - polling a counter
                    await asyncio.sleep(0.01)
                os.kill(victim["pid"], signal.SIGKILL)
                await asyncio.gather(*tasks)
            return outcomes

        outcomes = asyncio.run(load())
        print(f"\nkill -9 of {victim['id']}: sent {TOTAL}, outcomes {dict(outcomes)}")
        assert sum(outcomes.values()) == TOTAL
        plain = sum(v for k, v in outcomes.items() if k.startswith("plain"))
        assert outcomes["plain_ok"] == plain, outcomes
        assert set(outcomes) <= {"plain_ok", "stream_ok", "stream_error_event"}, outcomes
        # the gateway keeps serving, and the supervisor brings the engine back
        resp = httpx.post(f"{gw.url}/v1/chat/completions", timeout=30,
                          json={"model": MODEL, "messages": [{"role": "user", "content": "still there?"}]})
        assert resp.status_code == 200
        gw.wait_until(lambda: gw.backend(victim["id"])["healthy"] and gw.backend(victim["id"])["pid"] != victim["pid"])
        # /admin/backends says why it went and that it was relaunched; the others never left
        back = gw.backend(victim["id"])
        assert back["last_exit"] == "exited with status 137 (killed by SIGKILL)" and back["restarts"] >= 1, back
        assert all(b["last_exit"] is None for b in gw.backends() if b["id"] != victim["id"])
        # drained, its engine stopped: the count stays (it fell to 0, a counter reset to Prometheus)
        restarts = back["restarts"]
        assert metric_total(gw, "heterogate_backend_restarts_total", backend=victim["id"]) == restarts
        drained = httpx.post(f"{gw.url}/admin/backends/{victim['id']}/drain", timeout=10)
        assert drained.status_code == 202, drained.text
        gw.wait_until(lambda: gw.backend(victim["id"])["state"] == "stopped", timeout=30)
        assert gw.backend(victim["id"])["restarts"] == restarts
        assert metric_total(gw, "heterogate_backend_restarts_total", backend=victim["id"]) == restarts

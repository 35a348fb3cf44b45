"""`gateway demo-upstream`, the packaged mock vLLM, and a gateway in front of it with the shipped
configs/demo-upstream.yaml, as the README has a user without a GPU try "front an existing vLLM": both
are the real console script on 127.0.0.1, and the official openai client talks to the gateway."""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import httpx
import openai
import pytest
import yaml
from openai.types.chat import ChatCompletionMessageParam

from testkit.harness import ROOT, free_port, metric_total, run_gateway, write_config

MODEL = "llava-1.5-7b"
pytestmark = pytest.mark.timeout(120)


@contextmanager
def demo_upstream(*args: str) -> Iterator[str]:
    """`gateway demo-upstream --port P ARGS` until the block ends; yields its base URL once it answers."""
    exe = shutil.which("gateway", path=str(Path(sys.executable).parent))
    assert exe is not None, "the gateway console script is not installed next to this interpreter"
    port = free_port()
    proc = subprocess.Popen([exe, "demo-upstream", "--port", str(port), *args], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(200):
            assert proc.poll() is None, proc.communicate()[0].decode(errors="replace")
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.05)
        else:
            raise TimeoutError("demo upstream never answered /health")
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_the_official_client_through_the_gateway_in_front_of_the_demo_upstream(tmp_path: Path) -> None:
    with demo_upstream() as url:
        shipped = yaml.safe_load((ROOT / "configs" / "demo-upstream.yaml").read_text())
        shipped["backends"][0]["address"] = url   # the shipped file says 8001; a free port here
        with run_gateway(write_config(tmp_path, shipped), timeout=60) as gw:
            client = openai.OpenAI(base_url=f"{gw.url}/v1", api_key="unused", timeout=30)
            messages: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Hello!"}]

            reply = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4)
            assert reply.choices[0].message.content == "w0 w1 w2 w3 "
            assert reply.model == MODEL and reply.usage is not None and reply.usage.completion_tokens == 4

            streamed = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=3, stream=True)
            assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == "w0 w1 w2 "

            completion = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=2)
            assert completion.choices[0].text == "w0 w1 "
            assert [m.id for m in client.models.list()] == [MODEL]

            # The gateway reads the mock's vLLM metrics itself (scrape:): what the mock reports shows.
            httpx.post(f"{url}/control", json={"waiting": 7}, timeout=5).raise_for_status()
            gw.wait_until(lambda: gw.backend("demo-vllm")["queue_depth"] == 7)
            assert httpx.get(f"{url}/stats", timeout=5).json()["last_body"]["model"] == "demo-model"
            assert 'vllm:e2e_request_latency_seconds_count{engine="0",model_name="demo-model"} 3' in httpx.get(
                f"{url}/metrics", timeout=5).text   # the three completions above
            assert "engine_metrics_missing" not in gw.log_path.read_text()   # it reads as vLLM's


def test_the_demo_upstream_answers_bad_input_with_a_clear_4xx() -> None:
    with demo_upstream("--api-key", "k1", "--max-model-len", "4096") as url:
        keyed = {"authorization": "Bearer k1"}
        assert httpx.get(f"{url}/v1/models", timeout=5).status_code == 401
        models = httpx.get(f"{url}/v1/models", headers=keyed, timeout=5).json()["data"]
        assert [(m["id"], m["max_model_len"]) for m in models] == [("demo-model", 4096)]
        body = {"model": "demo-model", "prompt": "hi", "max_tokens": 2}
        assert httpx.post(f"{url}/v1/completions", json=body, timeout=5).status_code == 401
        assert httpx.post(f"{url}/v1/completions", json=body, headers=keyed, timeout=5).status_code == 200
        not_json = httpx.post(f"{url}/v1/completions", content=b"{nope", headers=keyed, timeout=5)
        assert not_json.status_code == 400 and "not JSON" in not_json.json()["error"]["message"]
        for bad in ({"bogus": 1}, {"waiting": -1}, {"fail": "many"}, [1]):
            answer = httpx.post(f"{url}/control", json=bad, timeout=5)
            assert answer.status_code == 400 and "waiting" in answer.json()["error"]["message"], bad
        metrics = httpx.get(f"{url}/metrics", timeout=5).text
        assert 'vllm:num_requests_waiting{engine="0",model_name="demo-model"} 0' in metrics


def test_time_to_first_token_in_metrics_counts_the_wait_in_the_gateways_queue(tmp_path: Path) -> None:
    """Four streams at once on an upstream the gateway holds at a depth of one: each waits for those before
    it in the admission queue (about a second each, 10 tokens at 100 ms), and the TTFT and end-to-end
    histograms count that wait as the clients and the request log do (they counted from the dispatch:
    four first tokens in milliseconds while the clients waited up to 3 s)."""
    with demo_upstream("--token-delay-ms", "100") as url:
        held = {"admission": {"saturated_queue_depth": 1}, "overload": {"enabled": False}}
        config = {"model": MODEL, "gateway": held,
                  "backends": [{"id": "slow", "kind": "openai", "role": "language", "gpu": "H100", "address": url,
                                "upstream_model": "demo-model", "scrape": {"engine": "vllm"}}]}
        with run_gateway(write_config(tmp_path, config), timeout=60) as gw:
            body = {"model": MODEL, "messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 10,
                    "stream": True}

            def ttft() -> float:
                t0 = time.monotonic()
                with httpx.stream("POST", f"{gw.url}/v1/chat/completions", json=body, timeout=30) as answer:
                    assert answer.status_code == 200
                    lines = answer.iter_lines()
                    next(line for line in lines if line.startswith("data: {"))
                    first = time.monotonic() - t0
                    for _ in lines:
                        pass
                return first

            with ThreadPoolExecutor(4) as pool:
                clients = list(pool.map(lambda _: ttft(), range(4)))
            assert max(clients) > 2.0, clients   # the queue held the last one behind the others
            counted = metric_total(gw, "heterogate_ttft_seconds_sum", backend="slow")
            assert metric_total(gw, "heterogate_ttft_seconds_count", backend="slow") == 4
            # the clients' own times add their connections and threads (up to 0.2 s each on a busy host)
            assert 0.7 * sum(clients) < counted <= sum(clients) + 0.1, (counted, clients)
            assert metric_total(gw, "heterogate_e2e_seconds_sum", backend="slow") > counted + 3.0

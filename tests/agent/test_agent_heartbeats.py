"""The agent as a real process: a real metrics endpoint on one side, the real Control service on the other.

The test changes the numbers the fake engine's /metrics serves and watches the gateway's state table
follow them; then the endpoint stops answering (refused, or hanging) and the backend must turn
saturated after STALE_INTERVALS intervals while staying healthy.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import grpc
import pytest

from common.catalog import load_catalog
from common.engine_scraper import STALE_INTERVALS
from common.metric_tables import SATURATED_QUEUE
from common.wire import control_pb2_grpc
from gateway.control.heartbeat_service import ControlService
from gateway.routing.backend_entry import BackendEntry
from gateway.routing.signals import LocalSignals
from gateway.routing.state_table import StateTable
from testkit.harness import ROOT

pytestmark = pytest.mark.timeout(30)

INTERVAL_S = 0.1
# Process start, scheduling on a busy two-core machine: on top of the intervals a change needs.
SLACK_S = 1.0
CATALOG = load_catalog()
MODEL, GPU = CATALOG.model("llava-1.5-7b"), CATALOG.gpu("H100")
BPT = MODEL.kv_bytes_per_token


class MetricsEndpoint:
    """A real HTTP/1.0 server on 127.0.0.1 serving `body` with `status`; `hang()` holds every answer."""

    def __init__(self) -> None:
        self.body, self.status = "", 200
        self._answer = threading.Event()
        self._answer.set()
        endpoint = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                endpoint._answer.wait(10)
                data = endpoint.body.encode()
                self.send_response(endpoint.status)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self._thread.start()

    def hang(self) -> None:
        self._answer.clear()

    def answer(self) -> None:
        self._answer.set()

    def close(self) -> None:
        self._answer.set()
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def endpoint() -> Iterator[MetricsEndpoint]:
    ep = MetricsEndpoint()
    yield ep
    ep.close()


@pytest.fixture
async def gateway() -> AsyncIterator[tuple[StateTable, str]]:
    """The gateway's Control service over a state table holding one external backend, `ext-0`."""
    table = StateTable(MODEL, heartbeat_interval_s=INTERVAL_S)
    table.register("ext-0", "language", GPU, address=None, managed=False)
    server = grpc.aio.server()
    control_pb2_grpc.add_ControlServicer_to_server(ControlService(LocalSignals(table)), server)  # type: ignore[no-untyped-call]
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    yield table, f"127.0.0.1:{port}"
    await server.stop(grace=None)


def start_agent(tmp: Path, engine: str, metrics: MetricsEndpoint, gateway: str) -> tuple[subprocess.Popen[bytes], Path]:
    log_path = tmp / f"agent-{engine}.log"
    cmd = [sys.executable, "-m", "backends.agent", "--engine", engine, "--metrics-url", f"{metrics.url}/metrics",
           "--address", metrics.url, "--backend-id", "ext-0", "--gpu", "H100", "--model", "llava-1.5-7b",
           "--gateway", gateway, "--interval-ms", str(int(INTERVAL_S * 1000)), "--scrape-timeout-s", "0.5"]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env={**os.environ})
    return proc, log_path


@pytest.fixture
def agents() -> Iterator[list[subprocess.Popen[bytes]]]:
    procs: list[subprocess.Popen[bytes]] = []
    yield procs
    for p in procs:
        p.terminate()
        try:
            p.wait(timeout=5)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def log_text(log: Path) -> str:
    return log.read_text(errors="replace")


async def wait_for(predicate: Callable[[], bool], limit_s: float, what: str, log: Path) -> float:
    """Seconds until `predicate` held; the event loop keeps serving the Control stream meanwhile."""
    t0 = time.monotonic()
    while not predicate():
        if time.monotonic() - t0 > limit_s:
            tail = "\n".join(log_text(log).splitlines()[-15:])
            pytest.fail(f"{what}: not within {limit_s:.2f} s; agent log tail:\n{tail}")
        await asyncio.sleep(0.01)
    return time.monotonic() - t0


def vllm_text(ranks: list[tuple[int, int, float]], latency: tuple[float, int] = (0.0, 0)) -> str:
    """(waiting, running, usage) per `engine` rank, 1000 blocks of 16 tokens each."""
    lines = ["# TYPE vllm:num_requests_waiting gauge"]
    lines += [f'vllm:num_requests_waiting{{engine="{i}",model_name="m"}} {w}' for i, (w, _, _) in enumerate(ranks)]
    lines.append("# TYPE vllm:num_requests_running gauge")
    lines += [f'vllm:num_requests_running{{engine="{i}",model_name="m"}} {r}' for i, (_, r, _) in enumerate(ranks)]
    lines.append("# TYPE vllm:kv_cache_usage_perc gauge")
    lines += [f'vllm:kv_cache_usage_perc{{engine="{i}",model_name="m"}} {u}' for i, (_, _, u) in enumerate(ranks)]
    lines.append("# TYPE vllm:cache_config_info gauge")
    lines += [f'vllm:cache_config_info{{block_size="16",engine="{i}",num_gpu_blocks="1000"}} 1.0'
              for i in range(len(ranks))]
    lines += ["# TYPE vllm:e2e_request_latency_seconds histogram",
              f'vllm:e2e_request_latency_seconds_sum{{engine="0",model_name="m"}} {latency[0]}',
              f'vllm:e2e_request_latency_seconds_count{{engine="0",model_name="m"}} {latency[1]}']
    return "\n".join(lines) + "\n"


def reported(entry: BackendEntry) -> tuple[int, int, int, int]:
    r = entry.reported
    return r.waiting, r.running, r.kv_free_bytes, r.kv_total_bytes


async def test_vllm_agent_follows_the_metrics_and_reports_saturation_when_the_endpoint_is_gone(
    tmp_path: Path, endpoint: MetricsEndpoint, gateway: tuple[StateTable, str], agents: list[subprocess.Popen[bytes]]
) -> None:
    table, address = gateway
    entry = table.get("ext-0")
    assert entry is not None
    endpoint.body = vllm_text([(0, 0, 0.0), (0, 0, 0.0)])
    proc, log = start_agent(tmp_path, "vllm", endpoint, address)
    agents.append(proc)
    await wait_for(lambda: entry.last_heartbeat is not None, 15, "first heartbeat", log)
    total = 2 * 16 * 1000 * BPT
    assert reported(entry) == (0, 0, total, total)
    assert entry.address == endpoint.url
    assert table.is_healthy(entry)

    endpoint.body = vllm_text([(3, 2, 0.5), (4, 1, 0.25)], latency=(10.0, 4))
    bound = 3 * INTERVAL_S + SLACK_S
    await wait_for(lambda: entry.reported.waiting == 7, bound, "waiting follows the metrics", log)
    await wait_for(lambda: entry.reported.running == 3, bound, "running follows", log)
    assert entry.reported.kv_free_bytes == (8000 + 12000) * BPT
    assert (entry.reported.mean_service_s, entry.reported.requests_completed) == (2.5, 4)

    endpoint.body = vllm_text([(0, 1, 0.125), (1, 0, 0.0)], latency=(16.0, 6))
    await wait_for(lambda: reported(entry)[:2] == (1, 1), bound, "a second change follows", log)
    assert entry.reported.kv_free_bytes == (14000 + 16000) * BPT
    assert entry.reported.mean_service_s == 3.0

    await asyncio.to_thread(endpoint.close)   # connection refused from now on
    elapsed = await wait_for(lambda: entry.reported.waiting == SATURATED_QUEUE,
                             STALE_INTERVALS * INTERVAL_S + SLACK_S, "saturated after the endpoint went away", log)
    # The last good scrape was at most one interval before the endpoint closed.
    assert elapsed > (STALE_INTERVALS - 1) * INTERVAL_S
    assert reported(entry) == (SATURATED_QUEUE, 1, 0, total)   # running and capacity: the last good values
    assert endpoint.url.removeprefix("http://") in entry.reported.scrape_error   # why, for /admin/backends
    await asyncio.sleep(3 * INTERVAL_S)
    # still heartbeating, but with no fresh load figure: not heard from (the gateway fails open on it)
    assert not table.is_healthy(entry)
    assert entry.reported.waiting == SATURATED_QUEUE
    assert table.snapshot(entry).queue_depth >= SATURATED_QUEUE
    assert log_text(log).count("engine_metrics_stale") == 1


def sglang_text(waiting: int, running: int, usage: float) -> str:
    labels = 'model_name="qwen",tp_rank="0"'
    return (f"sglang:num_queue_reqs{{{labels}}} {waiting}\nsglang:num_running_reqs{{{labels}}} {running}\n"
            f"sglang:token_usage{{{labels}}} {usage}\nsglang:max_total_num_tokens{{{labels}}} 20000\n")


async def test_sglang_agent_waits_for_a_good_scrape_and_saturates_while_the_endpoint_hangs(
    tmp_path: Path, endpoint: MetricsEndpoint, gateway: tuple[StateTable, str], agents: list[subprocess.Popen[bytes]]
) -> None:
    table, address = gateway
    entry = table.get("ext-0")
    assert entry is not None
    endpoint.status, endpoint.body = 503, "starting"
    proc, log = start_agent(tmp_path, "sglang", endpoint, address)
    agents.append(proc)
    await wait_for(lambda: "agent_started" in log_text(log), 15, "agent start", log)
    await asyncio.sleep(5 * INTERVAL_S)
    assert entry.last_heartbeat is None          # nothing is sent before the first good scrape

    endpoint.status, endpoint.body = 200, sglang_text(5, 2, 0.5)
    await wait_for(lambda: entry.reported.waiting == 5, 3 * INTERVAL_S + SLACK_S, "first heartbeat", log)
    assert reported(entry) == (5, 2, 10_000 * BPT, 20_000 * BPT)

    endpoint.hang()
    elapsed = await wait_for(lambda: entry.reported.waiting == SATURATED_QUEUE,
                             STALE_INTERVALS * INTERVAL_S + SLACK_S, "saturated while the endpoint hangs", log)
    assert elapsed > (STALE_INTERVALS - 1) * INTERVAL_S
    assert reported(entry) == (SATURATED_QUEUE, 2, 0, 20_000 * BPT)
    assert "metrics" in entry.reported.scrape_error, entry.reported.scrape_error   # the scrape that timed out

    endpoint.body = sglang_text(1, 1, 0.25)
    endpoint.answer()
    await wait_for(lambda: entry.reported.waiting == 1, 3 * INTERVAL_S + SLACK_S, "recovered", log)
    assert reported(entry) == (1, 1, 15_000 * BPT, 20_000 * BPT)
    assert entry.reported.scrape_error == ""
    text = log_text(log)
    assert text.count("engine_metrics_stale") == 1 and text.count("engine_metrics_recovered") == 1

"""Why a watched `kind: openai` backend is unhealthy is in /admin/backends (`last_error`), not only in the
log; an engine's absurd metric values never reach routing. A real gateway process in front of a loopback
aiohttp engine whose /metrics the test scripts, and an address where nothing listens."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from aiohttp import web

from testkit.harness import Gateway, free_port, run_gateway, write_config
from tests.e2e.test_upstream_faults import MODEL, serving
from tests.e2e.test_upstream_faults import Engine as Upstream

pytestmark = pytest.mark.timeout(120)

VLLM = """\
vllm:num_requests_waiting{engine="0",model_name="m"} 4
vllm:num_requests_running{engine="0",model_name="m"} 3
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25
vllm:cache_config_info{block_size="16",engine="0",num_gpu_blocks="1000"} 1
"""
SGLANG = "sglang:num_queue_reqs 2\nsglang:num_running_reqs 1\nsglang:token_usage 0.5\n"


class Scraped(Upstream):
    """The fault tests' vLLM-like engine, with a /metrics that answers `status` and `text` as set."""

    def __init__(self) -> None:
        super().__init__()
        self.status, self.text, self.scrapes = 200, VLLM, 0

    def app(self) -> web.Application:
        app = super().app()
        app.add_routes([web.get("/metrics", self.metrics)])
        return app

    async def metrics(self, _: web.Request) -> web.Response:
        self.scrapes += 1
        return web.Response(status=self.status, text=self.text)


@pytest.fixture(scope="module")
def engine() -> Scraped:
    return Scraped()


@pytest.fixture(scope="module")
def gateway(engine: Scraped, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    tmp = tmp_path_factory.mktemp("watch")
    with serving(engine) as url:
        config = write_config(tmp, {
            "model": MODEL,
            "gateway": {"heartbeat_interval_ms": 100},
            "backends": [
                {"id": "scraped", "kind": "openai", "gpu": "H100", "address": url, "kv_capacity_tokens": 2000,
                 "scrape": {"engine": "vllm", "interval_ms": 100}},
                {"id": "gone", "kind": "openai", "gpu": "L40S", "address": f"http://127.0.0.1:{free_port()}"},
            ],
        })
        with run_gateway(config, healthy=1) as gw:
            yield gw


@pytest.fixture
def metrics(engine: Scraped) -> Iterator[Scraped]:
    yield engine
    engine.status, engine.text = 200, VLLM


def error_of(gw: Gateway, backend_id: str) -> str | None:
    error: str | None = gw.backend(backend_id)["last_error"]
    return error


def test_a_healthy_scraped_backend_has_no_error(gateway: Gateway, metrics: Scraped) -> None:
    gateway.wait_until(lambda: gateway.backend("scraped")["waiting"] == 4)
    assert error_of(gateway, "scraped") is None


@pytest.mark.parametrize(("status", "text", "said"), [
    (404, "not here", "/metrics: HTTP 404"),
    (200, SGLANG, "/metrics: no vllm load metrics in the response"),
    (200, 'vllm:num_requests_waiting{engine="0" 4\n', "/metrics: not Prometheus text"),
])
def test_a_failing_scrape_says_why_and_the_next_good_one_clears_it(
    gateway: Gateway, metrics: Scraped, status: int, text: str, said: str,
) -> None:
    metrics.status, metrics.text = status, text
    error = gateway.wait_until(lambda: error_of(gateway, "scraped"))
    assert said in error and "\n" not in error
    metrics.status, metrics.text = 200, VLLM
    gateway.wait_until(lambda: error_of(gateway, "scraped") is None)


def test_an_upstream_that_refuses_the_probe_says_so(gateway: Gateway) -> None:
    gateway.wait_until(lambda: gateway.backend("gone")["reachable"] is False)
    error = error_of(gateway, "gone")
    assert error is not None and error.startswith("probe GET http://127.0.0.1:") and "ConnectError" in error


def test_absurd_metric_values_are_missing_for_routing_and_logged_once(gateway: Gateway, metrics: Scraped) -> None:
    metrics.text = VLLM.replace("} 4\n", "} -5\n", 1).replace('num_gpu_blocks="1000"', 'num_gpu_blocks="-1"')
    gateway.wait_until(lambda: gateway.backend("scraped")["kv_capacity_source"] == "config")
    seen = metrics.scrapes
    gateway.wait_until(lambda: metrics.scrapes >= seen + 5)   # the same values scraped again and again
    b = gateway.backend("scraped")
    assert (b["waiting"], b["running"], b["queue_depth"], b["last_error"]) == (0, 3, 3, None)
    assert b["kv_capacity_source"] == "config"   # the configured 2000 tokens, not the engine's "0"
    log = gateway.log_path.read_text()
    assert log.count("engine_metric_rejected") == 2
    assert "vllm:num_requests_waiting" in log and "vllm:cache_config_info{num_gpu_blocks}" in log

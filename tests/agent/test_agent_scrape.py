"""MetricsAgent against an injected HTTP transport and clock: no sockets, no sleeps."""

from __future__ import annotations

import httpx
import pytest
from structlog.testing import capture_logs

from backends.agent import config_from_args, parse_args
from common import perf_model
from common.catalog import load_catalog
from common.engine_scraper import AgentConfig, MetricsAgent, make_client
from common.metric_tables import SATURATED_QUEUE, TABLES
from common.wire import control_pb2

CATALOG = load_catalog()
MODEL, GPU = CATALOG.model("llava-1.5-7b"), CATALOG.gpu("H100")
BPT = MODEL.kv_bytes_per_token
INTERVAL = 0.1

VLLM = """\
vllm:num_requests_waiting{engine="0",model_name="m"} 4
vllm:num_requests_running{engine="0",model_name="m"} 3
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25
vllm:cache_config_info{block_size="16",engine="0",num_gpu_blocks="1000"} 1
vllm:e2e_request_latency_seconds_sum{engine="0",model_name="m"} 6
vllm:e2e_request_latency_seconds_count{engine="0",model_name="m"} 3
"""


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Engine:
    """What the fake engine answers: text, a status, or a connection error; `models` at /v1/models."""

    def __init__(self, text: str = VLLM, models: object = None) -> None:
        self.text, self.status, self.down = text, 200, False
        self.models, self.models_status = models, 200
        self.paths: list[str] = []

    def handler(self, request: httpx.Request) -> httpx.Response:
        self.paths.append(request.url.path)
        if self.down:
            raise httpx.ConnectError("connection refused", request=request)
        if request.url.path == "/v1/models":
            return httpx.Response(self.models_status if self.models is not None else 404, json=self.models)
        return httpx.Response(self.status, text=self.text)


def make_agent(engine: Engine, clock: Clock, **config: object) -> MetricsAgent:
    cfg = AgentConfig(
        backend_id="ext-0", table=TABLES[str(config.pop("engine", "vllm"))], address="http://10.0.0.5:8000",
        metrics_url="http://10.0.0.5:8000/metrics", gateway="127.0.0.1:1", interval_s=INTERVAL,
        **config,  # type: ignore[arg-type]
    )
    return MetricsAgent(cfg, MODEL, GPU, make_client(1.0, httpx.MockTransport(engine.handler)), clock=clock)


async def test_heartbeat_carries_the_scraped_values() -> None:
    clock = Clock()
    agent = make_agent(Engine(), clock, role="both")
    assert await agent.scrape_once()
    assert agent.first_scrape.is_set()
    s = agent.state()
    assert (s.backend_id, s.role, s.address, s.model) == ("ext-0", control_pb2.ROLE_BOTH, "http://10.0.0.5:8000",
                                                          "llava-1.5-7b")
    assert (s.gpu.name, s.gpu.tflops) == ("H100", GPU.tflops)
    assert (s.queue_depth, s.running) == (4, 3)
    assert (s.kv_total_bytes, s.kv_free_bytes) == (16_000 * BPT, 12_000 * BPT)
    assert (s.mean_service_s, s.requests_completed) == (2.0, 3)
    assert s.pid > 0


async def test_failed_scrapes_keep_the_last_values_then_saturate_after_three_intervals_and_recover() -> None:
    clock, engine = Clock(), Engine()
    agent = make_agent(engine, clock)
    assert await agent.scrape_once()
    engine.down = True
    with capture_logs() as logs:
        for t in (0.1, 0.2, 0.3):
            clock.now = t
            assert not await agent.scrape_once()
            s = agent.state()
            assert (s.queue_depth, s.running, s.kv_free_bytes) == (4, 3, 12_000 * BPT), t
        clock.now = 0.3001
        for _ in range(3):
            s = agent.state()
            assert (s.queue_depth, s.running, s.kv_free_bytes) == (SATURATED_QUEUE, 3, 0)
            assert s.kv_total_bytes == 16_000 * BPT
        clock.now = 0.4
        assert not await agent.scrape_once()
        engine.down = False
        engine.text = VLLM.replace("} 4", "} 1")
        assert await agent.scrape_once()
        s = agent.state()
        assert (s.queue_depth, s.kv_free_bytes) == (1, 12_000 * BPT)
    events = [e["event"] for e in logs if e["event"].startswith("engine_metrics")]
    assert events == ["engine_metrics_stale", "engine_metrics_recovered"]
    stale = next(e for e in logs if e["event"] == "engine_metrics_stale")
    assert stale["log_level"] == "warning" and "ConnectError" in stale["error"]


@pytest.mark.parametrize(
    ("status", "text", "error"),
    [
        (503, VLLM, "HTTP 503"),
        (200, "<html>metrics are disabled</html>", "no vllm load metrics"),
        (200, 'vllm:num_requests_waiting{engine="0" 3\n', "not Prometheus text"),
    ],
)
async def test_unusable_answers_are_failed_scrapes(status: int, text: str, error: str) -> None:
    engine = Engine(text)
    engine.status = status
    agent = make_agent(engine, Clock())
    assert not await agent.scrape_once()
    assert error in agent.last_error
    assert agent.metrics is None and not agent.first_scrape.is_set()


async def test_kv_capacity_from_the_command_line_or_the_performance_model_when_the_engine_exports_none() -> None:
    text = "\n".join(line for line in VLLM.splitlines() if "cache_config_info" not in line)
    agent = make_agent(Engine(text), Clock(), kv_total_tokens=40_000)
    await agent.scrape_once()
    s = agent.state()
    assert (s.kv_total_bytes, s.kv_free_bytes) == (40_000 * BPT, 30_000 * BPT)
    assert s.kv_capacity_source == control_pb2.KV_CAPACITY_SOURCE_CONFIG
    agent = make_agent(Engine(text), Clock())
    await agent.scrape_once()
    estimate = perf_model.kv_capacity_bytes(MODEL, GPU) // BPT
    assert agent.state().kv_total_bytes == estimate * BPT
    assert agent.state().kv_capacity_source == control_pb2.KV_CAPACITY_SOURCE_ESTIMATE


async def test_the_engines_kv_capacity_wins_over_the_command_line() -> None:
    agent = make_agent(Engine(), Clock(), kv_total_tokens=40_000)
    await agent.scrape_once()
    s = agent.state()
    assert (s.kv_total_bytes, s.kv_free_bytes) == (16_000 * BPT, 12_000 * BPT)
    assert s.kv_capacity_source == control_pb2.KV_CAPACITY_SOURCE_ENGINE


def models(*cards: tuple[str, int]) -> dict[str, object]:
    return {"object": "list", "data": [{"id": i, "object": "model", "max_model_len": n} for i, n in cards]}


async def test_context_from_v1_models_is_read_once_and_carried_in_every_heartbeat() -> None:
    engine = Engine(models=models(("other", 8192), ("served", 32768)))
    agent = make_agent(engine, Clock(), upstream_model="served")
    assert await agent.scrape_once() and await agent.scrape_once()
    assert agent.state().max_model_len == 32768
    assert engine.paths == ["/metrics", "/v1/models", "/metrics"]


async def test_context_is_asked_again_after_a_server_error_and_after_the_engine_was_stale() -> None:
    clock, engine = Clock(), Engine(models=models(("m", 4096)))
    engine.models_status = 503
    agent = make_agent(engine, clock)
    assert await agent.scrape_once()
    assert agent.state().max_model_len == 0           # not known yet: the gateway uses its own figure
    engine.models_status = 200
    assert await agent.scrape_once()
    assert agent.state().max_model_len == 4096
    engine.down = True                                 # the engine goes away, comes back with other flags
    clock.now = 0.5
    assert not await agent.scrape_once() and agent.saturated
    engine.down, engine.models = False, models(("m", 16384))
    assert await agent.scrape_once()
    assert agent.state().max_model_len == 16384
    assert engine.paths.count("/v1/models") == 3


async def test_context_is_asked_again_when_the_engines_counters_go_back() -> None:
    engine = Engine(models=models(("m", 4096)))
    agent = make_agent(engine, Clock())
    assert await agent.scrape_once() and await agent.scrape_once()
    engine.models = models(("m", 8192))
    engine.text = VLLM.replace("_count{engine=\"0\",model_name=\"m\"} 3", "_count{engine=\"0\",model_name=\"m\"} 1")
    assert await agent.scrape_once()                  # restarted between two scrapes
    assert agent.state().max_model_len == 8192
    assert engine.paths.count("/v1/models") == 2


async def test_an_engine_that_lists_no_context_is_not_asked_again() -> None:
    engine = Engine(models={"object": "list", "data": [{"id": "m", "object": "model"}]})
    agent = make_agent(engine, Clock())
    for _ in range(3):
        assert await agent.scrape_once()
    assert agent.state().max_model_len == 0 and engine.paths.count("/v1/models") == 1
    engine = Engine()   # no /v1/models at all (404)
    agent = make_agent(engine, Clock())
    assert await agent.scrape_once() and await agent.scrape_once()
    assert agent.state().max_model_len == 0 and engine.paths.count("/v1/models") == 1


async def test_trtllm_prometheus_route_redirect_is_followed() -> None:
    text = "trtllm_num_requests_waiting 2\ntrtllm_num_requests_running 1\ntrtllm_kv_cache_utilization 0.5\n"

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/prometheus/metrics":
            return httpx.Response(307, headers={"location": "/prometheus/metrics/"})
        return httpx.Response(200, text=text)

    args = parse_args(["--engine", "trtllm", "--address", "http://10.0.0.5:8000/", "--backend-id", "t",
                       "--gpu", "H100", "--model", "llava-1.5-7b", "--gateway", "127.0.0.1:1"])
    config = config_from_args(args)
    assert config.metrics_url == "http://10.0.0.5:8000/prometheus/metrics"
    assert config.address == "http://10.0.0.5:8000"
    agent = MetricsAgent(config, MODEL, GPU, make_client(1.0, httpx.MockTransport(handler)), clock=Clock())
    assert await agent.scrape_once()
    assert (agent.state().queue_depth, agent.state().running) == (2, 1)


def test_the_address_must_be_an_http_url(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse_args(["--engine", "vllm", "--address", "10.0.0.5:8000", "--backend-id", "x", "--gpu", "H100",
                    "--model", "llava-1.5-7b", "--gateway", "127.0.0.1:1"])
    assert "http(s) URL" in capsys.readouterr().err

"""Absurd values in an engine's /metrics (negative counts or capacities, NaN, infinities) never reach
routing: the metric is rejected, treated as missing, and named once per backend in the log."""

from __future__ import annotations

import pytest
from structlog.testing import capture_logs

from common.metric_tables import parse
from tests.agent.test_agent_scrape import MODEL, VLLM, Clock, Engine, make_agent

SGLANG = """\
sglang:num_queue_reqs{dp_rank="0"} 2
sglang:num_running_reqs{dp_rank="0"} 1
sglang:token_usage{dp_rank="0"} 0.5
sglang:max_total_num_tokens{dp_rank="0"} 8000
sglang:cache_config_info{dp_rank="0",page_size="1",num_pages="4000"} 1
"""


@pytest.mark.parametrize("bad", ["-5", "NaN", "+Inf", "-Inf"])
def test_an_absurd_queue_depth_is_rejected_and_the_other_readings_count(bad: str) -> None:
    m = parse("vllm", VLLM.replace("num_requests_waiting{engine=\"0\",model_name=\"m\"} 4",
                                   f"num_requests_waiting{{engine=\"0\",model_name=\"m\"}} {bad}"))
    assert m.waiting == 0 and "vllm:num_requests_waiting" in m.missing
    assert [name for name, _ in m.rejected] == ["vllm:num_requests_waiting"]
    assert (m.running, m.kv_total_tokens, m.kv_free_tokens) == (3, 16_000, 12_000)


def test_one_ranks_absurd_value_rejects_the_metric_whole() -> None:
    m = parse("vllm", VLLM + 'vllm:num_requests_running{engine="1",model_name="m"} -2\n')
    assert m.running == 0 and [name for name, _ in m.rejected] == ["vllm:num_requests_running"]
    assert m.waiting == 4


@pytest.mark.parametrize("label", ['num_gpu_blocks="-1"', 'block_size="-16"', 'num_gpu_blocks="inf"',
                                   'num_gpu_blocks="nan"'])
def test_an_absurd_capacity_label_leaves_capacity_to_the_configuration(label: str) -> None:
    name = label.split("=")[0]
    m = parse("vllm", VLLM.replace(f'{name}="{"1000" if name == "num_gpu_blocks" else "16"}"', label))
    assert m.kv_total_tokens is None and m.kv_usage == 0.25
    assert m.kv_tokens(configured=4000) == (3000, 4000, "config")
    assert [n for n, _ in m.rejected] == [f"vllm:cache_config_info{{{name}}}"]


@pytest.mark.parametrize("bad", ["-3", "NaN", "+Inf"])
def test_an_absurd_token_capacity_gauge_falls_back_to_the_next_source(bad: str) -> None:
    m = parse("sglang", SGLANG.replace("max_total_num_tokens{dp_rank=\"0\"} 8000",
                                       f"max_total_num_tokens{{dp_rank=\"0\"}} {bad}"))
    assert (m.kv_total_tokens, m.kv_free_tokens) == (4000, 2000)   # from cache_config_info's pages
    assert [n for n, _ in m.rejected] == ["sglang:max_total_num_tokens"]
    assert parse("sglang", SGLANG).kv_total_tokens == 8000


def test_a_histogram_with_an_absurd_part_gives_no_mean() -> None:
    m = parse("vllm", VLLM.replace("latency_seconds_sum{engine=\"0\",model_name=\"m\"} 6",
                                   "latency_seconds_sum{engine=\"0\",model_name=\"m\"} -6"))
    assert (m.mean_service_s, m.latency_count) == (0.0, 0.0)
    assert "vllm:e2e_request_latency_seconds" in m.missing


async def test_the_scraper_names_a_rejected_metric_once_and_keeps_routing_on_the_rest() -> None:
    engine = Engine(VLLM.replace('num_gpu_blocks="1000"', 'num_gpu_blocks="-1"').replace("} 4\n", "} -5\n", 1))
    agent = make_agent(engine, Clock(), kv_total_tokens=2000)
    with capture_logs() as logs:
        for _ in range(3):
            assert await agent.scrape_once()
    rejected = [(e["metric"], e["value"]) for e in logs if e["event"] == "engine_metric_rejected"]
    assert sorted(rejected) == [("vllm:cache_config_info{num_gpu_blocks}", "-1"),
                                ("vllm:num_requests_waiting", "-5")]
    state = agent.state()
    assert (state.queue_depth, state.running) == (0, 3)
    assert state.kv_total_bytes == 2000 * MODEL.kv_bytes_per_token   # the configured capacity, not 0

"""The pure parser: exposition text of each engine → EngineMetrics."""

from __future__ import annotations

import pytest

from common.metric_tables import TABLES, EngineMetrics, parse

# Label shapes as vLLM ≥ 0.10 exports them with --data-parallel-size 2 (one series per `engine`).
VLLM_DP2 = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="llava-hf/llava-1.5-7b-hf"} 3.0
vllm:num_requests_running{engine="1",model_name="llava-hf/llava-1.5-7b-hf"} 2.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="llava-hf/llava-1.5-7b-hf"} 4.0
vllm:num_requests_waiting{engine="1",model_name="llava-hf/llava-1.5-7b-hf"} 1.0
# HELP vllm:gpu_cache_usage_perc GPU KV-cache usage. DEPRECATED: Use vllm:kv_cache_usage_perc instead.
# TYPE vllm:gpu_cache_usage_perc gauge
vllm:gpu_cache_usage_perc{engine="0",model_name="llava-hf/llava-1.5-7b-hf"} 0.99
vllm:gpu_cache_usage_perc{engine="1",model_name="llava-hf/llava-1.5-7b-hf"} 0.99
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="llava-hf/llava-1.5-7b-hf"} 0.25
vllm:kv_cache_usage_perc{engine="1",model_name="llava-hf/llava-1.5-7b-hf"} 0.5
# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="16",cache_dtype="auto",enable_prefix_caching="True",engine="0",\
gpu_memory_utilization="0.9",num_gpu_blocks="1000",num_gpu_blocks_override="None"} 1.0
vllm:cache_config_info{block_size="16",cache_dtype="auto",enable_prefix_caching="True",engine="1",\
gpu_memory_utilization="0.9",num_gpu_blocks="2000",num_gpu_blocks_override="None"} 1.0
# HELP vllm:generation_tokens_total Number of generation tokens processed.
# TYPE vllm:generation_tokens_total counter
vllm:generation_tokens_total{engine="0",model_name="llava-hf/llava-1.5-7b-hf"} 700.0
vllm:generation_tokens_total{engine="1",model_name="llava-hf/llava-1.5-7b-hf"} 300.0
# HELP vllm:e2e_request_latency_seconds Histogram of e2e request latency in seconds.
# TYPE vllm:e2e_request_latency_seconds histogram
vllm:e2e_request_latency_seconds_sum{engine="0",model_name="llava-hf/llava-1.5-7b-hf"} 12.0
vllm:e2e_request_latency_seconds_bucket{engine="0",le="1.0",model_name="llava-hf/llava-1.5-7b-hf"} 2.0
vllm:e2e_request_latency_seconds_bucket{engine="0",le="+Inf",model_name="llava-hf/llava-1.5-7b-hf"} 6.0
vllm:e2e_request_latency_seconds_count{engine="0",model_name="llava-hf/llava-1.5-7b-hf"} 6.0
vllm:e2e_request_latency_seconds_sum{engine="1",model_name="llava-hf/llava-1.5-7b-hf"} 8.0
vllm:e2e_request_latency_seconds_bucket{engine="1",le="+Inf",model_name="llava-hf/llava-1.5-7b-hf"} 4.0
vllm:e2e_request_latency_seconds_count{engine="1",model_name="llava-hf/llava-1.5-7b-hf"} 4.0
# HELP vllm:iteration_tokens_total Histogram of number of tokens per engine_step.
# TYPE vllm:iteration_tokens_total histogram
vllm:iteration_tokens_total_sum{engine="0",model_name="llava-hf/llava-1.5-7b-hf"} 0.0
"""

# vLLM 0.6-era single engine: no `engine` label, only the old usage gauge.
VLLM_OLD = """\
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="m"} 1.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{model_name="m"} 2.0
# TYPE vllm:gpu_cache_usage_perc gauge
vllm:gpu_cache_usage_perc{model_name="m"} 0.75
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="16",cache_dtype="auto",num_gpu_blocks="2375",sliding_window="None"} 1.0
"""


def latency(name: str, total: float, count: float) -> str:
    return f"# TYPE {name} histogram\n{name}_sum {total}\n{name}_count {count}\n"


def test_vllm_engine_ranks_are_summed_and_kv_matched_per_rank() -> None:
    m = parse("vllm", VLLM_DP2)
    assert (m.waiting, m.running) == (5, 5)
    assert m.kv_total_tokens == 16 * 1000 + 16 * 2000
    assert m.kv_free_tokens == 16_000 * 3 // 4 + 32_000 // 2      # each rank at its own usage
    assert m.kv_usage == pytest.approx(1 - 28_000 / 48_000)
    assert m.generation_tokens == 1000
    assert m.latency_count == 10 and m.mean_service_s == pytest.approx(2.0)   # lifetime mean, first scrape
    assert m.missing == frozenset()


def test_vllm_prefers_kv_cache_usage_perc_and_falls_back_to_gpu_cache_usage_perc() -> None:
    assert parse("vllm", VLLM_DP2).kv_usage != pytest.approx(0.99)
    old = parse("vllm", VLLM_OLD)
    assert (old.waiting, old.running) == (2, 1)
    assert old.kv_usage == pytest.approx(0.75)
    assert old.kv_total_tokens == 16 * 2375
    assert old.kv_free_tokens == 16 * 2375 // 4
    assert old.missing == {"vllm:e2e_request_latency_seconds"}


def test_vllm_kv_cache_size_tokens_label_wins_over_blocks_times_block_size() -> None:
    """Hybrid models: blocks × the smallest group's block size is not the capacity; newer vLLM says it."""
    text = VLLM_OLD.replace('num_gpu_blocks="2375"', 'kv_cache_size_tokens="150000",num_gpu_blocks="2375"')
    m = parse("vllm", text)
    assert m.kv_total_tokens == 150_000 and m.kv_free_tokens == 150_000 // 4
    unprofiled = parse("vllm", text.replace('"150000"', '"None"'))
    assert unprofiled.kv_total_tokens == 16 * 2375


def test_capacity_without_rank_labels_uses_the_mean_usage_of_the_ranks() -> None:
    text = VLLM_OLD.replace('{model_name="m"} 0.75', '{engine="0",model_name="m"} 0.5') + (
        'vllm:gpu_cache_usage_perc{engine="1",model_name="m"} 1.0\n'
    )
    m = parse("vllm", text)
    assert m.kv_total_tokens == 38_000 and m.kv_free_tokens == 38_000 // 4


def test_unprofiled_cache_config_leaves_capacity_unknown_and_usage_is_clamped() -> None:
    text = VLLM_OLD.replace('num_gpu_blocks="2375"', 'num_gpu_blocks="None"').replace("} 0.75", "} 1.3")
    m = parse("vllm", text)
    assert m.kv_total_tokens is None and m.kv_free_tokens is None
    assert m.kv_usage == 1.0
    assert m.kv_tokens(estimate=1000) == (0, 1000, "estimate")


def test_latency_histogram_deltas_give_the_mean_service_time_of_the_requests_finished_between_scrapes() -> None:
    name = "vllm:e2e_request_latency_seconds"
    base = VLLM_OLD
    first = parse("vllm", base + latency(name, 20.0, 10))
    assert first.mean_service_s == pytest.approx(2.0)
    second = parse("vllm", base + latency(name, 32.0, 14), first)
    assert second.mean_service_s == pytest.approx(3.0)                 # 12 s over 4 requests
    idle = parse("vllm", base + latency(name, 32.0, 14), second)
    assert idle.mean_service_s == pytest.approx(3.0)                   # none finished: keep the mean
    restarted = parse("vllm", base + latency(name, 1.0, 2), idle)
    assert restarted.mean_service_s == pytest.approx(0.5)              # counters reset: new lifetime mean
    gone = parse("vllm", base, restarted)
    assert (gone.mean_service_s, gone.latency_sum_s, gone.latency_count) == (0.5, 1.0, 2)
    back = parse("vllm", base + latency(name, 4.0, 3), gone)
    assert back.mean_service_s == pytest.approx(3.0)                   # delta from the carried totals
    assert parse("vllm", base + latency(name, 0.0, 0)).mean_service_s == 0.0


def test_missing_metrics_are_zero_or_unknown_and_named() -> None:
    m = parse("vllm", 'vllm:num_requests_waiting{engine="0"} 7\n')
    assert (m.waiting, m.running, m.kv_usage, m.kv_total_tokens, m.mean_service_s) == (7, 0, None, None, 0.0)
    assert m.missing == {"vllm:num_requests_running", "vllm:kv_cache_usage_perc", "vllm:e2e_request_latency_seconds"}
    empty = parse("sglang", "")
    assert empty == EngineMetrics(missing=empty.missing)
    assert {"sglang:num_queue_reqs", "sglang:num_running_reqs", "sglang:token_usage"} <= empty.missing


def test_unrelated_and_malformed_foreign_lines_are_ignored_but_a_malformed_wanted_line_raises() -> None:
    noise = "python_gc_objects_collected_total{generation=\"0\"} 1.0\nthis is { not prometheus\n"
    assert parse("vllm", noise + VLLM_OLD).waiting == 2
    with pytest.raises(ValueError):
        parse("vllm", 'vllm:num_requests_waiting{engine="0" 3\n')
    with pytest.raises(KeyError):
        parse("ollama", VLLM_OLD)


SGLANG_DP2 = """\
# HELP sglang:num_running_reqs The number of running requests.
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{dp_rank="0",engine_type="unified",model_name="qwen",moe_ep_rank="0",pp_rank="0",tp_rank="0"} 6.0
sglang:num_running_reqs{dp_rank="0",engine_type="unified",model_name="qwen",moe_ep_rank="0",pp_rank="0",tp_rank="1"} 6.0
sglang:num_running_reqs{dp_rank="1",engine_type="unified",model_name="qwen",moe_ep_rank="0",pp_rank="0",tp_rank="0"} 2.0
# HELP sglang:num_queue_reqs The number of requests in the waiting queue.
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{dp_rank="0",engine_type="unified",model_name="qwen",moe_ep_rank="0",pp_rank="0",tp_rank="0"} 3.0
sglang:num_queue_reqs{dp_rank="0",engine_type="unified",model_name="qwen",moe_ep_rank="0",pp_rank="0",tp_rank="1"} 3.0
sglang:num_queue_reqs{dp_rank="1",engine_type="unified",model_name="qwen",moe_ep_rank="0",pp_rank="0",tp_rank="0"} 1.0
# HELP sglang:token_usage The token usage.
# TYPE sglang:token_usage gauge
sglang:token_usage{dp_rank="0",engine_type="unified",model_name="qwen",moe_ep_rank="0",pp_rank="0",tp_rank="0"} 0.5
sglang:token_usage{dp_rank="1",engine_type="unified",model_name="qwen",moe_ep_rank="0",pp_rank="0",tp_rank="0"} 0.25
# HELP sglang:max_total_num_tokens Maximum total number of tokens in the KV cache pool.
# TYPE sglang:max_total_num_tokens gauge
sglang:max_total_num_tokens{dp_rank="0",engine_type="unified",model_name="qwen",moe_ep_rank="0",pp_rank="0",\
tp_rank="0"} 100000.0
sglang:max_total_num_tokens{dp_rank="1",engine_type="unified",model_name="qwen",moe_ep_rank="0",pp_rank="0",\
tp_rank="0"} 80000.0
# HELP sglang:e2e_request_latency_seconds Histogram of End-to-end request latency in seconds
# TYPE sglang:e2e_request_latency_seconds histogram
sglang:e2e_request_latency_seconds_sum{model_name="qwen"} 9.0
sglang:e2e_request_latency_seconds_bucket{le="+Inf",model_name="qwen"} 3.0
sglang:e2e_request_latency_seconds_count{model_name="qwen"} 3.0
"""


def test_sglang_dp_ranks_are_summed_and_tp_copies_counted_once() -> None:
    m = parse("sglang", SGLANG_DP2)
    assert (m.waiting, m.running) == (4, 8)
    assert m.kv_total_tokens == 180_000
    assert m.kv_free_tokens == 50_000 + 60_000
    assert m.mean_service_s == pytest.approx(3.0)
    assert m.missing == frozenset()


def test_sglang_capacity_from_cache_config_info_else_configured_else_estimated() -> None:
    text = """\
sglang:num_queue_reqs{model_name="qwen",tp_rank="0"} 2
sglang:num_running_reqs{model_name="qwen",tp_rank="0"} 1
sglang:token_usage{model_name="qwen",tp_rank="0"} 0.4
"""
    info = 'sglang:cache_config_info{model_name="qwen",num_pages="5000",page_size="16"} 1\n'
    m = parse("sglang", text + info)
    assert (m.kv_total_tokens, m.kv_free_tokens) == (80_000, 48_000)
    bare = parse("sglang", text)
    assert bare.kv_total_tokens is None and bare.kv_usage == pytest.approx(0.4)
    assert bare.kv_tokens(configured=50_000) == (30_000, 50_000, "config")
    assert m.kv_tokens(configured=50_000) == (48_000, 80_000, "engine")    # the engine's own figure wins
    assert bare.kv_tokens(estimate=10_000) == (6_000, 10_000, "estimate")
    assert "sglang:e2e_request_latency_seconds" in bare.missing


TRTLLM = """\
# HELP trtllm_num_requests_running Number of active requests
# TYPE trtllm_num_requests_running gauge
trtllm_num_requests_running{engine_type="trtllm",model_name="llava"} 12.0
# HELP trtllm_num_requests_waiting Number of queued requests
# TYPE trtllm_num_requests_waiting gauge
trtllm_num_requests_waiting{engine_type="trtllm",model_name="llava"} 9.0
# HELP trtllm_kv_cache_utilization KV cache utilization
# TYPE trtllm_kv_cache_utilization gauge
trtllm_kv_cache_utilization{engine_type="trtllm",model_name="llava"} 0.75
# TYPE trtllm_kv_cache_max_blocks gauge
trtllm_kv_cache_max_blocks{engine_type="trtllm",model_name="llava"} 4000.0
# TYPE trtllm_kv_cache_tokens_per_block gauge
trtllm_kv_cache_tokens_per_block{engine_type="trtllm",model_name="llava"} 32.0
# TYPE trtllm_e2e_request_latency_seconds histogram
trtllm_e2e_request_latency_seconds_bucket{engine_type="trtllm",le="+Inf",model_name="llava"} 5.0
trtllm_e2e_request_latency_seconds_count{engine_type="trtllm",model_name="llava"} 5.0
trtllm_e2e_request_latency_seconds_sum{engine_type="trtllm",model_name="llava"} 7.5
"""


def test_trtllm_capacity_from_block_gauges() -> None:
    m = parse("trtllm", TRTLLM)
    assert (m.waiting, m.running) == (9, 12)
    assert (m.kv_total_tokens, m.kv_free_tokens) == (128_000, 32_000)
    assert m.mean_service_s == pytest.approx(1.5)
    assert TABLES["trtllm"].metrics_path == "/prometheus/metrics"


def test_the_kv_block_size_is_read_where_the_engine_says_it() -> None:
    """The prefix cache keeps whole blocks: vLLM's cache_config_info block_size, SGLang's page_size,
    TensorRT-LLM's tokens-per-block gauge; None where the engine does not say."""
    assert parse("vllm", VLLM_DP2).kv_block_tokens == 16
    sglang = ('sglang:num_queue_reqs{tp_rank="0"} 0\nsglang:num_running_reqs{tp_rank="0"} 0\n'
              'sglang:token_usage{tp_rank="0"} 0\n')
    assert parse("sglang", sglang + 'sglang:cache_config_info{num_pages="50",page_size="64"} 1\n').kv_block_tokens == 64
    assert parse("sglang", sglang).kv_block_tokens is None
    assert parse("trtllm", TRTLLM).kv_block_tokens == 32

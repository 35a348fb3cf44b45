"""Engine metric tables and a pure parser: Prometheus exposition text → `EngineMetrics`.

One `EngineTable` per engine names the series that carry the signals a BackendState needs. `parse`
is pure (text and the previous result in, a value out), so the heartbeat agent that runs beside an
engine and a gateway-side scraper can share it.

Aggregation, for an engine that runs several data-parallel ranks behind one /metrics:

    gauge      = Σ over series, after collapsing copies (series equal but for `copy_labels`, by max)
    KV tokens  = Σ_rank capacity_r;   free = Σ_rank capacity_r · (1 − usage_r)
                 (ranks matched on `rank_label`; unmatched: Σ capacity · (1 − mean usage))
    T̄_service  = Δ latency_sum / Δ latency_count between two scrapes; the previous mean when no
                 request finished; the lifetime mean on the first scrape or after a counter reset

Capacity, first found: a token-count gauge; an info-style gauge whose labels carry the capacity in
tokens (newer vLLM's `kv_cache_size_tokens`) or block size and block count (vLLM's and SGLang's
`cache_config_info`); block-size and block-count gauges (TensorRT-LLM).
Usage is a fraction in [0, 1] for all three engines (vLLM's "perc" included) and is clamped to it.

Every series read is a count, a capacity, a fraction or a counter: a negative, NaN or infinite value
(a sample, or a capacity label of `cache_info`) is an engine's bug, not a load figure. Such a metric
is rejected whole (one bad rank would make the sum a lie) and treated as missing, so the engine's other
readings still count and capacity falls back to the next source; `rejected` names it and the value.

Limits: series of a model other than the served one are summed in too; usage is matched to capacity
per rank only when both carry `rank_label`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Literal

from prometheus_client.parser import text_string_to_metric_families

Labels = Mapping[str, str]
Series = list[tuple[Labels, float]]
LabelKey = tuple[tuple[str, str], ...]

# Where a KV capacity figure comes from: the engine's own, the operator's configuration, the performance model.
KvSource = Literal["engine", "config", "estimate"]

# Queue depth reported for, and assumed of, a backend whose metrics are stale: policies route around it.
SATURATED_QUEUE = 1_000_000


@dataclass(frozen=True, slots=True)
class EngineTable:
    name: str
    waiting: str                          # gauge: requests admitted, not yet running
    running: str                          # gauge: requests in the running batch
    kv_usage: tuple[str, ...]             # gauge, fraction of KV in use; the first one present wins
    metrics_path: str = "/metrics"        # where the engine serves Prometheus text
    rank_label: str | None = None         # tells data-parallel ranks apart (each has its own KV cache)
    copy_labels: tuple[str, ...] = ()     # series differing only here report one rank's state twice
    kv_tokens_gauge: str | None = None    # KV capacity in tokens
    cache_info: str | None = None         # info-style gauge: block size and count as labels
    block_size_label: str = "block_size"
    num_blocks_label: str = "num_gpu_blocks"
    tokens_label: str | None = None       # capacity in tokens as a label of `cache_info`, over blocks × size
    block_size_gauge: str | None = None   # tokens per KV block, as a gauge
    num_blocks_gauge: str | None = None   # KV blocks, as a gauge
    latency_histogram: str | None = None  # end-to-end request latency, seconds
    generation_tokens: str | None = None  # counter of generated tokens
    prefix_queries: str | None = None     # counter: prompt tokens looked up in the prefix cache
    prefix_hits: str | None = None        # counter: of them, found cached

    def wanted(self) -> frozenset[str]:
        """Every sample name `parse` reads."""
        names = {self.waiting, self.running, *self.kv_usage}
        names.update(n for n in (self.kv_tokens_gauge, self.cache_info, self.block_size_gauge,
                                 self.num_blocks_gauge, self.generation_tokens, self.prefix_queries,
                                 self.prefix_hits) if n)
        if self.latency_histogram:
            names.update((f"{self.latency_histogram}_sum", f"{self.latency_histogram}_count"))
        return frozenset(names)


# Sources: vLLM vllm/v1/metrics/loggers.py; SGLang python/sglang/srt/metrics/collector.py; TensorRT-LLM
# tensorrt_llm/metrics/collector.py and serve/openai_server.py (Prometheus text on /prometheus/metrics,
# /metrics is JSON); cross-checked with llm-d/llm-d-router docs/plugin-metric-protocol.md.
TABLES: dict[str, EngineTable] = {
    "vllm": EngineTable(
        name="vllm",
        waiting="vllm:num_requests_waiting",
        running="vllm:num_requests_running",
        kv_usage=("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),  # the second: before 0.10
        rank_label="engine",
        cache_info="vllm:cache_config_info",
        tokens_label="kv_cache_size_tokens",   # newer vLLM; right for hybrid models where blocks × size is not
        latency_histogram="vllm:e2e_request_latency_seconds",
        generation_tokens="vllm:generation_tokens_total",
        prefix_queries="vllm:prefix_cache_queries_total",
        prefix_hits="vllm:prefix_cache_hits_total",
    ),
    "sglang": EngineTable(
        name="sglang",
        waiting="sglang:num_queue_reqs",
        running="sglang:num_running_reqs",
        kv_usage=("sglang:token_usage",),
        rank_label="dp_rank",
        copy_labels=("tp_rank", "pp_rank", "moe_ep_rank"),   # --enable-metrics-for-all-schedulers
        kv_tokens_gauge="sglang:max_total_num_tokens",
        cache_info="sglang:cache_config_info",
        block_size_label="page_size",
        num_blocks_label="num_pages",
        latency_histogram="sglang:e2e_request_latency_seconds",
        generation_tokens="sglang:generation_tokens_total",
    ),
    "trtllm": EngineTable(
        name="trtllm",
        waiting="trtllm_num_requests_waiting",
        running="trtllm_num_requests_running",
        kv_usage=("trtllm_kv_cache_utilization",),
        metrics_path="/prometheus/metrics",
        block_size_gauge="trtllm_kv_cache_tokens_per_block",
        num_blocks_gauge="trtllm_kv_cache_max_blocks",
        latency_histogram="trtllm_e2e_request_latency_seconds",
        generation_tokens="trtllm_generation_tokens_total",
    ),
}


@dataclass(frozen=True, slots=True)
class EngineMetrics:
    """One scrape, aggregated over ranks. None = the engine does not export it."""

    waiting: int = 0
    running: int = 0
    kv_usage: float | None = None          # fraction of the KV cache in use, all ranks
    kv_total_tokens: int | None = None
    kv_free_tokens: int | None = None
    mean_service_s: float = 0.0            # 0 = no sample yet
    latency_sum_s: float = 0.0             # cumulative histogram totals, kept for the next delta
    latency_count: float = 0.0
    generation_tokens: int = 0
    prefix_cache_queries: int = 0          # cumulative tokens; 0 where the engine does not export them
    prefix_cache_hits: int = 0
    kv_block_tokens: int | None = None     # tokens a KV block holds (its prefix cache's granularity)
    missing: frozenset[str] = frozenset()  # metrics of the table absent from the text (or rejected)
    rejected: tuple[tuple[str, str], ...] = ()   # (metric, the absurd value) dropped from this scrape

    def kv_tokens(self, configured: int | None = None, estimate: int = 0) -> tuple[int, int, KvSource]:
        """(free, total, source) KV tokens. Capacity: the engine's, else `configured`, else `estimate`;
        free from the engine's per-rank figures when its capacity is used, else total · (1 − usage)."""
        if self.kv_total_tokens is not None:
            free = self.kv_total_tokens if self.kv_free_tokens is None else self.kv_free_tokens
            return free, self.kv_total_tokens, "engine"
        free_share = 1.0 - (self.kv_usage or 0.0)
        if configured is not None:
            return int(configured * free_share), configured, "config"
        return int(estimate * free_share), estimate, "estimate"


def parse(engine: str | EngineTable, text: str, previous: EngineMetrics | None = None) -> EngineMetrics:
    """Raises KeyError for an unknown engine name, ValueError for text that is not exposition format."""
    table = TABLES[engine] if isinstance(engine, str) else engine
    samples, rejected = _samples(text, table.wanted())
    if table.latency_histogram and any(name.startswith(table.latency_histogram) for name in rejected):
        for part in ("_sum", "_count"):   # a mean from half a histogram would be made up
            samples.pop(f"{table.latency_histogram}{part}", None)
    missing = {name for name in (table.waiting, table.running) if name not in samples}
    usage_name = next((n for n in table.kv_usage if n in samples), None)
    if usage_name is None:
        missing.add(table.kv_usage[0])
    usage = _by_rank(samples.get(usage_name, []) if usage_name else [], table)
    capacity = _capacity(samples, table, rejected)
    block = _block_tokens(samples, table, rejected)
    total, free, kv_usage = _kv(capacity, {r: min(1.0, max(0.0, u)) for r, u in usage.items()})

    latency_sum, latency_count, mean = _service(samples, table, previous)
    if table.latency_histogram and f"{table.latency_histogram}_count" not in samples:
        missing.add(table.latency_histogram)
    return EngineMetrics(
        waiting=int(_sum(samples.get(table.waiting, []), table.copy_labels)),
        running=int(_sum(samples.get(table.running, []), table.copy_labels)),
        kv_usage=kv_usage,
        kv_total_tokens=total,
        kv_free_tokens=free,
        mean_service_s=mean,
        latency_sum_s=latency_sum,
        latency_count=latency_count,
        generation_tokens=int(_sum(samples.get(table.generation_tokens or "", []), table.copy_labels)),
        prefix_cache_queries=int(_sum(samples.get(table.prefix_queries or "", []), table.copy_labels)),
        prefix_cache_hits=int(_sum(samples.get(table.prefix_hits or "", []), table.copy_labels)),
        kv_block_tokens=block,
        missing=frozenset(missing),
        rejected=tuple(sorted(rejected.items())),
    )


def _samples(text: str, wanted: frozenset[str]) -> tuple[dict[str, Series], dict[str, str]]:
    """Samples by name, of the wanted names only (other lines are dropped before the parser sees them),
    and the names rejected for an absurd value (`_absurd`), with the first such value."""
    lines = [line for line in text.splitlines() if _keep(line, wanted)]
    out: dict[str, Series] = {}
    rejected: dict[str, str] = {}
    for family in text_string_to_metric_families("\n".join(lines) + "\n"):
        for s in family.samples:
            if s.name not in wanted:
                continue
            if _absurd(s.value):
                rejected.setdefault(s.name, f"{float(s.value):g}")
            else:
                out.setdefault(s.name, []).append((s.labels, float(s.value)))
    for name in rejected:
        out.pop(name, None)
    return out, rejected


def _absurd(value: float | str) -> bool:
    """No count, capacity, fraction or counter: negative, NaN or infinite. A label that is no number at
    all ("None" before vLLM profiles memory) is not absurd, only unknown."""
    try:
        number = float(value)
    except ValueError:
        return False
    return not (math.isfinite(number) and number >= 0)


def _keep(line: str, wanted: frozenset[str]) -> bool:
    if line.startswith("#"):   # TYPE lines of wanted metrics only, so that histograms parse as such
        parts = line.split(None, 3)
        return len(parts) >= 3 and parts[1] == "TYPE" and (parts[2] in wanted or f"{parts[2]}_count" in wanted)
    return bool(line.strip()) and line.split("{", 1)[0].split(None, 1)[0] in wanted


def _collapse(series: Iterable[tuple[Labels, float]], copy_labels: tuple[str, ...]) -> dict[LabelKey, float]:
    groups: dict[LabelKey, float] = {}
    for labels, value in series:
        key = tuple(sorted((k, v) for k, v in labels.items() if k not in copy_labels))
        groups[key] = max(groups.get(key, value), value)
    return groups


def _sum(series: Series, copy_labels: tuple[str, ...]) -> float:
    return sum(_collapse(series, copy_labels).values())


def _by_rank(series: Series, table: EngineTable) -> dict[str, float]:
    """Value per data-parallel rank (max over a rank's series: copies, or several models)."""
    out: dict[str, float] = {}
    for labels, value in series:
        rank = labels.get(table.rank_label, "") if table.rank_label else ""
        out[rank] = max(out.get(rank, value), value)
    return out


def _capacity(samples: Mapping[str, Series], table: EngineTable, rejected: dict[str, str]) -> dict[str, int]:
    """KV capacity in tokens per rank, from the first source the engine exports; a `cache_info` with an
    absurd capacity label is rejected whole (into `rejected`, as `name{label}`)."""
    if table.kv_tokens_gauge and table.kv_tokens_gauge in samples:
        return {r: int(v) for r, v in _by_rank(samples[table.kv_tokens_gauge], table).items()}
    if table.cache_info and table.cache_info in samples:
        series = samples[table.cache_info]
        labels_read = (table.block_size_label, table.num_blocks_label, table.tokens_label)
        bad = {f"{table.cache_info}{{{name}}}": labels[name]
               for labels, _ in series for name in labels_read if name and _absurd(labels.get(name, ""))}
        rejected.update(bad)
        out = {} if bad else _info_capacity(series, table)
        if out:
            return out
    if table.block_size_gauge and table.num_blocks_gauge:
        sizes = _by_rank(samples.get(table.block_size_gauge, []), table)
        counts = _by_rank(samples.get(table.num_blocks_gauge, []), table)
        return {r: int(sizes[r]) * int(counts[r]) for r in sizes.keys() & counts.keys()}
    return {}


def _block_tokens(samples: Mapping[str, Series], table: EngineTable, rejected: dict[str, str]) -> int | None:
    """Tokens a KV block holds: the block size label of `cache_info`, else the block size gauge; the
    largest where ranks differ (None: the engine does not say, or says something absurd)."""
    sizes: list[int] = []
    if table.cache_info and table.cache_info in samples and not any(k.startswith(table.cache_info) for k in rejected):
        sizes = [s for labels, _ in samples[table.cache_info] if (s := _int(labels.get(table.block_size_label)))]
    if not sizes and table.block_size_gauge:
        sizes = [int(v) for v in _by_rank(samples.get(table.block_size_gauge, []), table).values() if v >= 1]
    return max(sizes, default=None)


def _info_capacity(series: Series, table: EngineTable) -> dict[str, int]:
    """Tokens per rank from the labels of `cache_info`: the tokens label, else block size × count."""
    out: dict[str, int] = {}
    for labels, _ in series:
        size, count = _int(labels.get(table.block_size_label)), _int(labels.get(table.num_blocks_label))
        tokens = _int(labels.get(table.tokens_label)) if table.tokens_label else None
        if tokens is None and size is not None and count is not None:
            tokens = size * count
        if tokens is not None:
            rank = labels.get(table.rank_label, "") if table.rank_label else ""
            out[rank] = max(out.get(rank, 0), tokens)
    return out


def _int(value: str | None) -> int | None:
    try:
        return int(float(value)) if value is not None else None   # "None" before vLLM profiles memory
    except ValueError:
        return None


def _kv(capacity: dict[str, int], usage: dict[str, float]) -> tuple[int | None, int | None, float | None]:
    """(total tokens, free tokens, usage fraction) over all ranks."""
    mean_usage = sum(usage.values()) / len(usage) if usage else None
    if not capacity:
        return None, None, mean_usage
    total = sum(capacity.values())
    if mean_usage is None:
        return total, None, None
    if capacity.keys() == usage.keys():
        free = sum(int(c * (1.0 - usage[r])) for r, c in capacity.items())
    else:
        free = int(total * (1.0 - mean_usage))
    return total, free, (1.0 - free / total) if total else mean_usage


def _service(
    samples: Mapping[str, Series], table: EngineTable, previous: EngineMetrics | None
) -> tuple[float, float, float]:
    """(latency sum, latency count, mean service seconds)."""
    prev_mean = previous.mean_service_s if previous else 0.0
    name = table.latency_histogram
    if not name or f"{name}_count" not in samples:
        if previous is None:
            return 0.0, 0.0, 0.0
        return previous.latency_sum_s, previous.latency_count, prev_mean
    total = _sum(samples.get(f"{name}_sum", []), table.copy_labels)
    count = _sum(samples[f"{name}_count"], table.copy_labels)
    if previous is None or count < previous.latency_count:   # first scrape, or the engine restarted
        return total, count, (total / count if count > 0 else prev_mean)
    finished = count - previous.latency_count
    if finished <= 0:
        return total, count, prev_mean
    return total, count, max(0.0, total - previous.latency_sum_s) / finished

"""The request path's plain counter and histogram tables render exactly what prometheus_client's own
Counter and Histogram render for the same increments (names, help, labels, buckets, sums)."""

from __future__ import annotations

import random

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics, generate_latest

from gateway.pipeline.request_metrics import CounterTable, HistogramTable, TablesCollector

BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


def test_tables_render_as_prometheus_client_objects_do() -> None:
    disable_created_metrics()  # type: ignore[no-untyped-call]  # as GatewayMetrics does
    rng = random.Random(3)
    ours, theirs = CollectorRegistry(), CollectorRegistry()
    counter = CounterTable("t_requests", "Requests by outcome", ["endpoint", "status"])
    tokens = CounterTable("t_tokens", "Tokens", ["backend"])
    latency = HistogramTable("t_latency_seconds", "Latency", ["backend"], BUCKETS)
    ours.register(TablesCollector([counter, tokens, latency]))
    ref_counter = Counter("t_requests", "Requests by outcome", ["endpoint", "status"], registry=theirs)
    ref_tokens = Counter("t_tokens", "Tokens", ["backend"], registry=theirs)
    ref_latency = Histogram("t_latency_seconds", "Latency", ["backend"], buckets=BUCKETS, registry=theirs)
    # bounds themselves (a bucket's upper bound is inclusive), beyond the last bound, zero, random values
    values = [*BUCKETS, 0.0, 500.0, *(rng.expovariate(2.0) for _ in range(300))]
    for k, value in enumerate(values):
        backend = f"b{k % 3}"
        latency.observe((backend,), value)
        ref_latency.labels(backend).observe(value)
        labels = (rng.choice(["chat", "completions"]), rng.choice(["200", "400", "499"]))
        counter.inc(labels)
        ref_counter.labels(*labels).inc()
        tokens.inc((backend,), k % 5)   # increments of 0 create the series, as they do there
        ref_tokens.labels(backend).inc(k % 5)
    assert generate_latest(ours).decode() == generate_latest(theirs).decode()
    assert counter.value(("chat", "200")) == ref_counter.labels("chat", "200")._value.get()
    assert latency.count(("b0",)) == sum(1 for k in range(len(values)) if k % 3 == 0)
    assert latency.count(("none",)) == 0.0

"""The request path's counters and histograms kept as plain numbers, rendered by a collector at scrape time.

A labelled prometheus_client Counter or Histogram checks, locks and (a histogram) walks its buckets
in Python on every increment. Every request touches seven of them (requests, routing decisions,
prompt and generated tokens, decision time, time to first token, end-to-end latency); measured side
by side in front of a fast engine, taking those increments and the request log's call out of the
path took a non-streamed request from ~267 to ~215 µs of gateway CPU (docs/FRONT_DOOR.md). Here an
increment is one dict update and an observation a bisect and two additions; what /metrics shows
(names, help, labels, buckets, no `_created` series) is what the prometheus_client objects showed,
which `tests/unit/test_request_metrics.py` checks against them.

Writers are not locked: the request path runs on one event loop thread. A scrape reads a copy of
the series (`list(dict.items())` is atomic under the GIL), so it may miss increments made while it
runs, never corrupt them.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterator, Sequence
from typing import Any

from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

Labels = tuple[str, ...]


class CounterTable:
    """A labelled counter: label values (in `labels` order) → count."""

    def __init__(self, name: str, documentation: str, labels: Sequence[str]) -> None:
        self.name, self.documentation, self.labels = name, documentation, list(labels)
        self._counts: dict[Labels, float] = {}

    def inc(self, labels: Labels, amount: float = 1.0) -> None:
        counts = self._counts
        counts[labels] = counts.get(labels, 0.0) + amount

    def value(self, labels: Labels) -> float:
        return self._counts.get(labels, 0.0)

    def items(self) -> list[tuple[Labels, float]]:
        return list(self._counts.items())

    def forget(self, label: str, value: str) -> None:
        """Drop every series whose `label` is `value` (a backend removed from the fleet)."""
        _drop(self._counts, self.labels.index(label), value)

    def family(self) -> Metric:
        family = CounterMetricFamily(self.name, self.documentation, labels=self.labels)
        for labels, count in self.items():
            family.add_metric(list(labels), count)
        return family


class HistogramTable:
    """A labelled histogram: label values → the count in each bucket (upper bounds inclusive, +Inf
    last) and the sum of the observations."""

    def __init__(self, name: str, documentation: str, labels: Sequence[str], buckets: Sequence[float]) -> None:
        self.name, self.documentation, self.labels = name, documentation, list(labels)
        self._bounds = sorted(float(b) for b in buckets if b != float("inf"))
        self._les = [floatToGoString(b) for b in self._bounds] + ["+Inf"]  # type: ignore[no-untyped-call]
        self._series: dict[Labels, list[float]] = {}   # bucket counts..., the +Inf bucket's, then the sum

    def observe(self, labels: Labels, value: float) -> None:
        series = self._series.get(labels)
        if series is None:
            series = self._series[labels] = [0.0] * (len(self._bounds) + 2)
        series[bisect_left(self._bounds, value)] += 1.0
        series[-1] += value

    def count(self, labels: Labels) -> float:
        series = self._series.get(labels)
        return sum(series[:-1]) if series is not None else 0.0

    def forget(self, label: str, value: str) -> None:
        """Drop every series whose `label` is `value` (a backend removed from the fleet)."""
        _drop(self._series, self.labels.index(label), value)

    def family(self) -> Metric:
        family = HistogramMetricFamily(self.name, self.documentation, labels=self.labels)
        for labels, series in list(self._series.items()):
            cumulative, buckets = 0.0, []
            for le, count in zip(self._les, series, strict=False):
                cumulative += count
                buckets.append((le, cumulative))
            family.add_metric(list(labels), buckets, sum_value=series[-1])
        return family


def _drop(series: dict[Labels, Any], index: int, value: str) -> None:
    for labels in [labels for labels in series if labels[index] == value]:
        del series[labels]


class TablesCollector(Collector):
    def __init__(self, tables: Sequence[CounterTable | HistogramTable]) -> None:
        self._tables = list(tables)

    def collect(self) -> Iterator[Metric]:
        for table in self._tables:
            yield table.family()

"""The metric types the gateway's declarations (gateway.metrics) use beside prometheus_client's.

The series every request writes (requests, their durations, the upstream's, tokens, the
in-flight gauge) are kept in one process in plain floats (:class:`LoopCounter`,
:class:`LoopHistogram`, :class:`LoopGauge`): written only on the event loop's thread, they need
none of the lock prometheus_client takes for each ``inc`` (a request made ~60 calls into it), and
are read by the registry at scrape time like any collector's, in the same exposition.

Under ``serve --workers N`` every worker keeps its counters, histograms and gauges in
prometheus_client's multiprocess files, and any worker answering a scrape sums them all
(:class:`WorkersCollector`).
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Iterator, Sequence
from typing import Any

import prometheus_client.metrics
from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample
from prometheus_client.utils import floatToGoString


class _CounterSeries:
    """One series of a :class:`LoopCounter`."""

    __slots__ = ("created", "value")

    def __init__(self) -> None:
        self.value = 0.0
        self.created = time.time()

    def inc(self, amount: float = 1) -> None:
        if amount < 0:
            raise ValueError("Counters can only be incremented by non-negative amounts.")
        self.value += amount


class _HistogramSeries:
    """One series of a :class:`LoopHistogram`: the count of each bucket (not cumulative) and the sum."""

    __slots__ = ("_bounds", "counts", "created", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self._bounds = bounds
        self.counts = [0] * len(bounds)
        self.sum = 0.0
        self.created = time.time()

    def observe(self, amount: float) -> None:
        self.sum += amount
        self.counts[bisect.bisect_left(self._bounds, amount)] += 1  # the first bound >= amount (+Inf last)


class _LoopMetric(Collector):
    """A labelled metric kept in this process's memory, registered as a collector: its series are
    made by :meth:`labels` (as prometheus_client's are) and read by :meth:`collect` at scrape time.
    Only the event loop's thread writes them (a ``+=`` is not atomic across threads)."""

    def __init__(self, name: str, documentation: str, labelnames: Sequence[str], registry: CollectorRegistry) -> None:
        self.name, self.documentation, self.labelnames = name, documentation, tuple(labelnames)
        self._series: dict[tuple[str, ...], Any] = {}
        registry.register(self)

    def labels(self, *values: str) -> Any:
        key = tuple(str(v) for v in values)
        found = self._series.get(key)
        if found is None:
            if len(key) != len(self.labelnames):
                raise ValueError(f"{self.name}: {len(self.labelnames)} label values expected, {len(key)} given")
            found = self._series[key] = self._new()
        return found

    def _new(self) -> Any:
        raise NotImplementedError

    def describe(self) -> Iterator[Metric]:
        """Its family, empty: the names the registry knows it by (a duplicate refused, a scrape's
        ``name[]`` filter finds it)."""
        yield self._family()

    def _family(self) -> Metric:
        raise NotImplementedError


class LoopCounter(_LoopMetric):
    """prometheus_client's ``Counter``, lock-free (:class:`_LoopMetric`); the same exposition:
    ``<name>_total`` and ``<name>_created`` a series."""

    def _new(self) -> _CounterSeries:
        return _CounterSeries()

    def labels(self, *values: str) -> _CounterSeries:
        series: _CounterSeries = super().labels(*values)
        return series

    def _family(self) -> CounterMetricFamily:
        return CounterMetricFamily(self.name, self.documentation, labels=self.labelnames)

    def collect(self) -> Iterator[Metric]:
        family, created = self._family(), _created_series()
        for values, series in list(self._series.items()):  # a scrape in a thread sees a copy
            family.add_metric(values, series.value, created=series.created if created else None)
        yield family


class LoopHistogram(_LoopMetric):
    """prometheus_client's ``Histogram``, lock-free (:class:`_LoopMetric`): cumulative
    ``<name>_bucket`` series (``le`` written as prometheus_client writes it), then ``_count``,
    ``_sum`` and ``_created``."""

    def __init__(
        self,
        name: str,
        documentation: str,
        labelnames: Sequence[str],
        registry: CollectorRegistry,
        *,
        buckets: Sequence[float],
    ) -> None:
        self._bounds = (*sorted(float(b) for b in buckets if b != float("inf")), float("inf"))
        self._le = tuple(floatToGoString(b) for b in self._bounds)  # type: ignore[no-untyped-call]
        super().__init__(name, documentation, labelnames, registry)

    def _new(self) -> _HistogramSeries:
        return _HistogramSeries(self._bounds)

    def labels(self, *values: str) -> _HistogramSeries:
        series: _HistogramSeries = super().labels(*values)
        return series

    def _family(self) -> HistogramMetricFamily:
        return HistogramMetricFamily(self.name, self.documentation, labels=self.labelnames)

    def collect(self) -> Iterator[Metric]:
        family, created = self._family(), _created_series()
        for values, series in list(self._series.items()):
            counts, total, cumulative = list(series.counts), series.sum, 0
            buckets = []
            for le, n in zip(self._le, counts, strict=True):
                cumulative += n
                buckets.append((le, float(cumulative)))
            family.add_metric(values, buckets, total)
            if created:
                family.samples.append(
                    Sample(self.name + "_created", dict(zip(self.labelnames, values, strict=True)), series.created)
                )
        yield family


class LoopGauge(Collector):
    """prometheus_client's ``Gauge`` of no labels, lock-free (:class:`_LoopMetric`)."""

    def __init__(self, name: str, documentation: str, registry: CollectorRegistry) -> None:
        self.name, self.documentation, self.value = name, documentation, 0.0
        registry.register(self)

    def inc(self, amount: float = 1) -> None:
        self.value += amount

    def dec(self, amount: float = 1) -> None:
        self.value -= amount

    def set(self, value: float) -> None:
        self.value = float(value)

    def describe(self) -> Iterator[Metric]:
        yield GaugeMetricFamily(self.name, self.documentation)

    def collect(self) -> Iterator[Metric]:
        yield GaugeMetricFamily(self.name, self.documentation, value=self.value)


def _created_series() -> bool:
    """Whether ``_created`` series are written: not with ``PROMETHEUS_DISABLE_CREATED_SERIES`` set
    (or ``disable_created_metrics()`` called), as prometheus_client's own metrics have it."""
    return bool(getattr(prometheus_client.metrics, "_use_created", True))


class WorkersCollector(Collector):
    """Under ``serve --workers N``: the metrics of every worker, alive or gone, from prometheus_client's
    multiprocess files in ``path``. Counters and histograms are summed (a worker that died still
    counts), gauges combine by their ``multiprocess_mode``; ``gateway_config_info`` keeps only the
    versions some live worker runs."""

    def __init__(self, path: str) -> None:
        self._files = MultiProcessCollector(None, path)  # type: ignore[no-untyped-call]

    def collect(self) -> Iterator[Metric]:
        for metric in self._files.collect():  # type: ignore[no-untyped-call]
            if metric.name == "gateway_config_info":
                metric.samples = [s for s in metric.samples if s.value != 0]
            yield metric

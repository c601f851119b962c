"""The lock-free metrics every request writes (gateway.metrics' Loop*) expose exactly what
prometheus_client's own give for the same writes: names, HELP and TYPE, labels, cumulative
buckets with prometheus_client's ``le``, ``_count``, ``_sum`` and ``_created``."""

from __future__ import annotations

import re

import prometheus_client.metrics
import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.openmetrics.exposition import generate_latest as generate_openmetrics

from gateway.meters import LoopCounter, LoopGauge, LoopHistogram
from gateway.metrics import DURATION_BUCKETS, GatewayMetrics


def _pairs() -> tuple[CollectorRegistry, CollectorRegistry]:
    theirs, ours = CollectorRegistry(), CollectorRegistry()
    counters = (
        Counter("t_requests", "Requests.", ["model", "code"], registry=theirs),
        LoopCounter("t_requests", "Requests.", ["model", "code"], ours),
    )
    histograms = (
        Histogram("t_seconds", "Seconds.", ["model"], buckets=DURATION_BUCKETS, registry=theirs),
        LoopHistogram("t_seconds", "Seconds.", ["model"], ours, buckets=DURATION_BUCKETS),
    )
    gauges = (Gauge("t_in_flight", "Now.", registry=theirs), LoopGauge("t_in_flight", "Now.", ours))
    for counter in counters:
        counter.labels("a", 200).inc()  # a label value that is not a str is written as str() of it
        counter.labels("a", "200").inc(2.5)
        counter.labels("b", "500")  # made at 0
    for histogram in histograms:
        for seconds in (0.001, 0.005, 0.0051, 1, 600, 601, 1e9):  # on a bound, past the last one
            histogram.labels("a").observe(seconds)
        histogram.labels("z")
    for gauge in gauges:
        gauge.inc()
        gauge.inc(3)
        gauge.dec()
    return theirs, ours


def _without_created(text: bytes) -> str:
    return re.sub(r"_created(\{[^}]*\})? \S+", r"_created\1 T", text.decode())


@pytest.mark.parametrize("exposition", [generate_latest, generate_openmetrics], ids=["text", "openmetrics"])
def test_loop_metrics_expose_what_prometheus_clients_do(exposition: object) -> None:
    theirs, ours = _pairs()
    assert callable(exposition)
    assert _without_created(exposition(ours)) == _without_created(exposition(theirs))


def test_a_scrapes_name_filter_finds_them_as_it_finds_prometheus_clients() -> None:
    """``/metrics?name[]=...`` (the registry's restricted_registry) finds a collector by the
    names its ``describe()`` gives: each of the Loop* gives its family's."""
    theirs, ours = _pairs()
    names = ["t_requests_total", "t_seconds_bucket", "t_in_flight"]
    picked = _without_created(generate_latest(ours.restricted_registry(names))).splitlines()
    expected = _without_created(generate_latest(theirs.restricted_registry(names))).splitlines()
    assert sorted(picked) == sorted(expected)  # in the order of a set
    assert all(any(line.startswith(name) for line in picked) for name in names)


def test_a_name_registered_twice_is_refused() -> None:
    registry = CollectorRegistry()
    LoopCounter("t_twice", "Once.", ["model"], registry)
    with pytest.raises(ValueError, match="Duplicated"):
        LoopCounter("t_twice", "Twice.", ["model"], registry)


def test_created_series_are_left_out_as_prometheus_clients_are(monkeypatch: pytest.MonkeyPatch) -> None:
    """``PROMETHEUS_DISABLE_CREATED_SERIES`` (prometheus_client's ``disable_created_metrics()``)."""
    monkeypatch.setattr(prometheus_client.metrics, "_use_created", False)
    theirs, ours = _pairs()
    text = generate_latest(ours).decode()
    assert "_created" not in text and text == generate_latest(theirs).decode()


def test_sample_values_read_alike() -> None:
    theirs, ours = _pairs()
    for name, labels in (
        ("t_requests_total", {"model": "a", "code": "200"}),
        ("t_seconds_bucket", {"model": "a", "le": "0.005"}),
        ("t_seconds_bucket", {"model": "a", "le": "+Inf"}),
        ("t_seconds_count", {"model": "a"}),
        ("t_seconds_sum", {"model": "a"}),
        ("t_in_flight", {}),
    ):
        assert ours.get_sample_value(name, labels) == theirs.get_sample_value(name, labels), name


def test_a_counter_refuses_what_prometheus_clients_refuse() -> None:
    counter = LoopCounter("t_refused", "Refused.", ["model"], CollectorRegistry())
    with pytest.raises(ValueError):
        counter.labels("a").inc(-1)
    with pytest.raises(ValueError):
        counter.labels("a", "b")


def test_one_process_writes_without_locks_and_workers_through_the_files() -> None:
    single = GatewayMetrics(CollectorRegistry())
    assert isinstance(single.requests, LoopCounter) and isinstance(single.request_duration, LoopHistogram)
    assert isinstance(single.in_flight, LoopGauge)
    workers = GatewayMetrics(CollectorRegistry(), multiprocess=True)
    assert isinstance(workers.requests, Counter) and isinstance(workers.request_duration, Histogram)
    assert isinstance(workers.in_flight, Gauge)
    single.child(single.requests, "m", "200", "-", "chat").inc()
    assert (
        single.registry.get_sample_value(
            "gateway_requests_total", {"model": "m", "code": "200", "key": "-", "api": "chat"}
        )
        == 1
    )

"""The replica pools' and the models' queues' state as Prometheus gauges, read at scrape time:
nothing to keep in step per request. Under ``serve --workers N`` a scrape reads the answering
worker's own pools."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from ..config import PRIORITIES
from .concurrency import Gates
from .replicas import BREAKER_STATES, Pool


class PoolCollector(Collector):
    """The live pools' and queues' state, read at scrape time: nothing to keep in step per request."""

    def __init__(self, pools: Callable[[], Mapping[str, Pool]], gates: Gates) -> None:
        self._pools, self._gates = pools, gates

    def collect(self) -> Iterator[Metric]:
        healthy = GaugeMetricFamily(
            "gateway_upstream_healthy",
            "1 when the replica takes requests (its breaker is not open), else 0.",
            labels=["model", "upstream"],
        )
        state = GaugeMetricFamily(
            "gateway_upstream_breaker_state",
            "The replica's circuit breaker: 1 for its current state (closed, half_open, open), 0 for the others.",
            labels=["model", "upstream", "state"],
        )
        in_flight = GaugeMetricFamily(
            "gateway_upstream_in_flight",
            "Requests being sent to or relayed from the replica now.",
            labels=["model", "upstream"],
        )
        for name, pool in self._pools().items():
            for replica in pool.replicas:
                healthy.add_metric([name, replica.url], 1.0 if replica.healthy else 0.0)
                in_flight.add_metric([name, replica.url], replica.in_flight)
                for s in BREAKER_STATES:
                    state.add_metric([name, replica.url, s], 1.0 if replica.state == s else 0.0)
        queued = GaugeMetricFamily(
            "gateway_queue_depth",
            "Requests waiting for a slot of their model (max_concurrency), by priority class.",
            labels=["model", "priority"],
        )
        active = GaugeMetricFamily(
            "gateway_model_in_flight", "Requests holding a slot of their model (max_concurrency).", labels=["model"]
        )
        slots = GaugeMetricFamily(
            "gateway_model_slots",
            "The slots of its model's max_concurrency this process may fill: all of them, or with server.limits_store "
            "its part (the limit divided among the live gateway processes).",
            labels=["model"],
        )
        for name, gate in self._gates.items():
            slots.add_metric([name], gate.slots)
            for rank, priority in enumerate(PRIORITIES):
                queued.add_metric([name, priority], gate.queued_at(rank))
            active.add_metric([name], gate.active)
        yield from (healthy, state, in_flight, queued, active, slots)

"""Active health checks: a replica that fails its probes takes no requests until one passes."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
from prometheus_client import CollectorRegistry

from gateway.config import parse_config
from gateway.errors import ConfigError
from gateway.metrics import GatewayMetrics
from gateway.server.store import ConfigStore
from gateway.upstream.health import HealthChecker
from gateway.upstream.replicas import Pool
from tests.conftest import free_port, routing


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


async def test_failed_probes_take_a_replica_out_and_one_pass_brings_it_back(upstream_factory) -> None:
    sick, well = await upstream_factory("sick"), await upstream_factory("well")
    dead = f"http://127.0.0.1:{free_port()}"
    config = parse_config(
        routing(
            f"  - {{name: m, upstreams: [{sick.url}, {well.url}, {dead}], accepts: [text],"
            " health_check: {interval_s: 10, failures: 2, timeout_s: 1}}",
            f"  - {{name: n, upstreams: [{well.url}], accepts: [text]}}",  # no health_check: never probed
        )
    )
    metrics = GatewayMetrics(CollectorRegistry())
    store = ConfigStore(config, metrics=metrics)
    clock = Clock()
    checker = HealthChecker(lambda: store.live, metrics, clock=clock)
    sick.standin.healthy = False
    pool = store.live.pools["m"]
    by_url = {r.url: r for r in pool.replicas}
    async with aiohttp.ClientSession() as session:
        await checker.check_due(session)
        assert not by_url[sick.url].checked_down  # one failure of two
        await checker.check_due(session)  # not due yet: nothing probed
        assert by_url[sick.url].probe_failures == 1
        clock.now += 10
        await checker.check_due(session)
        assert by_url[sick.url].checked_down and by_url[dead].checked_down
        assert not by_url[well.url].checked_down
        assert by_url[sick.url].last_error == "health check: HTTP 503"
        assert {take(pool) for _ in range(10)} == {well.url}
        sick.standin.healthy = True
        clock.now += 10
        await checker.check_due(session)
        assert not by_url[sick.url].checked_down and by_url[sick.url].healthy
    assert (
        metrics.registry.get_sample_value(
            "gateway_health_checks_total", {"model": "m", "upstream": well.url, "result": "pass"}
        )
        == 3
    )
    assert (
        metrics.registry.get_sample_value(
            "gateway_health_checks_total", {"model": "m", "upstream": sick.url, "result": "fail"}
        )
        == 2
    )
    assert len(well.received) == 0  # probes are GETs of /health, not requests


def take(pool: Pool) -> str:
    lease = pool.lease()
    assert lease is not None
    with lease:
        return lease.replica.url


async def test_the_gateway_runs_its_health_checks(upstream_factory, gateway_factory) -> None:
    sick, well = await upstream_factory("sick"), await upstream_factory("well")
    sick.standin.healthy = False
    gw = await gateway_factory(
        routing(
            f"  - {{name: m, upstreams: [{sick.url}, {well.url}], accepts: [text],"
            " health_check: {interval_s: 0.05, failures: 1}}"
        )
    )
    for _ in range(3000):  # bounded (30 s of waits): the first probes run as the gateway starts
        if gw.sample("gateway_upstream_healthy", model="m", upstream=sick.url) == 0:
            break
        await asyncio.sleep(0.01)
    assert gw.sample("gateway_upstream_healthy", model="m", upstream=sick.url) == 0
    async with gw.client() as client:
        for _ in range(10):
            await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
    assert len(sick.received) == 0 and len(well.received) == 10


@pytest.mark.parametrize(
    ("check", "expected"),
    [
        ("{path: health}", "models[0].health_check.path: must start with '/', not 'health'"),
        ("{interval_s: 0}", "models[0].health_check.interval_s: must be greater than 0, not 0"),
        (
            "{fails: 2}",
            "models[0].health_check.fails: unknown key 'fails' (expected one of: path, interval_s, "
            "timeout_s, failures); did you mean 'failures'?",
        ),
    ],
)
def test_health_check_keys_are_checked(check: str, expected: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_config(routing(f"  - {{name: m, upstreams: ['http://h:1'], accepts: [text], health_check: {check}}}"))
    assert [str(p).split(": ", 1)[1] for p in info.value.problems] == [expected]


async def test_a_reload_that_drops_the_health_check_lets_its_replicas_back_in(upstream, tmp_path) -> None:
    checked = routing(f"  - {{name: m, upstreams: [{upstream.url}], accepts: [text], health_check: {{failures: 1}}}}")
    path = tmp_path / "routing.yaml"
    path.write_text(checked)
    metrics = GatewayMetrics(CollectorRegistry())
    store = ConfigStore(parse_config(checked), metrics=metrics, path=str(path))
    upstream.standin.healthy = False
    async with aiohttp.ClientSession() as session:
        await HealthChecker(lambda: store.live, metrics).check_due(session)
    assert store.live.pools["m"].lease() is None  # out
    path.write_text(routing(f"  - {{name: m, upstreams: [{upstream.url}], accepts: [text]}}"))
    await store.reload()
    assert store.live.pools["m"].lease() is not None  # no probe would ever bring it back: back in now

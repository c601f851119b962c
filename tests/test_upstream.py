"""Replica choice, failover, and how upstream faults reach the client."""

from __future__ import annotations

import asyncio

import aiohttp
import openai
import pytest
from aiohttp import web

from gateway.config import parse_config
from gateway.state import SERVICES_KEY
from gateway.upstream import Replica, Replicas
from tests.conftest import error_body, free_port, routing

HI = [{"role": "user", "content": "hi"}]


def url_of(replica: Replica | None) -> str:
    assert replica is not None
    return replica.url


def dead_url() -> str:
    """A loopback port nothing listens on: connections are refused at once."""
    return f"http://127.0.0.1:{free_port()}"


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def replicas_for(*urls: str, cooldown: float = 5.0) -> tuple[Replicas, Clock]:
    clock = Clock()
    replicas = Replicas(cooldown_s=cooldown, clock=clock)
    config = parse_config(routing(f"  - {{name: m, upstreams: [{', '.join(urls)}], accepts: [text]}}"))
    replicas.update(config)
    return replicas, clock


def test_choose_prefers_the_least_loaded_then_takes_turns() -> None:
    replicas, _ = replicas_for("http://a", "http://b", "http://c")
    urls = ["http://a", "http://b", "http://c"]
    first = replicas.choose(urls, set())
    assert first is not None
    first.in_flight = 3
    picks = [replicas.choose(urls, set()) for _ in range(4)]
    assert {p.url for p in picks if p} == set(urls) - {first.url}


def test_choose_skips_tried_and_cooling_down_replicas_until_all_are_down() -> None:
    replicas, clock = replicas_for("http://a", "http://b")
    a = replicas.choose(["http://a"], set())
    assert a is not None
    replicas.mark_down(a, "refused")
    assert [url_of(replicas.choose(["http://a", "http://b"], set())) for _ in range(3)] == ["http://b"] * 3
    assert url_of(replicas.choose(["http://a", "http://b"], {"http://b"})) == "http://a"  # down, but all else tried
    assert not replicas.all_down(["http://a", "http://b"])
    clock.now += 5.0
    assert {url_of(replicas.choose(["http://a", "http://b"], set())) for _ in range(4)} == {"http://a", "http://b"}


def test_replica_state_survives_a_reload_by_url() -> None:
    replicas, _ = replicas_for("http://a", "http://b")
    a = replicas.choose(["http://a"], set())
    replicas.mark_down(a, "refused")
    replicas.update(parse_config(routing("  - {name: n, upstreams: ['http://a', 'http://c'], accepts: [text]}")))
    snapshot = {r["url"]: r["healthy"] for r in replicas.snapshot()}
    assert snapshot == {"http://a": False, "http://c": True}


async def test_fails_over_from_a_refusing_replica(gateway_factory, upstream) -> None:
    dead = dead_url()
    gw = await gateway_factory(routing(f"  - {{name: m, upstreams: [{dead}, {upstream.url}], accepts: [text]}}"))
    async with gw.client() as client:
        for _ in range(3):
            await client.chat.completions.create(model="m", messages=HI)
    assert len(upstream.received) == 3
    assert gw.sample("gateway_upstream_requests_total", model="m", upstream=dead, outcome="connect_error") == 1
    assert gw.sample("gateway_upstream_requests_total", model="m", upstream=upstream.url, outcome="ok") == 3


async def test_no_upstream_listening_is_502_then_503_while_cooling_down(gateway_factory) -> None:
    gw = await gateway_factory(routing(f"  - {{name: m, upstreams: [{dead_url()}], accepts: [text]}}"))
    async with gw.client() as client:
        with pytest.raises(openai.InternalServerError) as first:
            await client.chat.completions.create(model="m", messages=HI)
        with pytest.raises(openai.InternalServerError) as second:
            await client.chat.completions.create(model="m", messages=HI)
    assert first.value.status_code == 502
    assert error_body(first.value)["code"] == "upstream_unreachable"
    assert "Could not connect to any upstream of model 'm'" in error_body(first.value)["message"]
    assert second.value.status_code == 503
    assert error_body(second.value)["code"] == "no_healthy_upstream"
    assert second.value.response.headers["Retry-After"] == "5"
    assert gw.sample("gateway_requests_total", model="m", code="502") == 1


async def test_an_upstream_that_does_not_answer_in_time_is_504(gateway_factory, upstream) -> None:
    gw = await gateway_factory(
        routing(
            f"  - {{name: m, upstreams: [{upstream.url}], accepts: [text]}}",
            server="{upstream_read_timeout_s: 0.2}",
        )
    )
    async with gw.client() as client:
        with pytest.raises(openai.APIStatusError) as caught:
            await client.chat.completions.create(model="m", messages=HI, extra_headers={"X-Standin-Delay-Ms": "3000"})
    assert caught.value.status_code == 504
    assert error_body(caught.value)["code"] == "upstream_timeout"
    assert gw.sample("gateway_upstream_requests_total", model="m", upstream=upstream.url, outcome="timeout") == 1


async def test_a_client_that_leaves_mid_stream_stops_the_upstream(upstream_factory, gateway_factory) -> None:
    upstream_gone = asyncio.Event()

    async def endless(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        try:
            while True:
                await response.write(b'data: {"tick": 1}\n\n')
                await asyncio.sleep(0.01)
        except (ConnectionResetError, asyncio.CancelledError):
            upstream_gone.set()
            raise

    app = web.Application()
    app.router.add_post("/v1/chat/completions", endless)
    up = await upstream_factory("endless", app)
    gw = await gateway_factory(routing(f"  - {{name: m, upstreams: [{up.url}], accepts: [text]}}"))
    async with aiohttp.ClientSession() as session:
        body = {"model": "m", "stream": True, "messages": HI}
        async with session.post(f"{gw.url}/v1/chat/completions", json=body) as resp:
            await resp.content.readuntil(b"\n\n")
            resp.close()
    await asyncio.wait_for(upstream_gone.wait(), timeout=10)
    for _ in range(200):  # the gateway counts the request once its handler has unwound
        if gw.sample("gateway_requests_total", model="m", code="499"):
            break
        await asyncio.sleep(0.01)
    assert gw.sample("gateway_requests_total", model="m", code="499") == 1
    assert gw.sample("gateway_requests_in_flight") == 0


async def test_a_client_that_gives_up_before_the_response_leaks_no_load(gateway_factory, upstream) -> None:
    gw = await gateway_factory(routing(f"  - {{name: m, upstreams: [{upstream.url}], accepts: [text]}}"))
    async with aiohttp.ClientSession() as session:
        for _ in range(3):
            with pytest.raises(TimeoutError):
                async with session.post(
                    f"{gw.url}/v1/chat/completions",
                    json={"model": "m", "messages": HI},
                    headers={"X-Standin-Delay-Ms": "2000"},
                    timeout=aiohttp.ClientTimeout(total=0.2),
                ):
                    pass
    for _ in range(300):  # bounded: the gateway notices the disconnects
        if gw.sample("gateway_upstream_requests_total", model="m", upstream=upstream.url, outcome="aborted") == 3:
            break
        await asyncio.sleep(0.01)
    assert gw.sample("gateway_upstream_requests_total", model="m", upstream=upstream.url, outcome="aborted") == 3
    replicas = gw.app[SERVICES_KEY].upstream.replicas.snapshot()
    assert [r["in_flight"] for r in replicas] == [0]
    assert gw.sample("gateway_requests_total", model="m", code="499") == 3


async def test_a_413_and_bad_json_are_counted_as_unknown_model(gateway_factory, upstream) -> None:
    gw = await gateway_factory(
        routing(f"  - {{name: m, upstreams: [{upstream.url}], accepts: [text]}}", server="{max_body_bytes: 2048}")
    )
    async with aiohttp.ClientSession() as session:
        for body in (b"x" * 4096, b"{bad"):
            async with session.post(f"{gw.url}/v1/chat/completions", data=body) as resp:
                await resp.read()
    assert gw.sample("gateway_requests_total", model="_unknown", code="413") == 1
    assert gw.sample("gateway_requests_total", model="_unknown", code="400") == 1

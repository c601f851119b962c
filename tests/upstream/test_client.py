"""Replica choice, failover, and how upstream faults reach the client."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable, Iterator
from pathlib import Path

import aiohttp
import openai
import pytest
from aiohttp import web

from gateway.server.state import SERVICES_KEY
from tests.conftest import error_body, routing

# every fault, through the gateway's own client and through aiohttp's

HI = [{"role": "user", "content": "hi"}]


_RESERVED: list[socket.socket] = []  # bound, never listening: held until the module's tests end


@pytest.fixture(autouse=True, scope="module")
def _release_reserved_ports() -> Iterator[None]:
    yield
    while _RESERVED:
        _RESERVED.pop().close()


def dead_url() -> str:
    """A loopback port nothing listens on: connections are refused at once. Bound and kept (not
    merely found free), so no server of another test can take it meanwhile."""
    held = socket.socket()
    held.bind(("127.0.0.1", 0))
    _RESERVED.append(held)
    return f"http://127.0.0.1:{held.getsockname()[1]}"


async def test_fails_over_from_a_refusing_replica(gateway_factory, upstream) -> None:
    dead = dead_url()
    # round robin starts with the first replica; one failure opens its breaker
    options = "balance: round_robin, breaker: {failures: 1}"
    gw = await gateway_factory(
        routing(f"  - {{name: m, upstreams: [{dead}, {upstream.url}], accepts: [text], {options}}}")
    )
    async with gw.client() as client:
        for _ in range(3):
            await client.chat.completions.create(model="m", messages=HI)
    assert len(upstream.received) == 3
    assert gw.sample("gateway_upstream_requests_total", model="m", upstream=dead, outcome="connect_error") == 1
    assert gw.sample("gateway_retries_total", model="m", reason="connect_error") == 1
    assert gw.sample("gateway_upstream_requests_total", model="m", upstream=upstream.url, outcome="ok") == 3


async def test_no_upstream_listening_is_502_then_503_while_the_breaker_is_open(gateway_factory) -> None:
    model = f"{{name: m, upstreams: [{dead_url()}], accepts: [text], breaker: {{failures: 1, open_s: 5}}}}"
    gw = await gateway_factory(routing(f"  - {model}"))
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
    loop = asyncio.get_running_loop()

    async def until(done: Callable[[], bool]) -> None:
        deadline = loop.time() + 30  # (a bound against a hang, not a bet on speed)
        while not done() and loop.time() < deadline:
            await asyncio.sleep(0.01)

    async with aiohttp.ClientSession() as session:

        async def send() -> None:
            async with session.post(
                f"{gw.url}/v1/chat/completions",
                json={"model": "m", "messages": HI},
                headers={"X-Standin-Delay-Ms": "10000"},
            ) as resp:
                await resp.read()

        for n in range(1, 4):
            sending = asyncio.create_task(send())
            await until(lambda n=n: len(upstream.received) == n)  # the engine has it: the client gives up now
            sending.cancel()
            with pytest.raises(asyncio.CancelledError):
                await sending

    def aborted() -> float | None:
        return gw.sample("gateway_upstream_requests_total", model="m", upstream=upstream.url, outcome="aborted")

    await until(lambda: aborted() == 3)  # the gateway notices the disconnects
    assert aborted() == 3
    replicas = gw.app[SERVICES_KEY].store.replicas.snapshot()
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


# --- retries, breakers, faults (docs/reliability.md) -------------------------------------------

FAST = "retries: {backoff_s: 0}"  # no backoff wait in tests that retry on purpose


def model_on(*urls: str, options: str = FAST) -> str:
    return routing(f"  - {{name: m, upstreams: [{', '.join(urls)}], accepts: [text], {options}}}")


async def ask_all(gw, n: int, *, concurrency: int = 8, stream: bool = False) -> list[int]:
    """Send ``n`` chat requests, ``concurrency`` at a time; the statuses (0 for a connection error)."""
    limit = asyncio.Semaphore(concurrency)
    body = {"model": "m", "messages": HI, "stream": stream}

    async def one(session: aiohttp.ClientSession) -> int:
        async with limit:
            try:
                async with session.post(f"{gw.url}/v1/chat/completions", json=body) as resp:
                    await resp.read()
                    return resp.status
            except aiohttp.ClientError:
                return 0

    async with aiohttp.ClientSession() as session:
        return list(await asyncio.gather(*(one(session) for _ in range(n))))


async def test_a_replica_answering_503_costs_no_request_and_is_ejected(upstream_factory, gateway_factory) -> None:
    bad, good = await upstream_factory("bad"), await upstream_factory("good")
    bad.standin.fail_status = 503
    gw = await gateway_factory(model_on(bad.url, good.url))
    statuses = await ask_all(gw, 60)
    assert statuses == [200] * 60
    # breaker.failures, plus what was already on its way when the breaker opened; then no more
    assert 5 <= len(bad.received) < 5 + 8
    assert len(good.received) == 60
    assert gw.sample("gateway_retries_total", model="m", reason="http_503") == len(bad.received)
    assert gw.sample("gateway_upstream_ejections_total", model="m", upstream=bad.url) == 1
    assert gw.sample("gateway_upstream_healthy", model="m", upstream=bad.url) == 0
    assert gw.sample("gateway_upstream_breaker_state", model="m", upstream=bad.url, state="open") == 1
    assert gw.sample("gateway_upstream_healthy", model="m", upstream=good.url) == 1
    assert gw.sample("gateway_upstream_in_flight", model="m", upstream=good.url) == 0


async def test_a_429_is_retried_elsewhere_without_counting_against_the_replica(upstream_factory, gateway_factory):
    busy, free = await upstream_factory("busy"), await upstream_factory("free")
    busy.standin.fail_status = 429
    gw = await gateway_factory(model_on(busy.url, free.url))
    assert await ask_all(gw, 30, concurrency=1) == [200] * 30
    # passed over for a second (its Retry-After, 1 s when absent) rather than drawing the load as
    # the fastest replica; never ejected: a 429 is the engine protecting itself, not failing
    assert 1 <= len(busy.received) <= 3  # once a second at most (30 quick requests: about once)
    assert gw.sample("gateway_upstream_healthy", model="m", upstream=busy.url) == 1
    assert gw.sample("gateway_retries_total", model="m", reason="http_429") == len(busy.received)


async def test_a_500_is_relayed_unless_retries_on_lists_it(upstream_factory, gateway_factory) -> None:
    bad, good = await upstream_factory("bad"), await upstream_factory("good")
    bad.standin.fail_status = 500
    gw = await gateway_factory(model_on(bad.url, options=FAST))
    async with gw.client() as client:
        with pytest.raises(openai.InternalServerError) as caught:
            await client.chat.completions.create(model="m", messages=HI)
    assert caught.value.status_code == 500
    assert error_body(caught.value)["message"] == "stand-in bad says 500"  # the engine's own answer, relayed
    gw = await gateway_factory(model_on(bad.url, good.url, options="retries: {on_status: [500, 503], backoff_s: 0}"))
    assert await ask_all(gw, 20) == [200] * 20


async def test_a_reset_before_the_response_is_retried_on_another_replica(upstream_factory, gateway_factory) -> None:
    flaky, good = await upstream_factory("flaky"), await upstream_factory("good")
    flaky.standin.reset = True
    gw = await gateway_factory(model_on(flaky.url, good.url))
    assert await ask_all(gw, 30) == [200] * 30
    assert 5 <= len(flaky.received) < 5 + 8
    assert gw.sample("gateway_retries_total", model="m", reason="reset") == len(flaky.received)


async def test_when_every_replica_fails_the_client_gets_the_last_answer(upstream_factory, gateway_factory) -> None:
    a, b = await upstream_factory("a"), await upstream_factory("b")
    a.standin.fail_status = b.standin.fail_status = 503
    gw = await gateway_factory(model_on(a.url, b.url))
    async with gw.client() as client:
        with pytest.raises(openai.APIStatusError) as caught:
            await client.chat.completions.create(model="m", messages=HI)
    assert caught.value.status_code == 503
    assert error_body(caught.value)["message"].startswith("stand-in ")  # relayed: nothing left to try
    assert len(a.received) + len(b.received) == 2
    assert gw.sample("gateway_retries_total", model="m", reason="http_503") == 1


async def test_all_replicas_ejected_is_503_no_healthy_upstream_with_retry_after(upstream_factory, gateway_factory):
    a = await upstream_factory("a")
    a.standin.fail_status = 502
    gw = await gateway_factory(model_on(a.url, options="breaker: {failures: 2, open_s: 30}"))
    statuses = await ask_all(gw, 4, concurrency=1)
    assert statuses == [502, 502, 503, 503]
    async with gw.client() as client:
        with pytest.raises(openai.APIStatusError) as caught:
            await client.chat.completions.create(model="m", messages=HI)
    assert error_body(caught.value)["code"] == "no_healthy_upstream"
    assert caught.value.response.headers["Retry-After"] == "30"
    assert len(a.received) == 2


async def test_retries_stop_at_attempts_and_within_the_budget(upstream_factory, gateway_factory) -> None:
    ups = [await upstream_factory(f"u{i}") for i in range(4)]
    for u in ups:
        u.standin.fail_status = 503
    urls = [u.url for u in ups]
    gw = await gateway_factory(model_on(*urls, options="retries: {attempts: 1, backoff_s: 0}, breaker: {failures: 9}"))
    assert await ask_all(gw, 1) == [503]
    assert sum(len(u.received) for u in ups) == 2  # the first try and one retry
    gw = await gateway_factory(
        model_on(*urls, options="retries: {budget: 0, min_per_s: 0, backoff_s: 0}, breaker: {failures: 9}")
    )
    assert await ask_all(gw, 1) == [503]
    assert gw.sample("gateway_retries_refused_total", model="m") == 1


async def test_a_replica_killed_under_load_costs_no_request(upstream_factory, gateway_factory) -> None:
    doomed, survivor = await upstream_factory("doomed"), await upstream_factory("survivor")
    gw = await gateway_factory(model_on(doomed.url, survivor.url))
    load = asyncio.create_task(ask_all(gw, 400, concurrency=8))
    while len(doomed.received) < 20:  # the load reaches both
        await asyncio.sleep(0.005)
    await doomed.server.close()
    statuses = await load
    assert statuses == [200] * 400
    assert gw.sample("gateway_upstream_healthy", model="m", upstream=doomed.url) == 0


async def test_a_slow_replica_gets_less_traffic(upstream_factory, gateway_factory) -> None:
    slow, fast = await upstream_factory("slow"), await upstream_factory("fast")
    slow.standin.delay_ms = 100
    gw = await gateway_factory(model_on(slow.url, fast.url))
    assert await ask_all(gw, 80, concurrency=8) == [200] * 80
    assert len(fast.received) > 3 * len(slow.received)


async def test_a_request_in_flight_keeps_its_generations_pool_across_a_reload(upstream_factory, gateway_factory):
    old, new = await upstream_factory("old"), await upstream_factory("new")
    gw = await gateway_factory(model_on(old.url), write_file=True)
    old.standin.delay_ms = 300
    async with gw.client() as client:
        pending = asyncio.create_task(client.chat.completions.create(model="m", messages=HI))
        while not old.received:
            await asyncio.sleep(0.005)
        store = gw.app[SERVICES_KEY].store
        assert store.path is not None
        Path(store.path).write_text(model_on(new.url))
        await store.reload()
        done = await pending
        after = await client.chat.completions.create(model="m", messages=HI)
    assert done.choices[0].message.content.startswith("[old]")
    assert after.choices[0].message.content.startswith("[new]")
    assert [r["url"] for r in gw.app[SERVICES_KEY].store.replicas.snapshot()] == [new.url]


KEY_ENV = "MODALITY_GATEWAY_TEST_UPSTREAM_KEY"


async def test_a_models_api_key_goes_upstream_in_place_of_the_clients_and_never_back(
    upstream_factory, gateway_factory, monkeypatch
) -> None:
    keyed, open_ = await upstream_factory("keyed"), await upstream_factory("open")
    monkeypatch.setenv(KEY_ENV, "sk-upstream-secret")
    gw = await gateway_factory(
        routing(
            f"  - {{name: m, upstreams: [{keyed.url}], accepts: [text], api_key_env: {KEY_ENV}}}",
            f"  - {{name: n, upstreams: [{open_.url}], accepts: [text]}}",
        )
    )
    async with aiohttp.ClientSession(headers={"Authorization": "Bearer client-key"}) as session:
        for model, stream in (("m", False), ("m", True), ("n", False)):
            body = {"model": model, "messages": HI, "stream": stream}
            async with session.post(f"{gw.url}/v1/chat/completions", json=body) as resp:
                assert resp.status == 200
                text = await resp.text()
                assert "sk-upstream-secret" not in text + str(resp.headers)
    assert [r.headers["Authorization"] for r in keyed.received] == ["Bearer sk-upstream-secret"] * 2
    assert open_.received[0].headers["Authorization"] == "Bearer client-key"  # no key: the client's passes


# --- per-model concurrency and timeouts --------------------------------------------------------


async def test_max_concurrency_queues_then_sheds_with_429(upstream, gateway_factory) -> None:
    upstream.standin.delay_ms = 300
    gw = await gateway_factory(model_on(upstream.url, options="max_concurrency: 2, queue: {size: 1}"))
    async with gw.client() as client:
        calls = [client.chat.completions.create(model="m", messages=HI) for _ in range(4)]
        results = await asyncio.gather(*calls, return_exceptions=True)
    refused = [r for r in results if isinstance(r, openai.RateLimitError)]
    assert len(refused) == 1 and len(results) - len(refused) == 3  # 2 in flight and 1 waiting are served
    assert error_body(refused[0])["code"] == "queue_full" and refused[0].response.headers["Retry-After"] == "1"
    assert gw.sample("gateway_shed_total", model="m", reason="queue_full") == 1
    assert gw.sample("gateway_requests_total", model="m", code="429") == 1
    assert gw.sample("gateway_queue_depth", model="m") == 0 and gw.sample("gateway_model_in_flight", model="m") == 0
    assert len(upstream.received) == 3


async def test_a_request_that_waits_past_queue_timeout_is_503(upstream, gateway_factory) -> None:
    upstream.standin.delay_ms = 500
    gw = await gateway_factory(model_on(upstream.url, options="max_concurrency: 1, queue: {timeout_s: 0.05}"))
    async with gw.client() as client:
        results = await asyncio.gather(
            *(client.chat.completions.create(model="m", messages=HI) for _ in range(2)), return_exceptions=True
        )
    failed = [r for r in results if isinstance(r, openai.APIStatusError)]
    assert len(failed) == 1 and failed[0].status_code == 503
    assert error_body(failed[0])["code"] == "queue_timeout"
    assert gw.sample("gateway_shed_total", model="m", reason="queue_timeout") == 1


async def test_total_s_bounds_the_whole_exchange(upstream, gateway_factory) -> None:
    gw = await gateway_factory(model_on(upstream.url, options="timeouts: {total_s: 0.3}"))
    async with gw.client() as client:
        with pytest.raises(openai.APIStatusError) as caught:
            await client.chat.completions.create(model="m", messages=HI, extra_headers={"X-Standin-Delay-Ms": "2000"})
        assert caught.value.status_code == 504
        assert error_body(caught.value)["message"] == "Upstream of model 'm' did not finish within 0.3s"
        stream = await client.chat.completions.create(
            model="m", messages=HI, stream=True, extra_headers={"X-Standin-Chunk-Delay-Ms": "100"}
        )
        with pytest.raises(openai.APIError) as mid_stream:
            async for _ in stream:
                pass
    assert "did not finish within 0.3s" in str(mid_stream.value)
    # a long generation is the model's limit, not the replica's fault
    assert gw.sample("gateway_upstream_healthy", model="m", upstream=upstream.url) == 1
    assert gw.app[SERVICES_KEY].store.live.pools["m"].replicas[0].failures == 0


async def test_per_model_timeouts_default_to_the_server_keys_and_override_them(upstream, gateway_factory) -> None:
    gw = await gateway_factory(
        routing(
            f"  - {{name: m, upstreams: [{upstream.url}], accepts: [text], timeouts: {{first_byte_s: 0.2}}}}",
            f"  - {{name: n, upstreams: [{upstream.url}], accepts: [text]}}",
            server="{upstream_read_timeout_s: 5}",
        )
    )
    n = gw.config.model("n")
    assert n is not None and n.timeouts.first_byte_s == 5
    async with gw.client() as client:
        with pytest.raises(openai.APIStatusError) as caught:
            await client.chat.completions.create(model="m", messages=HI, extra_headers={"X-Standin-Delay-Ms": "1000"})
        assert caught.value.status_code == 504
        await client.chat.completions.create(model="n", messages=HI, extra_headers={"X-Standin-Delay-Ms": "300"})


async def test_affinity_keeps_each_conversation_on_one_replica(upstream_factory, gateway_factory) -> None:
    ups = [await upstream_factory(f"u{i}") for i in range(3)]
    gw = await gateway_factory(model_on(*(u.url for u in ups), options="balance: affinity"))
    async with gw.client() as client:
        for turn in range(4):
            for chat in range(6):
                messages = [{"role": "user", "content": f"conversation {chat}"}]
                for i in range(turn):
                    messages += [{"role": "assistant", "content": f"a{i}"}, {"role": "user", "content": f"q{i}"}]
                await client.chat.completions.create(model="m", messages=messages)
    homes: dict[str, set[str]] = {}
    for u in ups:
        for r in u.received:
            homes.setdefault(r.json()["messages"][0]["content"], set()).add(u.url)
    assert len(homes) == 6 and all(len(h) == 1 for h in homes.values())


async def test_a_small_reply_cut_short_is_a_clean_502_not_a_truncated_200(upstream_factory, gateway_factory) -> None:
    async def cut(request: web.Request) -> web.StreamResponse:
        await request.read()
        response = web.StreamResponse(headers={"Content-Type": "application/json", "Content-Length": "100"})
        await response.prepare(request)
        await response.write(b'{"id": "cmpl-1", ')  # then the engine dies
        assert request.transport is not None
        request.transport.close()
        return response

    app = web.Application()
    app.router.add_post("/v1/chat/completions", cut)
    broken = await upstream_factory("cut", app)
    gw = await gateway_factory(model_on(broken.url, options="retries: {attempts: 0}"))
    async with gw.client() as client:
        with pytest.raises(openai.APIStatusError) as caught:
            await client.chat.completions.create(model="m", messages=HI)
    assert caught.value.status_code == 502
    assert error_body(caught.value)["message"] == "Upstream of model 'm' broke off its response"
    assert caught.value.response.headers["X-Gateway-Model"] == "m"
    assert gw.sample("gateway_upstream_requests_total", model="m", outcome="aborted") == 1


async def test_a_header_that_would_split_is_a_502_and_blames_no_replica(gateway_factory, upstream, monkeypatch) -> None:
    """A config built in code skips the load-time check of an upstream key: one with a line break
    inside made the gateway's client raise a ValueError, a 500 (aiohttp's raises one as it writes)."""
    monkeypatch.setenv("MODALITY_GATEWAY_TEST_SPLIT_KEY", "sk-one\r\nX-Injected: yes")
    gw = await gateway_factory(
        routing(
            f"  - {{name: m, upstreams: [{upstream.url}], accepts: [text], "
            "api_key_env: MODALITY_GATEWAY_TEST_SPLIT_KEY, breaker: {failures: 1}}"
        )
    )
    async with gw.client() as client:
        with pytest.raises(openai.InternalServerError) as caught:
            await client.chat.completions.create(model="m", messages=HI)
    assert caught.value.status_code == 502 and error_body(caught.value)["code"] == "upstream_error"
    assert "line break" in error_body(caught.value)["message"]
    assert upstream.received == []
    assert gw.sample("gateway_upstream_healthy", model="m") == 1  # its breaker is not open


async def test_a_replica_whose_connections_are_all_busy_is_passed_over_not_ejected(
    gateway_factory, upstream, monkeypatch
) -> None:
    """MAX_CONNECTIONS busy for a connect timeout is this gateway's saturation, not the replica
    failing: the request goes to another replica, or (none left) 503 with Retry-After, and no
    breaker counts it: a request once a connection is free is served."""
    from gateway.upstream.http1 import client as http1_client

    monkeypatch.setattr(http1_client, "MAX_CONNECTIONS", 1)
    upstream.standin.delay_ms = 1000  # holds its one connection
    gw = await gateway_factory(
        routing(
            f"  - {{name: m, upstreams: [{upstream.url}], accepts: [text], timeouts: {{connect_s: 0.2}}, "
            "breaker: {failures: 1}}"
        )
    )
    async with gw.client() as client:
        held = asyncio.ensure_future(client.chat.completions.create(model="m", messages=HI))
        while not upstream.received:
            await asyncio.sleep(0.01)  # bounded by the test's timeout
        with pytest.raises(openai.InternalServerError) as caught:
            await client.chat.completions.create(model="m", messages=HI)
        await held
        upstream.standin.delay_ms = 0
        await client.chat.completions.create(model="m", messages=HI)  # not ejected
    assert caught.value.status_code == 503 and "Retry-After" in caught.value.response.headers
    assert gw.sample("gateway_upstream_requests_total", model="m", outcome="pool_full") == 1
    assert gw.sample("gateway_upstream_ejections_total", model="m") == 0

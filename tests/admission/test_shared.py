"""gateway.admission.shared: key limits held in a real redis-server on loopback, shared by two
gateways in one process and by the two workers of ``serve --workers 2``; the store killed
mid-test gives on_failure's answer (open: served; closed: 503 in each API's shape), never a 500
or a hang."""

from __future__ import annotations

import asyncio
import os
import shutil
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import anthropic
import openai
import pytest

from gateway.admission.store_time import TICKS, store_time
from gateway.server.state import SERVICES_KEY
from tests.conftest import Gateway, Upstream, error_body, free_port, routing
from tools.redis_server import RedisServer

pytestmark = [
    pytest.mark.timeout(60),
    pytest.mark.skipif(
        shutil.which("redis-server") is None and os.environ.get("CI") != "true",
        reason="needs Debian's redis-server (make test installs it)",
    ),
]
KEY_ENV = "MODALITY_GATEWAY_TEST_SHARED_KEY"
# Generous: a call past it fails open and pauses the store for a second, which on a loaded
# machine can let a 6-a-minute key through more than 6 times (a killed store refuses at once).
STORE_TIMEOUT_MS = 2000
ASK: Any = [{"role": "user", "content": "hello"}]


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path)
    yield server
    server.kill()


def table(
    upstream: Upstream, redis: RedisServer, limits: str, on_failure: str = "open", timeout_ms: int = STORE_TIMEOUT_MS
) -> str:
    keys = f"auth:\n  keys:\n    - {{name: team-a, key_env: {KEY_ENV}, {limits}}}\n"
    server = f"{{limits_store: {{url: '{redis.url}', timeout_ms: {timeout_ms}, on_failure: {on_failure}}}}}"
    model = f"  - {{name: m, upstreams: [{upstream.url}], accepts: [text], apis: [chat, messages]}}"
    return routing(model, server=server, extra=keys)


def client(gw: Gateway) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{gw.url}/v1", api_key="sk-shared", max_retries=0)


async def settled(*gateways: Gateway) -> None:
    """Every request's end written to the store (it is sent off the request's path), and each
    gateway's lease given back: the next request reads the store again."""
    for gw in gateways:
        shared = gw.app[SERVICES_KEY].shared_limits
        assert shared is not None
        if shared._ending:
            await asyncio.wait(shared._ending)
        await shared.settle()


@pytest.fixture
async def pair(gateway_factory, upstream: Upstream, redis_server: RedisServer, monkeypatch, request) -> list[Gateway]:
    monkeypatch.setenv(KEY_ENV, "sk-shared")
    text = table(upstream, redis_server, request.param)
    return [await gateway_factory(text), await gateway_factory(text)]


@pytest.mark.parametrize("pair", ["rate_limit: {requests_per_minute: 6, burst: 5}"], indirect=True)
async def test_a_keys_rate_holds_across_two_gateways(pair: list[Gateway], upstream: Upstream) -> None:
    served, refused = 0, 0
    async with client(pair[0]) as a, client(pair[1]) as b:
        for n in range(12):
            try:
                await (a if n % 2 else b).chat.completions.create(model="m", messages=ASK)
                served += 1
            except openai.RateLimitError as exc:
                assert error_body(exc)["code"] == "rate_limit_exceeded"
                assert int(exc.response.headers["Retry-After"]) >= 1
                refused += 1
    assert served in (5, 6) and served + refused == 12  # the one burst of 5 (a tenth of a request a second refills)
    assert len(upstream.received) == served


@pytest.mark.parametrize("pair", ["rate_limit: {tokens_per_minute: 20}"], indirect=True)
async def test_a_keys_token_budget_is_spent_by_replies_on_either_gateway(pair: list[Gateway]) -> None:
    async with client(pair[0]) as a, client(pair[1]) as b:
        reply = await a.chat.completions.create(model="m", messages=ASK)
        assert reply.usage is not None and 10 < reply.usage.total_tokens < 20
        await settled(*pair)
        raw = await b.chat.completions.with_raw_response.create(model="m", messages=ASK)
        assert int(raw.headers["x-ratelimit-remaining-tokens"]) == 20 - reply.usage.total_tokens
        await settled(*pair)
        with pytest.raises(openai.RateLimitError) as caught:  # spent on both, refused on the first
            await a.chat.completions.create(model="m", messages=ASK)
    assert error_body(caught.value)["code"] == "tokens_rate_limit_exceeded"
    assert pair[0].sample("gateway_rate_limited_total", key="team-a", reason="tokens") == 1


@pytest.mark.parametrize("pair", ["max_concurrency: 1"], indirect=True)
async def test_a_keys_requests_in_flight_are_counted_across_gateways(pair: list[Gateway]) -> None:
    async with client(pair[0]) as a, client(pair[1]) as b:
        slow = asyncio.create_task(
            a.chat.completions.create(model="m", messages=ASK, extra_headers={"X-Standin-Delay-Ms": "400"})
        )
        gateway_a = pair[0].app[SERVICES_KEY]
        while not gateway_a.metrics.registry.get_sample_value("gateway_requests_in_flight"):  # the slow one admitted
            await asyncio.sleep(0.01)
        with pytest.raises(openai.RateLimitError) as caught:
            await b.chat.completions.create(model="m", messages=ASK)
        assert error_body(caught.value)["code"] == "concurrency_limit_exceeded"
        await slow
        await settled(*pair)
        await b.chat.completions.create(model="m", messages=ASK)  # the slot given back


async def test_a_store_killed_mid_test_fails_open_or_closed_as_configured(
    gateway_factory, upstream: Upstream, redis_server: RedisServer, monkeypatch
) -> None:
    monkeypatch.setenv(KEY_ENV, "sk-shared")
    limits = "rate_limit: {requests_per_minute: 600, tokens_per_minute: 100000}"
    opened = await gateway_factory(table(upstream, redis_server, limits, "open"))
    closed = await gateway_factory(table(upstream, redis_server, limits, "closed"))
    async with client(opened) as a, client(closed) as b:
        await a.chat.completions.create(model="m", messages=ASK)
        await b.chat.completions.create(model="m", messages=ASK)
        await settled(opened, closed)
        redis_server.kill()
        for _ in range(3):  # the first finds it gone, the others are answered without asking it
            reply = await a.chat.completions.create(model="m", messages=ASK)
            assert reply.choices
            with pytest.raises(openai.InternalServerError) as caught:
                await b.chat.completions.create(model="m", messages=ASK)
            assert caught.value.status_code == 503
            assert error_body(caught.value)["code"] == "limits_store_unavailable"
            assert caught.value.response.headers["Retry-After"] == "1"
    async with anthropic.AsyncAnthropic(base_url=closed.url, api_key="sk-shared", max_retries=0) as claude:
        with pytest.raises(anthropic.InternalServerError) as refused:
            await claude.messages.create(model="m", max_tokens=8, messages=ASK)
    body = refused.value.body
    assert isinstance(body, dict) and body["type"] == "error" and "limits store" in body["error"]["message"]
    assert opened.sample("gateway_limits_store_errors_total", op="admit") >= 3
    assert closed.sample("gateway_requests_total", code="503") == 4
    assert (
        closed.sample("gateway_requests_total", code="500") == opened.sample("gateway_requests_total", code="500") == 0
    )


async def test_a_keys_rate_holds_while_the_gateways_own_loop_is_held(
    gateway_factory, upstream: Upstream, redis_server: RedisServer, monkeypatch
) -> None:
    """Issue 40, finding 2: the loop held 200 ms every 100 ms (what huge bodies or a busy machine
    do) while a key's requests go on; each store call's deadline passes while the loop is held.
    The store's answers, which came meanwhile, are read (store_time): the key gets its rate, not
    a second without limits after each stall (before: nearly every request served)."""
    monkeypatch.setenv(KEY_ENV, "sk-shared")
    limits = "rate_limit: {requests_per_minute: 600, burst: 10}"
    gw = await gateway_factory(table(upstream, redis_server, limits, "open", timeout_ms=100))
    held = 0

    async def hold_the_loop() -> None:
        nonlocal held
        while held < 6:
            await asyncio.sleep(0.1)
            time.sleep(0.2)  # the whole loop held: gateway, store client and test client alike
            held += 1

    statuses: list[int] = []

    async def send(session: aiohttp.ClientSession) -> None:
        while held < 6:
            async with session.post(f"{gw.url}/v1/chat/completions", json={"model": "m", "messages": ASK},
                                    headers={"Authorization": "Bearer sk-shared"}) as resp:  # fmt: skip
                await resp.read()
                statuses.append(resp.status)

    loop = asyncio.get_running_loop()
    holder = asyncio.create_task(hold_the_loop())
    started = loop.time()
    try:
        async with aiohttp.ClientSession() as session:
            await asyncio.gather(*(send(session) for _ in range(4)))
    finally:
        held = 6
        await holder
    elapsed = loop.time() - started
    served = statuses.count(200)
    assert set(statuses) <= {200, 429}
    assert 10 <= served <= (10 + 10 * elapsed) * 1.05 + 1, (served, len(statuses), elapsed)


async def test_nothing_of_a_key_is_written_to_the_store(
    gateway_factory, upstream: Upstream, redis_server: RedisServer, monkeypatch
) -> None:
    import redis

    monkeypatch.setenv(KEY_ENV, "sk-shared")
    gw = await gateway_factory(
        table(upstream, redis_server, "rate_limit: {requests_per_minute: 60, tokens_per_day: 1000}")
    )
    async with client(gw) as c:
        await c.chat.completions.create(model="m", messages=ASK)
    await settled(gw)
    store = redis.Redis.from_url(redis_server.url, decode_responses=True)
    names = [str(k) for k in store.keys("*")]
    members = store.zrange("mg:gateways", 0, -1)  # the live gateway processes: host, pid, a nonce
    store.close()
    assert names and all(n.startswith("mg:") and "team-a" not in n and "sk-shared" not in n for n in names)
    assert {n.rsplit(":", 1)[1] for n in names} == {"requests", "tokens_day", "gateways"}
    assert len(members) == 1 and "team-a" not in members[0] and "sk-shared" not in members[0]


async def test_the_scripts_of_one_turn_go_in_one_round_trip_and_a_flushed_store_is_served_again(
    gateway_factory, upstream: Upstream, redis_server: RedisServer, monkeypatch
) -> None:
    import redis

    monkeypatch.setenv(KEY_ENV, "sk-shared")
    # a key with max_concurrency: one script an admission (the others' are leases: gateway.admission.leases)
    limits = "rate_limit: {requests_per_minute: 6, burst: 100}, max_concurrency: 1000"
    gw = await gateway_factory(table(upstream, redis_server, limits))
    shared = gw.app[SERVICES_KEY].shared_limits
    assert shared is not None
    (key,) = gw.config.auth.keys
    await shared.admit(key)  # the scripts loaded (a fresh store has none: one trip more)
    before = shared.round_trips
    admitted = await asyncio.gather(*(shared.admit(key) for _ in range(20)))
    assert shared.round_trips == before + 1  # 20 admissions, one pipeline
    remaining = sorted(int(headers["x-ratelimit-remaining-requests"]) for headers, _ in admitted)
    assert remaining == list(range(79, 99))  # each its own request spent, atomically
    store = redis.Redis.from_url(redis_server.url, decode_responses=True)
    (bucket,) = store.keys("mg:*:requests")
    # the store's clock kept to the microsecond: rounded to 100 us (Lua's tostring), a key refused
    # thousands of times a second was let through 6% over its rate (bench.across). Written with
    # %.17g, a clock whose last digits are 0 has fewer: one of three admissions' has more than 4.
    decimals: list[int] = []
    for _ in range(3):
        await shared.admit(key)
        decimals.append(len(store.hget(bucket, "u").partition(".")[2]))  # type: ignore[union-attr]
    assert max(decimals) > 4, decimals
    store.script_flush()  # as a restarted store has no script
    store.close()
    async with client(gw) as c:  # loaded again, and the request served within its limits
        raw = await c.chat.completions.with_raw_response.create(model="m", messages=ASK)
    assert raw.headers["x-ratelimit-remaining-requests"] == "75"  # of 100: 1 + 20 + 3 admissions before it
    assert gw.sample("gateway_limits_store_errors_total") == 0


async def test_a_resend_that_fails_fails_only_the_calls_sent_again(monkeypatch) -> None:
    """A store that lacked one script: the call that ran is answered, and only the one sent again
    fails with the resend (a request's end spent twice, or an admission told it failed after it
    ran, would be wrong)."""
    import redis
    from prometheus_client import CollectorRegistry

    from gateway.admission.shared import SharedLimits
    from gateway.config import LimitsStoreConfig
    from gateway.metrics import GatewayMetrics

    shared = SharedLimits(LimitsStoreConfig("redis://127.0.0.1:9/0", 200.0), GatewayMetrics(CollectorRegistry()))
    sent: list[int] = []

    async def execute(batch: list[Any]) -> list[Any]:
        sent.append(len(batch))
        if len(sent) == 1:
            return ["ran", redis.exceptions.NoScriptError("NOSCRIPT No matching script")]
        raise redis.ConnectionError("the store went away")

    async def load(script: str) -> None: ...

    monkeypatch.setattr(shared, "_execute", execute)
    monkeypatch.setattr(shared._redis, "script_load", load)
    ran = shared._pipelined(shared._finish, ["k"], ["", "", "1", ""])
    lacked = shared._pipelined(shared._visual, ["k"], ["", "", "", "1"])
    await asyncio.wait([ran, lacked])
    assert ran.result() == "ran" and isinstance(lacked.exception(), redis.ConnectionError)
    assert sent == [2, 1]  # the one that ran was not sent again
    await shared.close()


@pytest.mark.parametrize(
    ("limit", "members", "parts"),
    [(8, 1, [8]), (8, 2, [4, 4]), (8, 3, [3, 3, 2]), (2, 3, [1, 1, 1]), (5, 4, [2, 1, 1, 1])],
)
def test_a_limit_is_divided_among_the_processes_so_that_the_parts_add_up(
    limit: int, members: int, parts: list[int]
) -> None:
    from gateway.admission.shared import share

    assert [share(limit, rank, members) for rank in range(members)] == parts  # a limit below them: one each


async def test_a_models_max_concurrency_holds_across_two_gateways(
    gateway_factory, upstream: Upstream, redis_server: RedisServer
) -> None:
    """Two gateways on one store divide the model's 4 slots; one that stops leaves them all to
    the other (counted out at once)."""
    upstream.standin.hold = asyncio.Event()
    server = f"{{limits_store: {{url: '{redis_server.url}', timeout_ms: {STORE_TIMEOUT_MS}}}}}"
    model = f"  - {{name: m, upstreams: [{upstream.url}], accepts: [text], max_concurrency: 4, queue: {{size: 16}}}}"
    first, second = [await gateway_factory(routing(model, server=server)) for _ in range(2)]
    stores = [gw.app[SERVICES_KEY].shared_limits for gw in (first, second)]
    assert stores[0] is not None and stores[1] is not None
    await stores[0].heartbeat()  # it began alone; the second is counted now
    assert [(s.rank, s.members) for s in stores] in ([(0, 2), (1, 2)], [(1, 2), (0, 2)])
    async with client(first) as a, client(second) as b:
        calls = [asyncio.create_task(c.chat.completions.create(model="m", messages=ASK)) for c in (a, b) * 4]
        for gw in (first, second):  # each filled its 2 slots, and queued the rest
            gate = gw.app[SERVICES_KEY].gates("m")
            while gate.queued < 2:
                await asyncio.sleep(0.005)
            assert (gate.active, gate.limit) == (2, 2)
        assert len(upstream.received) <= 4
        upstream.standin.hold.set()
        await asyncio.gather(*calls)
    assert first.sample("gateway_model_slots", model="m") == 2
    await stores[1].close()  # as a stopping gateway does
    await stores[0].heartbeat()
    assert (stores[0].rank, stores[0].members) == (0, 1) and stores[0].slots(4) == 4
    assert first.sample("gateway_model_slots", model="m") == 4  # the gauge says so before the next request


# --- two processes: serve --workers 2 ------------------------------------------------------------


@pytest.fixture
async def workers(upstream: Upstream, redis_server: RedisServer, tmp_path: Path, monkeypatch) -> AsyncIterator[str]:
    from tests.server.test_serve import wait_healthy
    from tests.server.test_workers import each_worker, start, stop

    monkeypatch.setenv(KEY_ENV, "sk-shared")
    config = tmp_path / "routing.yaml"
    config.write_text(table(upstream, redis_server, "rate_limit: {requests_per_minute: 60, burst: 10}"))
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    served = await start(config, port, tmp_path)
    try:
        await wait_healthy(url, served.process)
        await each_worker(url)
        yield url
    finally:
        await stop(served, tmp_path)


async def test_a_burst_from_many_connections_to_two_workers_gets_one_keys_limit(
    workers: str, upstream: Upstream
) -> None:
    async def one(session: aiohttp.ClientSession) -> int:
        body = {"model": "m", "messages": ASK}
        async with session.post(f"{workers}/v1/chat/completions", json=body,
                                headers={"Authorization": "Bearer sk-shared"}) as resp:  # fmt: skip
            await resp.read()
            return resp.status

    loop = asyncio.get_running_loop()
    started = loop.time()
    connector = aiohttp.TCPConnector(force_close=True, limit=16)  # a new connection each: both workers take them
    async with aiohttp.ClientSession(connector=connector) as session:
        statuses = await asyncio.gather(*(one(session) for _ in range(40)))
    elapsed = loop.time() - started
    ok = statuses.count(200)
    assert set(statuses) <= {200, 429}
    # the key's one burst of 10 and what a request a second refilled meanwhile; per process, it would be 20
    assert 10 <= ok <= 10 + int(elapsed) + 1, (ok, elapsed)


# --- store_time: the store's time, not the loop's ----------------------------------------------


async def test_an_answer_that_came_while_the_loop_was_held_is_read_not_timed_out() -> None:
    """The answer is ready in the same turn as the deadline, which the hold made late
    (asyncio.timeout would cancel it there); and one that comes 20 ms after a 150 ms hold of
    a 50 ms timeout: the hold spent one step of it."""
    loop = asyncio.get_running_loop()
    for after in (0.0, 0.02):
        answer = loop.create_future()

        def held(answer: asyncio.Future[str] = answer, after: float = after) -> None:
            time.sleep(0.15)  # past the deadline
            loop.call_later(after, answer.set_result, "came")

        loop.call_later(0.01, held)
        async with store_time(0.05):
            assert await answer == "came"


async def test_a_store_that_does_not_answer_times_out_even_on_a_loop_held_every_turn() -> None:
    loop = asyncio.get_running_loop()
    with pytest.raises(TimeoutError):
        async with store_time(0.05):
            await loop.create_future()
    turns, holding = 0, True

    def hold() -> None:  # every turn of the loop held 30 ms: each step's timer fires late
        nonlocal turns
        turns += 1
        time.sleep(0.03)
        if holding:
            loop.call_soon(hold)

    loop.call_soon(hold)
    try:
        with pytest.raises(TimeoutError):
            async with store_time(0.02):
                await loop.create_future()
    finally:
        holding = False
    assert turns >= TICKS


async def test_a_rate_a_reload_lowered_takes_nothing_back_from_before_it(redis_server: RedisServer) -> None:
    """The store's bucket keeps the rate it fills at: a call with a lower one (the key reloaded)
    first settles it at the old rate, then fills at the new one."""
    import redis.asyncio as aioredis

    from gateway.admission import scripts

    store = aioredis.from_url(redis_server.url)
    try:
        seconds, micros = await store.time()
        now = seconds + micros / 1e6
        bucket = "test:requests"
        # empty 5 s ago, filling at one a second (60 a minute) since: 5 earned
        await store.hset(bucket, mapping={"t": "0", "u": repr(now - 5), "r": "1"})
        admit = store.register_script(scripts.ADMIT)
        keys = [bucket, "test:minute", "test:day", "test:slots"]
        refused, left, _, _ = await admit(keys=keys, args=["6.0", "10", "", "", "", "m", "60"])  # now 6 a minute
        assert refused == b"" and 3.9 <= float(left) < 4.1  # at 0.1 a second it would have been refused
        assert float(await store.hget(bucket, "r")) == 0.1  # the new rate from here on
    finally:
        await store.aclose()

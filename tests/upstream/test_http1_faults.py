"""Faults of the upstream HTTP/1.1 client found in review, each kept as a regression test: a
connection released with reading paused, a POST resent after the engine took it, a stalled small
body, heads aiohttp's server would refuse to relay, a bad model key charged to the replica, a
cancelled exchange aborting the next one, endless interim answers, timers, split
Transfer-Encoding fields."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer, make_mocked_request

from gateway.config import ModelConfig
from gateway.modalities import Modality
from gateway.upstream import http1
from gateway.upstream.dispatch import Dispatch, Timeouts
from gateway.upstream.http1 import Http1Client
from gateway.upstream.relay import Relayed, _relay_whole
from gateway.upstream.replicas import Pool, Replica
from tests.upstream.test_http1 import CHAT, connection, ok, script

pytestmark = [pytest.mark.timeout(30)]

ORIGIN = "http://127.0.0.1:9"


def exchange(conn: http1._Connection, client: Http1Client, *, head_timeout=None, read_timeout=None):
    head = client.origin(ORIGIN).request_head("/v1/chat/completions", {}, CHAT)
    return asyncio.ensure_future(conn.exchange(head, CHAT, head_timeout, read_timeout))


async def test_a_reply_that_ends_while_paused_leaves_no_paused_connection_in_the_pool() -> None:
    """The read that pushes the buffer over HIGH_WATER may also end the body: the connection goes
    back to the pool reading again, whatever the reply's consumer does next."""
    client = Http1Client()
    conn, sink = connection(client)
    waiting = exchange(conn, client, read_timeout=5.0)
    size = http1.HIGH_WATER + 1000
    conn.data_received(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % size)
    reply = await waiting
    conn.data_received(b"x" * http1.HIGH_WATER)  # the consumer is busy writing to its client
    conn.data_received(b"x" * 1000)  # the end of the body, over the high-water mark
    assert client.origin(ORIGIN).idle == [conn]  # released: the next request may take it
    reply.close()  # e.g. the client left (relay: ConnectionResetError -> upstream.close())
    assert not sink.paused, "a connection in the keep-alive pool has reading paused"


async def test_the_next_request_on_that_connection_gets_its_reply() -> None:
    """End to end on loopback: request A's large reply ends while reading is paused and A's client
    leaves; request B, on the same connection, gets its reply."""
    big = http1.HIGH_WATER + 1000

    async def large(writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % big + b"x" * http1.HIGH_WATER)
        await writer.drain()
        await asyncio.sleep(0.05)  # the last bytes come in their own read
        writer.write(b"x" * 1000)
        await writer.drain()

    client = Http1Client()
    try:
        async with script(large, ok(b"B")) as s:
            waits = http1.Waits(connect=5.0, head=None, read=30.0)  # waits no busy machine outlasts
            a = await client.post(s.url, "/v1/chat/completions", {}, CHAT, waits)
            for _ in range(3000):  # the relay is busy writing A's first chunks to a slow client
                if a._done:
                    break
                await asyncio.sleep(0.01)
            assert a._done
            a.close()  # A's client leaves
            b = await client.post(s.url, "/v1/chat/completions", {}, CHAT, waits)
            assert await b.read() == b"B"
            assert s.connections == 1
    finally:
        await client.close()


def test_on_uvloop_as_served() -> None:
    """The same on uvloop (what `modality-gateway serve` runs on), with a reply that ends paused as
    the kernel splits it."""
    uvloop = pytest.importorskip("uvloop")
    size = 778 * 1024  # a size that ends paused on uvloop in this setup

    async def scenario() -> None:
        async def large(writer: asyncio.StreamWriter) -> None:
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % size + b"x" * size)
            await writer.drain()

        client = Http1Client()
        try:
            async with script(large, ok(b"B")) as s:
                waits = http1.Waits(connect=5.0, head=30.0, read=30.0)  # no busy machine outlasts them
                a = await client.post(s.url, "/v1/chat/completions", {}, CHAT, waits)
                async for _ in a:  # the relay writing to a client
                    await asyncio.sleep(0.005)
                    if a._done:
                        break  # A's client leaves during the last write
                a.close()
                b = await client.post(s.url, "/v1/chat/completions", {}, CHAT, waits)
                assert await b.read() == b"B"
        finally:
            await client.close()

    uvloop.run(scenario())


async def test_a_reused_connection_that_dies_mid_generation_is_not_resent() -> None:
    """A reused connection that ends long after the request went (an engine that read it, worked,
    and died) is a reset for gateway.upstream.client's retry policy and budget, not sent again here."""

    async def works_then_dies(writer: asyncio.StreamWriter) -> None:
        await asyncio.sleep(0.3)  # prefill, decode... then the process is killed
        writer.close()

    client = Http1Client()
    try:
        async with script(ok(b"first"), works_then_dies, ok(b"again")) as s:
            waits = http1.Waits(connect=5.0, head=None, read=5.0)
            async with await client.post(s.url, "/v1/chat/completions", {}, CHAT, waits) as reply:
                await reply.read()
            with pytest.raises(http1.Disconnected):  # the gateway's policy (retries.*) decides
                await client.post(s.url, "/v1/chat/completions", {}, CHAT, waits)
            assert len(s.requests) == 2, "the engine was sent the same request twice"
    finally:
        await client.close()


async def test_a_silence_in_a_small_body_is_a_timeout_for_the_relay() -> None:
    """A small reply whose body stalls is a 504 timeout (http1.ReadTimeout is a TimeoutError, as
    aiohttp's), not a 502 "broke off"."""
    client = Http1Client()
    conn, _ = connection(client)
    waiting = exchange(conn, client, read_timeout=0.05)
    conn.data_received(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n" + b'{"id": "x"')  # then nothing
    reply = await waiting
    timeouts = Timeouts(connect=1.0, read=0.05, client_write=1.0)
    model = ModelConfig("m", ("http://127.0.0.1:9",), (Modality.TEXT,))
    dispatch = Dispatch(model, Pool("m", [Replica("http://127.0.0.1:9")]), b"", timeouts, {})
    relayed = await _relay_whole(reply, dispatch, None, "ok", make_mocked_request("POST", "/v1/chat/completions"))
    assert relayed.error is not None
    assert (relayed.error.status, relayed.outcome) == (504, "timeout")


@contextlib.asynccontextmanager
async def gateway(
    upstream_url: str, upstream_client: str, server: str = ""
) -> AsyncIterator[TestClient[web.Request, web.Application]]:
    from prometheus_client import CollectorRegistry

    from gateway.config import parse_config
    from gateway.server.app import SERVER_OPTIONS, create_app

    server_line = f"server: {{upstream_client: {upstream_client}{', ' + server if server else ''}}}\n"
    yaml_text = f"version: 1\n{server_line}models:\n  - {{name: m, upstreams: [{upstream_url}], accepts: [text]}}\n"
    app = create_app(parse_config(yaml_text, filename="routing.yaml"), registry=CollectorRegistry())
    test_server = TestServer(app, host="127.0.0.1", port=0)
    await test_server.start_server(**{k: v for k, v in SERVER_OPTIONS.items() if k != "handler_cancellation"})
    test_client = TestClient(test_server)
    await test_client.start_server()
    try:
        yield test_client
    finally:
        await test_client.close()


@contextlib.asynccontextmanager
async def raw_upstream(answer: Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]):
    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await answer(reader, writer)
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    try:
        yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    finally:
        server.close()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(1):
                await server.wait_closed()


async def _read_request(reader: asyncio.StreamReader) -> None:
    head = await reader.readuntil(b"\r\n\r\n")
    length = next(
        int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")
    )
    await reader.readexactly(length)


async def test_end_to_end_a_stalled_body_is_a_504() -> None:
    async def stalls(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(Exception):
            await _read_request(reader)
            writer.write(b'HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{"id"')
            await writer.drain()
            await reader.read()  # until the gateway lets go

    statuses = {}
    async with raw_upstream(stalls) as url:
        for kind in ("http1",):
            async with gateway(url, kind, "upstream_read_timeout_s: 0.2") as gw:
                resp = await gw.post(
                    "/v1/chat/completions", json={"model": "m", "messages": [{"role": "user", "content": "hi"}]}
                )
                statuses[kind] = resp.status
    assert statuses == {"http1": 504}


SPLIT_HEAD = (
    b"HTTP/1.1 200 OK\r\nX-A: a\rb\r\nX-B: c\nd\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}"
)


async def test_a_bare_cr_and_a_bare_lf_in_one_head_are_refused() -> None:
    client = Http1Client()
    conn, _ = connection(client)
    waiting = exchange(conn, client)
    conn.data_received(SPLIT_HEAD)
    with pytest.raises(http1.ProtocolError):
        reply = await waiting
        pytest.fail(f"accepted: {dict(reply.headers)!r}")


BAD_HEADS = {
    "bare-cr-and-bare-lf": SPLIT_HEAD,
    "nul-in-a-value": b"HTTP/1.1 200 OK\r\nX-A: a\x00b\r\nContent-Length: 2\r\n\r\n{}",
    "ctl-in-a-name": b"HTTP/1.1 200 OK\r\nX\x01A: b\r\nContent-Length: 2\r\n\r\n{}",
    "non-token-name": b"HTTP/1.1 200 OK\r\nX(A): b\r\nContent-Length: 2\r\n\r\n{}",
    # aiohttp's client lets these through; its server would not write them
    "soh-in-a-value": b"HTTP/1.1 200 OK\r\nX-A: a\x01b\r\nContent-Length: 2\r\n\r\n{}",
    "del-in-a-value": b"HTTP/1.1 200 OK\r\nX-A: a\x7fb\r\nContent-Length: 2\r\n\r\n{}",
    "ctl-in-the-reason": b"HTTP/1.1 200 O\x02K\r\nContent-Length: 2\r\n\r\n{}",
}


@pytest.mark.parametrize("head", list(BAD_HEADS))
async def test_end_to_end_such_a_head_is_a_502_not_a_dropped_connection(head: str) -> None:
    """Heads aiohttp's server would refuse to relay (control characters, non-token names) are a
    clean 502, never a dropped client connection."""

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(Exception):
            await _read_request(reader)
            writer.write(BAD_HEADS[head])
            await writer.drain()
            await reader.read()

    statuses: dict[str, int | str] = {}
    logging.getLogger("aiohttp.server").disabled = True
    try:
        async with raw_upstream(answer) as url:
            for kind in ("http1",):
                async with gateway(url, kind) as gw:
                    try:
                        resp = await gw.post(
                            "/v1/chat/completions", json={"model": "m", "messages": [{"role": "user", "content": "hi"}]}
                        )
                        statuses[kind] = resp.status
                    except aiohttp.ClientError as exc:  # no response at all
                        statuses[kind] = type(exc).__name__
    finally:
        logging.getLogger("aiohttp.server").disabled = False
    assert statuses == {"http1": 502}, statuses


async def test_a_bad_model_key_does_not_eject_a_replica_other_models_share(monkeypatch) -> None:
    """A model key read from a secret file ends with a newline: it is stripped, and nothing of the
    gateway's own config is ever charged to a replica that other models share."""
    from prometheus_client import CollectorRegistry

    from gateway.config import parse_config
    from gateway.server.app import create_app
    from tools.standin import StandIn

    monkeypatch.setenv("REVIEW_UP_KEY", "sk-secret\n")
    standin = StandIn("s")
    engine = TestServer(standin.app(), host="127.0.0.1", port=0)
    await engine.start_server()
    url = str(engine.make_url("")).rstrip("/")
    yaml_text = (
        "version: 1\nserver: {upstream_client: http1}\nmodels:\n"
        f"  - {{name: a, upstreams: [{url}], accepts: [text], api_key_env: REVIEW_UP_KEY}}\n"
        f"  - {{name: b, upstreams: [{url}], accepts: [text]}}\n"
    )
    app = create_app(parse_config(yaml_text, filename="routing.yaml"), registry=CollectorRegistry())
    gw = TestClient(TestServer(app, host="127.0.0.1", port=0))
    await gw.start_server()
    try:
        for _ in range(6):
            await gw.post("/v1/chat/completions", json={"model": "a", "messages": [{"role": "user", "content": "hi"}]})
        resp = await gw.post(
            "/v1/chat/completions", json={"model": "b", "messages": [{"role": "user", "content": "hi"}]}
        )
        assert resp.status == 200, await resp.text()
    finally:
        await gw.close()
        await engine.close()


async def test_a_cancelled_exchange_does_not_abort_the_next_request_on_its_connection() -> None:
    """A reply that lands as its request is cancelled (before the task steps, as on uvloop) does
    not release the connection and then abort it under the next request. Driven by hand."""
    client = Http1Client()
    conn, sink = connection(client)
    origin = client.origin(ORIGIN)
    a = exchange(conn, client)
    await asyncio.sleep(0)  # A awaits its head
    a.cancel()  # the client of A left (handler cancellation)
    conn.data_received(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")  # same loop turn
    b_conn = origin.idle_connection()  # request B, whose task ran before A's
    if b_conn is conn:
        b = exchange(conn, client, head_timeout=1.0)
    with contextlib.suppress(asyncio.CancelledError):
        await a
    assert b_conn is not conn or not sink.closed, "A's cancellation aborted the connection B's request went on"
    if b_conn is conn:
        b.cancel()


async def test_many_interim_answers_in_one_packet_do_not_raise_in_data_received() -> None:
    """Interim (1xx) answers are read in a loop, at most MAX_INTERIM of them, and never extend the
    head's deadline."""
    client = Http1Client()
    conn, _ = connection(client)
    waiting = exchange(conn, client)
    data = b"HTTP/1.1 102 Processing\r\n\r\n" * 2000 + b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"
    conn.data_received(data)
    with pytest.raises(http1.ProtocolError):  # over MAX_INTERIM: refused, in the exchange
        await waiting


async def test_read_timeout_applies_from_the_head_even_when_head_timeout_is_longer() -> None:
    """A read_timeout shorter than the head_timeout applies from the head on."""

    async def stalls(writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nhalf")
        await writer.drain()

    client = Http1Client()
    try:
        async with script(stalls) as s:
            reply = await client.post(s.url, "/", {}, CHAT, http1.Waits(connect=5.0, head=10.0, read=0.1))
            with pytest.raises(http1.ReadTimeout):
                async with asyncio.timeout(30.0):  # read_timeout is 0.1 s: a guard, not a bet
                    await reply.read()
    finally:
        await client.close()


async def test_transfer_codings_in_two_fields_are_read_as_one_list() -> None:
    """``Transfer-Encoding: chunked`` then ``Transfer-Encoding: gzip`` is the list "chunked, gzip"
    (RFC 9110 5.3): a coding the client does not read, refused rather than relayed as a body it is
    not; the connection is not reused."""
    client = Http1Client()
    conn, sink = connection(client)
    waiting = exchange(conn, client)
    conn.data_received(
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nTransfer-Encoding: gzip\r\n\r\n2\r\nok\r\n0\r\n\r\n"
    )
    with pytest.raises(http1.ProtocolError, match="only chunked is read"):
        await waiting
    assert sink.closed and client.origin(ORIGIN).idle == []


def held_until(release: asyncio.Event, body: bytes) -> Callable[[asyncio.StreamWriter], Awaitable[None]]:
    """An answer written once ``release`` is set."""

    async def held(writer: asyncio.StreamWriter) -> None:
        await release.wait()
        await ok(body)(writer)

    return held


# --- found reading the hand parser (issue 21): what llhttp and the pool now hold -----------------


async def test_bytes_that_came_before_a_request_never_answer_it() -> None:
    """A reply's end, then bytes the engine sent after it, still in the kernel when the next request
    went out on that connection: they answered it (``200 b'forged'``, 5 of 300 trials with 0.2 to
    1 ms between them). A connection with unread bytes is not reused."""
    from tests.upstream.test_http1 import post, script

    writers: list[asyncio.StreamWriter] = []

    def remember(body: bytes) -> Callable[[asyncio.StreamWriter], Awaitable[None]]:
        async def write(writer: asyncio.StreamWriter) -> None:
            writers.append(writer)
            await ok(body)(writer)

        return write

    client = Http1Client()
    try:
        async with script(remember(b"first"), remember(b"real")) as s:
            async with await post(client, s.url) as reply:
                assert await reply.read() == b"first"
            # the engine writes more, and the next request goes before the loop reads it
            writers[0].write(b"HTTP/1.1 200 OK\r\nContent-Length: 6\r\n\r\nforged")
            async with await post(client, s.url) as reply:
                assert await reply.read() == b"real"
            assert s.connections == 2
    finally:
        await client.close()


async def test_a_replica_gets_max_connections_at_most_and_the_next_request_waits_for_one() -> None:
    from tests.upstream.test_http1 import post, script

    release = asyncio.Event()
    held = held_until(release, b"held")

    client = Http1Client(max_connections=2)
    try:
        async with script(held, held, ok(b"third")) as s:
            first = asyncio.ensure_future(post(client, s.url))
            second = asyncio.ensure_future(post(client, s.url))
            while len(s.requests) < 2:
                await asyncio.sleep(0.01)  # bounded by the test's timeout
            third = asyncio.ensure_future(post(client, s.url))
            with pytest.raises(http1.ConnectTimeout, match=r"2 connections .* open and busy"):
                await post(client, s.url, connect=0.05)  # none frees in time: nothing sent
            release.set()
            for waiting in (first, second):
                async with await waiting as reply:
                    assert await reply.read() == b"held"
            async with await third as reply:  # on a connection given back
                assert await reply.read() == b"third"
            assert s.connections == 2 and len(s.requests) == 3
    finally:
        await client.close()


@pytest.mark.parametrize("over", [False, True], ids=["at the bound", "over it"])
async def test_a_head_a_byte_a_read_is_read_or_refused_at_its_bound(over: bool) -> None:
    """The hand parser scanned the head from its start at every read (a 64 KiB head a byte at a
    time held the loop 1.5 s: python -m bench.http1_head), and its bound held only when the end of
    the head came in another read. llhttp goes on where it stopped; the bound holds either way."""
    client = Http1Client()
    conn, sink = connection(client)
    waiting = exchange(conn, client)
    size = http1.MAX_HEAD_BYTES - 100 + (200 if over else 0)
    head = b"HTTP/1.1 200 OK\r\nX-Big: " + b"a" * size + b"\r\nContent-Length: 2\r\n\r\nok"
    for i in range(len(head)):
        conn.data_received(head[i : i + 1])
        if sink.closed:
            break
    if over:
        with pytest.raises(http1.ProtocolError, match="reply head over"):
            await waiting
    else:
        reply = await waiting
        assert await reply.read() == b"ok"


# --- found in review of the llhttp client ---------------------------------------------------------


async def test_keep_alive_holds_past_descriptor_1023() -> None:
    """select() refuses descriptors past 1023: every idle connection looked unsafe and was closed,
    so a busy gateway opened a connection a request."""
    import os
    import resource

    from tests.upstream.test_http1 import post, script

    if resource.getrlimit(resource.RLIMIT_NOFILE)[0] < 1200:
        pytest.skip("needs room for 1,200 open files")
    pipes: list[tuple[int, int]] = []
    try:
        while not pipes or pipes[-1][1] < 1100:
            pipes.append(os.pipe())
        client = Http1Client()
        try:
            async with script(ok(), ok(), ok()) as s:
                for _ in range(3):
                    async with await post(client, s.url) as reply:
                        assert await reply.read() == b'{"ok": true}'
                assert s.connections == 1
        finally:
            await client.close()
    finally:
        for r, w in pipes:
            os.close(r)
            os.close(w)


async def test_concurrent_requests_open_max_connections_at_most() -> None:
    """The bound counted open connections only: requests that found none idle all connected at once."""
    from tests.upstream.test_http1 import post, script

    release = asyncio.Event()
    held = held_until(release, b"held")

    client = Http1Client(max_connections=2)
    try:
        async with script(*[held] * 6) as s:
            posts = [asyncio.ensure_future(post(client, s.url)) for _ in range(6)]
            while len(s.requests) < 2:
                await asyncio.sleep(0.01)  # bounded by the test's timeout
            release.set()
            for waiting in posts:
                async with await waiting as reply:
                    assert await reply.read() == b"held"
            assert s.connections == 2
    finally:
        await client.close()


async def test_a_waiter_that_leaves_passes_its_turn_on() -> None:
    from tests.upstream.test_http1 import post, script

    release = asyncio.Event()
    held = held_until(release, b"first")

    client = Http1Client(max_connections=1)
    try:
        async with script(held, ok(b"third")) as s:
            first = asyncio.ensure_future(post(client, s.url))
            while not s.requests:
                await asyncio.sleep(0.01)
            leaving = asyncio.ensure_future(post(client, s.url))
            staying = asyncio.ensure_future(post(client, s.url))
            await asyncio.sleep(0)
            leaving.cancel()
            release.set()
            async with await first as reply:
                assert await reply.read() == b"first"
            async with await staying as reply:  # the connection went on to it
                assert await reply.read() == b"third"
            assert s.connections == 1 and client.origin(s.url).waiting == type(client.origin(s.url).waiting)()
    finally:
        await client.close()


async def test_trailers_that_never_end_are_refused_before_they_are_held() -> None:
    client = Http1Client()
    conn, sink = connection(client)
    waiting = exchange(conn, client)
    conn.data_received(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nok\r\n0\r\nX-Trailer: ")
    reply = await waiting
    piece = b"a" * 4096
    for _ in range((http1.MAX_TRAILERS + 8 * 1024) // len(piece) + 2):
        conn.data_received(piece)
        if sink.closed:
            break
    assert sink.closed
    with pytest.raises(http1.ProtocolError, match="too long"):
        await reply.read()


@pytest.mark.parametrize(
    "data",
    [
        b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\nX-Big: "
        + b"a" * (70 * 1024)
        + b"\r\nContent-Length: 0\r\n\r\n",
        b"HTTP/2.0 200 OK\r\nContent-Length: 0\r\n\r\n",
    ],
    ids=["a big head after an interim answer, in one read", "HTTP/2.0"],
)
async def test_what_llhttp_let_through_is_refused(data: bytes) -> None:
    client = Http1Client()
    conn, sink = connection(client)
    waiting = exchange(conn, client)
    conn.data_received(data)
    with pytest.raises(http1.ProtocolError):
        await waiting
    assert sink.closed


async def test_a_small_reply_is_sent_at_once_only_to_a_client_with_nothing_left_to_write() -> None:
    """A whole reply under SENT_AT_ONCE_BYTES (its head and body) is written by the relay itself
    (before the request's bookkeeping) only where the client's connection has nothing buffered: its
    write then never waits on a client that does not read. A client that left as it was written is told as
    gone (the reply was whole: its usage is still read, and spent)."""
    from unittest import mock

    from gateway.upstream.relay import SentResponse

    async def relayed(buffered: int, writer: mock.Mock | None = None, head: bytes = b"") -> Relayed:
        client = Http1Client()
        conn, _ = connection(client)
        waiting = exchange(conn, client, read_timeout=5.0)
        body = b'{"id": "x", "usage": {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}}'
        conn.data_received(b"HTTP/1.1 200 OK\r\n%sContent-Length: %d\r\n\r\n" % (head, len(body)) + body)
        reply = await waiting
        transport = mock.Mock()
        transport.get_write_buffer_size.return_value = buffered
        more = {} if writer is None else {"writer": writer}
        request = make_mocked_request("POST", "/v1/chat/completions", transport=transport, **more)
        model = ModelConfig("m", ("http://127.0.0.1:9",), (Modality.TEXT,))
        timeouts = Timeouts(connect=1.0, read=5.0, client_write=1.0)
        dispatch = Dispatch(model, Pool("m", [Replica("http://127.0.0.1:9")]), b"", timeouts, {"X-Request-Id": "r"})
        try:
            return await _relay_whole(reply, dispatch, None, "ok", request)
        finally:
            await client.close()  # (no keep-alive timer of it left behind)

    sent = await relayed(0)
    assert isinstance(sent.response, SentResponse) and sent.response.prepared and sent.outcome == "ok"
    waiting = await relayed(1)  # bytes of an earlier answer still buffered: aiohttp sends it, later
    assert waiting.response is not None and not isinstance(waiting.response, SentResponse)
    assert not waiting.response.prepared
    assert waiting.usage is not None and waiting.usage.total == 7
    broken = mock.Mock()
    broken.write_headers = mock.AsyncMock()
    broken.write_eof = mock.AsyncMock(side_effect=ConnectionError("Connection lost"))
    broken.write = broken.drain = mock.AsyncMock()
    large = await relayed(0, head=b"X-Engine-Note: " + b"n" * 40_000 + b"\r\n")  # a head of 40 KB: later too
    assert large.response is not None and not isinstance(large.response, SentResponse)
    gone = await relayed(0, broken)
    assert isinstance(gone.response, SentResponse) and gone.response.client_gone and gone.outcome == "aborted"
    assert gone.usage is not None and gone.usage.total == 7

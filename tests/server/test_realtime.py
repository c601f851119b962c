"""gateway.server.realtime: a realtime session (``GET /v1/realtime``, vLLM's WebSocket protocol)
through the gateway, the openai SDK's realtime client as the client and the stand-in speaking
vLLM's protocol as the engine: transcribed end to end; every refusal an HTTP answer before the
upgrade; an event the table refuses answered with an error event, the session kept; an engine
lost, an idle session and a stopping gateway each closing the session with its reason."""

from __future__ import annotations

import asyncio
import base64
import json
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.conftest import Gateway, Upstream, routing

SECOND = b"\x01\x00" * 16_000  # a second of PCM16 at 16 kHz, mono
TENTH = SECOND[: len(SECOND) // 10]
UPGRADE = {
    "Connection": "Upgrade",
    "Upgrade": "websocket",
    "Sec-WebSocket-Version": "13",
    "Sec-WebSocket-Key": base64.b64encode(b"0123456789abcdef").decode(),
}


def table(upstream: str, realtime: str = "") -> str:
    return routing(
        f"  - {{name: asr, upstream_model: voxtral-rt, upstreams: [{upstream}], accepts: [text, audio],"
        f" apis: [transcriptions, realtime]{realtime}}}",
        f"  - {{name: chatty, upstreams: [{upstream}], accepts: [text, audio]}}",
        f"  - {{name: texty, upstreams: [{upstream}], accepts: [text]}}",
    )


def append(audio: bytes) -> dict[str, Any]:
    return {"type": "input_audio_buffer.append", "audio": base64.b64encode(audio).decode()}


async def events_until(connection: Any, kind: str) -> list[dict[str, Any]]:
    """The engine's events through the gateway, up to the first of ``kind``."""
    seen: list[dict[str, Any]] = []
    while not seen or seen[-1]["type"] != kind:
        seen.append(json.loads(await connection.recv_bytes()))
    return seen


async def test_a_session_is_transcribed_end_to_end_with_the_openai_sdk(gateway_factory, upstream: Upstream) -> None:
    gw: Gateway = await gateway_factory(table(upstream.url))
    async with gw.client().realtime.connect(model="asr") as connection:
        (created,) = await events_until(connection, "session.created")
        await connection.send({"type": "session.update", "model": "asr"})
        await connection.send({"type": "input_audio_buffer.commit"})
        for _ in range(5):
            await connection.send(append(TENTH))
        await connection.send({"type": "input_audio_buffer.commit", "final": True})
        said = await events_until(connection, "transcription.done")
    assert created["id"].startswith("sess-")
    assert [e["delta"] for e in said if e["type"] == "transcription.delta"] == ["w1", " w2", " w3", " w4", " w5"]
    assert said[-1]["text"] == "w1 w2 w3 w4 w5" and said[-1]["usage"]["completion_tokens"] == 5
    sent = [json.loads(r.body) for r in upstream.received if r.method == "WS"]
    assert sent[0] == {"type": "session.update", "model": "voxtral-rt"}  # renamed for its upstream
    assert [e["type"] for e in sent[1:]] == ["input_audio_buffer.commit", *["input_audio_buffer.append"] * 5,
                                             "input_audio_buffer.commit"]  # fmt: skip
    await _closed(gw, "asr", "client")
    assert gw.sample("gateway_audio_seconds_total", model="asr", api="realtime") == pytest.approx(0.5)
    assert gw.sample("gateway_realtime_events_total", model="asr", source="client") == 8
    assert gw.sample("gateway_realtime_events_total", model="asr", source="engine") == 7
    assert gw.sample("gateway_realtime_sessions_open", model="asr") == 0
    assert gw.sample("gateway_requests_total", model="asr", code="101", api="realtime", key="-") == 1
    assert gw.sample("gateway_tokens_total", model="asr", key="-", kind="completion") == 5


async def _closed(gw: Gateway, model: str, reason: str) -> None:
    """The session's end counted: the gateway's side may close a moment after the client's, so
    its end is waited for (the hub says when no session is open)."""
    from gateway.server.state import SERVICES_KEY

    await asyncio.wait_for(gw.app[SERVICES_KEY].realtime.idle(), 30)
    said = {
        r: gw.sample("gateway_realtime_sessions_total", model=model, reason=r)
        for r in ("client", "engine", "engine_lost", "idle", "too_long", "draining", "error")
    }
    assert said[reason] == 1, said


async def _closing(gw: Gateway, *events: dict[str, Any], then: Any = None) -> tuple[int, str]:
    """A session opened, ``events`` sent (and ``then`` called), until the gateway closes it: the
    close frame's code and reason (the engine's events before it read and let go)."""
    async with aiohttp.ClientSession() as session, session.ws_connect(f"{gw.url}/v1/realtime?model=asr") as ws:
        await ws.receive_str()  # session.created
        for event in events:
            await ws.send_json(event)
        if then is not None:
            then()
        while (message := await ws.receive()).type is aiohttp.WSMsgType.TEXT:
            pass
    assert message.type is aiohttp.WSMsgType.CLOSE, message
    return message.data, message.extra or ""


async def _get(url: str, headers: dict[str, str] | None = None) -> tuple[int, dict[str, Any]]:
    async with aiohttp.ClientSession() as session, session.get(url, headers={**UPGRADE, **(headers or {})}) as resp:
        return resp.status, await resp.json()


async def test_every_refusal_is_an_http_answer_before_the_upgrade(
    gateway_factory, upstream: Upstream, unused_tcp_port: int
) -> None:
    """The key, the model, its APIs and modalities, the upgrade itself and a replica to take it:
    each refused with its status and OpenAI's error body, the engine never asked."""
    keys = (
        "auth:\n  keys:\n"
        "    - {name: ops, key_sha256: " + __import__("hashlib").sha256(b"sk-ops").hexdigest() + ",\n"
        "       rate_limit: {requests_per_minute: 60, burst: 4}}\n"
    )
    gone = f"http://127.0.0.1:{unused_tcp_port}"
    text = (
        table(upstream.url) + f"\n  - {{name: lost, upstreams: [{gone}], accepts: [text, audio], apis: [realtime]}}\n"
    )
    gw: Gateway = await gateway_factory(text.replace("models:\n", keys + "models:\n"))
    ok = {"Authorization": "Bearer sk-ops"}
    said = [
        await _get(f"{gw.url}/v1/realtime?model=asr"),  # no key
        await _get(f"{gw.url}/v1/realtime", ok),  # no model
        await _get(f"{gw.url}/v1/realtime?model=nope", ok),
        await _get(f"{gw.url}/v1/realtime?model=chatty", ok),  # not served on realtime
        await _get(f"{gw.url}/v1/realtime?model=lost", ok),  # no replica takes it
        await _get(f"{gw.url}/v1/realtime?model=asr", ok),  # the key's rate: its burst of 4 spent
    ]
    async with aiohttp.ClientSession() as session, session.get(f"{gw.url}/v1/realtime?model=asr") as plain:
        said.append((plain.status, await plain.json()))  # (no key: 401 before it is seen not to upgrade)
    assert [(status, body["error"]["code"]) for status, body in said] == [
        (401, "invalid_api_key"),
        (400, "invalid_request"),
        (404, "model_not_found"),
        (400, "unsupported_api"),
        (502, "upstream_unreachable"),
        (429, "rate_limit_exceeded"),
        (401, "invalid_api_key"),
    ]
    assert said[1][1]["error"]["message"].startswith("A realtime session names its model in the URL")
    assert upstream.standin.sessions == 0


async def test_a_plain_get_is_told_it_is_a_websocket(gateway_factory, upstream: Upstream) -> None:
    gw: Gateway = await gateway_factory(table(upstream.url))
    async with aiohttp.ClientSession() as session, session.get(f"{gw.url}/v1/realtime?model=asr") as plain:
        assert plain.status == 400
        assert (await plain.json())["error"]["message"].startswith("A realtime session is a WebSocket")
    assert upstream.standin.sessions == 0


async def test_events_the_table_refuses_are_error_events_and_the_session_goes_on(
    gateway_factory, upstream: Upstream
) -> None:
    """A session.update to another model or for an output the model does not make, an append
    over realtime.max_append_bytes, audio faster than audio_speed allows, a binary frame: each an
    error event naming its field, not passed on; the session transcribes on."""
    bounds = ", realtime: {max_append_bytes: 6400, audio_burst_s: 0.5, audio_speed: 0.001}"
    gw: Gateway = await gateway_factory(table(upstream.url, bounds))
    refused = []
    async with aiohttp.ClientSession() as session, session.ws_connect(f"{gw.url}/v1/realtime?model=asr") as ws:
        assert json.loads(await ws.receive_str())["type"] == "session.created"
        for event in (
            {"type": "session.update", "model": "chatty"},
            {"type": "session.update", "session": {"type": "realtime", "output_modalities": ["text", "audio"]}},
            append(SECOND[:6402]),  # over 6400 bytes
        ):
            await ws.send_json(event)
            refused.append(json.loads(await ws.receive_str()))
        await ws.send_bytes(b"\x00")
        refused.append(json.loads(await ws.receive_str()))
        await ws.send_json({"type": "session.update", "model": "asr"})
        await ws.send_json({"type": "input_audio_buffer.commit"})
        for _ in range(5):  # half a second: the burst
            await ws.send_json(append(TENTH))
            assert json.loads(await ws.receive_str())["type"] == "transcription.delta"
        await ws.send_json(append(TENTH))  # past it, at a thousandth of a second a second
        refused.append(json.loads(await ws.receive_str()))
        await ws.send_json({"type": "input_audio_buffer.commit", "final": True})
        done = json.loads(await ws.receive_str())
    assert [(e["type"], e["code"], e["param"]) for e in refused] == [
        ("error", "model_not_allowed", "model"),
        ("error", "unsupported_output_modality", "session.output_modalities[1]"),
        ("error", "audio_too_large", "audio"),
        ("error", "invalid_event", ""),
        ("error", "audio_too_fast", "audio"),
    ]
    assert refused[0]["error"].startswith("This session is for model 'asr': 'model' cannot switch it to 'chatty'")
    assert done["type"] == "transcription.done" and done["text"] == "w1 w2 w3 w4 w5"
    sent = [json.loads(r.body)["type"] for r in upstream.received if r.method == "WS"]
    assert sent == ["session.update", "input_audio_buffer.commit", *["input_audio_buffer.append"] * 5,
                    "input_audio_buffer.commit"]  # fmt: skip
    for reason, n in (("model", 1), ("output", 1), ("too_large", 1), ("invalid", 1), ("too_fast", 1)):
        assert gw.sample("gateway_realtime_events_refused_total", model="asr", reason=reason) == n


async def test_an_engine_lost_mid_session_closes_the_client_with_a_reason(gateway_factory, upstream: Upstream) -> None:
    gw: Gateway = await gateway_factory(table(upstream.url))
    upstream.standin.realtime_break_after = 2  # its third event: the replica's connection cut
    events = ({"type": "session.update", "model": "asr"}, {"type": "input_audio_buffer.commit"}, append(TENTH))
    assert await _closing(gw, *events) == (1011, "the engine's connection was lost")
    await _closed(gw, "asr", "engine_lost")


async def test_an_idle_session_is_closed_with_its_reason(gateway_factory, upstream: Upstream) -> None:
    gw: Gateway = await gateway_factory(table(upstream.url, ", realtime: {idle_s: 0.2}"))
    assert await _closing(gw) == (1000, "idle for 0.2s (realtime.idle_s)")  # nothing either way: the bound fires
    await _closed(gw, "asr", "idle")


async def test_a_stopping_gateway_closes_its_sessions_saying_so(gateway_factory, upstream: Upstream) -> None:
    from gateway.server.state import SERVICES_KEY

    gw: Gateway = await gateway_factory(table(upstream.url))
    stop = gw.app[SERVICES_KEY].realtime.stop_all  # what the drain does once drain_timeout_s is up
    assert await _closing(gw, then=stop) == (1001, "the gateway is shutting down")
    await _closed(gw, "asr", "draining")


def test_check_wants_audio_of_a_realtime_model_and_reads_its_bounds() -> None:
    from gateway.config import parse_config
    from gateway.errors import ConfigError

    with pytest.raises(ConfigError) as refused:
        parse_config(
            "version: 1\nmodels:\n  - {name: t, upstreams: ['http://h:1'], accepts: [text], apis: [realtime],\n"
            "     realtime: {idle_s: 0, max_append_bytes: 1, nope: 1}}\n",
            filename="r.yaml",
        )
    said = str(refused.value)
    assert "models[0].apis: the realtime API takes audio: the model must accept it (accepts:)" in said
    assert "models[0].realtime.idle_s: must be greater than 0, not 0" in said
    assert "models[0].realtime.max_append_bytes: must be" in said
    assert "models[0].realtime.nope: unknown key 'nope'" in said


async def test_sigterm_lets_a_session_run_through_the_drain_then_closes_it_saying_why(
    upstream: Upstream, tmp_path: Path
) -> None:
    """`serve` as a process: a session open at SIGTERM goes on through the drain (events still
    relayed after the signal and after the listener closed), and gets a close with its reason
    when drain_timeout_s is up; a request in flight longer than that is cut then too (its
    drain_timeout_s was the same window), and the process exits."""
    import signal

    from tests.conftest import free_port
    from tests.server.test_serve import finish, start, wait_healthy

    config = tmp_path / "routing.yaml"
    config.write_text(
        routing(
            f"  - {{name: asr, upstreams: [{upstream.url}], accepts: [text, audio], apis: [realtime]}}",
            f"  - {{name: chat, upstreams: [{upstream.url}], accepts: [text]}}",
            server="{reload_interval_s: 0, drain_grace_s: 0, drain_timeout_s: 2, access_log: false}",
        )
    )
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    process = await start(config, port)
    try:
        await wait_healthy(url, process)

        async def slow() -> int:  # a request that outlasts the drain
            body = {"model": "chat", "messages": [{"role": "user", "content": "hi"}]}
            async with (
                aiohttp.ClientSession() as held,
                held.post(f"{url}/v1/chat/completions", json=body, headers={"X-Standin-Delay-Ms": "60000"}) as resp,
            ):
                return resp.status

        long = asyncio.create_task(slow())
        async with aiohttp.ClientSession() as session, session.ws_connect(f"{url}/v1/realtime?model=asr") as ws:
            await ws.receive_str()
            while not any(r.path.startswith("/v1/chat") for r in upstream.received):
                await asyncio.sleep(0.01)  # (the request reached the engine: it is in flight)
            process.send_signal(signal.SIGTERM)
            await ws.send_json({"type": "session.update", "model": "asr"})
            await ws.send_json({"type": "input_audio_buffer.commit"})
            await ws.send_json(append(TENTH))
            relayed = json.loads(await ws.receive_str())  # after the signal: the session goes on
            closing = await ws.receive()  # then, drain_timeout_s on, its close
        assert relayed["type"] == "transcription.delta"
        assert (closing.type, closing.data, closing.extra) == (
            aiohttp.WSMsgType.CLOSE,
            1001,
            "the gateway is shutting down",
        )
        assert await asyncio.wait_for(process.wait(), timeout=15) == 0
        with pytest.raises(aiohttp.ClientError):  # cut with the drain, not answered 60 s on
            await long
    finally:
        output = await finish(process)
    assert "1 realtime sessions open: they have 2s to end" in output and "stopped" in output


async def test_a_replica_that_refuses_the_session_is_passed_over_for_the_next(
    gateway_factory, upstream: Upstream, unused_tcp_port: int
) -> None:
    """The engine's WebSocket is opened through the attempt loop: a replica that cannot be
    reached counts against its breaker, and the session goes to the next one."""
    gone = f"http://127.0.0.1:{unused_tcp_port}"
    text = routing(
        f"  - {{name: asr, upstreams: [{gone}, {upstream.url}], balance: round_robin, accepts: [text, audio],"
        " apis: [realtime]}"
    )
    gw: Gateway = await gateway_factory(text)
    for _ in range(2):  # whichever the round robin tries first, the session opens on the live one
        async with aiohttp.ClientSession() as session, session.ws_connect(f"{gw.url}/v1/realtime?model=asr") as ws:
            assert json.loads(await ws.receive_str())["type"] == "session.created"
    assert upstream.standin.sessions == 2
    assert gw.sample("gateway_upstream_requests_total", model="asr", upstream=gone, outcome="connect_error") >= 1


async def test_a_session_longer_than_its_bound_is_closed_saying_so(gateway_factory, upstream: Upstream) -> None:
    gw: Gateway = await gateway_factory(table(upstream.url, ", realtime: {max_session_s: 0.3}"))
    busy = {"type": "session.update", "model": "asr"}  # not idle: only long
    assert await _closing(gw, busy) == (1008, "the session is over 0.3s long (realtime.max_session_s)")
    await _closed(gw, "asr", "too_long")


async def test_a_client_that_stops_reading_holds_the_engine_not_the_gateways_memory(
    gateway_factory, upstream: Upstream
) -> None:
    """Backpressure: an engine sending 64 MiB of events to a client that reads none is held at
    its own send once the buffers between (the kernel's sockets, the gateway's reader and writer) are full:
    the gateway reads the next frame of one side only once the last is written to the other."""
    gw: Gateway = await gateway_factory(table(upstream.url))
    count, size = 1024, 64 * 1024
    async with aiohttp.ClientSession() as session, session.ws_connect(f"{gw.url}/v1/realtime?model=asr") as ws:
        await ws.receive_str()
        await ws.send_json({"type": "standin.flood", "count": count, "size": size})  # passed on as any event

        async def flooded() -> None:
            while upstream.standin.flooded < count:
                await asyncio.sleep(0.01)

        with pytest.raises(TimeoutError):  # the timeout is meant to fire: the engine is held
            await asyncio.wait_for(flooded(), 1.0)
        held = upstream.standin.flooded
        # what was sent before the engine was held: the kernel's socket buffers on loopback (up to
        # some MiB a socket, four sockets between engine and client) and a frame or two in the gateway
        assert held * size < 32 << 20
        got = 0
        while got < count:  # the client reads: the engine goes on, to the end
            message = await ws.receive()
            assert message.type is aiohttp.WSMsgType.TEXT
            got += 1
    assert upstream.standin.flooded == count and held < count


async def test_an_engines_own_close_is_passed_on_with_its_code_and_reason(gateway_factory, upstream: Upstream) -> None:
    gw: Gateway = await gateway_factory(table(upstream.url))
    closing = {"type": "standin.close", "code": 1011, "reason": "engine overloaded"}
    assert await _closing(gw, closing) == (1011, "engine overloaded")
    await _closed(gw, "asr", "engine")


def test_events_are_read_as_vllm_reads_them() -> None:
    """What orjson refuses and Python's json takes (NaN, a lone surrogate) is checked all the
    same; an append of padding alone is no audio, not an error."""
    from gateway.admission.realtime import Refusal, Session
    from gateway.config import parse_config

    model = parse_config(table("http://127.0.0.1:1")).models[0]
    session = Session(model)
    with pytest.raises(Refusal) as refused:
        session.client_event('{"type": "session.update", "model": "chatty", "x": NaN}')
    assert refused.value.reason == "model"
    with pytest.raises(Refusal):
        session.client_event('{"type": "session.update", "model": "\\ud800"}')
    audio = base64.b64encode(TENTH).decode()
    tagged = '{"type": "input_audio_buffer.append", "audio": "' + audio + '", "x": NaN}'
    assert session.client_event(tagged)[1] == 0.1
    assert session.client_event('{"type": "input_audio_buffer.append", "audio": "="}')[1] == 0.0
    renamed, _ = session.client_event('{"type": "session.update", "model": "asr"}')
    assert json.loads(renamed) == {"type": "session.update", "model": "voxtral-rt"}
    assert session.client_event("not json") == ("not json", 0.0)  # the engine's to refuse


def test_a_burst_shorter_than_one_append_is_refused_by_check() -> None:
    from gateway.config import parse_config
    from gateway.errors import ConfigError

    with pytest.raises(ConfigError) as refused:
        parse_config(table("http://127.0.0.1:1", ", realtime: {max_append_bytes: 64000, audio_burst_s: 1}"))
    assert "realtime.audio_burst_s: an append of max_append_bytes (64000) is 2s of audio, over the burst" in str(
        refused.value
    )

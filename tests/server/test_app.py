"""End to end: the real openai SDK -> the gateway -> stand-in upstreams, all on 127.0.0.1."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import openai
import orjson
import pytest
from aiohttp import web

from tests.conftest import Gateway, Upstream, error_body, routing
from tests.test_hardening import raw_exchange

# run against the gateway's own upstream client and aiohttp's


IMAGE = {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}
VIDEO = {"type": "video_url", "video_url": {"url": "data:video/mp4;base64,AAAA"}}
AUDIO = {"type": "input_audio", "input_audio": {"data": "UklGRg==", "format": "wav"}}


def user(*parts: Any) -> dict[str, Any]:
    return {"role": "user", "content": [{"type": "text", "text": "look"}, *parts]}


def table(vision: Upstream, omni: Upstream) -> str:
    return routing(
        f"""  - name: vision
    upstreams: [{vision.url}]
    upstream_model: org/Vision-7B
    accepts: [text, image]
    limits: {{image: 2}}
    on_unsupported:
      video: {{redirect: omni}}
      audio: reject""",
        f"""  - name: omni
    upstreams: [{omni.url}]
    accepts: [text, image, video, audio]""",
        f"""  - name: texty
    upstreams: [{vision.url}]
    accepts: [text]
    on_unsupported:
      image: strip""",
    )


@pytest.fixture
async def two(upstream_factory) -> tuple[Upstream, Upstream]:
    return await upstream_factory("vision"), await upstream_factory("omni")


@pytest.fixture
async def gw(gateway_factory, two) -> Gateway:
    return await gateway_factory(table(*two))


async def test_accepts_and_renames_model_for_upstream(gw: Gateway, two) -> None:
    vision, omni = two
    async with gw.client() as client:
        raw = await client.chat.completions.with_raw_response.create(model="vision", messages=[user(IMAGE)])
    completion = raw.parse()
    assert completion.choices[0].message.content == "[vision] model=org/Vision-7B messages=1 image_url=1 text=1"
    assert raw.headers["x-gateway-model"] == "vision"
    assert raw.headers["x-gateway-route"] == "direct"
    assert len(vision.received) == 1 and not omni.received
    assert vision.received[0].json()["model"] == "org/Vision-7B"
    assert gw.sample("gateway_requests_total", model="vision", code="200") == 1
    assert gw.sample("gateway_upstream_requests_total", model="vision", upstream=vision.url, outcome="ok") == 1


async def test_forwards_the_clients_bytes_unchanged_when_nothing_is_rewritten(gw: Gateway, two) -> None:
    vision, _ = two
    body = b'{ "messages" : [ {"role":"user","content":"hi \\u00e9"} ],\n "model":"texty", "temperature": 0.50 }'
    async with aiohttp.ClientSession() as session:
        async with session.post(f"{gw.url}/v1/chat/completions", data=body) as resp:
            assert resp.status == 200
    assert vision.received[0].body == body


async def test_rejects_unsupported_modality_before_any_upstream(gw: Gateway, two) -> None:
    messages = [
        {"role": "system", "content": "be brief"},
        user(IMAGE),
        {"role": "assistant", "content": "ok"},
        user(AUDIO, AUDIO),
    ]
    async with gw.client() as client:
        with pytest.raises(openai.BadRequestError) as caught:
            await client.chat.completions.create(model="vision", messages=messages)
    error = caught.value
    assert error.status_code == 400
    assert error.body == {
        "message": "Model 'vision' does not accept audio input: messages[3].content[1] is 'input_audio'. "
        "It accepts: text, image.",
        "type": "invalid_request_error",
        "param": "messages[3].content[1]",
        "code": "unsupported_modality",
    }
    assert not two[0].received and not two[1].received
    assert gw.sample("gateway_modality_rejections_total", model="vision", modality="audio", reason="unsupported") == 1
    assert gw.sample("gateway_requests_total", model="vision", code="400") == 1


async def test_redirects_the_whole_request_to_a_model_that_takes_it(gw: Gateway, two) -> None:
    vision, omni = two
    async with gw.client() as client:
        raw = await client.chat.completions.with_raw_response.create(model="vision", messages=[user(IMAGE, VIDEO)])
    assert raw.headers["x-gateway-model"] == "omni"
    assert raw.headers["x-gateway-route"] == "redirect"
    assert not vision.received
    assert omni.received[0].json()["model"] == "omni"
    assert omni.received[0].json()["messages"] == [user(IMAGE, VIDEO)]
    assert gw.sample("gateway_modality_redirects_total", model="vision", modality="video", target="omni") == 1
    assert gw.sample("gateway_requests_total", model="vision", code="200") == 1


async def test_strips_parts_and_says_so(gw: Gateway, two) -> None:
    vision, _ = two
    async with gw.client() as client:
        raw = await client.chat.completions.with_raw_response.create(
            model="texty", messages=[user(IMAGE), {"role": "user", "content": [IMAGE]}]
        )
    assert raw.headers["x-gateway-route"] == "strip"
    sent = vision.received[0].json()["messages"]
    note = {
        "type": "text",
        "text": "[An image was removed here by the gateway: model 'texty' does not take image input]",
    }
    assert sent == [
        {"role": "user", "content": [{"type": "text", "text": "look"}, note]},
        {"role": "user", "content": [note]},
    ]
    assert gw.sample("gateway_modality_stripped_parts_total", model="texty", modality="image") == 2


async def test_enforces_limits(gw: Gateway, two) -> None:
    async with gw.client() as client:
        with pytest.raises(openai.BadRequestError) as caught:
            await client.chat.completions.create(model="vision", messages=[user(IMAGE, IMAGE), user(IMAGE)])
    assert error_body(caught.value)["code"] == "too_many_items"
    assert error_body(caught.value)["param"] == "messages[1].content[1]"
    assert not two[0].received
    assert (
        gw.sample("gateway_modality_rejections_total", model="vision", modality="image", reason="too_many_items") == 1
    )


async def test_unknown_model_is_404(gw: Gateway) -> None:
    async with gw.client() as client:
        with pytest.raises(openai.NotFoundError) as caught:
            await client.chat.completions.create(model="gpt-9", messages=[{"role": "user", "content": "hi"}])
    assert error_body(caught.value)["code"] == "model_not_found"
    assert error_body(caught.value)["param"] == "model"
    assert gw.sample("gateway_requests_total", model="_unknown", code="404") == 1


async def test_streaming_is_relayed_as_sse(gw: Gateway, two) -> None:
    async with gw.client() as client:
        stream = await client.chat.completions.create(
            model="vision", messages=[user()], stream=True, stream_options={"include_usage": True}
        )
        chunks = [chunk async for chunk in stream]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "[vision] model=org/Vision-7B messages=1 text=1"
    assert chunks[-1].usage is not None and chunks[-1].usage.total_tokens == 14
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"


async def test_stream_chunks_reach_the_client_before_the_upstream_finishes(upstream_factory, gateway_factory) -> None:
    release = asyncio.Event()

    async def slow_stream(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(b'data: {"first": true}\n\n')
        await release.wait()  # the rest only once the client has seen the first event
        await response.write(b"data: [DONE]\n\n")
        return response

    app = web.Application()
    app.router.add_post("/v1/chat/completions", slow_stream)
    up = await upstream_factory("slow", app)
    gw = await gateway_factory(routing(f"  - {{name: m, upstreams: [{up.url}], accepts: [text]}}"))
    async with aiohttp.ClientSession() as session:
        body = {"model": "m", "stream": True, "messages": [{"role": "user", "content": "hi"}]}
        async with session.post(f"{gw.url}/v1/chat/completions", json=body) as resp:
            assert resp.headers["Content-Type"] == "text/event-stream"
            first = await asyncio.wait_for(resp.content.readuntil(b"\n\n"), timeout=10)
            assert first == b'data: {"first": true}\n\n'
            release.set()
            assert await resp.content.read() == b"data: [DONE]\n\n"


async def test_upstream_error_status_and_body_pass_through(gw: Gateway, two) -> None:
    async with gw.client() as client:
        with pytest.raises(openai.RateLimitError) as caught:
            await client.chat.completions.create(
                model="vision", messages=[user()], extra_headers={"X-Standin-Status": "429"}
            )
    assert caught.value.body == {
        "message": "stand-in vision says 429",
        "type": "BadRequestError",
        "param": None,
        "code": 429,
    }
    assert gw.sample("gateway_upstream_requests_total", model="vision", upstream=two[0].url, outcome="http_4xx") == 1
    assert gw.sample("gateway_requests_total", model="vision", code="429") == 1


async def test_mid_stream_upstream_failure_ends_with_an_sse_error(gw: Gateway, two) -> None:
    async with gw.client() as client:
        stream = await client.chat.completions.create(
            model="vision", messages=[user()], stream=True, extra_headers={"X-Standin-Break-After": "2"}
        )
        assert isinstance(stream, openai.AsyncStream)
        received = []
        with pytest.raises(openai.APIError, match="broke off the stream"):
            async for chunk in stream:
                received.append(chunk)
    assert len(received) == 3  # the role chunk and two content chunks
    assert gw.sample("gateway_upstream_requests_total", model="vision", upstream=two[0].url, outcome="aborted") == 1


async def test_request_id_is_kept_or_made_and_sent_upstream(gw: Gateway, two) -> None:
    vision, _ = two
    async with aiohttp.ClientSession() as session:
        body = {"model": "vision", "messages": [{"role": "user", "content": "hi"}]}
        async with session.post(f"{gw.url}/v1/chat/completions", json=body, headers={"X-Request-Id": "abc-1"}) as r:
            assert r.headers["X-Request-Id"] == "abc-1"
        async with session.post(f"{gw.url}/v1/chat/completions", json=body) as r:
            made = r.headers["X-Request-Id"]
        async with session.post(f"{gw.url}/v1/chat/completions", json={"model": "nope"}) as r:
            assert r.status == 404 and len(r.headers["X-Request-Id"]) == 32
    assert len(made) == 32
    assert [r.headers["X-Request-Id"] for r in vision.received] == ["abc-1", made]
    assert vision.received[0].headers["X-Gateway-Model"] == "vision"


async def test_the_upstream_gets_the_clients_headers_and_the_gateways_and_nothing_of_aiohttps(gw: Gateway, two) -> None:
    vision, _ = two
    body = b'{"model": "vision", "messages": [{"role": "user", "content": "hi"}]}'
    async with aiohttp.ClientSession(skip_auto_headers=("Accept", "Accept-Encoding", "User-Agent")) as session:
        async with session.post(  # a client that sends no Accept, Accept-Encoding or User-Agent
            f"{gw.url}/v1/chat/completions", data=body, headers={"Content-Type": "application/json"}
        ) as resp:
            assert resp.status == 200
        async with session.post(
            f"{gw.url}/v1/chat/completions",
            data=body,
            headers={
                "Content-Type": "application/json",
                "Accept-Encoding": "br",
                "User-Agent": "sdk/1",
                "X-Custom": "y",
            },
        ) as resp:
            assert resp.status == 200
    bare, full = (r.headers for r in vision.received)
    for name in ("Accept", "Accept-Encoding", "User-Agent"):
        assert name not in bare  # none added on the client's behalf: no compression it did not ask for
    assert {name.lower() for name in bare} == {"host", "content-type", "content-length", "x-request-id",
                                               "x-gateway-model", "x-gateway-route", "x-gateway-priority",
                                               "x-forwarded-for"}  # fmt: skip
    assert (full["Accept-Encoding"], full["User-Agent"], full["X-Custom"]) == ("br", "sdk/1", "y")


async def test_completions_pass_through(gw: Gateway, two) -> None:
    async with gw.client() as client:
        completion = await client.completions.create(model="vision", prompt="say hi")
        stream = await client.completions.create(model="texty", prompt="x", stream=True)
        streamed = "".join([c.choices[0].text async for c in stream])
    assert completion.choices[0].text == "[vision] model=org/Vision-7B prompt='say hi'"
    assert streamed == "[vision] model=texty prompt='x'"
    assert [r.path for r in two[0].received] == ["/v1/completions", "/v1/completions"]


async def test_models_list_carries_input_modalities(gw: Gateway) -> None:
    async with gw.client() as client:
        page = await client.models.list()
    models = {m.id: (m.model_extra or {})["input_modalities"] for m in page.data}
    assert models == {"vision": ["text", "image"], "omni": ["text", "image", "video", "audio"], "texty": ["text"]}
    for m in page.data:  # what each produces (text, unless produces: says more), and both as OpenRouter has them
        extra = m.model_extra or {}
        assert extra["output_modalities"] == ["text"]
        assert extra["architecture"] == {"input_modalities": models[m.id], "output_modalities": ["text"]}


BAD_BODIES = [
    (b"{not json", "invalid_request", None),
    (b"[1, 2]", "invalid_request", None),
    (b"", "invalid_request", None),
    (b'{"messages": []}', "invalid_request", "model"),
    (b'{"model": 7, "messages": []}', "invalid_request", "model"),
    (b'{"model": "vision"}', "invalid_request", "messages"),
    (b'{"model": "vision", "messages": "hi"}', "invalid_request", "messages"),
    (b'{"model": "vision", "messages": [7]}', "invalid_request", "messages[0]"),
    (b'{"model": "vision", "messages": [{"content": "hi"}]}', "invalid_request", "messages[0].role"),
    (
        b'{"model": "vision", "messages": [{"role": "user", "content": 5}]}',
        "invalid_content_part",
        "messages[0].content",
    ),
    (
        b'{"model": "vision", "messages": [{"role": "user", "content": [{"type": "file", "file": {}}]}]}',
        "invalid_content_part",
        "messages[0].content[0]",
    ),
    (
        b'{"model": "vision", "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": 3}]}]}',
        "invalid_content_part",
        "messages[0].content[0]",
    ),
    (
        b'{"model": "vision", "messages": [{"role": "user", "content": [{"detail": "x"}]}]}',
        "invalid_content_part",
        "messages[0].content[0]",
    ),
    (
        b'{"model": "vision", "messages": [{"role": "user", "content": [null]}]}',
        "invalid_content_part",
        "messages[0].content[0]",
    ),
]


@pytest.mark.parametrize(("body", "code", "param"), BAD_BODIES)
async def test_bad_input_is_a_clear_400_and_the_gateway_keeps_serving(gw: Gateway, two, body, code, param) -> None:
    async with aiohttp.ClientSession() as session:
        async with session.post(f"{gw.url}/v1/chat/completions", data=body) as resp:
            assert resp.status == 400
            error = (await resp.json())["error"]
        assert error["code"] == code and error["param"] == param and error["type"] == "invalid_request_error"
        assert error["message"]
        ok = {"model": "vision", "messages": [{"role": "user", "content": "hi"}]}
        async with session.post(f"{gw.url}/v1/chat/completions", json=ok) as resp:
            assert resp.status == 200
    assert not any(r.json().get("messages") != ok["messages"] for r in two[0].received)


async def test_invalid_content_is_counted(gw: Gateway) -> None:
    async with aiohttp.ClientSession() as session:
        body = {"model": "vision", "messages": [{"role": "user", "content": [{"type": "video_url", "video_url": 1}]}]}
        async with session.post(f"{gw.url}/v1/chat/completions", json=body) as resp:
            assert resp.status == 400
    assert (
        gw.sample("gateway_modality_rejections_total", model="vision", modality="video", reason="invalid_content") == 1
    )


async def test_routes_and_methods_errors_use_the_openai_shape(gw: Gateway) -> None:
    async with aiohttp.ClientSession() as session:
        async with session.get(f"{gw.url}/v2/nothing") as resp:
            assert resp.status == 404
            assert (await resp.json())["error"]["code"] == "not_found"
        async with session.get(f"{gw.url}/v1/chat/completions") as resp:
            assert resp.status == 405
            assert resp.headers["Allow"] == "POST"
            assert (await resp.json())["error"]["code"] == "method_not_allowed"


async def test_body_over_the_limit_is_413(gateway_factory, upstream) -> None:
    gw = await gateway_factory(
        routing(f"  - {{name: m, upstreams: [{upstream.url}], accepts: [text]}}", server="{max_body_bytes: 2048}")
    )
    big = {"model": "m", "messages": [{"role": "user", "content": "x" * 4096}]}
    async with aiohttp.ClientSession() as session:
        async with session.post(f"{gw.url}/v1/chat/completions", json=big) as resp:
            assert resp.status == 413
            error = (await resp.json())["error"]
    assert error["code"] == "payload_too_large" and "2048" in error["message"]
    assert not upstream.received


async def test_a_chunked_body_over_the_limit_is_413_though_it_came_whole_with_its_head(
    gateway_factory, upstream
) -> None:
    """No length declared, every byte in one write with the head: the body is taken as it lies
    (no read loop), and held to the limit all the same."""
    gw = await gateway_factory(
        routing(f"  - {{name: m, upstreams: [{upstream.url}], accepts: [text]}}", server="{max_body_bytes: 2048}")
    )
    body = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "x" * 4096}]})
    head = (
        "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        "Transfer-Encoding: chunked\r\n\r\n"
    )
    reader, writer = await asyncio.open_connection("127.0.0.1", int(gw.url.rsplit(":", 1)[1]))
    writer.write(head.encode() + f"{len(body):x}\r\n".encode() + body + b"\r\n0\r\n\r\n")
    await writer.drain()
    answer = b""
    async with asyncio.timeout(30):  # a bound, not a bet: the answer is waited for
        while b"payload_too_large" not in answer and (more := await reader.read(65536)):
            answer += more
    writer.close()
    assert answer.startswith(b"HTTP/1.1 413 ") and b"payload_too_large" in answer
    assert not upstream.received


@pytest.mark.parametrize(
    "target", [b"/foo%0Abar", b"*", b"/v1/chat%2Fcompletions"], ids=["a-line-feed", "asterisk", "an-encoded-slash"]
)
async def test_a_request_target_no_route_serves_is_the_gateways_own_404(gw: Gateway, target: bytes) -> None:
    """Whatever the request-target (one of any bytes, ``*``, a ``%2F`` that is no ``/``), the
    answer is the gateway's: JSON in the API's shape, with the request id; never aiohttp's text."""
    answer = await raw_exchange(gw, b"OPTIONS " + target + b" HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n")
    assert answer.startswith(b"HTTP/1.1 404 "), answer
    assert b"X-Request-Id: " in answer and b'"code":"not_found"' in answer


async def test_health_ready_and_metrics_endpoints(gw: Gateway, two, monkeypatch) -> None:
    monkeypatch.setenv("GATEWAY_ADMIN_TOKEN", "s3cret")
    async with aiohttp.ClientSession() as session:
        async with session.get(f"{gw.url}/healthz") as resp:
            assert resp.status == 200 and await resp.json() == {"status": "ok"}
        async with session.get(f"{gw.url}/readyz") as resp:  # a probe, or anyone: the status alone
            assert await resp.json() == {"status": "ready", "config_generation": 1}
        async with session.get(f"{gw.url}/readyz", headers={"Authorization": "Bearer s3cret"}) as resp:
            ready = await resp.json()
        async with session.get(f"{gw.url}/metrics") as resp:
            text = await resp.text()
    assert ready["status"] == "ready" and ready["models"] == ["vision", "omni", "texty"]
    assert {u["url"] for u in ready["upstreams"]} == {two[0].url, two[1].url}
    # series declared up front exist at 0, so alerts see them before the first rejection
    declared = 'gateway_modality_rejections_total{api="chat",modality="video",model="omni",reason="unsupported"} 0.0'
    assert declared in text


async def test_a_scrape_asks_for_some_series_by_name(gw: Gateway, two) -> None:
    """``/metrics?name[]=...``: the series every request writes (kept in plain floats) are found
    by name too, and only those asked for are sent."""
    async with aiohttp.ClientSession() as session:
        async with session.post(
            f"{gw.url}/v1/chat/completions", json={"model": "texty", "messages": [{"role": "user", "content": "hi"}]}
        ) as resp:
            assert resp.status == 200
        names = [("name[]", "gateway_requests_total"), ("name[]", "gateway_requests_in_flight")]
        async with session.get(f"{gw.url}/metrics", params=names) as resp:
            text = await resp.text()
    assert 'gateway_requests_total{api="chat",code="200",key="-",model="texty"} 1.0' in text
    assert "\ngateway_requests_in_flight 1.0\n" in text  # the scrape itself
    assert "gateway_modality_rejections_total" not in text and "gateway_request_duration" not in text


async def test_a_compressed_request_body_reaches_the_upstream_decoded(gw: Gateway, two) -> None:
    import gzip

    body = b'{"model": "texty", "messages": [{"role": "user", "content": "hi"}]}'
    headers = {"Content-Encoding": "gzip", "Content-Type": "application/json"}
    async with aiohttp.ClientSession() as session:
        async with session.post(f"{gw.url}/v1/chat/completions", data=gzip.compress(body), headers=headers) as resp:
            assert resp.status == 200
    received = two[0].received[0]
    assert received.body == body
    assert "Content-Encoding" not in received.headers


async def test_a_client_that_fails_to_start_stops_those_started_before_it() -> None:
    """Issue 41: each client has its own lifetime (it was one generator, which left the clients it
    had started open when a later one failed): the encoder client fails as it starts; the
    supervisor and the describer, started before it, are stopped; the upstream client, after
    it, never started."""
    from aiohttp.test_utils import TestServer

    from gateway.config import parse_config
    from gateway.server.app import create_app
    from gateway.server.state import SERVICES_KEY

    app = create_app(parse_config(routing("  - {name: m, upstreams: ['http://127.0.0.1:9'], accepts: [text]}")))
    services = app[SERVICES_KEY]
    done: list[str] = []

    def noting(name: str, then: Any) -> Any:
        async def call(*args: Any) -> None:
            done.append(name)
            await then(*args)

        return call

    async def refuse(*args: Any) -> None:
        raise RuntimeError("the encoder client cannot start")

    services.encoder.start = refuse  # type: ignore[method-assign, assignment]
    services.supervisor.close = noting("supervisor closed", services.supervisor.close)  # type: ignore[method-assign]
    assert services.describer is not None
    services.describer.close = noting("describer closed", services.describer.close)  # type: ignore[method-assign]
    services.upstream.start = noting("upstream started", services.upstream.start)  # type: ignore[method-assign]
    server = TestServer(app)
    with pytest.raises(RuntimeError, match="cannot start"):
        await server.start_server()
    await server.close()
    assert done == ["describer closed", "supervisor closed"]

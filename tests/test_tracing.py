"""Traces: the span tree of a request, decoded from the OTLP/HTTP protobuf a collector on
loopback receives, and the W3C trace context the engine and the encoder got."""

from __future__ import annotations

import asyncio
import hashlib
import re
import sys
from dataclasses import dataclass, field
from typing import Any

import openai
import pytest
from aiohttp import web

from gateway.config import parse_config
from gateway.errors import ConfigError
from gateway.server.state import SERVICES_KEY
from gateway.tracing import available, traces_url
from tests.conftest import Gateway, Upstream, routing
from tests.images import image_part, png

needs_tracing = pytest.mark.skipif(not available(), reason="needs the tracing extra: pip install -e '.[tracing]'")

TRACEPARENT = re.compile(r"00-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})")  # version, trace, parent, flags
CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_PARENT = f"00-{CLIENT_TRACE}-00f067aa0ba902b7-01"


@dataclass
class Collector:
    """An OTLP/HTTP receiver: every span of every export, decoded with opentelemetry-proto."""

    spans: list[Any] = field(default_factory=list)
    resources: list[dict[str, Any]] = field(default_factory=list)
    content_types: list[str] = field(default_factory=list)

    def app(self) -> web.Application:
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
            ExportTraceServiceRequest,
            ExportTraceServiceResponse,
        )

        async def export(request: web.Request) -> web.Response:
            self.content_types.append(request.content_type)
            message = ExportTraceServiceRequest()
            message.ParseFromString(await request.read())
            for resource_spans in message.resource_spans:
                self.resources.append({a.key: value(a.value) for a in resource_spans.resource.attributes})
                for scope in resource_spans.scope_spans:
                    self.spans.extend(scope.spans)
            reply = ExportTraceServiceResponse().SerializeToString()
            return web.Response(body=reply, content_type="application/x-protobuf")

        app = web.Application()
        app.router.add_post("/v1/traces", export)
        return app

    def named(self, name: str) -> list[Any]:
        return [s for s in self.spans if s.name == name]


def value(any_value: Any) -> Any:
    kind = any_value.WhichOneof("value")
    if kind == "array_value":
        return [value(v) for v in any_value.array_value.values]
    return getattr(any_value, kind)


def attributes(span: Any) -> dict[str, Any]:
    return {a.key: value(a.value) for a in span.attributes}


@dataclass
class Encoder:
    """An encoder backend (POST /v1/encode) that keeps the trace context of each call."""

    traceparents: list[str] = field(default_factory=list)

    def app(self) -> web.Application:
        async def encode(request: web.Request) -> web.Response:
            await request.read()
            self.traceparents.append(request.headers.get("traceparent", ""))
            return web.json_response({"image_embeds": "QUFBQQ==", "cached": False})

        app = web.Application(client_max_size=1 << 26)
        app.router.add_post("/v1/encode", encode)
        return app


@pytest.fixture
async def collector(upstream_factory) -> tuple[Collector, str]:
    found = Collector()
    server = await upstream_factory("collector", found.app())
    return found, server.url


async def flushed(gw: Gateway) -> None:
    tracing = gw.app[SERVICES_KEY].tracing
    assert tracing is not None
    assert await asyncio.to_thread(tracing.flush)  # the exporter's thread posts to this loop's collector


def traced(collector_url: str, *models: str, extra: str = "", ratio: float = 1.0, trust: bool = False) -> str:
    options = f"otlp_endpoint: '{collector_url}', sample_ratio: {ratio}, trust_client_sampling: {str(trust).lower()}"
    return routing(*models, extra=extra, server=f"{{tracing: {{{options}}}}}")


@needs_tracing
async def test_a_request_with_an_encoded_image_and_a_retry_is_one_span_tree_the_engine_continues(
    upstream_factory, gateway_factory, collector
) -> None:
    found, url = collector
    failing, serving = await upstream_factory("failing"), await upstream_factory("serving")
    failing.standin.fail_status = 503
    encoder = Encoder()
    enc = await upstream_factory("encoder", encoder.app())
    gw = await gateway_factory(
        traced(
            url,
            f"  - {{name: m, upstreams: [{failing.url}, {serving.url}], balance: round_robin, accepts: [text, image],",
            "     encode: {image: enc}, retries: {attempts: 1, on_status: [503], budget: 1.0, min_per_s: 10}}",
            extra=f"encoders:\n  enc: {{kind: http, urls: [{enc.url}]}}\n",
        )
    )
    content = [{"type": "text", "text": "what is it?"}, image_part(png())]
    for _ in range(2):  # round robin: one of the two requests meets the failing replica first
        async with openai.AsyncOpenAI(
            base_url=f"{gw.url}/v1", api_key="sk", max_retries=0, default_headers={"traceparent": CLIENT_PARENT}
        ) as client:
            await client.chat.completions.create(model="m", messages=[{"role": "user", "content": content}])
    await flushed(gw)

    roots = found.named("chat m")
    assert len(roots) == 2 and all(r.trace_id.hex() == CLIENT_TRACE for r in roots)  # the client's trace
    assert all(r.parent_span_id.hex() == "00f067aa0ba902b7" and r.kind == 2 for r in roots)  # SERVER
    retried = next(r for r in roots if len([s for s in found.spans if s.parent_span_id == r.span_id]) == 3)
    root = attributes(retried)
    assert root["gen_ai.operation.name"] == "chat" and root["gen_ai.request.model"] == "m"
    assert root["gen_ai.response.model"] == "m" and root["http.response.status_code"] == 200
    assert root["gen_ai.usage.input_tokens"] > 0 and root["gen_ai.usage.output_tokens"] > 0
    assert root["gateway.priority"] == "default" and root["gateway.route"] == "direct"
    children = sorted(
        (s for s in found.spans if s.parent_span_id == retried.span_id), key=lambda s: s.start_time_unix_nano
    )
    # admission's findings on the request's span (no span of its own: a request pays for two
    # spans, its own and its attempt's, unless it has stages to show)
    assert [s.name for s in children] == ["gateway.encode", "gateway.upstream", "gateway.upstream"]
    encode, first, second = children
    assert root["gateway.media.image.count"] == 1 and root["gateway.media.text.count"] == 1
    (sha,) = attributes(encode)["gateway.encode.image.sha256"]  # of the image's bytes
    assert sha == hashlib.sha256(png()).hexdigest()
    (sent,) = root["gateway.media.image.sha256"]  # of what was sent: its data URL
    assert sent == hashlib.sha256(content[1]["image_url"]["url"].encode()).hexdigest()
    assert attributes(first)["http.response.status_code"] == 503 and attributes(first)["gateway.outcome"] == "http_5xx"
    assert first.status.code == 2 and attributes(first)["error.type"] == "http_5xx"  # ERROR
    assert attributes(second)["http.response.status_code"] == 200 and second.kind == 3  # CLIENT
    assert attributes(first)["server.address"] == "127.0.0.1" and attributes(first)["gateway.attempt"] == 1
    assert attributes(second)["gateway.attempt"] == 2
    assert not [s for s in found.spans if s.parent_span_id == second.span_id]  # a reply sent whole: its attempt's
    # what the engines and the encoder got: the trace, each attempt and each encoding its own parent
    attempts = {s.span_id.hex() for s in found.named("gateway.upstream")}
    engine = [TRACEPARENT.fullmatch(x.headers["traceparent"]) for r in (failing, serving) for x in r.received]
    assert len(engine) == 3 and len({m.group(2) for m in engine if m is not None}) == 3
    assert all(m is not None and m.group(1) == CLIENT_TRACE and m.group(2) in attempts for m in engine)
    encodes = {s.span_id.hex() for s in found.named("gateway.encode")}
    sent = [TRACEPARENT.fullmatch(t) for t in encoder.traceparents]
    assert len(sent) == 2 and all(m is not None and m.group(1) == CLIENT_TRACE and m.group(2) in encodes for m in sent)
    assert found.resources[0]["service.name"] == "modality-gateway"
    assert found.content_types[0] == "application/x-protobuf"
    assert all("what is it" not in str(attributes(s)) and "sk" != attributes(s).get("gateway.key") for s in found.spans)


@needs_tracing
async def test_a_request_without_a_traceparent_starts_a_trace_and_errors_say_their_code(
    upstream, gateway_factory, collector
) -> None:
    found, url = collector
    gw = await gateway_factory(traced(url, f"  - {{name: m, upstreams: [{upstream.url}], accepts: [text]}}"))
    async with gw.client() as client:
        await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
        with pytest.raises(openai.BadRequestError):
            await client.chat.completions.create(
                model="m", messages=[{"role": "user", "content": [{"type": "video_url", "video_url": {"url": "x"}}]}]
            )
    await flushed(gw)
    ok, refused = sorted(found.named("chat m"), key=lambda s: s.start_time_unix_nano)
    assert ok.parent_span_id == b"" and ok.trace_id != refused.trace_id
    (received,) = upstream.received
    match = TRACEPARENT.fullmatch(received.headers["traceparent"])
    assert match is not None and match.group(1) == ok.trace_id.hex()
    assert attributes(refused)["error.type"] == "unsupported_modality"
    assert refused.status.code == 0  # unset: a 4xx is the client's error, not the gateway's
    assert attributes(refused)["http.response.status_code"] == 400


@needs_tracing
async def test_an_upload_is_traced_as_a_json_request_is(upstream_factory, gateway_factory, collector) -> None:
    """A transcription's exchange knows it is traced (gateway.server.uploads): its span says who
    served it and how, as a chat request's does."""
    from tests.media.test_transcribe import wav

    found, url = collector
    whisper = await upstream_factory("whisper")
    model = (
        f"  - {{name: whisper, upstream_model: openai/whisper-large-v3, upstreams: [{whisper.url}], "
        "accepts: [text, audio], apis: [chat, transcriptions]}"
    )
    gw = await gateway_factory(traced(url, model, extra="media: {max_audio_bytes: 100000}\n"))
    async with gw.client() as client:
        await client.audio.transcriptions.create(model="whisper", file=("a.wav", wav(0.3)))
    await flushed(gw)
    (span,) = [s for s in found.spans if s.name.startswith("transcri")]
    assert attributes(span)["gen_ai.response.model"] == "whisper" and attributes(span)["gateway.route"] == "direct"


@needs_tracing
async def test_a_streams_relay_is_a_span_under_the_attempt_that_answered(upstream, gateway_factory, collector) -> None:
    found, url = collector
    gw = await gateway_factory(traced(url, f"  - {{name: m, upstreams: [{upstream.url}], accepts: [text]}}"))
    async with gw.client() as client:
        stream = await client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "hi"}], stream=True
        )
        assert [chunk async for chunk in stream]
    await flushed(gw)
    (root,) = found.named("chat m")
    (attempt,) = found.named("gateway.upstream")
    (relay,) = found.named("gateway.relay")
    assert attempt.parent_span_id == root.span_id and relay.parent_span_id == attempt.span_id
    assert attributes(relay)["gateway.stream"] is True and relay.end_time_unix_nano <= root.end_time_unix_nano


@needs_tracing
@pytest.mark.parametrize("trust", [False, True])
async def test_sample_ratio_zero_records_nothing_yet_passes_the_context_on(
    upstream, gateway_factory, collector, trust: bool
) -> None:
    """A client's traceparent is continued either way; its sampled flag decides only where the
    table trusts it (else a client could have every request recorded, 2.5x the CPU)."""
    found, url = collector
    model = f"  - {{name: m, upstreams: [{upstream.url}], accepts: [text]}}"
    gw = await gateway_factory(traced(url, model, ratio=0, trust=trust))
    async with gw.client() as client:
        await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
        await client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "hi"}], extra_headers={"traceparent": CLIENT_PARENT}
        )  # the client sampled it
    await flushed(gw)
    assert [s.trace_id.hex() for s in found.named("chat m")] == ([CLIENT_TRACE] if trust else [])
    first, second = (TRACEPARENT.fullmatch(r.headers["traceparent"]) for r in upstream.received)
    assert first is not None and int(first.group(3), 16) & 1 == 0  # not sampled, still propagated
    assert second is not None and second.group(1) == CLIENT_TRACE  # the client's trace, continued


@needs_tracing
async def test_the_wait_for_a_slot_is_a_span_with_the_requests_class(upstream, gateway_factory, collector) -> None:
    found, url = collector
    gw = await gateway_factory(
        traced(url, f"  - {{name: m, upstreams: [{upstream.url}], accepts: [text], max_concurrency: 1}}")
    )
    async with gw.client() as client:
        await client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "hi"}], extra_headers={"x-priority": "bulk"}
        )
    await flushed(gw)
    (root,) = found.named("chat m")
    (queue,) = found.named("gateway.queue")
    (attempt,) = found.named("gateway.upstream")
    assert queue.parent_span_id == root.span_id == attempt.parent_span_id
    assert attributes(queue)["gateway.priority"] == "bulk" == attributes(root)["gateway.priority"]
    assert queue.end_time_unix_nano <= attempt.start_time_unix_nano


def test_a_table_with_tracing_is_refused_where_opentelemetry_is_not_installed(monkeypatch) -> None:
    monkeypatch.setattr(sys.modules["gateway.config.validate"], "tracing_available", lambda: False)
    text = routing(
        "  - {name: m, upstreams: ['http://h:1'], accepts: [text]}",
        server="{tracing: {otlp_endpoint: 'http://c:4318'}}",
    )
    parse_config(text)  # `check FILE`: any machine
    with pytest.raises(ConfigError) as info:
        parse_config(text, here=True)
    assert "server.tracing: needs the OpenTelemetry SDK" in str(info.value) and "modality-gateway[tracing]" in str(
        info.value
    )


def test_tracing_config_is_checked() -> None:
    for server, expected in (
        ("{tracing: {otlp_endpoint: 'ftp://c:4318'}}", "server.tracing.otlp_endpoint: bad URL 'ftp://c:4318': must be"),
        (
            "{tracing: {otlp_endpoint: 'http://u:pw@c:4318'}}",
            "server.tracing.otlp_endpoint: bad URL 'http://u:pw@c:4318': must not carry credentials",
        ),
        ("{tracing: {otlp_endpoint: 'http://[::1:4318'}}", "server.tracing.otlp_endpoint: bad URL"),
        ("{limits_store: {url: 'redis://[::1:6379'}}", "server.limits_store.url: must be a redis://"),
        ("{tracing: {otlp_endpoint: 'http://c:4318', sample_ratio: 2}}", "server.tracing.sample_ratio: must be"),
        ("{tracing: {sample_ratio: 0.5}}", "server.tracing.otlp_endpoint: is required"),
    ):
        with pytest.raises(ConfigError) as info:
            parse_config(routing("  - {name: m, upstreams: ['http://h:1'], accepts: [text]}", server=server))
        assert str(info.value.problems[0]).split(": ", 1)[1].startswith(expected), info.value.problems
    config = parse_config(
        routing(
            "  - {name: m, upstreams: ['http://h:1'], accepts: [text]}",
            server="{tracing: {otlp_endpoint: 'http://c:4318'}}",
        )
    )
    assert config.server.tracing is not None and config.server.tracing.sample_ratio == 1.0
    assert traces_url("http://c:4318/") == "http://c:4318/v1/traces" == traces_url("http://c:4318/v1/traces")


def _unused(upstream: Upstream) -> None: ...


async def test_a_clients_tracestate_and_baggage_go_upstream_within_w3cs_bounds(upstream, gateway_factory) -> None:
    gw = await gateway_factory(routing(f"  - {{name: m, upstreams: [{upstream.url}], accepts: [text]}}"))
    async with gw.client() as client:
        # (a baggage past 8192 bytes cannot arrive: aiohttp refuses a header field over 8190)
        for state, baggage in (("a=1", "k=v"), ("a=" + "x" * 600, "k=" + "v" * 8000)):
            await client.chat.completions.create(
                model="m",
                messages=[{"role": "user", "content": "hi"}],
                extra_headers={"tracestate": state, "baggage": baggage},
            )
    kept, dropped = (r.headers for r in upstream.received)
    assert (kept["tracestate"], kept["baggage"]) == ("a=1", "k=v")
    assert "tracestate" not in dropped and len(dropped["baggage"]) == 8002


@needs_tracing
@pytest.mark.parametrize("trust", [False, True])
def test_a_request_not_sampled_makes_no_span_yet_its_context_goes_on(monkeypatch, trust: bool) -> None:
    """Sampling is decided once, as the request opens: one not sampled costs its context alone (no
    span of the SDK's, no attributes), and what it passes upstream says not sampled, in the
    client's trace where it came with one."""
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    import gateway.tracing
    from gateway.tracing import Tracing, stage

    exported = InMemorySpanExporter()
    tracing = Tracing("http://127.0.0.1:9", 0.0, exporter=exported, trust_client_sampling=trust)
    made: list[str] = []

    class Counted(gateway.tracing.Span):
        def __init__(self, tracing: Tracing, name: str, *args: Any) -> None:
            made.append(name)
            super().__init__(tracing, name, *args)

    monkeypatch.setattr(gateway.tracing, "Span", Counted)
    sent = []
    for headers in ({}, {"traceparent": CLIENT_PARENT.removesuffix("01") + "00"}, {"traceparent": CLIENT_PARENT}):
        opened = tracing.open(headers, "chat", "POST", "/v1/chat/completions", "rid")
        with stage(tracing, "gateway.admission"):
            pass
        upstream: dict[str, str] = {}
        tracing.inject(upstream, tracing.start("gateway.upstream", kind="client"))
        sent.append(TRACEPARENT.fullmatch(upstream["traceparent"]))
        tracing.close(opened, 200, None, "m")
    assert tracing.flush()
    # the client's sampled flag records its request (and its stages) only where the table trusts it
    assert made == (["chat", "gateway.admission", "gateway.upstream"] if trust else [])
    assert [s.name for s in exported.get_finished_spans()] == (["gateway.admission", "chat m"] if trust else [])
    new, unsampled, sampled = sent
    assert new is not None and new.group(1) != CLIENT_TRACE and new.group(3) == "00"
    assert unsampled is not None and unsampled.group(1) == CLIENT_TRACE and unsampled.group(3) == "00"
    assert sampled is not None and sampled.group(1) == CLIENT_TRACE and sampled.group(3) == ("01" if trust else "00")
    tracing.shutdown()


@needs_tracing
def test_spans_made_here_keep_the_sdks_environment_limits_and_a_stages_failure(monkeypatch) -> None:
    """The spans are the gateway's, handed to the SDK's batch processor: the environment the SDK
    reads still holds (the resource's OTEL_RESOURCE_ATTRIBUTES, OTEL_SPAN_ATTRIBUTE_* limits); a
    stage that fails is marked; an ended span takes nothing more (its attributes are the export's)."""
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    from opentelemetry.trace import SpanKind, StatusCode

    from gateway.tracing import Tracing

    monkeypatch.setenv("OTEL_RESOURCE_ATTRIBUTES", "deployment.environment=test")
    monkeypatch.setenv("OTEL_SPAN_ATTRIBUTE_VALUE_LENGTH_LIMIT", "4")
    exported = InMemorySpanExporter()
    tracing = Tracing("http://127.0.0.1:9", 1.0, exporter=exported, version="9.9")
    opened = tracing.open({"traceparent": CLIENT_PARENT, "tracestate": "a=1"}, "chat", "POST", "/p", "rid")
    with pytest.raises(ValueError), tracing.stage("gateway.decode", {"gateway.media": "video"}):
        raise ValueError("not shown")
    attempt = tracing.start("gateway.upstream", {"server.port": 8000}, kind="client")
    sent: dict[str, str] = {}
    tracing.inject(sent, attempt)
    attempt.end()
    attempt.set_attribute("late", "x")
    tracing.close(opened, 502, None, "m")
    assert tracing.flush()
    decode, upstream, request = exported.get_finished_spans()
    assert request.resource.attributes["deployment.environment"] == "test"
    assert request.resource.attributes["service.version"] == "9.9"
    assert request.instrumentation_scope is not None and request.instrumentation_scope.name == "modality-gateway"
    assert (request.name, request.kind, request.status.status_code) == ("chat m", SpanKind.SERVER, StatusCode.ERROR)
    assert (
        request.parent is not None and request.parent.is_remote and f"{request.context.trace_id:032x}" == CLIENT_TRACE
    )
    assert request.attributes is not None and request.attributes["url.path"] == "/p"
    assert request.attributes["error.type"] == "502" and request.attributes["gateway.request_id"] == "rid"
    assert decode.attributes == {"gateway.media": "vide", "error.type": "Valu"}  # every value held to 4
    assert decode.status.status_code == StatusCode.ERROR and decode.parent == request.context
    assert upstream.kind == SpanKind.CLIENT and upstream.attributes == {"server.port": 8000}
    assert (
        upstream.start_time is not None and upstream.end_time is not None and upstream.start_time <= upstream.end_time
    )
    assert sent == {"traceparent": f"00-{CLIENT_TRACE}-{upstream.context.span_id:016x}-01", "tracestate": "a=1"}
    tracing.shutdown()


@needs_tracing
def test_otel_sdk_disabled_records_nothing_yet_passes_the_context_on(monkeypatch) -> None:
    """``OTEL_SDK_DISABLED=true``, as the SDK reads it: no span is made, and the engine still gets
    a traceparent (not sampled)."""
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from gateway.tracing import Tracing

    monkeypatch.setenv("OTEL_SDK_DISABLED", "true")
    exported = InMemorySpanExporter()
    tracing = Tracing("http://127.0.0.1:9", 1.0, exporter=exported, trust_client_sampling=True)
    opened = tracing.open({"traceparent": CLIENT_PARENT}, "chat", "POST", "/p", "rid")
    sent: dict[str, str] = {}
    tracing.inject(sent)
    tracing.close(opened, 200, None, "m")
    assert tracing.flush() and exported.get_finished_spans() == ()
    found = TRACEPARENT.fullmatch(sent["traceparent"])
    assert found is not None and found.group(1) == CLIENT_TRACE and found.group(3) == "00"
    tracing.shutdown()


@needs_tracing
async def test_a_realtime_session_is_one_span_that_says_how_it_went(upstream, gateway_factory, collector) -> None:
    """The session's request span (``realtime MODEL``) lasts as the session does, and says how it
    ended, its audio seconds and the events relayed each way; the engine's side got its traceparent."""
    import base64

    import aiohttp

    found, url = collector
    gw = await gateway_factory(
        traced(url, f"  - {{name: asr, upstreams: [{upstream.url}], accepts: [text, audio], apis: [realtime]}}")
    )
    audio = base64.b64encode(b"\x01\x00" * 1600).decode()
    async with aiohttp.ClientSession() as session, session.ws_connect(f"{gw.url}/v1/realtime?model=asr") as ws:
        await ws.receive_str()
        for event in (
            {"type": "session.update", "model": "asr"},
            {"type": "input_audio_buffer.commit"},
            {"type": "input_audio_buffer.append", "audio": audio},
        ):
            await ws.send_json(event)
        await ws.receive_str()  # the delta
    from gateway.server.state import SERVICES_KEY

    await asyncio.wait_for(gw.app[SERVICES_KEY].realtime.idle(), 30)
    await flushed(gw)
    (span,) = found.named("realtime asr")
    said = attributes(span)
    assert said["gateway.realtime.end"] == "client" and said["gateway.realtime.audio_s"] == 0.1
    assert (said["gateway.realtime.events.client"], said["gateway.realtime.events.engine"]) == (3, 2)
    assert said["http.response.status_code"] == 101
    (opened,) = [r for r in upstream.received if r.method == "WS"][:1]
    match = TRACEPARENT.fullmatch(opened.headers["traceparent"])
    assert match is not None and match.group(1) == span.trace_id.hex()

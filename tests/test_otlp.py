"""gateway.otlp: the OTLP protobuf the gateway writes itself, read back with opentelemetry-proto's own
parser and held equal to the SDK's own encoding of the same spans; and its sending: the
collector's environment, compression, retries and their end."""

from __future__ import annotations

import gzip
import http.server
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from gateway.tracing import available

pytestmark = pytest.mark.skipif(not available(), reason="needs the tracing extra: pip install -e '.[tracing]'")


def _spans() -> Any:
    """Spans of every shape the SDK makes: each attribute type, events, links, a status with its
    message, a remote parent with a tracestate, an unset and an error status, each kind."""
    from opentelemetry import trace
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    from opentelemetry.trace import Link, SpanContext, SpanKind, Status, StatusCode, TraceFlags, TraceState

    kept = InMemorySpanExporter()
    provider = TracerProvider(resource=Resource.create({"service.name": "modality-gateway", "replicas": 3}))
    provider.add_span_processor(SimpleSpanProcessor(kept))
    tracer = provider.get_tracer("modality-gateway", "0.1.0")
    remote = SpanContext(
        0x0AF7651916CD43DD8448EB211C80319C,
        0xB7AD6B7169203331,
        is_remote=True,
        trace_flags=TraceFlags(1),
        trace_state=TraceState([("vendor", "v1"), ("other", "x")]),
    )
    attributes = {
        "http.request.method": "POST",
        "url.path": "/v1/chat/completions",
        "gen_ai.usage.input_tokens": 0,
        "big": 2**62,
        "negative": -5,
        "ratio": 0.25,
        "yes": True,
        "no": False,
        "empty": "",
        "gateway.media.image.sha256": ["aa", "bb"],
        "counts": [1, -2],
        "flags": [True, False],
        "ratios": [0.5],
        "nothing": [],
        "unicode": "naïve ☃",
    }
    for kind in SpanKind:
        with tracer.start_as_current_span(
            "chat m", context=trace.set_span_in_context(trace.NonRecordingSpan(remote)), kind=kind
        ) as root:
            root.set_attributes(attributes)
            root.add_event("retry", {"attempt": 2})
            child = tracer.start_span("gateway.upstream", kind=SpanKind.CLIENT, links=[Link(remote, {"why": "x"})])
            child.set_status(Status(StatusCode.ERROR, "http_5xx"))
            child.end()
            ok = tracer.start_span("gateway.relay")
            ok.set_status(Status(StatusCode.OK))
            ok.end()
    return kept.get_finished_spans()


def test_the_written_request_is_what_the_sdks_own_encoder_makes() -> None:
    from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    from gateway.otlp import encode

    spans = _spans()
    assert len(spans) == 15
    written = ExportTraceServiceRequest.FromString(encode(spans))  # opentelemetry-proto's parser
    links = [link for r in written.resource_spans for s in r.scope_spans for span in s.spans for link in span.links]
    assert len(links) == 5 and all(link.trace_state == "vendor=v1,other=x" for link in links)
    for link in links:  # a link's tracestate: Link.trace_state 3, which the SDK's encoder leaves out
        link.ClearField("trace_state")
    assert written == encode_spans(spans)
    assert encode(spans) == encode(spans)  # the second time from what was kept


def test_an_attribute_kept_written_is_told_apart_by_its_type() -> None:
    from opentelemetry.proto.common.v1.common_pb2 import KeyValue

    from gateway.otlp import _pair

    written = [KeyValue.FromString(_pair("n", value)).value for value in (1, True, 1.0, "1")]
    assert [v.WhichOneof("value") for v in written] == ["int_value", "bool_value", "double_value", "string_value"]


def test_an_int_outside_int64_is_left_out_and_said(caplog: pytest.LogCaptureFixture) -> None:
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    from gateway.otlp import encode

    span = _spans()[0]
    span._attributes = {"big": 1 << 63, "fine": (1 << 63) - 1, "low": -(1 << 63), "also": [1, 1 << 64]}
    written = ExportTraceServiceRequest.FromString(encode([span]))
    (kept,) = [s for r in written.resource_spans for sc in r.scope_spans for s in sc.spans]
    assert {a.key: a.value.int_value for a in kept.attributes} == {"fine": (1 << 63) - 1, "low": -(1 << 63)}
    assert "span attribute 'big' left out" in caplog.text and "span attribute 'also' left out" in caplog.text


def test_a_collector_without_a_port_in_its_url_is_asked_on_the_schemes() -> None:
    from gateway.otlp import SpanSender

    assert (SpanSender("http://[::1]/v1/traces")._host, SpanSender("http://[::1]/v1/traces")._port) == ("::1", 80)
    assert SpanSender("https://collector/v1/traces")._port == 443


class _Collector:
    """An OTLP/HTTP receiver on 127.0.0.1 in a thread: what it got, and the answers it gives in turn
    (``drop``: the connection closed after each answer, without saying so, as an idle timeout does)."""

    def __init__(self, answers: list[tuple[int, dict[str, str]]], drop: bool = False) -> None:
        self.answers, self.drop = answers, drop
        self.got: list[tuple[dict[str, str], bytes]] = []  # (headers, body) of each POST
        self.asked = threading.Event()
        collector = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                collector.got.append((dict(self.headers), body))
                status, headers = collector.answers.pop(0) if collector.answers else (200, {})
                self.send_response(status)
                for name, value in {**headers, "Content-Length": "0"}.items():
                    self.send_header(name, value)
                self.end_headers()
                collector.asked.set()
                if collector.drop:
                    self.close_connection = True

            def log_message(self, *args: Any) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1/traces"
        self.thread = threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def collector() -> Iterator[Callable[..., _Collector]]:
    """A collector that gives these answers (status, headers) first, then 200s; closed after."""
    made: list[_Collector] = []

    def make(*answers: tuple[int, dict[str, str]], drop: bool = False) -> _Collector:
        made.append(_Collector(list(answers), drop))
        return made[-1]

    yield make
    for received in made:
        received.close()


def _spans_in(body: bytes) -> int:
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    message = ExportTraceServiceRequest.FromString(body)
    return sum(len(s.spans) for r in message.resource_spans for s in r.scope_spans)


def test_spans_go_with_the_environments_headers_and_compression(
    collector: Callable[..., _Collector], monkeypatch: pytest.MonkeyPatch
) -> None:
    from opentelemetry.sdk.trace.export import SpanExportResult

    from gateway.otlp import SpanSender

    monkeypatch.setenv("OTEL_EXPORTER_OTLP_HEADERS", "x-general=no")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_HEADERS", "x-token=s%20ecret,x-other=1")  # the traces' own wins
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_COMPRESSION", "gzip")
    received = collector()
    sender = SpanSender(received.url)
    assert sender.export(_spans()) is SpanExportResult.SUCCESS
    assert sender.export(_spans()[:2]) is SpanExportResult.SUCCESS  # on the same connection
    sender.shutdown()
    (headers, body), (_, second) = received.got
    assert headers["x-token"] == "s ecret" and headers["x-other"] == "1" and "x-general" not in headers
    assert headers["Content-Type"] == "application/x-protobuf" and headers["Content-Encoding"] == "gzip"
    assert _spans_in(gzip.decompress(body)) == 15 and _spans_in(gzip.decompress(second)) == 2


def test_a_busy_collector_is_asked_again_until_it_takes_them(collector: Callable[..., _Collector]) -> None:
    from opentelemetry.sdk.trace.export import SpanExportResult

    from gateway.otlp import SpanSender

    received = collector((503, {"Retry-After": "0"}), (429, {"Retry-After": "0"}))
    sender = SpanSender(received.url)
    assert sender.export(_spans()) is SpanExportResult.SUCCESS
    sender.shutdown()
    assert [_spans_in(body) for _, body in received.got] == [15, 15, 15]


def test_a_refused_batch_is_dropped_and_said(
    collector: Callable[..., _Collector], caplog: pytest.LogCaptureFixture
) -> None:
    from opentelemetry.sdk.trace.export import SpanExportResult

    from gateway.otlp import SpanSender

    received = collector((400, {}))
    sender = SpanSender(received.url)
    assert sender.export(_spans()) is SpanExportResult.FAILURE
    assert len(received.got) == 1  # a 400 is not asked again
    assert "15 spans not exported to the collector (HTTP 400): dropped" in caplog.text
    assert sender.export(_spans()[:1]) is SpanExportResult.SUCCESS  # the next batch goes
    sender.shutdown()


def test_shutting_down_ends_a_wait_to_ask_again(collector: Callable[..., _Collector]) -> None:
    from opentelemetry.sdk.trace.export import SpanExportResult

    from gateway.otlp import SpanSender

    received = collector((503, {"Retry-After": "3600"}))
    sender = SpanSender(received.url, timeout=7200)
    results: list[SpanExportResult] = []
    exporting = threading.Thread(target=lambda: results.append(sender.export(_spans())))
    exporting.start()
    assert received.asked.wait(30)  # the first try was answered: it waits an hour to ask again
    sender.shutdown()
    exporting.join(30)
    assert results == [SpanExportResult.FAILURE]
    assert sender.export(_spans()) is SpanExportResult.FAILURE  # shut: nothing more is sent
    assert len(received.got) == 1


def test_a_collector_not_there_costs_the_batch_within_the_timeout(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    import socket

    from opentelemetry.sdk.trace.export import SpanExportResult

    from gateway import otlp
    from gateway.otlp import SpanSender

    with socket.socket() as closed:  # a port nothing listens on
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    monkeypatch.setattr(otlp, "_delay", lambda attempt, retry_after: 3600.0)  # the next try past the timeout
    sender = SpanSender(f"http://127.0.0.1:{port}/v1/traces", timeout=30)  # no second try fits in it
    assert sender.export(_spans()) is SpanExportResult.FAILURE
    sender.shutdown()
    assert "not exported to the collector (ConnectionRefusedError" in caplog.text


def test_a_kept_connection_the_collector_closed_is_replaced_at_once(
    collector: Callable[..., _Collector], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its request fails as it is sent: sent again on a new connection, not after a backoff (no
    wait before another try is ever asked for: counted, not timed)."""
    from opentelemetry.sdk.trace.export import SpanExportResult

    from gateway import otlp
    from gateway.otlp import SpanSender

    waits: list[int] = []

    def delay(attempt: int, retry_after: str | None) -> float:
        waits.append(attempt)
        return 0.0

    monkeypatch.setattr(otlp, "_delay", delay)
    received = collector(drop=True)
    sender = SpanSender(received.url, timeout=30)
    try:
        for n in (3, 2, 1):
            assert sender.export(_spans()[:n]) is SpanExportResult.SUCCESS
    finally:
        sender.shutdown()
    assert [_spans_in(body) for _, body in received.got] == [3, 2, 1]
    assert waits == []

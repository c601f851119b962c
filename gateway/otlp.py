"""Spans to an OTLP/HTTP collector: the protobuf written here, posted from the SDK's export thread.

The SDK's own OTLP exporter builds each span, attribute and value as a protobuf message object
before serializing them: in a traced gateway that was a quarter of the process's CPU (in the
exporter's thread, but the gateway's process and its GIL), more than making the spans. Here the
``ExportTraceServiceRequest`` is written straight as bytes, field by field, as
opentelemetry-proto's ``trace.proto`` numbers them (tests/test_otlp.py reads it back with
opentelemetry-proto's parser and holds it equal to the SDK's own encoding of the same spans); the
resource and the instrumentation scope, the same in every batch, are written once.

:class:`SpanSender` is the SDK's ``SpanExporter``: ``BatchSpanProcessor`` calls it from its
thread, never the event loop. It posts with ``http.client`` (a kept connection), and reads the
exporter's environment as the SDK's OTLP/HTTP exporter does: ``OTEL_EXPORTER_OTLP_[TRACES_]HEADERS``
(a collector's token), ``…_COMPRESSION`` (``gzip``, ``deflate``), ``…_CERTIFICATE``,
``…_CLIENT_CERTIFICATE`` and ``…_CLIENT_KEY``. A collector that answers 429, 502, 503 or 504, or
cannot be reached, is tried again with backoff (or its ``Retry-After``) until the export's
timeout; the batch is then dropped and said in the log, never a request's concern.

Imported by gateway.tracing only when tracing is on, so only where the SDK (the ``tracing``
extra) is installed.
"""

from __future__ import annotations

import gzip
import http.client
import logging
import os
import random
import ssl
import struct
import threading
import time
import zlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any
from urllib.parse import urlsplit

from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult
from opentelemetry.util.re import parse_env_headers

log = logging.getLogger("gateway.tracing")

_Q = struct.Struct("<Q").pack  # fixed64
_I = struct.Struct("<I").pack  # fixed32
_D = struct.Struct("<d").pack  # double
_SMALL = [bytes((n,)) for n in range(128)]  # a varint under 128 is its own byte
_MASK64 = (1 << 64) - 1


def _varint(n: int) -> bytes:
    if n < 128:
        return _SMALL[n]
    out = bytearray()
    while n >= 128:
        out.append((n & 127) | 128)
        n >>= 7
    out.append(n)
    return bytes(out)


def _field(tag: bytes, payload: bytes) -> bytes:
    """A length-delimited field (wire type 2): its tag, its length, its bytes."""
    return tag + _varint(len(payload)) + payload


def _text(value: str) -> bytes:
    return value.encode("utf-8", "replace")  # a lone surrogate may not stop an export


def _any(value: Any) -> bytes:
    """An ``AnyValue``: string 1, bool 2, int 3, double 4, array 5, key-value list 6, bytes 7 (a
    oneof: written even where it is its type's default); None, an empty one."""
    if value is None:
        return b""
    if isinstance(value, str):
        return _field(b"\x0a", _text(value))
    if isinstance(value, bool):
        return b"\x10\x01" if value else b"\x10\x00"
    if isinstance(value, int):
        if not -(1 << 63) <= value < 1 << 63:
            raise ValueError(f"{value} is outside int64")  # the attribute is left out, as the SDK's encoder does
        return b"\x18" + _varint(value & _MASK64)  # int64: a negative one as its 64-bit complement
    if isinstance(value, float):
        return b"\x21" + _D(value)
    if isinstance(value, bytes):
        return _field(b"\x3a", value)
    if isinstance(value, Sequence):
        return _field(b"\x2a", b"".join(_field(b"\x0a", _any(v)) for v in value))  # ArrayValue.values 1
    if isinstance(value, Mapping):
        return _field(b"\x32", _attributes(b"\x0a", {str(k): v for k, v in value.items()}))  # KeyValueList.values 1
    return _field(b"\x0a", _text(str(value)))


_PAIRS: dict[
    tuple[str, type, Any], bytes
] = {}  # an attribute's KeyValue, written: most repeat (a method, a path, a port)
_PAIRS_MOST = 4096  # then forgotten all at once, the hot ones written again as they come


def _pair(key: str, value: Any) -> bytes:
    """A ``KeyValue``: key 1, value 2."""
    cacheable = type(value) in _SCALARS and (type(value) is not str or len(value) <= 64)
    if cacheable:
        written = _PAIRS.get((key, type(value), value))  # the type too: True == 1 == 1.0
        if written is not None:
            return written
    written = _field(b"\x0a", _text(key)) + _field(b"\x12", _any(value))
    if cacheable:
        if len(_PAIRS) >= _PAIRS_MOST:
            _PAIRS.clear()
        _PAIRS[key, type(value), value] = written
    return written


_SCALARS = frozenset({str, int, bool})  # not float: 0.0 == -0.0, and a NaN is never found again


def _attributes(tag: bytes, attributes: Mapping[str, Any] | None) -> bytes:
    """Each attribute a ``KeyValue`` under ``tag``."""
    if not attributes:
        return b""
    written = []
    for key, value in attributes.items():
        try:
            written.append(_field(tag, _pair(key, value)))
        except ValueError as exc:
            log.warning("span attribute %r left out: %s", key, exc)
    return b"".join(written)


def _dropped(tag: bytes, count: int) -> bytes:
    return tag + _varint(count) if count else b""


def _trace_state(state: Any) -> bytes:
    return _field(b"\x1a", _text(",".join(f"{k}={v}" for k, v in state.items()))) if state else b""


def _flags(parent: Any) -> int:
    """``SpanFlags``: that a parent's remoteness is known (0x100), and that it is remote (0x200)."""
    return 0x300 if parent is not None and parent.is_remote else 0x100


def _span(span: ReadableSpan) -> bytes:
    """A ``Span``, its fields in trace.proto's numbers."""
    context = span.context
    assert context is not None  # a span the SDK made has one
    parent = span.parent
    status = span.status
    parts = [
        b"\x0a\x10" + context.trace_id.to_bytes(16, "big"),  # trace_id 1
        b"\x12\x08" + context.span_id.to_bytes(8, "big"),  # span_id 2
        _trace_state(context.trace_state),  # 3
        b"\x22\x08" + parent.span_id.to_bytes(8, "big") if parent is not None else b"",  # parent_span_id 4
        _field(b"\x2a", _text(span.name)),  # name 5
        b"\x30" + _SMALL[span.kind.value + 1],  # kind 6: the SDK's INTERNAL 0 is the proto's 1
        b"\x39" + _Q(span.start_time or 0),  # start_time_unix_nano 7
        b"\x41" + _Q(span.end_time or 0),  # end_time_unix_nano 8
        _attributes(b"\x4a", span.attributes),  # 9
        _dropped(b"\x50", span.dropped_attributes),  # 10
    ]
    for event in span.events:  # 11: time 1, name 2, attributes 3, dropped 4
        written = b"\x09" + _Q(event.timestamp) + _field(b"\x12", _text(event.name))
        written += _attributes(b"\x1a", event.attributes) + _dropped(b"\x20", event.dropped_attributes)
        parts.append(_field(b"\x5a", written))
    parts.append(_dropped(b"\x60", span.dropped_events))  # 12
    for link in span.links:  # 13: trace_id 1, span_id 2, trace_state 3, attributes 4, dropped 5, flags 6
        linked = link.context
        written = b"\x0a\x10" + linked.trace_id.to_bytes(16, "big") + b"\x12\x08" + linked.span_id.to_bytes(8, "big")
        written += _trace_state(linked.trace_state) + _attributes(b"\x22", link.attributes)
        written += _dropped(b"\x28", link.dropped_attributes) + b"\x35" + _I(_flags(linked))
        parts.append(_field(b"\x6a", written))
    parts.append(_dropped(b"\x70", span.dropped_links))  # 14
    said = _field(b"\x12", _text(status.description)) if status.description else b""  # 15: message 2, code 3
    code = status.status_code.value
    parts.append(_field(b"\x7a", said + b"\x18" + _SMALL[code]) if code else _field(b"\x7a", said))
    parts.append(b"\x85\x01" + _I(_flags(parent)))  # flags 16, fixed32
    return b"".join(parts)


class _Heads:
    """The written ``Resource`` and ``InstrumentationScope`` of each (the same in every batch)."""

    def __init__(self) -> None:
        self._resources: dict[int, tuple[Any, bytes]] = {}
        self._scopes: dict[int, tuple[Any, bytes]] = {}

    def resource(self, resource: Any) -> bytes:  # ResourceSpans: resource 1, schema_url 3
        kept = self._resources.get(id(resource))
        if kept is None or kept[0] is not resource:
            written = _field(b"\x0a", _attributes(b"\x0a", resource.attributes))
            kept = self._resources[id(resource)] = (resource, written)
        return kept[1]

    def scope(self, scope: Any) -> bytes:  # ScopeSpans: scope 1 (name 1, version 2, attributes 3)
        kept = self._scopes.get(id(scope))
        if kept is None or kept[0] is not scope:
            written = b"\x0a\x00"  # none: an empty one
            if scope is not None:
                inner = _field(b"\x0a", _text(scope.name)) if scope.name else b""
                inner += _field(b"\x12", _text(scope.version)) if scope.version else b""
                inner += _attributes(b"\x1a", getattr(scope, "attributes", None))
                written = _field(b"\x0a", inner)
            kept = self._scopes[id(scope)] = (scope, written)
        return kept[1]

    def request(self, spans: Sequence[ReadableSpan]) -> bytes:
        """An ``ExportTraceServiceRequest`` of ``spans``: grouped by resource, then by scope."""
        grouped: dict[int, tuple[Any, dict[int, tuple[Any, list[bytes]]]]] = {}
        for span in spans:
            resource, scope = span.resource, span.instrumentation_scope
            scopes = grouped.setdefault(id(resource), (resource, {}))[1]
            scopes.setdefault(id(scope), (scope, []))[1].append(_field(b"\x12", _span(span)))
        out = []
        for resource, scopes in grouped.values():
            written = [self.resource(resource)]
            for scope, encoded in scopes.values():
                schema = getattr(scope, "schema_url", "") if scope is not None else ""
                tail = _field(b"\x1a", _text(schema)) if schema else b""
                written.append(_field(b"\x12", self.scope(scope) + b"".join(encoded) + tail))
            if resource.schema_url:
                written.append(_field(b"\x1a", _text(resource.schema_url)))
            out.append(_field(b"\x0a", b"".join(written)))  # resource_spans 1
        return b"".join(out)


def encode(spans: Sequence[ReadableSpan]) -> bytes:
    """``spans`` as one serialized ``ExportTraceServiceRequest``."""
    return _Heads().request(spans)


RETRIED = frozenset({429, 502, 503, 504})  # what OTLP/HTTP says a client tries again
_COMPRESSIONS: dict[str, Callable[[bytes], bytes]] = {"gzip": gzip.compress, "deflate": zlib.compress}


def _setting(name: str) -> str | None:
    """``OTEL_EXPORTER_OTLP_TRACES_{name}``, else ``OTEL_EXPORTER_OTLP_{name}``."""
    return os.environ.get(f"OTEL_EXPORTER_OTLP_TRACES_{name}") or os.environ.get(f"OTEL_EXPORTER_OTLP_{name}") or None


class SpanSender(SpanExporter):
    """Spans posted to ``url`` (the collector's ``/v1/traces``), written by :func:`encode`."""

    def __init__(self, url: str, *, timeout: float = 10.0, headers: Mapping[str, str] | None = None) -> None:
        parts = urlsplit(url)
        self._https = parts.scheme == "https"
        self._host = parts.hostname or "localhost"
        self._port = parts.port or (443 if self._https else 80)  # http.client would read "::1" as a host:port
        self._path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        self._timeout = timeout
        compression = (_setting("COMPRESSION") or "none").strip().lower()
        self._compress = _COMPRESSIONS.get(compression)
        if compression not in ("gzip", "deflate", "none"):
            log.warning("OTLP compression %r is not one of gzip, deflate, none: spans go uncompressed", compression)
        self._headers = {"Content-Type": "application/x-protobuf", "User-Agent": "modality-gateway"}
        self._headers.update(parse_env_headers(_setting("HEADERS") or "", liberal=True))
        self._headers.update(headers or {})
        if self._compress is not None:
            self._headers["Content-Encoding"] = compression
        self._heads = _Heads()
        self._connection: http.client.HTTPConnection | None = None
        self._lock = threading.Lock()  # export() and shutdown() may come from two threads
        self._stopping = threading.Event()

    def _connect(self) -> http.client.HTTPConnection:
        if self._connection is None:
            if self._https:
                context = ssl.create_default_context(cafile=_setting("CERTIFICATE"))
                certificate = _setting("CLIENT_CERTIFICATE")
                if certificate:
                    context.load_cert_chain(certificate, _setting("CLIENT_KEY"))
                self._connection = http.client.HTTPSConnection(
                    self._host, self._port, timeout=self._timeout, context=context
                )
            else:
                self._connection = http.client.HTTPConnection(self._host, self._port, timeout=self._timeout)
        return self._connection

    def _post(self, body: bytes, timeout: float) -> tuple[int, str | None]:
        """One POST within ``timeout`` seconds: the collector's status and its ``Retry-After`` (the
        connection closed on an error). A kept connection the collector (or a balancer before it)
        closed while idle is found out by the request: that one goes again at once on a new one."""
        for fresh in (self._connection is None, True):
            connection = self._connect()
            connection.timeout = timeout
            if connection.sock is not None:
                connection.sock.settimeout(timeout)
            try:
                connection.request("POST", self._path, body=body, headers=self._headers)
                response = connection.getresponse()
                response.read()  # the connection kept for the next batch
                return response.status, response.getheader("Retry-After")
            except (BrokenPipeError, ConnectionResetError, http.client.RemoteDisconnected):
                connection.close()
                self._connection = None
                if fresh:
                    raise
            except BaseException:
                connection.close()
                self._connection = None
                raise
        raise AssertionError("unreachable: a fresh connection's failure is raised")

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        if self._stopping.is_set():
            return SpanExportResult.FAILURE
        with self._lock:
            body = self._heads.request(spans)
            if self._compress is not None:
                body = self._compress(body)
            deadline = time.monotonic() + self._timeout
            for attempt in range(7):
                reason: str
                retry_after: str | None = None
                try:
                    status, retry_after = self._post(body, max(0.001, deadline - time.monotonic()))
                except (OSError, http.client.HTTPException) as exc:
                    reason = f"{type(exc).__name__}: {exc}"
                else:
                    if 200 <= status < 300:
                        return SpanExportResult.SUCCESS
                    reason = f"HTTP {status}"
                    if status not in RETRIED:
                        break
                delay = _delay(attempt, retry_after)
                if time.monotonic() + delay > deadline or self._stopping.wait(delay):
                    break
            log.warning("%d spans not exported to the collector (%s): dropped", len(spans), reason)
            return SpanExportResult.FAILURE

    def shutdown(self) -> None:
        self._stopping.set()  # a backoff under way ends now
        with self._lock:
            if self._connection is not None:
                self._connection.close()
                self._connection = None

    def force_flush(self, timeout_millis: int = 30_000) -> bool:
        return True  # nothing is held here: each export is posted as it comes


def _delay(attempt: int, retry_after: str | None) -> float:
    """The wait before another try: the collector's ``Retry-After`` seconds where it gave them,
    else 1, 2, 4 … seconds with a fifth of jitter."""
    if retry_after is not None and retry_after.strip().isdigit():
        return float(retry_after.strip())
    return float(2**attempt) * random.uniform(0.8, 1.2)

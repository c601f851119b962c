"""Traces: a span for each stage of a request (OpenTelemetry), W3C trace context in and out.

Off unless ``server.tracing`` names an OTLP/HTTP endpoint; then every request to a model
endpoint is a trace (or a part of the client's, from its ``traceparent``), sampled at
``sample_ratio`` (or as the client's sampled flag says, with ``trust_client_sampling``), once, as
it arrives: a request not sampled makes no span (:meth:`Tracing.open`). The SDK is the
``tracing`` extra (``pip install 'modality-gateway[tracing]'``): this module imports it only when
tracing is on, and without it the gateway runs as it always did (the config refuses
``server.tracing`` where it is not installed).

A sampled request's spans are recorded here (:class:`Span`: a name, ids, attributes and times,
kept as the request goes) and handed, as each ends, to the SDK's ``BatchSpanProcessor`` as its
``ReadableSpan``: the SDK's pipeline from there on (its queue and batch thread, never the event
loop, ``OTEL_BSP_*``, the resource with ``OTEL_RESOURCE_ATTRIBUTES``, ``OTEL_SPAN_ATTRIBUTE_*``
limits), sent as OTLP/HTTP protobuf that gateway.otlp writes itself. The SDK's ``Tracer`` is not
used: making and ending its spans (a sampler, an attributes object under a lock, context attach
and detach) cost a traced request ~36 µs on the loop against ~7 here (docs/benchmarks.md), for
spans whose every attribute the gateway sets itself. No global of OpenTelemetry's is set, and the
current span is a context variable of this module's.

The span tree of one request (names fixed: dashboards and queries rely on them)::

    {operation} {model}     SERVER   the request, from its arrival to its handler's end: http.*,
    │                                gen_ai.operation.name, gen_ai.request.model,
    │                                gen_ai.response.model, gen_ai.usage.*, gateway.priority,
    │                                gateway.route, error.type
    ├── gateway.admission            arrival to the plan: the media it holds, by modality and hash
    ├── gateway.fetch                remote images fetched (visual_tokens remote: fetch)
    ├── gateway.decode               videos probed and sampled, images downscaled
    ├── gateway.transcribe           audio to its transcript (the transcription POST carries it)
    ├── gateway.encode               images to embeddings (gateway.prime on vLLM's encoder
    │                                instances): their bytes' sha256, the encoder's request carries it
    ├── gateway.queue                the wait for a slot of the model (max_concurrency)
    └── gateway.upstream  CLIENT     one per attempt: server.address, http.response.status_code,
        │                            gateway.outcome; the engine gets its traceparent
        └── gateway.relay            the answer relayed to the client

Nothing of a request's content, and no key, is ever an attribute: media are named by modality
and hash, errors by their code.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Iterator, Mapping, MutableMapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from contextvars import ContextVar
from importlib.util import find_spec
from typing import TYPE_CHECKING, Any, NamedTuple

if TYPE_CHECKING:
    from opentelemetry.sdk.trace.export import SpanExporter
    from opentelemetry.trace import SpanContext

Value = str | bool | int | float | Sequence[str]
Attributes = Mapping[str, Value]


class Span:
    """A span the gateway records: its name, context (ids), parent's context, kind, attributes,
    times and status, kept as the request goes; at :meth:`end` the SDK's batch processor is given
    it as a ``ReadableSpan``. The methods are the OpenTelemetry API's that the gateway uses. Made
    by :class:`Tracing` only."""

    __slots__ = ("_tracing", "attributes", "context", "end_ns", "error", "kind", "name", "parent", "start_ns")

    def __init__(
        self, tracing: Tracing, name: str, context: SpanContext, parent: SpanContext | None, kind: str, start_ns: int
    ) -> None:
        self._tracing, self.name, self.context, self.parent, self.kind = tracing, name, context, parent, kind
        self.start_ns, self.end_ns = start_ns, 0
        self.attributes: dict[str, Value] = {}
        self.error = False  # the span's status: an error, or not set

    def is_recording(self) -> bool:
        """Until it ends (the SDK's spans say so too)."""
        return not self.end_ns

    def set_attribute(self, key: str, value: Value | None) -> None:
        """Set, unless the value is None (the SDK drops it too) or the span ended (its attributes
        are the export's, read in the batch thread)."""
        if value is not None and not self.end_ns:
            self.attributes[key] = value

    def set_attributes(self, attributes: Mapping[str, Value | None]) -> None:
        if not self.end_ns:
            for key, value in attributes.items():
                if value is not None:
                    self.attributes[key] = value

    def update_name(self, name: str) -> None:
        if not self.end_ns:
            self.name = name

    def end(self) -> None:
        """Ended now, and given to the export; a second end does nothing."""
        if not self.end_ns:
            self.end_ns = time.time_ns()
            self._tracing._export(self)


class _Untraced:
    """What :meth:`Tracing.start` and :meth:`Tracing.current` give where the request is not
    sampled (or there is none): a span that records nothing."""

    def is_recording(self) -> bool:
        return False

    def set_attribute(self, key: str, value: Value | None) -> None:
        pass

    def set_attributes(self, attributes: Mapping[str, Value | None]) -> None:
        pass

    def update_name(self, name: str) -> None:
        pass

    def end(self) -> None:
        pass


UNTRACED: Any = _Untraced()  # typed as a Span by its users: it answers the same calls


class Traced(NamedTuple):
    """A request's span (None: not sampled), the context token that made it current (or made its
    context :data:`UNSAMPLED`'s), and its operation."""

    span: Span | None
    token: object
    operation: str


# What a request not sampled passes on: its traceparent (and the client's tracestate), made once
# as it opens; the rest of its path asks :meth:`Tracing.recording` (one read of this) and no more.
UNSAMPLED: ContextVar[dict[str, str] | None] = ContextVar("gateway_unsampled_context", default=None)
# A sampled request's span current now: its own, or a stage's while the stage runs.
CURRENT: ContextVar[Span | None] = ContextVar("gateway_current_span", default=None)


def available() -> bool:
    """Whether the SDK is installed here (the OTLP it sends is written by gateway.otlp)."""
    return find_spec("opentelemetry.sdk") is not None


def traces_url(endpoint: str) -> str:
    """The collector's traces path under an OTLP/HTTP endpoint (``http://collector:4318``), as
    OTEL_EXPORTER_OTLP_ENDPOINT is read; an endpoint that already ends in it is taken as it is."""
    endpoint = endpoint.rstrip("/")
    return endpoint if endpoint.endswith("/v1/traces") else f"{endpoint}/v1/traces"


class Tracing:
    """The gateway's spans, the SDK's batch processor and exporter, the W3C propagator; one per process."""

    def __init__(
        self,
        endpoint: str,
        sample_ratio: float = 1.0,
        *,
        service: str = "modality-gateway",
        version: str = "",
        exporter: SpanExporter | None = None,
        trust_client_sampling: bool = False,
    ) -> None:
        import random

        from opentelemetry import trace
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import ReadableSpan, SpanLimits
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.sdk.util.instrumentation import InstrumentationScope
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        from gateway.otlp import SpanSender

        # Whether a request is recorded is decided once, in open(): a request not sampled makes
        # no span, one sampled records every stage it goes through.
        self._ratio, self._trust, self._draw = sample_ratio, trust_client_sampling, random.Random().random
        if os.environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":  # as the SDK's provider reads it
            self._ratio, self._trust = 0.0, False  # nothing recorded; the context still goes on
        self._trace, self._readable = trace, ReadableSpan
        self._resource = Resource.create({"service.name": service, "service.version": version})
        self._scope = InstrumentationScope("modality-gateway", version)
        self._limits = SpanLimits()  # OTEL_SPAN_ATTRIBUTE_COUNT_LIMIT, ..._VALUE_LENGTH_LIMIT
        # trace and span ids: random bits, never 0 (the invalid id), as the SDK's RandomIdGenerator
        # draws them, without its two calls an id
        self._bits = random.Random().getrandbits
        self._sampled = trace.TraceFlags(trace.TraceFlags.SAMPLED)
        self._kinds = {
            "server": trace.SpanKind.SERVER,
            "internal": trace.SpanKind.INTERNAL,
            "client": trace.SpanKind.CLIENT,
        }
        self._error = trace.Status(trace.StatusCode.ERROR)
        self._unset = trace.Status(trace.StatusCode.UNSET)
        sending = exporter if exporter is not None else SpanSender(traces_url(endpoint), timeout=10)
        self._processor = BatchSpanProcessor(sending)
        self._propagator = TraceContextTextMapPropagator()

    def open(self, headers: Mapping[str, str], operation: str, method: str, path: str, request_id: str) -> Traced:
        """A request's span, the client's ``traceparent`` its parent, made current until
        :meth:`close` (no context manager: the front door keeps one frame); ``operation``:
        the GenAI semantic conventions' ``gen_ai.operation.name`` of its API (gateway.admission.apis).

        Sampled here, once: at ``sample_ratio``, by a draw of the gateway's own (a ratio of the
        trace id would be the client's to choose, through its traceparent), or by the client's
        sampled flag where the table trusts it. A request not sampled costs what its context
        does and no more: no span, in the client's trace or a new one, whose traceparent (flag
        not sampled) still goes to the engine."""
        remote: SpanContext | None = None
        if "traceparent" in headers:
            remote = self._trace.get_current_span(self._propagator.extract(headers)).get_span_context()
            if not remote.is_valid:  # a traceparent that does not parse: a new trace
                remote = None
        sampled = remote.trace_flags.sampled if self._trust and remote is not None else self._draw() < self._ratio
        if not sampled:
            trace_id = remote.trace_id if remote is not None else self._bits(128) or 1
            context = {"traceparent": f"00-{trace_id:032x}-{self._bits(64) or 1:016x}-00"}
            if remote is not None and remote.trace_state:
                context["tracestate"] = remote.trace_state.to_header()
            return Traced(None, UNSAMPLED.set(context), operation)
        span = self._span(operation, remote, "server", None)
        span.attributes.update(
            {
                "http.request.method": method,
                "url.path": path,
                "gen_ai.operation.name": operation,
                "gateway.request_id": request_id,
            }
        )
        return Traced(span, CURRENT.set(span), operation)

    def close(self, traced: Traced, status: int, error: str | None, model: str | None) -> None:
        """The request's span ended with the status its client got: named ``{operation}
        {model}`` once the model is known, ``error.type`` the error's code (``cancelled``,
        ``client_closed``: the client left); the span's status an error for a 5xx only, as HTTP
        servers' spans have it (a 4xx is the client's)."""
        span = traced.span
        if span is None:  # not sampled: nothing to say, nothing to send
            UNSAMPLED.reset(traced.token)  # type: ignore[arg-type]
            return
        _reset(traced.token)
        if model is not None:  # None: the request named no model the gateway knows
            span.name = f"{traced.operation} {model}"
            span.attributes["gen_ai.request.model"] = model
        span.attributes["http.response.status_code"] = status
        if error is None and status >= 400:
            error = str(status)
        if error is not None:
            span.attributes["error.type"] = error
            span.error = status >= 500
        span.end()

    @contextlib.contextmanager
    def stage(self, name: str, attributes: Attributes | None = None) -> Iterator[Span]:
        """A child of the current span, current while the stage runs; an error ends it marked
        with its code (never its message: messages may quote a request)."""
        span = self.start(name, attributes)
        if span is UNTRACED:  # under no span that records: nothing to make current
            yield span
            return
        token = CURRENT.set(span)
        try:
            yield span
        except BaseException as exc:
            self.failed(span, exc)
            raise
        finally:
            _reset(token)
            span.end()

    def start(
        self,
        name: str,
        attributes: Attributes | None = None,
        *,
        parent: Span | None = None,
        kind: str = "internal",
        start_ns: int | None = None,
    ) -> Span:
        """A span not made current: a child of ``parent`` (default the current span), from
        ``start_ns`` (``time.time_ns()``; default now), ended by its caller. Under no span that
        records (a request not sampled) a span that records nothing: the context the request
        passes on says not sampled."""
        above = parent if parent is not None else CURRENT.get()
        if above is None or not above.is_recording():
            return UNTRACED  # type: ignore[no-any-return]
        span = self._span(name, above.context, kind, start_ns)
        if attributes:
            span.set_attributes(attributes)
        return span

    def _span(self, name: str, parent: SpanContext | None, kind: str, start_ns: int | None) -> Span:
        """A new span under ``parent`` (its trace, its tracestate), or the root of a new trace."""
        trace_id = parent.trace_id if parent is not None else self._bits(128) or 1
        context = self._trace.SpanContext(
            trace_id,
            self._bits(64) or 1,
            False,
            self._sampled,
            parent.trace_state if parent is not None else None,
        )
        return Span(self, name, context, parent, kind, start_ns or time.time_ns())

    def _export(self, span: Span) -> None:
        """An ended span to the SDK's batch processor (its queue; the batch thread sends it),
        its attributes held to the span limits the environment sets."""
        attributes: Any = span.attributes
        limits = self._limits
        if limits.max_span_attribute_length is not None or len(attributes) > (limits.max_span_attributes or 0):
            from opentelemetry.attributes import BoundedAttributes

            attributes = BoundedAttributes(
                limits.max_span_attributes, attributes, immutable=True, max_value_len=limits.max_span_attribute_length
            )
        self._processor.on_end(
            self._readable(
                span.name,
                span.context,
                span.parent,
                self._resource,
                attributes,
                kind=self._kinds[span.kind],
                status=self._error if span.error else self._unset,
                start_time=span.start_ns,
                end_time=span.end_ns,
                instrumentation_scope=self._scope,
            )
        )

    def failed(self, span: Span, exc: BaseException | str) -> None:
        """``span`` failed: ``error.type`` is the error's code, or what happened."""
        if isinstance(exc, asyncio.CancelledError):
            kind = "cancelled"  # the client left
        elif isinstance(exc, BaseException):
            code = getattr(exc, "code", None)
            kind = code if isinstance(code, str) else type(exc).__name__
        else:
            kind = exc
        if span.is_recording():
            span.set_attribute("error.type", kind)
            span.error = True

    def current(self) -> Span:
        """The span current now (a stage's, or the request's), or one that records nothing."""
        span = CURRENT.get()
        return span if span is not None else UNTRACED

    def recording(self) -> bool:
        """Whether the current request is recorded (sampled): what its spans would be made for."""
        span = CURRENT.get()
        return span is not None and not span.end_ns

    def inject(self, headers: MutableMapping[str, str], span: Span | None = None) -> None:
        """``traceparent`` (and ``tracestate``) of ``span``, default the current one, into
        ``headers``, in place of any the client sent; a request not sampled passes its own."""
        unsampled = UNSAMPLED.get()
        if unsampled is not None:
            while "tracestate" in headers:  # every line of it: the request's own goes, if any
                del headers["tracestate"]
            headers.update(unsampled)
            return
        if span is None:
            span = CURRENT.get()
        context = getattr(span, "context", None)  # an ended span's too, as the SDK's propagator does
        if context is None:
            return
        headers["traceparent"] = f"00-{context.trace_id:032x}-{context.span_id:016x}-01"
        if context.trace_state:
            headers["tracestate"] = context.trace_state.to_header()

    def flush(self, timeout_ms: int = 10_000) -> bool:
        """Every span ended so far sent (blocking: call it in a thread)."""
        return self._processor.force_flush(timeout_ms)

    def shutdown(self) -> None:
        """The spans left sent, the exporter closed (blocking: call it in a thread)."""
        self._processor.shutdown()  # type: ignore[no-untyped-call]


def _reset(token: Any) -> None:
    """The current span as it was before ``token``'s; one made current in another context (a task
    the span's stage did not start in) is left, said in the log, as the SDK's ``detach`` does."""
    try:
        CURRENT.reset(token)
    except ValueError:
        logging.getLogger("gateway.tracing").warning("a span ended in another context than it began in")


def stage(tracing: Tracing | None, name: str, attributes: Attributes | None = None) -> AbstractContextManager[Any]:
    """:meth:`Tracing.stage`, or nothing with tracing off or the request not sampled (the calls
    it makes still carry its context: the current span's)."""
    return nullcontext() if tracing is None or not tracing.recording() else tracing.stage(name, attributes)


def inject(tracing: Tracing | None, headers: MutableMapping[str, str]) -> None:
    """The current span's ``traceparent`` into ``headers`` (a call to an encoder or a
    transcription model), with tracing on."""
    if tracing is not None:
        tracing.inject(headers)

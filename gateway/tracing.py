"""Traces: a span for each stage of a request (OpenTelemetry), W3C trace context in and out.

Off unless ``server.tracing`` names an OTLP/HTTP endpoint; then every request to a model
endpoint is a trace (or a part of the client's, from its ``traceparent``), sampled at
``sample_ratio`` (or as the client's sampled flag says, with ``trust_client_sampling``), once, as
it arrives: a request not sampled never reaches the SDK (:meth:`Tracing.open`). The SDK is the
``tracing`` extra (``pip install 'modality-gateway[tracing]'``): this module imports it only when
tracing is on, and without it the gateway runs as it always did (the config refuses
``server.tracing`` where it is not installed). Spans are batched by the SDK's own thread, never on
the event loop, and sent from it as OTLP/HTTP protobuf that gateway.otlp writes itself (a third
of the SDK exporter's CPU). No global of OpenTelemetry's is set: the
gateway's provider is its own, and so is its propagator.

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
from collections.abc import Iterator, Mapping, MutableMapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from contextvars import ContextVar
from importlib.util import find_spec
from typing import TYPE_CHECKING, Any, NamedTuple

if TYPE_CHECKING:
    from opentelemetry.context import Context
    from opentelemetry.sdk.trace.export import SpanExporter
    from opentelemetry.trace import Span as Span
else:
    Span = Any  # the name imports without the extra too (its users annotate with it)

Attributes = Mapping[str, str | bool | int | float | Sequence[str]]


class Traced(NamedTuple):
    """A request's span (None: not sampled), the context token that made it current (or made its
    context :data:`UNSAMPLED`'s), and its operation."""

    span: Span | None
    token: object
    operation: str


# What a request not sampled passes on: its traceparent (and the client's tracestate), made once
# as it opens; the rest of its path asks :meth:`Tracing.recording` (one read of this) and no more.
UNSAMPLED: ContextVar[dict[str, str] | None] = ContextVar("gateway_unsampled_context", default=None)


def available() -> bool:
    """Whether the SDK is installed here (the OTLP it sends is written by gateway.otlp)."""
    return find_spec("opentelemetry.sdk") is not None


def traces_url(endpoint: str) -> str:
    """The collector's traces path under an OTLP/HTTP endpoint (``http://collector:4318``), as
    OTEL_EXPORTER_OTLP_ENDPOINT is read; an endpoint that already ends in it is taken as it is."""
    endpoint = endpoint.rstrip("/")
    return endpoint if endpoint.endswith("/v1/traces") else f"{endpoint}/v1/traces"


class Tracing:
    """The gateway's tracer provider, its exporter and the W3C propagator; one per process."""

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

        from opentelemetry import context, trace
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.sdk.trace.sampling import ALWAYS_ON
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self._context, self._trace = context, trace
        # Whether a request is recorded is decided once, in open(), before the SDK is asked for
        # anything: its sampler records every span it is asked for (a request's root and, under
        # it, the stages), and a request not sampled never reaches it.
        self._ratio, self._trust, self._draw = sample_ratio, trust_client_sampling, random.Random().random
        self._provider = TracerProvider(
            sampler=ALWAYS_ON,
            resource=Resource.create({"service.name": service, "service.version": version}),
            shutdown_on_exit=False,  # closed with the app
        )
        self._ids = self._provider.id_generator
        self._root = context.Context()  # the context of a request without a traceparent: no parent
        from gateway.otlp import SpanSender

        sending = exporter if exporter is not None else SpanSender(traces_url(endpoint), timeout=10)
        self._provider.add_span_processor(BatchSpanProcessor(sending))
        self._tracer = self._provider.get_tracer("modality-gateway", version)
        self._propagator = TraceContextTextMapPropagator()
        self._kinds = {"internal": trace.SpanKind.INTERNAL, "client": trace.SpanKind.CLIENT}

    def open(self, headers: Mapping[str, str], operation: str, method: str, path: str, request_id: str) -> Traced:
        """A request's span, the client's ``traceparent`` its parent, made current until
        :meth:`close` (no context manager: the front door keeps one frame); ``operation``:
        the GenAI semantic conventions' ``gen_ai.operation.name`` of its API (gateway.admission.apis).

        Sampled here, once: at ``sample_ratio``, by a draw of the gateway's own (a ratio of the
        trace id would be the client's to choose, through its traceparent), or by the client's
        sampled flag where the table trusts it. A request not sampled costs what its context
        does and no more: a span that records nothing, in the client's trace or a new one, whose
        traceparent (flag not sampled) still goes to the engine; the SDK is never asked."""
        parent = self._propagator.extract(headers) if "traceparent" in headers else None
        remote = self._trace.get_current_span(parent).get_span_context() if parent is not None else None
        if remote is not None and not remote.is_valid:  # a traceparent that does not parse: a new trace
            remote = None
        sampled = remote.trace_flags.sampled if self._trust and remote is not None else self._draw() < self._ratio
        if not sampled:
            trace_id = remote.trace_id if remote is not None else self._ids.generate_trace_id()
            context = {"traceparent": f"00-{trace_id:032x}-{self._ids.generate_span_id():016x}-00"}
            if remote is not None and remote.trace_state:
                context["tracestate"] = remote.trace_state.to_header()
            return Traced(None, UNSAMPLED.set(context), operation)
        attributes = {
            "http.request.method": method,
            "url.path": path,
            "gen_ai.operation.name": operation,
            "gateway.request_id": request_id,
        }
        span = self._tracer.start_span(
            operation,
            context=parent if parent is not None else self._root,  # none: a trace of its own
            kind=self._trace.SpanKind.SERVER,
            attributes=attributes,
            record_exception=False,
            set_status_on_exception=False,
        )
        return Traced(span, self._context.attach(self._trace.set_span_in_context(span)), operation)

    def close(self, traced: Traced, status: int, error: str | None, model: str | None) -> None:
        """The request's span ended with the status its client got: named ``{operation}
        {model}`` once the model is known, ``error.type`` the error's code (``cancelled``,
        ``client_closed``: the client left); the span's status an error for a 5xx only, as HTTP
        servers' spans have it (a 4xx is the client's)."""
        span = traced.span
        if span is None:  # not sampled: nothing to say, nothing to send
            UNSAMPLED.reset(traced.token)  # type: ignore[arg-type]
            return
        self._context.detach(traced.token)  # type: ignore[arg-type]
        if model is not None:  # None: the request named no model the gateway knows
            span.update_name(f"{traced.operation} {model}")
            span.set_attribute("gen_ai.request.model", model)
        span.set_attribute("http.response.status_code", status)
        if error is None and status >= 400:
            error = str(status)
        if error is not None:
            span.set_attribute("error.type", error)
            if status >= 500:
                span.set_status(self._trace.StatusCode.ERROR)
        span.end()

    @contextlib.contextmanager
    def stage(self, name: str, attributes: Attributes | None = None) -> Iterator[Span]:
        """A child of the current span, current while the stage runs; an error ends it marked
        with its code (never its message: messages may quote a request)."""
        with self._tracer.start_as_current_span(
            name, attributes=attributes, record_exception=False, set_status_on_exception=False
        ) as span:
            try:
                yield span
            except BaseException as exc:
                self.failed(span, exc)
                raise

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
        ``start_ns`` (``time.time_ns()``; default now), ended by its caller. Under a span that
        is not recorded (a request not sampled) it is that span: nothing to make, and the
        context it passes on says not sampled."""
        above = parent if parent is not None else self._trace.get_current_span()
        if not above.is_recording():
            return above
        context: Context | None = self._trace.set_span_in_context(parent) if parent is not None else None
        return self._tracer.start_span(
            name,
            context=context,
            kind=self._kinds[kind],
            attributes=attributes,
            start_time=start_ns,
            record_exception=False,
            set_status_on_exception=False,
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
        span.set_attribute("error.type", kind)
        span.set_status(self._trace.StatusCode.ERROR)

    def current(self) -> Span:
        return self._trace.get_current_span()

    def recording(self) -> bool:
        """Whether the current request is recorded (sampled): what its spans would be made for."""
        return UNSAMPLED.get() is None and self._trace.get_current_span().is_recording()

    def inject(self, headers: MutableMapping[str, str], span: Span | None = None) -> None:
        """``traceparent`` (and ``tracestate``) of ``span``, default the current one, into
        ``headers``, in place of any the client sent; a request not sampled passes its own."""
        unsampled = UNSAMPLED.get()
        if unsampled is not None:
            while "tracestate" in headers:  # every line of it: the request's own goes, if any
                del headers["tracestate"]
            headers.update(unsampled)
            return
        context = self._trace.set_span_in_context(span) if span is not None else None
        self._propagator.inject(headers, context=context)

    def flush(self, timeout_ms: int = 10_000) -> bool:
        """Every span ended so far sent (blocking: call it in a thread)."""
        return self._provider.force_flush(timeout_ms)

    def shutdown(self) -> None:
        """The spans left sent, the exporter closed (blocking: call it in a thread)."""
        self._provider.shutdown()


def stage(tracing: Tracing | None, name: str, attributes: Attributes | None = None) -> AbstractContextManager[Any]:
    """:meth:`Tracing.stage`, or nothing with tracing off or the request not sampled (the calls
    it makes still carry its context: the current span's)."""
    return nullcontext() if tracing is None or not tracing.recording() else tracing.stage(name, attributes)


def inject(tracing: Tracing | None, headers: MutableMapping[str, str]) -> None:
    """The current span's ``traceparent`` into ``headers`` (a call to an encoder or a
    transcription model), with tracing on."""
    if tracing is not None:
        tracing.inject(headers)

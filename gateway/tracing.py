"""Traces: a span for each stage of a request (OpenTelemetry), W3C trace context in and out.

Off unless ``server.tracing`` names an OTLP/HTTP endpoint; then every request to a model
endpoint is a trace (or a part of the client's, from its ``traceparent``), sampled at
``sample_ratio`` unless the client's context says whether it was (parent-based). The SDK and its
exporter are the ``tracing`` extra (``pip install 'modality-gateway[tracing]'``): this module
imports them only when tracing is on, and without it the gateway runs as it always did (the
config refuses ``server.tracing`` where they are not installed). Spans are batched and sent by
the SDK's own thread, never on the event loop. No global of OpenTelemetry's is set: the
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
    """A request's span, the context token that made it current, and its operation."""

    span: Span
    token: object
    operation: str


def available() -> bool:
    """Whether the SDK and its OTLP/HTTP exporter are installed here."""
    return find_spec("opentelemetry.sdk") is not None and find_spec("opentelemetry.exporter.otlp") is not None


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
        from opentelemetry import context, trace
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self._context, self._trace = context, trace
        ours = TraceIdRatioBased(sample_ratio)
        # a client's trace id is its own to choose, and so would be a ratio of it: a remote parent
        # is sampled at random, at the ratio, unless the table trusts the client's sampled flag
        sampler = ParentBased(ours)
        if not trust_client_sampling:
            remote = _random_sampler(sample_ratio)
            sampler = ParentBased(ours, remote_parent_sampled=remote, remote_parent_not_sampled=remote)
        self._provider = TracerProvider(
            sampler=sampler,
            resource=Resource.create({"service.name": service, "service.version": version}),
            shutdown_on_exit=False,  # closed with the app
        )
        sending = exporter if exporter is not None else OTLPSpanExporter(endpoint=traces_url(endpoint), timeout=10)
        self._provider.add_span_processor(BatchSpanProcessor(sending))
        self._tracer = self._provider.get_tracer("modality-gateway", version)
        self._propagator = TraceContextTextMapPropagator()
        self._kinds = {"internal": trace.SpanKind.INTERNAL, "client": trace.SpanKind.CLIENT}

    def open(self, headers: Mapping[str, str], operation: str, method: str, path: str, request_id: str) -> Traced:
        """A request's span, the client's ``traceparent`` its parent, made current until
        :meth:`close` (no context manager: the front middleware keeps one frame); ``operation``:
        the GenAI semantic conventions' ``gen_ai.operation.name`` of its API (gateway.admission.apis)."""
        attributes = {
            "http.request.method": method,
            "url.path": path,
            "gen_ai.operation.name": operation,
            "gateway.request_id": request_id,
        }
        span = self._tracer.start_span(
            operation,
            context=self._propagator.extract(headers),
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
        self._context.detach(traced.token)  # type: ignore[arg-type]
        span = traced.span
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
        return self._trace.get_current_span().is_recording()

    def inject(self, headers: MutableMapping[str, str], span: Span | None = None) -> None:
        """``traceparent`` (and ``tracestate``) of ``span``, default the current one, into
        ``headers``, in place of any the client sent."""
        context = self._trace.set_span_in_context(span) if span is not None else None
        self._propagator.inject(headers, context=context)

    def flush(self, timeout_ms: int = 10_000) -> bool:
        """Every span ended so far sent (blocking: call it in a thread)."""
        return self._provider.force_flush(timeout_ms)

    def shutdown(self) -> None:
        """The spans left sent, the exporter closed (blocking: call it in a thread)."""
        self._provider.shutdown()


def _random_sampler(ratio: float) -> Any:
    """A sampler that records ``ratio`` of what it is asked about, by a draw of its own (the
    SDK's ratio sampler reads the trace id, which a client's traceparent chooses)."""
    import random

    from opentelemetry.sdk.trace.sampling import Decision, Sampler, SamplingResult

    class RandomRatio(Sampler):
        def __init__(self) -> None:
            self._draw = random.Random()

        def should_sample(self, parent_context: Any, trace_id: int, name: str, *rest: Any, **named: Any) -> Any:
            # the SDK's arguments after these: kind, attributes, links, trace_state
            asked = dict(zip(("kind", "attributes", "links", "trace_state"), rest, strict=False)) | named
            if self._draw.random() < ratio:  # the span keeps the attributes it was started with
                return SamplingResult(Decision.RECORD_AND_SAMPLE, asked.get("attributes"), asked.get("trace_state"))
            return SamplingResult(Decision.DROP, None, asked.get("trace_state"))

        def get_description(self) -> str:
            return f"RandomRatio{{{ratio}}}"

    return RandomRatio()


def stage(tracing: Tracing | None, name: str, attributes: Attributes | None = None) -> AbstractContextManager[Any]:
    """:meth:`Tracing.stage`, or nothing with tracing off or the request not sampled (the calls
    it makes still carry its context: the current span's)."""
    return nullcontext() if tracing is None or not tracing.recording() else tracing.stage(name, attributes)


def inject(tracing: Tracing | None, headers: MutableMapping[str, str]) -> None:
    """The current span's ``traceparent`` into ``headers`` (a call to an encoder or a
    transcription model), with tracing on."""
    if tracing is not None:
        tracing.inject(headers)

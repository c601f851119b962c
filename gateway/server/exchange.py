"""One request, from admission to its last byte, and the stages it goes through.

An API's handler begins an :class:`Exchange` (the generation it is admitted under, its body read
and parsed once), admits it (its plan), and hands it to the stages, which are the same for every
API: :func:`convert` (media the model takes in another form), :func:`encode` (images to
embeddings, or primed on vLLM's encoder instances; the bytes to send) and :func:`forward` (the
upstream hop, given a :class:`~gateway.upstream.client.Dispatch`: the transport never sees the
exchange). Each stage reads what the ones before it left on the exchange.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Awaitable, Mapping
from dataclasses import dataclass, field
from typing import Any

import orjson
from aiohttp import web

from ..admission.apis import COMPLETIONS
from ..admission.attributes import admission_attributes
from ..admission.body import exact, read_json
from ..admission.priority import check_engine_priority
from ..admission.recount import counted_later
from ..admission.rewrite import check_grown_size, upstream_body, usage_fields
from ..admission.route import RoutePlan, Visible
from ..admission.strings import Deferred
from ..config import PRIORITIES, ApiKey, GatewayConfig, ModelConfig
from ..config.generation import Generation
from ..encode.client import Encoded, Replacements
from ..media import converters
from ..media.decoders import TENANT
from ..metrics import UNKNOWN_MODEL
from ..tracing import stage
from ..upstream.concurrency import gated
from ..upstream.dispatch import Dispatch, Timeouts
from ..upstream.replicas import Pool
from . import spending
from .state import MODEL_LABEL_KEY, REQUEST_ID_KEY, SERVICES_KEY, Services, Tab, admitted_as, left_by_the_door

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Exchange:
    """What one request has: its generation (to its last byte), its body as sent and as parsed,
    the model that serves it and how (the plan), the media converted, the gateway's response
    headers, and whether its images were primed. The parsed body and the converted media are let
    go before the reply is relayed (a 2 MB image is a 2 MB str); the bytes sent upstream stay.

    ``parsed`` is the body as admission reads it: its images' data URLs may hold their first
    characters only (``deferred``: gateway.admission.strings), enough for their headers. Every
    other stage reads :attr:`body`, which puts each whole string back first: a request sent on
    as the client sent it never makes them (a 100 KB image's str, ~10% of its hop's CPU)."""

    request: web.Request
    services: Services
    live: Generation[Pool]
    config: GatewayConfig  # the live generation's
    visible: Visible  # the model names the request's API key may use (None: every one, auth off)
    raw: bytes
    parsed: dict[str, Any]  # admission's: top-level fields, and images' headers, read here
    deferred: Deferred | None  # the rest of its images' data URLs (None: none held back)
    stream: bool  # the client asked for a stream ("stream": true)
    priority: int  # its class, as a rank in PRIORITIES (x-priority, capped by its key)
    key: ApiKey | None = None  # its API key (None: auth off); read once, as the request's other stages ask
    tab: Tab | None = None  # its key's account (gateway.server.state.Tab): what it spends, the headers it answers with
    recording: bool = False  # whether it is traced (sampled): decided at its front door, asked once
    model: ModelConfig | None = None  # the model that serves it, once known
    plan: RoutePlan | None = None  # for an API whose parts are admitted (every one but completions)
    converted: Replacements = field(default_factory=dict)
    headers: dict[str, str] = field(default_factory=dict)  # beyond X-Request-Id, -Model, -Route
    primed: bool = False  # its images went to vLLM's encoder instances
    # top-level fields that ask the engine for the stream's usage on the key's behalf (usage_fields)
    ask_usage: Mapping[str, Any] = field(default_factory=dict)

    @property
    def body(self) -> dict[str, Any]:
        """The body whole, every deferred string in its place (400 for bytes orjson refuses)."""
        if self.deferred is not None:
            self._restore()
        return self.parsed

    @body.setter
    def body(self, body: dict[str, Any]) -> None:
        self.parsed, self.deferred = body, None

    def _restore(self) -> None:
        assert self.deferred is not None
        self.deferred.restore()  # a 400 leaves it held back: asked again, the same 400
        self.deferred = None

    def _sent_as_it_came(self, plan: RoutePlan) -> bool:
        """Whether the plan sends the client's bytes upstream and no stage reads its images whole
        (converted, encoded, fetched, rewritten, hashed for affinity or a trace)."""
        return (
            plan.route == "direct"
            and not plan.needs_rewrite(self.parsed)
            and not (plan.encode_parts or plan.encodes_frames or plan.encodes_pages or plan.page_images)
            and not (plan.visual is not None and plan.visual.waits)
            and plan.model.balance != "affinity"
            and not self.recording
        )

    def serve_with(self, model: ModelConfig) -> None:
        """The model the request names: its label in gateway_requests_total from now on."""
        self.model = model
        self.request[MODEL_LABEL_KEY] = model.name

    def admitted(self, plan: RoutePlan) -> None:
        """The plan: the model that serves the request, and what happens to its parts (counted).
        Its visual tokens are spent of its key's budgets by :func:`convert`, once known; a body
        some stage will read whole is made whole first, so that bytes orjson refuses in its
        images' data URLs are refused (400) before anything of the request is spent."""
        if self.deferred is not None and not self._sent_as_it_came(plan):
            self._restore()
        self.plan, self.model = plan, plan.model
        metrics = self.services.metrics
        if plan.model.encode and (decision := plan.encode_decision) is not None:
            metrics.encode_decisions.labels(plan.model.name, decision).inc()
        for r in plan.redirects:
            metrics.redirects.labels(r.source, r.modality.value, r.target).inc()
        if plan.stripped or plan.history_stripped:
            for part in plan.stripped_parts:
                metrics.stripped_parts.labels(plan.model.name, part.modality.value).inc()
        if self.recording and (tracing := self.services.tracing) is not None:  # on the request's span
            tracing.current().set_attributes(admission_attributes(plan, self.body))

    async def counted(self, plan: RoutePlan) -> None:
        """The request's visual tokens, known: held to its key's token budgets, spent of its
        ``visual_tokens_per_minute`` (429 when they are not there), then counted as admitted."""
        assert plan.visual is not None
        if not plan.api.spends:  # only asked what it would cost
            return
        tokens, key = plan.visual.tokens, self.key
        if key is not None and tokens:
            spent = await self.services.limits.visual(key, tokens)  # held to its token budgets too
            if spent:
                assert self.tab is not None  # (a keyed request's)
                self.tab.headers = {**self.tab.headers, **spent}
        if plan.model.visual_tokens is not None:
            metrics = self.services.metrics
            metrics.child(metrics.visual_tokens, plan.model.name).inc(tokens)
            metrics.child(metrics.request_visual_tokens, plan.model.name).observe(tokens)


async def begin(request: web.Request) -> Exchange:
    """The exchange of a request to a model endpoint: the live generation (the request keeps it to
    its last byte), its body read within the limits and parsed."""
    services = request.app[SERVICES_KEY]
    live = services.store.live
    request[MODEL_LABEL_KEY] = UNKNOWN_MODEL  # until the body names a model: a 413 or bad JSON counts too
    key, priority = admitted_as(request)
    raw, body, deferred = await read_json(request, live.config.server, max_bytes=services.max_body_bytes)
    check_engine_priority(body, key)
    streamed = body.get("stream") is True
    allowed, tab = left_by_the_door(request, key)
    return Exchange(
        request,
        services,
        live,
        live.config,
        allowed,
        raw,
        body,
        deferred,
        streamed,
        priority,
        key,
        tab,
        recording=services.tracing is not None and services.tracing.recording(),
        ask_usage=usage_fields(key, body, request.path, streamed),
    )


async def convert(ex: Exchange) -> None:
    """Media the model takes in another form (gateway.media.converters: images downscaled, audio
    as its transcript, images described, files as their text, video as frames). Before encoding:
    a failure here costs no encoder work. What admission could not count (remote images of
    ``remote: fetch``, videos of ``video:``) is counted first, and the limits held, before any
    frame is decoded; the request's visual tokens are spent once all are known."""
    plan, services = ex.plan, ex.services
    assert plan is not None
    if plan.visual is None and not plan.classification.media:  # text alone: nothing to count or convert
        return
    later = counted_later(plan)
    if plan.visual is not None and not later:  # counted at admission: spent before anything is done
        await ex.counted(plan)
    if converters.wanted(plan):  # the body whole only then: a request that needs none keeps it held back
        TENANT.set(ex.key.name if ex.key is not None else f"client {ex.request.remote}")  # the decoders' fair share
        spend = functools.partial(spending.conversion, services, ex.key, ex.tab)
        job = converters.Job(plan, ex.body, ex.live, ex.request[REQUEST_ID_KEY], services.tools, spend)
        await converters.convert(job, services.tracing)
        ex.plan = plan = job.plan
        ex.converted |= job.made
        if job.route is not None:
            ex.headers["X-Gateway-Route"] = job.route
    if later:
        await ex.counted(plan)


def text_alone(ex: Exchange) -> bool:
    """Whether the request is text alone, to a model that counts nothing of it: :func:`convert`
    and :func:`encode` have nothing to do, and its body is :func:`written` at once (a door skips
    their coroutines)."""
    plan = ex.plan
    assert plan is not None
    return plan.visual is None and not plan.classification.media


async def encode(ex: Exchange) -> bytes:
    """The body to send upstream: the plan applied, its images encoded (``X-Gateway-Encoded``
    says how many) or primed on vLLM's encoder instances (``ex.primed``)."""
    plan = ex.plan
    assert plan is not None
    if not (plan.encode_parts or plan.encodes_frames or plan.encodes_pages):
        return written(ex)
    kind = ex.config.encoders[plan.encoder or ""].kind
    name = "gateway.prime" if kind == "vllm" else "gateway.encode"
    with stage(ex.services.tracing, name, {"gateway.encoder": plan.encoder or ""}):
        images = await ex.services.encoder.encode_or_pass(
            plan, ex.body, request_id=ex.request[REQUEST_ID_KEY], config=ex.config, frames=ex.converted
        )
    ex.headers["X-Gateway-Encoded"] = str(images.images)
    ex.primed = bool(images.replacements) and kind == "vllm"
    return written(ex, Encoded(ex.converted | images.replacements, {**images.fields, **ex.ask_usage}))


def written(ex: Exchange, encoded: Encoded | None = None) -> bytes:
    """The body to send upstream, the plan applied with what the stages made (``encoded``;
    default: the media converted, and the fields that ask for a stream's usage)."""
    plan = ex.plan
    assert plan is not None
    if encoded is None:
        if not plan.classification.media and not plan.normalized and not ex.ask_usage:
            if ex.parsed.get("model") == plan.model.upstream_name:
                return ex.raw  # the client's own bytes: nothing to encode, nothing to write again
        encoded = Encoded(ex.converted, dict(ex.ask_usage))
    if encoded.replacements:
        check_grown_size(ex.config.server.max_upstream_body_bytes, ex.raw, encoded.replacements, encoded.fields)
    if not encoded.replacements and not encoded.fields and not plan.needs_rewrite(ex.parsed):
        return ex.raw  # the client's own bytes (its top-level fields said so): no deferred string made
    return upstream_body(plan, ex.raw, ex.body, encoded.replacements, encoded.fields)


def forward(
    ex: Exchange, data: bytes, *, affinity_key: bytes | None = None, content_type: str = "application/json"
) -> Awaitable[web.StreamResponse]:
    """The upstream hop, and the relay of its answer (awaited by the caller: a plain function, no
    coroutine frame of its own for every resumption of the exchange to pass through). Images
    primed on vLLM encoder instances may not be found by the consumer: the attempt then primes
    them again (``reprime``: the client's request again, its media converted stand) and tries
    once more, within retries.attempts and the retry budget (:mod:`gateway.upstream.consumer`)."""
    model, live, request = ex.model, ex.live, ex.request
    assert model is not None
    api = ex.plan.api if ex.plan is not None else COMPLETIONS
    continues = ex.parsed.get("previous_response_id") if api.stores else None  # top-level: read as parsed
    reprime = functools.partial(_reprime, ex) if ex.primed else None
    if reprime is None:
        _let_go(ex)
    headers = {
        "X-Request-Id": request[REQUEST_ID_KEY],
        # Anthropic's name for it, which the anthropic SDK reads (request_id)
        **({"request-id": request[REQUEST_ID_KEY]} if api.errors == "anthropic" else {}),
        "X-Gateway-Model": model.name,
        "X-Gateway-Route": ex.plan.route if ex.plan is not None else "direct",
        "X-Gateway-Priority": PRIORITIES[ex.priority],
        **ex.headers,  # a route a conversion changed too (an image not described, dropped)
    }
    t = model.timeouts
    stream_idle = t.idle_s if ex.stream else None
    dispatch = Dispatch(
        model,
        live.pools[model.name],
        data,
        Timeouts(t.connect_s, t.first_byte_s, live.config.server.client_write_timeout_s, stream_idle, t.total_s),
        headers,
        auth=live.upstream_auth.get(model.name),
        # with auth on, the client's key stays here; without, as server.forward_client_credentials says
        forward_client_auth=live.keyring is None and live.config.server.forward_client_credentials,
        affinity_key=affinity_key,
        reprime=reprime,
        api=api,
        continues=continues if isinstance(continues, str) else None,
        owner=ex.key.name if ex.key is not None else None,
        hide_usage=bool(ex.ask_usage),
        content_type=content_type,
        on_usage=functools.partial(spending.reply, ex.services, ex.key, ex.tab, model.name, spending.floor(ex.plan)),
        answer_headers=ex.tab.headers if ex.tab is not None else None,  # a reply relayed as it comes
    )
    upstream = ex.services.upstream
    if ex.recording and (tracing := ex.services.tracing) is not None:  # the request's span: who served it
        tracing.current().set_attributes(
            {"gen_ai.response.model": model.name, "gateway.route": headers["X-Gateway-Route"],
             "gateway.priority": PRIORITIES[ex.priority]}
        )  # fmt: skip
    if model.max_concurrency is None:
        return upstream.forward(request, dispatch)
    return gated(
        ex.services.gates, ex.services.tracing, model, ex.priority, lambda: upstream.forward(request, dispatch)
    )


async def _reprime(ex: Exchange) -> bytes:
    """The body of a request whose primed embeddings the consumer missed, its images primed again."""
    ex.body = exact(ex.raw, orjson.loads(ex.raw))  # the client's request again: the first try rewrote its parts
    data = await encode(ex)
    _let_go(ex)
    return data


def _let_go(ex: Exchange) -> None:
    """What the relay does not need: the parsed request and the converted media."""
    ex.raw, ex.body, ex.converted = b"", {}, {}

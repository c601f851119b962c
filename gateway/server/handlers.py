"""HTTP handlers: thin, each a straight line from the parsed request to a response."""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import orjson
from aiohttp import hdrs, web

from ..admission.affinity import chat_key, prompt_key
from ..admission.auth import is_bearer
from ..admission.body import dump_body, exact, read_json
from ..admission.plan import EXPAND, RoutePlan, Visible, admit, lookup, upstream_body
from ..config import EncoderConfig, GatewayConfig, ModelConfig, as_dict, env_secret
from ..encode.client import NOTHING, Encoded, Replacements
from ..errors import (
    AuthenticationError,
    ConfigError,
    EmbeddingsNotDeliveredError,
    EncoderError,
    InvalidConfigError,
    InvalidRequestError,
    PayloadTooLargeError,
    PermissionDeniedError,
)
from ..media import video
from ..metrics import UNKNOWN_MODEL
from ..upstream.live import Live
from ..upstream.relay import Timeouts
from .state import API_KEY_KEY, MODEL_LABEL_KEY, REQUEST_ID_KEY, SERVICES_KEY, Services

log = logging.getLogger(__name__)
JSON = "application/json"
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


async def chat_completions(request: web.Request) -> web.StreamResponse:
    services = request.app[SERVICES_KEY]
    live = services.store.live  # this request's generation, to its last byte
    config = live.config
    request[MODEL_LABEL_KEY] = UNKNOWN_MODEL  # until the body names a model: a 413 or bad JSON counts too
    raw, body = await _read_json(request, config)
    visible = _visible(request)
    requested = lookup(config, body, visible)
    request[MODEL_LABEL_KEY] = requested.name
    plan = admit(config, body, visible, requested=requested)
    _count_plan(services, plan)
    headers: dict[str, str] = {}
    # before encoding: a failure here costs no encoder work
    converted = await _convert(request, services, live, plan, body)
    data, primed = await _upstream_data(request, services, config, plan, raw, body, converted, headers)
    key = chat_key(body) if plan.model.balance == "affinity" else None
    stream = _streams(body)
    if primed:  # vLLM's encoder instances: the consumer may not find what was primed
        return await _forward_primed(
            request, services, live, plan, raw, data, headers, converted, stream=stream, key=key
        )
    # the parsed request (as large as the body: a 2 MB image is a 2 MB str) is not kept while the
    # reply is relayed; the bytes sent upstream are
    del raw, body, converted
    return await _forward(
        request, services, live, plan.model, data, plan.route, headers, stream=stream, affinity_key=key
    )


async def _convert(
    request: web.Request, services: Services, live: Live, plan: RoutePlan, body: dict[str, Any]
) -> Replacements:
    """Media the model takes in another form: audio as its transcript, video as frames (images)
    or as vLLM's pre-sampled frames."""
    converted: Replacements = {}
    if plan.transcribe_parts:
        assert services.transcriber is not None
        converted |= await services.transcriber.transcribe(plan, body, live, request_id=request[REQUEST_ID_KEY])
    if plan.frame_parts or plan.presample_parts:
        sampling = video.Sampling(services.encoder.fetcher, services.metrics, services.decoders, services.conversions)
        if plan.frame_parts:
            converted |= await video.frames_for(plan, body, sampling)
        if plan.presample_parts:
            converted |= await video.presampled_for(plan, body, sampling)
    return converted


async def _upstream_data(
    request: web.Request,
    services: Services,
    config: GatewayConfig,
    plan: RoutePlan,
    raw: bytes,
    body: dict[str, Any],
    converted: Replacements,
    headers: dict[str, str],
) -> tuple[bytes, bool]:
    """The body sent upstream, its images encoded (``X-Gateway-Encoded`` set), and whether they
    were primed on vLLM encoder instances."""
    encoded = Encoded(converted, {})
    primed = False
    if plan.encode_parts or plan.encodes_frames:
        images = await _encode(request, services, plan, body, config.encoders, converted)
        headers["X-Gateway-Encoded"] = str(images.images)
        encoded = Encoded(converted | images.replacements, images.fields)
        primed = bool(images.replacements) and config.encoders[plan.encoder or ""].kind == "vllm"
    if encoded.replacements:
        _check_grown_size(config, raw, encoded)
    return upstream_body(plan, raw, body, encoded.replacements, encoded.fields), primed


async def _forward_primed(
    request: web.Request,
    services: Services,
    live: Live,
    plan: RoutePlan,
    raw: bytes,
    data: bytes,
    headers: dict[str, str],
    converted: Replacements,
    *,
    stream: bool,
    key: bytes | None,
) -> web.StreamResponse:
    """A request whose images were primed on vLLM encoder instances. A consumer that failed for
    want of them (a 500, or an answer that ends at once in ``finish_reason: "error"``: the
    connector could not deliver an embedding, evicted or lost) before any byte reached the client
    gets the request once more, its images primed again (the media converted stand)."""
    try:
        return await _forward(
            request, services, live, plan.model, data, plan.route, headers, stream=stream, affinity_key=key,
            ec_check=True,
        )  # fmt: skip
    except EmbeddingsNotDeliveredError as exc:
        # within retries.attempts and the retry budget: a consumer failing for another reason
        # must not double every request's load
        if not services.upstream.may_retry(plan.model, "ec_error"):
            raise
        log.warning("model %s: %s; priming its images again", plan.model.name, exc.message)
    body = exact(raw, orjson.loads(raw))  # the client's request again: the first try rewrote its parts
    data, _ = await _upstream_data(request, services, live.config, plan, raw, body, converted, headers)
    del raw, body
    return await _forward(
        request, services, live, plan.model, data, plan.route, headers, stream=stream, affinity_key=key
    )


async def _encode(
    request: web.Request,
    services: Services,
    plan: RoutePlan,
    body: dict[str, Any],
    encoders: Mapping[str, EncoderConfig],
    frames: Replacements,
) -> Encoded:
    try:
        return await services.encoder.encode(
            plan, body, request_id=request[REQUEST_ID_KEY], encoders=encoders, frames=frames
        )
    except EncoderError as exc:
        if plan.model.on_encoder_error != "passthrough":
            raise
        log.warning("encoder failed for model %s, sending the original images: %s", plan.model.name, exc.message)
        services.metrics.encoder_passthrough.labels(plan.model.name, plan.encoder or "").inc()
        return NOTHING


async def completions(request: web.Request) -> web.StreamResponse:
    """Text-only /v1/completions: the model must exist; the body passes through."""
    services = request.app[SERVICES_KEY]
    live = services.store.live
    config = live.config
    request[MODEL_LABEL_KEY] = UNKNOWN_MODEL
    raw, body = await _read_json(request, config)
    model = lookup(config, body, _visible(request))
    request[MODEL_LABEL_KEY] = model.name
    if body["model"] != model.upstream_name:
        body = exact(raw, body)
        body["model"] = model.upstream_name
        raw = dump_body(body)
    key = prompt_key(body) if model.balance == "affinity" else None
    return await _forward(request, services, live, model, raw, "direct", stream=_streams(body), affinity_key=key)


async def list_models(request: web.Request) -> web.Response:
    store = request.app[SERVICES_KEY].store
    created = int(store.loaded_at)
    visible = _visible(request)
    data = [
        {
            "id": m.name,
            "object": "model",
            "created": created,
            "owned_by": "modality-gateway",
            "input_modalities": [str(x) for x in m.accepts],
        }
        for m in store.current.models
        if visible is None or visible(m.name)
    ]
    return _json({"object": "list", "data": data})


async def healthz(request: web.Request) -> web.Response:
    return _json({"status": "ok"})


async def readyz(request: web.Request) -> web.Response:
    """Ready when every local encoder is (upstreams are reported, not required: they fail over),
    until SIGTERM: then 503 ``draining``, so that load balancers stop sending new requests.

    Probes get the status alone. With the admin token, the report also names the models, the
    encoders and every upstream replica with its health and last error: addresses and errors are
    for operators, never for clients (the port is public)."""
    services = request.app[SERVICES_KEY]
    draining = services.lifecycle.draining
    ready = services.supervisor.ready and not draining
    payload: dict[str, Any] = {
        "status": "draining" if draining else "ready" if ready else "starting",
        "config_generation": services.store.generation,
    }
    if _is_admin(request, services):
        encoders: dict[str, Any] = {
            name: {"kind": spec.kind, "urls": list(spec.urls), "backends": services.encoder.backends(spec.urls)}
            for name, spec in services.store.current.encoders.items()
            if spec.kind in ("http", "vllm")
        }
        encoders.update({name: e.status() for name, e in services.supervisor.encoders.items()})
        payload["models"] = [m.name for m in services.store.current.models]
        payload["encoders"] = encoders
        payload["upstreams"] = services.store.replicas.snapshot()
        if services.lifecycle.worker is not None:  # serve --workers N: which one answered
            payload["worker"] = {"index": services.lifecycle.worker, "pid": os.getpid()}
    return _json(payload, status=200 if ready else 503)


async def admin_reload(request: web.Request) -> web.Response:
    services = request.app[SERVICES_KEY]
    _check_admin(request, services)
    if services.store.path is None:
        raise InvalidRequestError("This gateway was started without a config file; there is nothing to reload")
    try:
        config = await services.store.reload()
    except ConfigError as exc:
        raise InvalidConfigError(f"routing.yaml is invalid; the running config is unchanged:\n{exc}") from None
    if services.lifecycle.reload_others is not None:  # serve --workers N: the other workers too
        services.lifecycle.reload_others()
    return _json({"status": "reloaded", "config_generation": services.store.generation, "models": len(config.models)})


async def admin_config(request: web.Request) -> web.Response:
    """The live config as the gateway understood it, every default filled in. It holds no secret
    (keys are named by their environment variables, never read into the config)."""
    services = request.app[SERVICES_KEY]
    _check_admin(request, services)
    live = services.store.live
    return _json(
        {
            "config_generation": live.generation,
            "sha256": live.config.sha256,
            "source": live.config.source,
            "loaded_at": services.store.loaded_at,
            "config": as_dict(live.config),
        }
    )


def metrics_endpoint(scrape: Handler) -> Handler:
    """``GET /metrics``. It names every model (those a key may not see too), every key's name and
    the upstream URLs, and each scrape costs ~10 ms of the event loop: with ``auth:`` on it needs
    the admin token, as ``/admin/*`` does, on the main port and on ``server.admin_listen`` alike
    (a port apart is often reachable from a whole cluster); a refusal costs what a 401 costs.
    Without ``auth:`` the gateway is open, /metrics too."""

    async def metrics(request: web.Request) -> web.StreamResponse:
        services = request.app[SERVICES_KEY]
        if services.store.live.keyring is not None:
            env = services.store.current.server.admin_token_env
            _check_admin(
                request,
                services,
                disabled=f"With auth: on, /metrics needs the admin token: set the {env} environment variable "
                "and scrape with it ('Authorization: Bearer <token>')",
            )
        return await scrape(request)

    return metrics


def _admin_token(services: Services) -> str:
    return env_secret(services.store.current.server.admin_token_env)


def _is_admin(request: web.Request, services: Services) -> bool:
    token = _admin_token(services)
    return bool(token) and is_bearer(request.headers.get(hdrs.AUTHORIZATION), token)


def _check_admin(request: web.Request, services: Services, *, disabled: str | None = None) -> None:
    """401 unless the request carries the admin token; 403 ``disabled`` while none is set."""
    if not _admin_token(services):
        env = services.store.current.server.admin_token_env
        raise PermissionDeniedError(
            disabled or f"Admin endpoints are disabled: set the {env} environment variable to enable them"
        )
    if not _is_admin(request, services):
        raise AuthenticationError("Missing or wrong admin token (send 'Authorization: Bearer <token>')")


async def _read_json(request: web.Request, config: GatewayConfig) -> tuple[bytes, dict[str, Any]]:
    return await read_json(request, config.server, max_bytes=request.app[SERVICES_KEY].max_body_bytes)


def _streams(body: dict[str, Any]) -> bool:
    return body.get("stream") is True


def _check_grown_size(config: GatewayConfig, raw: bytes, encoded: Encoded) -> None:
    """413 before writing a body that encoding grew past ``server.max_upstream_body_bytes``."""
    limit = config.server.max_upstream_body_bytes
    # at most: the client's bytes, plus each new part and field (the parts they replace are left counted)
    size = len(raw) + sum(_part_size(part) for part in encoded.replacements.values())
    if encoded.fields:
        size += len(orjson.dumps(encoded.fields))
    if size > limit:
        raise PayloadTooLargeError(
            f"With its media encoded, sampled or transcribed, this request would be {size} bytes upstream, over "
            f"the limit of {limit} bytes (server.max_upstream_body_bytes); send fewer or smaller images or videos"
        )


def _part_size(part: dict[str, Any]) -> int:
    """A new part's size as written, near enough: embeddings are base64 strings (their length,
    without writing megabytes again); frames are data URLs (theirs); anything else (metadata, a
    raw image's uuid, a transcript) is small, written."""
    if part.get("type") == EXPAND:
        return sum(_part_size(p) if p.get("type") != "image_url" else len(p["image_url"]["url"]) + 64
                   for p in part["parts"])  # fmt: skip
    embeds = part.get("image_embeds")
    if isinstance(embeds, str):
        return len(embeds) + 128
    if isinstance(embeds, dict) and all(isinstance(v, str) for v in embeds.values()):
        return sum(len(v) for v in embeds.values()) + 128
    return len(orjson.dumps({k: v for k, v in part.items() if k not in ("image_url", "input_image")})) + 128


def _visible(request: web.Request) -> Visible:
    """The model names the request's API key may use (None: every one, auth off)."""
    key = request.get(API_KEY_KEY)
    return key.allows if key is not None else None


def _count_plan(services: Services, plan: RoutePlan) -> None:
    if plan.model.encode:
        decision = plan.encode_decision
        if decision is not None:
            services.metrics.encode_decisions.labels(plan.model.name, decision).inc()
    if not plan.redirects and not plan.stripped:
        return
    for r in plan.redirects:
        services.metrics.redirects.labels(r.source, r.modality.value, r.target).inc()
    for part in plan.stripped_parts:
        services.metrics.stripped_parts.labels(plan.model.name, part.modality.value).inc()


def _forward(
    request: web.Request,
    services: Services,
    live: Live,
    model: ModelConfig,
    data: bytes,
    route: str,
    extra_headers: dict[str, str] | None = None,
    *,
    stream: bool,
    affinity_key: bytes | None = None,
    ec_check: bool = False,
) -> Awaitable[web.StreamResponse]:
    """The upstream exchange, awaited by the handler (a plain function: no coroutine frame of its
    own for every resumption of the exchange to pass through)."""
    headers = {
        "X-Request-Id": request[REQUEST_ID_KEY],
        "X-Gateway-Model": model.name,
        "X-Gateway-Route": route,
        **(extra_headers or {}),
    }
    t = model.timeouts
    timeouts = Timeouts(
        t.connect_s, t.first_byte_s, live.config.server.client_write_timeout_s, t.idle_s if stream else None, t.total_s
    )
    exchange = functools.partial(
        services.upstream.forward,
        request,
        model,
        live.pools[model.name],
        data,
        timeouts=timeouts,
        gateway_headers=headers,
        auth=live.upstream_auth.get(model.name),
        forward_client_auth=live.keyring is None,  # with auth on, the client's key stays here
        affinity_key=affinity_key,
        ec_check=ec_check,
    )
    if model.max_concurrency is None:
        return exchange()
    return _gated(services, model, exchange)


async def _gated(
    services: Services, model: ModelConfig, exchange: Callable[[], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    """The exchange, begun once the model's gate gives it a slot (``max_concurrency``): its
    deadlines and retry budget count from then."""
    async with services.gates.slot(model):
        return await exchange()


def _json(payload: Any, status: int = 200) -> web.Response:
    return web.Response(status=status, body=orjson.dumps(payload), content_type=JSON)

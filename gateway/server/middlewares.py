"""The front door of every request: one wrapper of every route's handler, the one place errors
become responses.

:func:`front` gives the request its id, counts it, refuses a path on the wrong port
(``server.admin_listen``) and, with ``auth:``, a /v1/* request without a valid key or over its
key's limits, and renders every error: every response, errors included, carries
``X-Request-Id``, and the metrics see the rendered status of every error. It wraps each route's
handler where the route is added (:func:`add_routes`), not as an aiohttp middleware: aiohttp runs
its middlewares through a frame of its own and a partial a request, ~2 µs of a 100 µs request.
A path no route serves goes to the last route, :func:`unmatched`, which answers the 404 or the
405 (with ``Allow``) aiohttp would have, in the API's error shape. (One layer, not one per
concern: each layer is a coroutine frame that every resumption of the handler passes through.)
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import random
import time
from collections.abc import Mapping

from aiohttp import hdrs, web
from aiohttp.typedefs import Handler
from yarl import URL

from ..admission.apis.catalog import BY_PATH, is_api, shape_of
from ..admission.auth import NO_LIMITS
from ..admission.body import body_too_large
from ..config import ApiKey
from ..config.generation import Keyring
from ..errors import (
    GatewayError,
    HTTPStatusError,
    InvalidApiKeyError,
    LimitsStoreUnavailableError,
    MethodNotAllowedError,
    NotFoundError,
    RateLimitedError,
    clip,
    render,
)
from ..metrics import NO_KEY, UNKNOWN_MODEL
from ..upstream.relay import RelayResponse, with_key_limits
from .state import API_KEY_KEY, MODEL_LABEL_KEY, REQUEST_ID_KEY, SERVICES_KEY, TAB_KEY, Services, Tab

log = logging.getLogger(__name__)

REQUEST_ID = "X-Request-Id"
ANTHROPIC_REQUEST_ID = "request-id"  # Anthropic's name for it (the anthropic SDK's request_id)
GATEWAY_MODEL = "X-Gateway-Model"
# Request ids: 128 random bits, as uuid4 has, from a generator seeded once per process from the
# OS (os.urandom is a system call per id: 2% of the gateway's CPU under load). An id names a
# request in logs; it guards nothing, so it needs to be unique, not unpredictable.
_ids = random.Random(os.urandom(32))
CLIENT_CLOSED = 499  # nginx's code for "the client went away first"


def _request_id(request: web.Request) -> str:
    given = request.headers.get(REQUEST_ID, "")
    if 0 < len(given) <= 200 and given.isascii() and given.isprintable():
        return given
    return f"{_ids.getrandbits(128):032x}"


def front(handler: Handler, of_api: bool | None = None) -> Handler:
    """``handler`` behind the front door: request id, in-flight gauge, errors rendered, and the
    request counted with the status sent (499 when the client left first). Only requests to a
    model endpoint (those whose handler set a model label) are counted in gateway_requests_total.
    ``of_api``: whether the route's path is an API's (a key needed, with ``auth:``), known where the
    route is added; None: asked of each request's path (the catch-all's)."""

    async def fronted(request: web.Request) -> web.StreamResponse:
        services = request.app[SERVICES_KEY]
        rid = request[REQUEST_ID_KEY] = _request_id(request)
        metrics = services.metrics
        started = time.perf_counter()
        code, failure, upgraded = 500, None, False
        key, tab = None, None
        metrics.in_flight.inc()
        tracing, traced = services.tracing, None
        if tracing is not None and (served := BY_PATH.get(request.path)) is not None:  # a model endpoint: traced
            traced = tracing.open(request.headers, served.traced_as, request.method, request.path, rid)
        try:
            try:
                _check_port(request, services)
                keyring = services.store.live.keyring
                if keyring is None or not (of_api if of_api is not None else is_api(request.path)):
                    request[API_KEY_KEY] = None  # (read by every model endpoint: a miss would raise inside)
                    response = await handler(request)
                else:  # with auth:, a /v1/* request needs a key of the live generation, within its limits
                    # the key as clients send it, found at once; anything else (x-api-key, or none
                    # found: refused and counted) by _key_of
                    key = keyring.key_of(request.headers.get(hdrs.AUTHORIZATION)) or _key_of(request, services, keyring)
                    # a key with limits is admitted at once where no wait is needed (no coroutine):
                    # the common case; one without, not asked (nothing to count of it)
                    limited = key.rate_limit is not None or key.max_concurrency is not None
                    limits = services.limits
                    headers, slot = (limits.admit_now(key) or await limits.admit(key)) if limited else NO_LIMITS
                    tab = request[TAB_KEY] = Tab(headers)
                    request[API_KEY_KEY] = key
                    try:
                        response = await handler(request)
                    finally:
                        if limited:
                            limits.finish(key, tab.spent, slot)
            except GatewayError as exc:
                failure = exc.code
                if key is not None and isinstance(exc, RateLimitedError | LimitsStoreUnavailableError):
                    _over_limits(request, services, key, exc)
                response = await _render_error(request, services, exc)
            except web.HTTPException as exc:
                if exc.status < 400:
                    code = exc.status
                    raise
                error = _from_http_exception(request, exc, services)
                failure = error.code
                response = render(error, shape_of(request.path))
            except Exception:
                log.exception("unhandled error in %s %s (request id %s)", request.method, request.path, rid)
                failure = "internal_error"
                response = render(
                    GatewayError(f"Internal error in the gateway (request id {rid})"), shape_of(request.path)
                )
            if not response.prepared:
                _answer_headers(request, response, rid, tab)
            upgraded = isinstance(response, web.WebSocketResponse)  # a session: its length is no latency
            gone = isinstance(response, RelayResponse) and response.client_gone
            code = CLIENT_CLOSED if gone else response.status
            if gone:
                failure = "client_closed"
            return response
        except asyncio.CancelledError:
            code, failure = CLIENT_CLOSED, "cancelled"
            raise
        finally:
            metrics.in_flight.dec()
            model = request.get(MODEL_LABEL_KEY)
            if traced is not None:
                assert tracing is not None
                tracing.close(traced, code, failure, model if model != UNKNOWN_MODEL else None)
            if model is not None:
                api = api_of(request.path)
                label = key.name if key is not None else NO_KEY
                metrics.child(metrics.requests, model, str(code), label, api).inc()
                if not upgraded:
                    metrics.child(metrics.request_duration, model).observe(time.perf_counter() - started)

    fronted.__name__ = fronted.__qualname__ = getattr(handler, "__name__", "handler")
    return fronted


def add_routes(app: web.Application, gets: Mapping[str, Handler], posts: Mapping[str, Handler]) -> None:
    """The app's routes, each handler behind :func:`front` and answering an ``Expect`` header the
    gateway's way (aiohttp's own 417 is plain text), a GET answering HEAD too; then, last, every
    other path and method to :func:`unmatched`."""
    for path, handler in gets.items():
        app.router.add_get(path, front(handler, is_api(path)), expect_handler=expect_continue)
    for path, handler in posts.items():
        app.router.add_post(path, front(handler, is_api(path)), expect_handler=expect_continue)
    methods: dict[str, list[str]] = {}
    for route in app.router.routes():
        methods.setdefault(route.resource.canonical if route.resource is not None else "", []).append(route.method)
    allowed = {path: ", ".join(sorted(names)) for path, names in methods.items()}
    everything = _Everything()
    app.router.register_resource(everything)
    everything.add_route("*", front(functools.partial(unmatched, allowed)), expect_handler=expect_continue)


class _Everything(web.Resource):
    """The last resource: whatever the request-target (a path of any bytes, ``*``, one no route
    serves), so that aiohttp never answers one itself (its 404 is plain text, without the
    request id). Indexed under ``/``, where aiohttp's router looks last."""

    @property
    def canonical(self) -> str:
        return "/{path}"

    def _match(self, path: str) -> dict[str, str]:
        return {"path": path}

    def raw_match(self, path: str) -> bool:
        return True

    def get_info(self) -> dict[str, str]:  # type: ignore[override]
        return {"formatter": "/{path}"}

    def url_for(self) -> URL:  # type: ignore[override]
        raise NotImplementedError("the catch-all names no URL")

    def add_prefix(self, prefix: str) -> None:
        raise NotImplementedError("the catch-all takes no prefix")


async def unmatched(allowed: Mapping[str, str], request: web.Request) -> web.StreamResponse:
    """A path no route serves (404), or a method its route does not take (405 with ``Allow``);
    looked up as the router matched it (``%2F`` still encoded: not a ``/``)."""
    methods = allowed.get(request.rel_url.path_safe)
    if methods is None:
        raise NotFoundError(f"Unknown endpoint: {request.method} {clip(request.path)}")
    raise MethodNotAllowedError(
        f"Method {request.method} is not allowed on {clip(request.path)} (allowed: {methods})",
        headers={"Allow": methods},
    )


def _answer_headers(request: web.Request, response: web.StreamResponse, rid: str, tab: Tab | None) -> None:
    """The request id, and a key's x-ratelimit-* headers: on an answer (a reply relayed whole
    too: the client's limits are its key's, not whatever an engine's own say), or where an error
    has none of the name (one of the key's limits has its own, newer); a stream has them as it
    begins (:func:`gateway.server.exchange.forward`). On an error, also the id as ``request-id``
    on the Messages API, where the anthropic SDK reads it, and the model it is about (a
    rejection). A reply relayed from an engine has both already."""
    response.headers[REQUEST_ID] = rid
    if tab is not None and tab.headers:
        with_key_limits(response.headers, tab.headers, response.status)
    if response.status < 400:
        return
    if shape_of(request.path) == "anthropic":
        response.headers[ANTHROPIC_REQUEST_ID] = rid
    model = request.get(MODEL_LABEL_KEY)
    if model is not None and model != UNKNOWN_MODEL and GATEWAY_MODEL not in response.headers:
        response.headers[GATEWAY_MODEL] = model


async def _render_error(request: web.Request, services: Services, exc: GatewayError) -> web.Response:
    if exc.rejection is not None:
        r = exc.rejection
        services.metrics.child(services.metrics.rejections, r.model, r.modality, r.reason, api_of(request.path)).inc()
    response = render(exc, shape_of(request.path))
    if exc.stops_reading:
        await _send_and_close(request, response)
    return response


def api_of(path: str) -> str:
    """The ``api`` label of a request: the API its path serves (routing.yaml's name), ``-`` for none."""
    api = BY_PATH.get(path)
    return api.name if api is not None else "-"


OPERATORS = frozenset({"/metrics", "/status", "/"})  # with /admin/*: on server.admin_listen alone, when set


def _check_port(request: web.Request, services: Services) -> None:
    """With ``server.admin_listen``: /admin/*, /metrics and the status page (/ and /status) only
    there, /v1/* only on the main port (health on both). A path on the wrong port is a plain 404,
    as if it did not exist."""
    admin_port = services.lifecycle.admin_port
    if admin_port is None or request.path in ("/healthz", "/readyz"):
        return
    sockname = request.get_extra_info("sockname")
    on_admin = isinstance(sockname, tuple) and len(sockname) >= 2 and sockname[1] == admin_port
    if on_admin != (request.path.startswith("/admin/") or request.path in OPERATORS):
        raise NotFoundError(f"Unknown endpoint: {request.method} {clip(request.path)}")


def _key_of(request: web.Request, services: Services, keyring: Keyring) -> ApiKey:
    """The request's key, of the live generation's keyring; a missing or wrong one is counted
    and refused (InvalidApiKeyError)."""
    header = request.headers.get(hdrs.AUTHORIZATION)
    if header is None and (x_api_key := request.headers.get("x-api-key")) is not None:
        header = f"Bearer {x_api_key}"  # Anthropic's clients send their key so (Claude Code, the SDKs)
    try:
        return keyring.find(header)
    except InvalidApiKeyError:
        services.metrics.auth_failures.labels("missing" if not header else "invalid").inc()
        raise


def _over_limits(
    request: web.Request, services: Services, key: ApiKey, exc: RateLimitedError | LimitsStoreUnavailableError
) -> None:
    """A key's request refused by its limits (at the door, or its images' visual tokens later),
    or by a limits store that fails closed: counted as the API's request, of its model if known."""
    if isinstance(exc, RateLimitedError):
        services.metrics.rate_limited.labels(key.name, exc.limit).inc()
    request[MODEL_LABEL_KEY] = request.get(MODEL_LABEL_KEY, UNKNOWN_MODEL)


async def expect_continue(request: web.Request) -> web.StreamResponse | None:
    """``Expect: 100-continue``: say 413 instead of 100 when the declared body is over the limit,
    so a client does not send 32 MB to be refused (aiohttp's default handler always says 100).

    aiohttp calls this before the middlewares: an error answered here is counted here."""
    if request.version != (1, 1):
        return None
    expect = request.headers.get("Expect", "")
    if expect.lower() != "100-continue":
        error: GatewayError = HTTPStatusError(417, f"Unsupported Expect header '{clip(expect)}'")
    elif (request.content_length or 0) > (limit := request.app[SERVICES_KEY].max_body_bytes):
        error = body_too_large(limit)
    else:
        await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        request.writer.output_size = 0  # the interim response is not the response's body
        return None
    request[REQUEST_ID_KEY] = _request_id(request)
    if is_api(request.path):  # gateway_requests_total counts the API's requests
        metrics = request.app[SERVICES_KEY].metrics
        metrics.requests.labels(UNKNOWN_MODEL, str(error.status), NO_KEY, api_of(request.path)).inc()
    response = render(error, shape_of(request.path))
    await _send_and_close(request, response)  # the client waits for a 100 that will not come
    return response


async def _send_and_close(request: web.Request, response: web.Response) -> None:
    """Answer, then close at once, where no more of the body should be waited for: one that
    trickles in (408), or one whose sender waits for a 100 Continue that was refused. aiohttp would
    linger up to 10 s for it; that stays right for a plain 413, whose client may still be sending
    and must get to read the answer."""
    _answer_headers(request, response, request[REQUEST_ID_KEY], request.get(TAB_KEY))
    try:
        await response.prepare(request)
        await response.write_eof()
    except ConnectionError:
        pass
    if request.transport is not None:
        request.transport.close()  # after the buffered answer is written


def _from_http_exception(request: web.Request, exc: web.HTTPException, services: Services) -> GatewayError:
    """One of aiohttp's own (its router's 404 and 405 never come: :func:`unmatched` answers them)."""
    if isinstance(exc, web.HTTPRequestEntityTooLarge):
        return body_too_large(services.max_body_bytes)
    return HTTPStatusError(exc.status, exc.reason)

"""Request id, metrics, and the one place where errors become HTTP responses.

Order (outermost first): ``request_id_middleware`` → ``metrics_middleware`` → ``error_middleware``.
The metrics middleware therefore sees the rendered status of every error, and every response,
errors included, carries ``X-Request-Id``.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid

from aiohttp import web
from aiohttp.typedefs import Handler

from .body import body_too_large
from .errors import GatewayError, HTTPStatusError, MethodNotAllowedError, NotFoundError, clip, render
from .metrics import UNKNOWN_MODEL
from .relay import RelayResponse
from .state import MODEL_LABEL_KEY, REQUEST_ID_KEY, SERVICES_KEY

log = logging.getLogger(__name__)

REQUEST_ID = "X-Request-Id"
CLIENT_CLOSED = 499  # nginx's code for "the client went away first"


def _request_id(request: web.Request) -> str:
    given = request.headers.get(REQUEST_ID, "")
    if 0 < len(given) <= 200 and given.isascii() and given.isprintable():
        return given
    return uuid.uuid4().hex


@web.middleware
async def request_id_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    rid = request[REQUEST_ID_KEY] = _request_id(request)
    response = await handler(request)
    if not response.prepared:
        response.headers[REQUEST_ID] = rid
    return response


@web.middleware
async def metrics_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    metrics = request.app[SERVICES_KEY].metrics
    started = time.perf_counter()
    code = 500
    metrics.in_flight.inc()
    try:
        response = await handler(request)
        gone = isinstance(response, RelayResponse) and response.client_gone
        code = CLIENT_CLOSED if gone else response.status
        return response
    except asyncio.CancelledError:
        code = CLIENT_CLOSED
        raise
    finally:
        metrics.in_flight.dec()
        model = request.get(MODEL_LABEL_KEY)
        if model is not None:  # only requests to a model endpoint are counted
            metrics.requests.labels(model, str(code)).inc()
            metrics.request_duration.labels(model).observe(time.perf_counter() - started)


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except GatewayError as exc:
        if exc.rejection is not None:
            r = exc.rejection
            request.app[SERVICES_KEY].metrics.rejections.labels(r.model, r.modality, r.reason).inc()
        response = render(exc)
        if exc.stops_reading:
            await _send_and_close(request, response)
        return response
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return render(_from_http_exception(request, exc))
    except asyncio.CancelledError:
        raise
    except Exception:
        rid = request.get(REQUEST_ID_KEY, "-")
        log.exception("unhandled error in %s %s (request id %s)", request.method, request.path, rid)
        return render(GatewayError(f"Internal error in the gateway (request id {rid})"))


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
    request.app[SERVICES_KEY].metrics.requests.labels(UNKNOWN_MODEL, str(error.status)).inc()
    response = render(error)
    await _send_and_close(request, response)  # the client waits for a 100 that will not come
    return response


async def _send_and_close(request: web.Request, response: web.Response) -> None:
    """Answer, then close at once, where no more of the body should be waited for: one that
    trickles in (408), or one whose sender waits for a 100 Continue that was refused. aiohttp would
    linger up to 10 s for it; that stays right for a plain 413, whose client may still be sending
    and must get to read the answer."""
    response.headers[REQUEST_ID] = request[REQUEST_ID_KEY]
    try:
        await response.prepare(request)
        await response.write_eof()
    except ConnectionError:
        pass
    if request.transport is not None:
        request.transport.close()  # after the buffered answer is written


def _from_http_exception(request: web.Request, exc: web.HTTPException) -> GatewayError:
    if isinstance(exc, web.HTTPNotFound):
        return NotFoundError(f"Unknown endpoint: {request.method} {clip(request.path)}")
    if isinstance(exc, web.HTTPMethodNotAllowed):
        allowed = ", ".join(sorted(exc.allowed_methods))
        return MethodNotAllowedError(
            f"Method {request.method} is not allowed on {clip(request.path)} (allowed: {allowed})",
            headers={"Allow": allowed},
        )
    if isinstance(exc, web.HTTPRequestEntityTooLarge):
        return body_too_large(request.app[SERVICES_KEY].max_body_bytes)
    return HTTPStatusError(exc.status, exc.reason)

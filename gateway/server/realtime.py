"""The realtime door: ``GET /v1/realtime?model=M``, a WebSocket session admitted before its
upgrade and relayed frame by frame to one of the model's replicas.

Everything a session can be refused for is said as a plain HTTP answer in OpenAI's error shape,
before the upgrade, never an upgrade followed by a close: the key, its models and its limits (the
front door, gateway.server.middlewares: a session is one request of the key's rate, and holds one
of its ``max_concurrency`` slots while it lasts), the model, that it serves ``realtime`` and takes
audio (gateway.admission.realtime), that the request is a WebSocket upgrade, and that a replica
took the engine's side of it (502, 503): the engine's WebSocket is open before the client's
upgrade is answered. Then gateway.upstream.realtime relays it, each client event checked as it
passes; the session's end is counted by reason, its transcriptions' usage spent of the key's
token budgets.
"""

from __future__ import annotations

import asyncio
import functools

from aiohttp import web

from ..admission.realtime import Session, admit_session
from ..errors import InvalidRequestError
from ..media.asking import engine_headers
from ..metrics import UNKNOWN_MODEL
from ..upstream.realtime import Relay, client_max_msg, connect
from . import spending
from .state import MODEL_LABEL_KEY, REQUEST_ID_KEY, SERVICES_KEY, admitted_as, left_by_the_door


async def handler(request: web.Request) -> web.StreamResponse:
    services = request.app[SERVICES_KEY]
    live = services.store.live
    request[MODEL_LABEL_KEY] = UNKNOWN_MODEL
    key, _ = admitted_as(request)  # (its x-priority is checked: a session has no queue to wait in)
    allowed, tab = left_by_the_door(request, key)
    model = admit_session(live.config, request.query, allowed)
    request[MODEL_LABEL_KEY] = model.name
    client = web.WebSocketResponse(max_msg_size=client_max_msg(model), autoping=True, compress=False)
    if not client.can_prepare(request).ok:
        raise InvalidRequestError(
            "A realtime session is a WebSocket: GET /v1/realtime with Upgrade: websocket (the openai SDK's "
            "client.realtime.connect)"
        )
    headers = engine_headers(services.tracing, model, live, request[REQUEST_ID_KEY])
    hub, metrics = services.realtime, services.metrics
    engine, lease = await connect(hub, live.pools[model.name], model, headers, metrics)
    with lease:
        try:
            await client.prepare(request)
        except BaseException:
            await engine.close()
            raise
        on_usage = functools.partial(spending.reply, services, key, tab, model.name, 0)
        relay = Relay(client, engine, Session(model), metrics, on_usage)
        hub.enter(relay)
        metrics.realtime_opened.labels(model.name).inc()
        metrics.realtime_open.labels(model.name).inc()
        running = asyncio.ensure_future(relay.run())
        try:
            await asyncio.shield(running)
        except asyncio.CancelledError:
            # aiohttp cancels the handler of a connection lost: for a session, its client's end. The
            # relay sees it too; the session is counted as it ended, not as a request cut short.
            relay.stop("client")
            await running
            if (task := asyncio.current_task()) is not None:
                task.uncancel()
        finally:
            metrics.realtime_open.labels(model.name).dec()
            metrics.realtime_closed.labels(model.name, relay.reason or "error").inc()
            hub.leave(relay)
            if services.tracing is not None and services.tracing.recording():
                services.tracing.current().set_attributes(
                    {
                        "gateway.realtime.end": relay.reason,
                        "gateway.realtime.audio_s": round(relay.session.audio_s, 3),
                        "gateway.realtime.events.client": relay.events["client"],
                        "gateway.realtime.events.engine": relay.events["engine"],
                    }
                )
    return client

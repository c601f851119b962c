"""The doors of the gateway's APIs, and the table of routes the app registers (:data:`ROUTES`),
made from the APIs' catalog (gateway.admission.apis.catalog): each API's routes taken by the door
its ``door`` names: ``parts`` for those whose requests carry content parts (chat, Responses,
Messages, the pooling APIs: every part admitted), ``text`` for the text-only completions and
``output`` for the APIs whose answer is one output (image generation, speech: the model must
produce it, gateway.admission.plan.lookup), ``upload`` for uploads (gateway.server.uploads: audio,
an image to edit).
Each reads as the stages of its exchange (gateway.server.exchange)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from aiohttp import web

from ..admission.apis import Api
from ..admission.apis.catalog import APIS
from ..admission.body import dump_body, exact
from ..admission.plan import admit, admit_output, lookup
from . import exchange, realtime, spoken, uploads

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def door(api: Api) -> Handler:
    """The handler of an API whose parts are admitted."""

    async def handler(request: web.Request) -> web.StreamResponse:
        ex = await exchange.begin(request)
        requested = lookup(ex.config, ex.parsed, ex.visible, api.name)
        ex.serve_with(requested)
        plan = admit(ex.config, ex.parsed, ex.visible, requested=requested, api=api, deferred=ex.deferred)
        ex.admitted(plan)  # served by plan.model; the model label stays the one requested
        if exchange.text_alone(ex):  # nothing to count, convert or encode: no coroutine of theirs
            data = exchange.written(ex)
        else:
            await exchange.convert(ex)
            data = await exchange.encode(ex)
        if plan.speaker is not None:  # its answer in audio, by a model that speaks it once whole
            return await spoken.answer(ex, data)
        affinity = api.affinity(ex.body) if plan.model.balance == "affinity" else None
        return await exchange.forward(ex, data, affinity_key=affinity)

    handler.__name__ = handler.__qualname__ = f"{api.name}_handler"
    return handler


def text_door(api: Api) -> Handler:
    """Text-only (completions): the model must exist; the body passes through, renamed for its upstream."""

    async def handler(request: web.Request) -> web.StreamResponse:
        ex = await exchange.begin(request)
        model = lookup(ex.config, ex.parsed, ex.visible, api.name)  # top-level fields: read as parsed
        ex.serve_with(model)
        data = ex.raw
        if ex.parsed["model"] != model.upstream_name or ex.ask_usage:  # written again: the body whole
            body = exact(ex.raw, ex.body)
            body["model"] = model.upstream_name
            body.update(ex.ask_usage)
            data = dump_body(body)
        key = api.affinity(ex.parsed) if model.balance == "affinity" else None
        return await exchange.forward(ex, data, affinity_key=key)

    handler.__name__ = handler.__qualname__ = f"{api.name}_handler"
    return handler


def output_door(api: Api) -> Handler:
    """An API whose answer is an output (image generation, speech): its model produces it, or
    the request goes where the model's ``on_unsupported_output`` sends it; an images request is
    held to the model's ``output_limits`` and asks base64 where its images come back inline. The
    body passes through, renamed for its upstream, those fields set."""

    async def handler(request: web.Request) -> web.StreamResponse:
        ex = await exchange.begin(request)
        requested = lookup(ex.config, ex.parsed, ex.visible, api.name)  # top-level fields: read as parsed
        ex.serve_with(requested)
        plan, setting = admit_output(ex.config, ex.parsed, ex.visible, requested=requested, api=api)
        ex.admitted(plan)
        model = plan.model
        data = ex.raw
        if ex.parsed["model"] != model.upstream_name or setting:  # written again: the body whole
            body = exact(ex.raw, ex.body)
            body["model"] = model.upstream_name
            body.update(setting)
            data = dump_body(body)
        return await exchange.forward(ex, data)

    handler.__name__ = handler.__qualname__ = f"{api.name}_handler"
    return handler


def realtime_door(api: Api) -> Handler:
    """The realtime API's: a WebSocket session (GET), gateway.server.realtime."""
    return realtime.handler


DOORS = {"parts": door, "text": text_door, "upload": uploads.door, "output": output_door, "realtime": realtime_door}
# every route the app registers: path -> (its handler, its API); a GET for the realtime door, else a POST
ROUTES: dict[str, tuple[Handler, Api]] = {
    path: (handler, api) for api, handler in ((a, DOORS[a.door](a)) for a in APIS) for path in api.paths
}

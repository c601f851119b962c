"""The OpenAI chat API's doors: ``/v1/chat/completions`` (every content part admitted) and the
text-only ``/v1/completions``. Each reads as the stages of its exchange (gateway.server.exchange)."""

from __future__ import annotations

from aiohttp import web

from ..admission.affinity import chat_key, prompt_key
from ..admission.body import dump_body, exact
from ..admission.plan import admit, lookup
from . import exchange


async def chat_completions(request: web.Request) -> web.StreamResponse:
    ex = await exchange.begin(request)
    requested = lookup(ex.config, ex.body, ex.visible)
    ex.serve_with(requested)
    plan = admit(ex.config, ex.body, ex.visible, requested=requested)
    ex.admitted(plan)  # served by plan.model; the model label stays the one requested
    await exchange.convert(ex)
    data = await exchange.encode(ex)
    key = chat_key(ex.body) if plan.model.balance == "affinity" else None
    return await exchange.forward(ex, data, affinity_key=key)


async def completions(request: web.Request) -> web.StreamResponse:
    """Text-only: the model must exist; the body passes through, renamed for its upstream."""
    ex = await exchange.begin(request)
    model = lookup(ex.config, ex.body, ex.visible)
    ex.serve_with(model)
    data = ex.raw
    if ex.body["model"] != model.upstream_name:
        body = exact(ex.raw, ex.body)
        body["model"] = model.upstream_name
        data = dump_body(body)
    key = prompt_key(ex.body) if model.balance == "affinity" else None
    return await exchange.forward(ex, data, affinity_key=key)

"""A chat request answered in audio by a model that answers in text: its answer spoken by the
model its ``on_unsupported_output: {audio: {speak: MODEL}}`` names (gateway.media.speak), once
whole. The text model is asked within its ``max_concurrency`` as any request is, and each
choice's text spoken within the speaking model's."""

from __future__ import annotations

from typing import Any

import orjson
from aiohttp import web

from ..config import PRIORITIES
from ..errors import UpstreamError
from ..fanout import gather_all
from ..media.asking import json_object
from ..media.speak import spoken
from ..upstream.concurrency import gated
from ..upstream.usage import usage_of
from . import spending
from .exchange import Exchange
from .state import REQUEST_ID_KEY


async def answer(ex: Exchange, data: bytes) -> web.StreamResponse:
    """The text model's answer to the request as sent upstream (``data``), each choice's text spoken."""
    services, live, plan = ex.services, ex.live, ex.plan
    assert plan is not None and plan.speaker is not None and services.speaker is not None
    speaking, model, speaker = services.speaker, plan.model, live.config.model(plan.speaker)
    if speaker is None:  # validation forbids it; a config built in code may not
        raise UpstreamError(f"Speaking model '{plan.speaker}' does not exist")
    rid = ex.request[REQUEST_ID_KEY]
    body = orjson.loads(data)
    asked = body.pop("audio", None)
    body.pop("modalities", None)  # the text model is asked for text: it makes no audio
    audio: dict[str, Any] = asked if isinstance(asked, dict) else {}  # (admission took no other)
    gates, tracing = services.gates, services.tracing

    async def ask() -> tuple[int, bytes]:
        return await speaking.answer(model, live, orjson.dumps(body), rid)

    status, reply = await gated(gates, tracing, model, ex.priority, ask)
    headers = {
        "X-Request-Id": rid,
        "X-Gateway-Model": model.name,
        "X-Gateway-Route": plan.route,
        "X-Gateway-Priority": PRIORITIES[ex.priority],
        **ex.headers,
    }
    if not 200 <= status < 300:  # the model's own refusal, as it came
        kind = "application/json" if json_object(reply) is not None else "text/plain"
        return web.Response(status=status, body=reply, content_type=kind, headers=headers)
    parsed = json_object(reply)
    choices = parsed.get("choices") if parsed is not None else None
    if parsed is None or not isinstance(choices, list):
        raise UpstreamError(f"Model '{model.name}' answered no chat completion to speak")
    usage = parsed.get("usage")
    known = spending.floor(plan)
    spending.reply(services, ex.key, ex.tab, model.name, known, usage_of(usage) if isinstance(usage, dict) else None)
    said = [
        (i, c["message"])
        for i, c in enumerate(choices)
        if isinstance(c, dict)
        and isinstance(c.get("message"), dict)
        and isinstance(c["message"].get("content"), str)
        and c["message"]["content"].strip()  # nothing to say (a tool call's empty content): left as it is
    ]

    async def speak(text: str) -> bytes:
        return await gated(
            gates, tracing, speaker, ex.priority, lambda: speaking.speak(speaker, live, text, audio, rid)
        )

    sounds = await gather_all(*(speak(m["content"]) for _, m in said))
    for (i, message), sound in zip(said, sounds, strict=True):
        spoken(message, sound, rid, i)
    services.metrics.child(services.metrics.spoken, model.name, speaker.name).inc(len(said))
    return web.Response(body=orjson.dumps(parsed), content_type="application/json", headers=headers)

"""Every API door of the gateway, and the table of routes the app registers (:data:`ROUTES`):
those whose requests carry content parts (chat, Responses, Messages, the pooling APIs: every part
admitted, gateway.admission.apis), audio uploads (gateway.server.audio), and the text-only
``/v1/completions``. Each reads as the stages of its exchange (gateway.server.exchange)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from aiohttp import web

from ..admission.affinity import chat_key, prompt_key, responses_key
from ..admission.apis import CHAT, Api
from ..admission.apis.messages import COUNT_TOKENS, MESSAGES
from ..admission.apis.pooling import EMBEDDINGS, RERANK, SCORE
from ..admission.apis.responses import RESPONSES
from ..admission.body import dump_body, exact
from ..admission.plan import admit, lookup
from . import audio, exchange

Key = Callable[[Mapping[str, Any]], bytes | None]  # a request's affinity key (gateway.admission.affinity)


def door(api: Api, key: Key) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
    """The handler of an API whose parts are admitted."""

    async def handler(request: web.Request) -> web.StreamResponse:
        ex = await exchange.begin(request)
        requested = lookup(ex.config, ex.parsed, ex.visible, api.name)
        ex.serve_with(requested)
        plan = admit(ex.config, ex.parsed, ex.visible, requested=requested, api=api, deferred=ex.deferred)
        ex.admitted(plan)  # served by plan.model; the model label stays the one requested
        await exchange.convert(ex)
        data = await exchange.encode(ex)
        affinity = key(ex.body) if plan.model.balance == "affinity" else None
        return await exchange.forward(ex, data, affinity_key=affinity)

    handler.__name__ = handler.__qualname__ = f"{api.name}_handler"
    return handler


APIS = (CHAT, RESPONSES, MESSAGES, EMBEDDINGS, SCORE, RERANK)  # every API whose parts are admitted
chat_completions = door(CHAT, chat_key)
responses = door(RESPONSES, responses_key)
messages = door(MESSAGES, chat_key)  # an Anthropic conversation opens as a chat one does
count_tokens = door(COUNT_TOKENS, chat_key)


def _no_key(body: Mapping[str, Any]) -> None:
    """A pooling request has no conversation to keep on one replica."""
    return None


embeddings = door(EMBEDDINGS, _no_key)
score = door(SCORE, _no_key)
rerank = door(RERANK, _no_key)


async def completions(request: web.Request) -> web.StreamResponse:
    """Text-only: the model must exist; the body passes through, renamed for its upstream."""
    ex = await exchange.begin(request)
    model = lookup(ex.config, ex.body, ex.visible, "completions")
    ex.serve_with(model)
    data = ex.raw
    if ex.body["model"] != model.upstream_name or ex.ask_usage:
        body = exact(ex.raw, ex.body)
        body["model"] = model.upstream_name
        body.update(ex.ask_usage)
        data = dump_body(body)
    key = prompt_key(ex.body) if model.balance == "affinity" else None
    return await exchange.forward(ex, data, affinity_key=key)


# path -> (handler, the API's name as routing.yaml says it: the `api` label of the metrics)
ROUTES: dict[str, tuple[Callable[[web.Request], Awaitable[web.StreamResponse]], str]] = {
    "/v1/chat/completions": (chat_completions, "chat"),
    "/v1/completions": (completions, "completions"),
    "/v1/responses": (responses, "responses"),
    "/v1/messages": (messages, "messages"),
    "/v1/messages/count_tokens": (count_tokens, "messages"),  # Claude Code asks it first; vLLM serves it
    "/v1/embeddings": (embeddings, "embeddings"),
    "/v1/score": (score, "score"),
    "/score": (score, "score"),  # vLLM serves each pooling route under both names
    "/v1/rerank": (rerank, "rerank"),
    "/rerank": (rerank, "rerank"),
    "/v2/rerank": (rerank, "rerank"),
    "/v1/audio/transcriptions": (audio.transcriptions, "transcriptions"),
    "/v1/audio/translations": (audio.translations, "translations"),
}
API_BY_PATH = {path: api for path, (_, api) in ROUTES.items()}

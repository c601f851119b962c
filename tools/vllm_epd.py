"""Stand-ins for vLLM's Encode/Prefill/Decode with the EC connector, for tests and demos.

:class:`EncoderInstance` is what an encoder-only vLLM instance (``ec_role: ec_producer``) answers
to a text-free chat request of media parts with ``uuid``s: no generation, and the top-level
``ec_transfer_params`` field, one entry per item keyed by its cache key (the uuid), as vLLM's
``collect_ec_item_metadata`` (vllm/distributed/ec_transfer/ec_connector/utils.py) builds it: the
item's ``modality``, its ``item_indices`` (its positions in the request) and the ``metadata`` the
model's processor produced, each tensor flattened to a list (one image's ``image_grid_thw`` is
``[t, h, w]``, derived here from the uuid so that it is deterministic). It stores
each item in an encoder cache shared with the consumers (vLLM's ``ECExampleConnector`` shares a
storage path), records every prime, and can fail, be slow, reset connections or report no
metadata (an older vLLM; ``--mm-processor-cache-type shm``).

:func:`consumer` wraps :class:`tools.standin.StandIn` as an ``ec_consumer`` instance: it refuses,
as vLLM does, a request that mixes raw images and ``image_embeds``, and records for every
``image_embeds`` reference whether its uuid was in the cache when the request came (a miss is an
embedding the connector could not deliver).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import orjson
from aiohttp import web

from tools.standin import StandIn

MEDIA_TYPES = ("image_url", "input_image", "audio_url", "input_audio", "video_url")


def grid(uuid: str) -> list[int]:
    """The image_grid_thw the stand-in reports for an image, ``[t, h, w]`` as vLLM reports one
    image's (``torch.atleast_1d(grid).tolist()``): derived from its uuid."""
    n = int(uuid[:8], 16) if len(uuid) >= 8 else 0
    return [1, 2 * (n % 7 + 1), 2 * (n % 5 + 1)]


@dataclass
class Prime:
    uuid: str
    url: str
    model: str
    carried: dict[str, Any]  # mm_processor_kwargs, media_io_kwargs as received


@dataclass
class EncoderInstance:
    name: str
    cache: set[str]  # shared with the consumers
    primes: list[Prime] = field(default_factory=list)
    requests: int = 0
    fail_status: int = 0
    reset: bool = False
    delay_s: float = 0.0
    metadata: bool = True  # False: entries without metadata (an older vLLM)
    extra_metadata: dict[str, Any] = field(default_factory=dict)  # more fields in every item's metadata
    # JSON text of one more field of every item's metadata, written as it is (what orjson cannot
    # write: nesting past 254 levels)
    raw_metadata: bytes = b""
    cancelled: int = 0  # requests whose client (the gateway) left before the answer
    refuse_jpeg: bool = False  # answer 400 to a request carrying a JPEG (an image the engine cannot read)

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self._encode)
        app.router.add_get("/health", self._health)
        return app

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def _encode(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.requests += 1
        if self.reset:
            assert request.transport is not None
            request.transport.abort()
            return web.Response()
        try:
            if self.delay_s:
                await asyncio.sleep(self.delay_s)
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        if self.fail_status:
            error = {"error": {"message": "engine failure", "type": "server_error", "param": None, "code": None}}
            return web.json_response(error, status=self.fail_status)
        assert body.get("stream") is False and "max_tokens" not in body, body
        (message,) = body["messages"]
        carried = {k: body[k] for k in ("mm_processor_kwargs", "media_io_kwargs") if k in body}
        items = [part for part in message["content"] if part.get("type") in MEDIA_TYPES]
        assert len(items) == len(message["content"]), "a priming request carries media parts alone"
        if self.refuse_jpeg and any("data:image/jpeg" in str(part.get("image_url")) for part in items):
            error = {"error": {"message": "cannot identify image", "type": "BadRequestError", "param": None}}
            return web.json_response({**error, "code": 400}, status=400)
        params: dict[str, Any] = {}
        for i, part in enumerate(items):
            uuid = part["uuid"]
            url = part.get("image_url", {}).get("url", "") if isinstance(part.get("image_url"), dict) else ""
            self.primes.append(Prime(uuid, url, body["model"], carried))
            self.cache.add(uuid)
            metadata = {"image_grid_thw": grid(uuid), **self.extra_metadata} if self.metadata else {}
            entry = params.setdefault(uuid, {"modality": "image", "item_indices": []})
            entry["metadata"] = metadata
            entry["item_indices"].append(i)
        reply = {
            "id": f"chatcmpl-{self.name}-{self.requests}",
            "object": "chat.completion",
            "created": 0,
            "model": body["model"],
            "choices": [],
            "usage": {"prompt_tokens": 16 * len(items), "completion_tokens": 0, "total_tokens": 16 * len(items)},
            "ec_transfer_params": params,
        }
        data = orjson.dumps(reply)
        if self.raw_metadata:
            data = data.replace(b'"metadata":{', b'"metadata":{' + self.raw_metadata + b",")
        return web.Response(body=data, content_type="application/json")


@dataclass
class ConsumerLog:
    hits: list[str] = field(default_factory=list)  # uuids of image_embeds found in the cache
    misses: list[str] = field(default_factory=list)  # image_embeds whose uuid was never primed
    raw_with_uuid: list[str] = field(default_factory=list)  # raw images sent with their uuid
    evict_next: int = 0  # the next N requests find the cache emptied (evicted, or a connector that lost it)
    errors: int = 0  # requests answered in error for a missing embedding


def consumer(standin: StandIn, cache: set[str], log: ConsumerLog) -> web.Application:
    """``standin``'s app as an ec_consumer instance (see the module docstring)."""

    @web.middleware
    async def ec_consumer(
        request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        if request.path == "/v1/chat/completions":
            body = orjson.loads(await request.read())
            parts = [p for m in body.get("messages", []) if isinstance(m.get("content"), list) for p in m["content"]]
            embeds = [p for p in parts if p.get("type") == "image_embeds"]
            raw = [p for p in parts if p.get("type") in ("image_url", "input_image")]
            if embeds and raw:
                error = {"message": "Mixing raw image and embedding inputs is not allowed", "type": "BadRequestError",
                         "param": None, "code": 400}  # fmt: skip
                return web.json_response({"error": error}, status=400)
            if embeds and log.evict_next:
                log.evict_next -= 1
                cache.clear()
            missing = [p.get("uuid", "") for p in embeds if p.get("uuid") not in cache]
            for part in embeds:
                (log.hits if part.get("uuid") in cache else log.misses).append(part.get("uuid", ""))
            log.raw_with_uuid.extend(p["uuid"] for p in raw if "uuid" in p)
            if missing:  # as vLLM answers an embedding the connector could not deliver
                log.errors += 1
                if body.get("stream"):
                    # as vLLM streams: the assistant's role alone first, then the end in error
                    head = {
                        "id": "chatcmpl-x",
                        "object": "chat.completion.chunk",
                        "created": 0,
                        "model": body.get("model"),
                    }
                    role = {**head, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                                 "finish_reason": None}]}  # fmt: skip
                    end = {**head, "choices": [{"index": 0, "delta": {}, "finish_reason": "error"}]}
                    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
                    await response.prepare(request)
                    await response.write(b"data: " + orjson.dumps(role) + b"\n\n")
                    await asyncio.sleep(0.01)  # its own packet
                    await response.write(b"data: " + orjson.dumps(end) + b"\n\ndata: [DONE]\n\n")
                    await response.write_eof()
                    return response
                error = {"message": f"Encoder cache miss for {missing[0]}", "type": "InternalServerError",
                         "param": None, "code": 500}  # fmt: skip
                return web.json_response({"error": error}, status=500)
        return await handler(request)

    app = standin.app()
    app.middlewares.append(ec_consumer)
    return app

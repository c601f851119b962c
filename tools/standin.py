"""A stand-in OpenAI-compatible upstream (what vLLM or SGLang would be) for tests, demos and benchmarks.

It speaks the chat completions and completions protocol exactly, and the Responses and Anthropic
Messages APIs as vLLM serves them (``/v1/responses``: named SSE events with a ``sequence_number``
from ``response.created`` to ``response.completed``; ``/v1/messages``: ``message_start`` to
``message_stop``, errors in Anthropic's shape; ``/v1/messages/count_tokens``), SSE streaming
included, records every request it receives, and answers deterministically: the reply names
the model it was asked for and counts the content parts by type. Knobs, sent as request
headers (the gateway forwards them):

    X-Standin-Status: 503        answer with this status and an OpenAI error body
    X-Standin-Delay-Ms: 200      wait before the response headers
    X-Standin-Chunk-Delay-Ms: 5  wait between streamed chunks
    X-Standin-Break-After: 2     stream this many content chunks, then drop the connection

An agent's tool call, in the conversation: a user message whose text says ``@read /abs/path`` is
answered, on the Messages API, with a ``tool_use`` of Claude Code's ``Read`` tool
(``{"file_path": path}``) and, on the Responses API, with a ``function_call`` of Codex's
``view_image`` (``{"path": path}``), where the request offers that tool; once the tool's result
follows the message, the usual reply (which counts the parts it got, the result's included). So
the real coding agents read an image with their own tools in the conformance suite.

A length, in the body as vLLM takes it: ``"ignore_eos": true`` with ``"max_tokens": N`` makes the
reply exactly N words, streamed as exactly N content chunks (the words of the usual reply, repeated
as needed), as vLLM generates exactly ``max_tokens`` tokens when told to ignore EOS. Being in the
body, it reaches the stand-in through any proxy (benchmarks use it for streams of known length).

Faults of the whole replica (what resilience tests and demos set on the instance): ``fail_status``
answers every request with that status, ``reset`` drops each connection once the request is read,
``break_after`` breaks every stream as ``X-Standin-Break-After`` does,
``delay_ms`` makes every answer that much slower, ``healthy = False`` turns ``GET /health`` to 503.
``record = False`` (``--no-record``) keeps no copy of the requests, for benchmarks that send millions.

``check``, where set, is the engine's own check of a JSON body or of a transcription's form fields
(the conformance suite sets vLLM's or SGLang's request models and parsers,
tests/conformance/engines/): each body is held to it
after it is recorded, and one it refuses is answered 400 with the engine's message, as the engine
answers it, so that a stand-in never accepts what the engine it stands for refuses.

Run one: ``python -m tools.standin --port 8000 --name vllm``.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import re
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import orjson
from aiohttp import BodyPartReader, WSMsgType, web
from aiohttp.http_exceptions import HttpProcessingError
from multidict import CIMultiDict

CREATED = 1_700_000_000  # fixed, so replies are byte-for-byte repeatable
# a generated image: a 1x1 PNG (what the images API answers inline, base64)
TINY_PNG = "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAIAAACQd1PeAAAADElEQVR4nGP4z8AAAAMBAQDJ/pLvAAAAAElFTkSuQmCC"


@dataclass
class Received:
    method: str
    path: str
    headers: CIMultiDict[str]
    body: bytes

    def json(self) -> Any:
        return orjson.loads(self.body)


@dataclass
class StandIn:
    name: str = "standin"
    received: list[Received] = field(default_factory=list)
    served: int = 0
    fail_status: int = 0
    reset: bool = False
    delay_ms: int = 0
    break_after: int = -1  # >= 0: every stream breaks off after this many content chunks (the header's fault)
    healthy: bool = True  # GET /health: 200, or 503 when False
    record: bool = True  # False: keep nothing in ``received`` (a benchmark's millions of requests)
    stored: set[str] = field(default_factory=set)  # ids of the responses it stores, as vLLM's store keeps them
    images_made: int = 0  # generations answered: each one's id, and the file a URL of it names
    sessions: int = 0  # realtime sessions opened (GET /v1/realtime)
    # >= 0: a realtime session's connection is cut (no close frame) after this many client events
    realtime_break_after: int = -1
    flooded: int = 0  # transcription.delta events sent for a `standin.flood` event (a test's slow client)
    hold: asyncio.Event | None = None  # each request, once recorded, waits for it (a test's saturated engine)
    # the engine's own check of a JSON body, (path, body) -> its refusal's message or None (see above)
    check: Callable[[str, Any], str | None] | None = None

    def app(self) -> web.Application:
        app = web.Application(client_max_size=1 << 30)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_post("/v1/responses", self._responses)
        app.router.add_post("/v1/messages", self._messages)
        app.router.add_post("/v1/messages/count_tokens", self._count_tokens)
        app.router.add_post("/v1/embeddings", self._embeddings)
        for path in ("/v1/score", "/score", "/v1/rerank", "/rerank", "/v2/rerank"):
            app.router.add_post(path, self._scores)
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/audio/transcriptions", self._transcribe)
        app.router.add_post("/v1/audio/translations", self._transcribe)
        app.router.add_post("/v1/images/generations", self._images)
        app.router.add_post("/v1/images/edits", self._edits)
        app.router.add_get("/v1/images/{id}/content", self._image_file)
        app.router.add_get("/v1/realtime", self._realtime)
        app.router.add_post("/v1/audio/speech", self._speech)
        app.router.add_get("/health", self._health)
        return app

    async def _record(self, request: web.Request) -> tuple[dict[str, Any], web.Response | None]:
        body = await request.read()
        if self.record:
            self.received.append(Received(request.method, request.path_qs, CIMultiDict(request.headers), body))
        if self.reset and request.transport is not None:
            request.transport.abort()
            return {}, web.Response(status=500)  # never reaches anyone: the connection is gone
        if self.hold is not None:
            await self.hold.wait()
        delay = int(request.headers.get("X-Standin-Delay-Ms", "0")) + self.delay_ms
        if delay:
            await asyncio.sleep(delay / 1000)
        status = self.fail_status or int(request.headers.get("X-Standin-Status", "200"))
        if status != 200 and request.path.startswith("/v1/messages"):  # vLLM's Anthropic handler: its own error names
            kind = "BadRequestError" if status < 500 else "InternalServerError"
            error = {"type": "error", "error": {"type": kind, "message": f"stand-in {self.name} says {status}"}}
            return {}, web.json_response(error, status=status)
        if status != 200:
            error = {
                "error": {
                    "message": f"stand-in {self.name} says {status}",
                    "type": "BadRequestError" if status < 500 else "InternalServerError",
                    "param": None,
                    "code": status,
                }
            }
            return {}, web.json_response(error, status=status, dumps=lambda o: orjson.dumps(o).decode())
        try:
            payload = orjson.loads(body)
        except orjson.JSONDecodeError:
            return {}, web.json_response(
                {"error": {"message": "bad json", "type": "BadRequestError", "param": None, "code": 400}}, status=400
            )
        refused = self.check(request.path, payload) if self.check is not None else None
        if refused is not None:
            if request.path.startswith("/v1/messages"):
                error = {"type": "error", "error": {"type": "invalid_request_error", "message": refused}}
                return {}, web.json_response(error, status=400)
            error = {"error": {"message": refused, "type": "BadRequestError", "param": None, "code": 400}}
            return {}, web.json_response(error, status=400)
        return payload, None

    async def _transcribe(self, request: web.Request) -> web.StreamResponse:
        """The OpenAI transcription API (what vLLM serves for Whisper): multipart ``file`` and
        ``model``; the transcript names the file, its size and the model, so tests can tell them apart."""
        if self.reset and request.transport is not None:
            request.transport.abort()
            return web.Response(status=500)
        delay = int(request.headers.get("X-Standin-Delay-Ms", "0")) + self.delay_ms
        if delay:
            await asyncio.sleep(delay / 1000)
        fields: dict[str, Any] = {}
        async for part in await request.multipart():
            if isinstance(part, BodyPartReader) and part.name:
                data = await part.read()
                fields[part.name] = (part.filename, part.headers.get("Content-Type"), data)
        if self.record:  # per field: its filename, type and size, and the value of a small one
            body = orjson.dumps({k: [v[0], v[1], len(v[2]), v[2].decode() if k != "file" and len(v[2]) < 4096 else None]
                                 for k, v in fields.items()})  # fmt: skip
            self.received.append(Received(request.method, request.path_qs, CIMultiDict(request.headers), body))
        if self.fail_status:
            error = {"message": f"stand-in {self.name} says {self.fail_status}", "type": "InternalServerError",
                     "param": None, "code": self.fail_status}  # fmt: skip
            return web.json_response({"error": error}, status=self.fail_status)
        if "file" not in fields or "model" not in fields:
            error = {"message": "file and model are required", "type": "BadRequestError", "param": None, "code": 400}
            return web.json_response({"error": error}, status=400)
        if self.check is not None:  # the form as the engine's check takes it: a file (name, bytes, type), text
            form = {k: (v[0], v[2], v[1]) if v[0] is not None else v[2].decode() for k, v in fields.items()}
            refused = self.check(request.path, form)
            if refused is not None:
                error = {"message": refused, "type": "BadRequestError", "param": None, "code": 400}
                return web.json_response({"error": error}, status=400)
        filename, _, audio = fields["file"]
        model = fields["model"][2].decode()
        text = f"[{self.name}] {model} heard {filename} ({len(audio)} bytes)"
        if "stream" not in fields or fields["stream"][2].decode().lower() != "true":
            return web.json_response({"text": text})
        # vLLM's streamed transcription: transcription.chunk events, then [DONE]
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for piece in _pieces(text):
            choice = {"delta": {"content": piece}, "finish_reason": None, "stop_reason": None}
            chunk = {"id": f"trsc-{self.name}", "object": "transcription.chunk", "created": CREATED, "model": model,
                     "choices": [choice]}  # fmt: skip
            await response.write(b"data: " + orjson.dumps(chunk) + b"\n\n")
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        payload, error = await self._record(request)
        if error is not None:
            return error
        text = f"[{self.name}] model={payload.get('model')} " + describe(payload.get("messages", []))
        return await self._answer(request, payload, _fixed_length(text, payload), chat=True)

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        payload, error = await self._record(request)
        if error is not None:
            return error
        text = f"[{self.name}] model={payload.get('model')} prompt={payload.get('prompt')!r}"
        return await self._answer(request, payload, _fixed_length(text, payload), chat=False)

    async def _responses(self, request: web.Request) -> web.StreamResponse:
        """The Responses API, as vLLM answers it: a ``response`` object, or its named events."""
        payload, error = await self._record(request)
        if error is not None:
            return error
        previous = payload.get("previous_response_id")
        if previous is not None and previous not in self.stored:  # vLLM's answer: only its process has it
            missing = {"message": f"Response with id '{previous}' not found.", "type": "invalid_request_error",
                       "param": "response_id", "code": 404}  # fmt: skip
            return web.json_response({"error": missing}, status=404)
        items = payload.get("input")
        items = [{"role": "user", "content": items}] if isinstance(items, str) else items or []
        path = _asked_to_read(items, payload, "view_image")
        if path is not None:
            return await self._function_call(request, payload, path)
        text = _fixed_length(f"[{self.name}] model={payload.get('model')} " + describe(items), payload)
        self.served += 1
        rid, mid = f"resp_{self.name}_{self.served}", f"msg_{self.name}_{self.served}"
        if payload.get("store", True) is not False:
            self.stored.add(rid)
        words = len(text.split())
        usage = {"input_tokens": 10, "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
                 "output_tokens": words, "output_tokens_details": {"reasoning_tokens": 0},
                 "total_tokens": 10 + words}  # fmt: skip
        part: dict[str, Any] = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
        item: dict[str, Any] = {
            "id": mid,
            "type": "message",
            "role": "assistant",
            "status": "completed",
            "content": [part],
        }

        def response(status: str, output: list[Any], usage: Any) -> dict[str, Any]:
            # every field vLLM's ResponsesResponse requires, as vLLM fills them from the request
            return {"id": rid, "object": "response", "created_at": CREATED, "status": status,
                    "model": payload.get("model"), "output": output, "usage": usage, "parallel_tool_calls": True,
                    "tool_choice": "auto", "tools": [], "temperature": payload.get("temperature", 1.0),
                    "top_p": payload.get("top_p", 1.0), "background": False,
                    "max_output_tokens": payload.get("max_output_tokens") or 4096, "service_tier": "auto",
                    "truncation": "disabled"}  # fmt: skip

        if not payload.get("stream"):
            return web.Response(
                body=orjson.dumps(response("completed", [item], usage)), content_type="application/json"
            )
        at: dict[str, Any] = {"item_id": mid, "output_index": 0, "content_index": 0}
        opening: list[dict[str, Any]] = [
            {"type": "response.created", "response": response("in_progress", [], None)},
            {"type": "response.in_progress", "response": response("in_progress", [], None)},
            {"type": "response.output_item.added", "output_index": 0, "item": {**item, "status": "in_progress",
                                                                                "content": []}},
            {"type": "response.content_part.added", **at, "part": {**part, "text": ""}},
        ]  # fmt: skip
        deltas = [{"type": "response.output_text.delta", **at, "delta": p, "logprobs": []} for p in _pieces(text)]
        closing = [
            {"type": "response.output_text.done", **at, "text": text, "logprobs": []},
            {"type": "response.content_part.done", **at, "part": part},
            {"type": "response.output_item.done", "output_index": 0, "item": item},
            {"type": "response.completed", "response": response("completed", [item], usage)},
        ]
        events = [{**e, "sequence_number": n} for n, e in enumerate([*opening, *deltas, *closing])]
        return await self._events(request, events, first_delta=len(opening))

    async def _messages(self, request: web.Request) -> web.StreamResponse:
        """The Anthropic Messages API, as vLLM answers it: a ``message``, or its named events."""
        payload, error = await self._record(request)
        if error is not None:
            return error
        path = _asked_to_read(payload.get("messages", []), payload, "Read")
        if path is not None:
            return await self._tool_use(request, payload, path)
        text = _fixed_length(f"[{self.name}] model={payload.get('model')} " + describe(payload.get("messages", [])),
                             payload)  # fmt: skip
        self.served += 1
        words = len(text.split())
        message: dict[str, Any] = {"id": f"msg_{self.name}_{self.served}", "type": "message", "role": "assistant",
                   "content": [{"type": "text", "text": text}], "model": payload.get("model"),
                   "stop_reason": "end_turn", "stop_sequence": None,
                   "usage": {"input_tokens": 10, "output_tokens": words}}  # fmt: skip
        if not payload.get("stream"):
            return web.Response(body=orjson.dumps(message), content_type="application/json")
        start = {**message, "content": [], "stop_reason": None, "usage": {"input_tokens": 10, "output_tokens": 0}}
        opening: list[dict[str, Any]] = [
            {"type": "message_start", "message": start},
            {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}},
        ]
        deltas: list[dict[str, Any]] = [
            {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": p}}
            for p in _pieces(text)
        ]
        closing: list[dict[str, Any]] = [
            {"type": "content_block_stop", "index": 0},
            {"type": "message_delta", "delta": {"stop_reason": "end_turn", "stop_sequence": None},
             "usage": {"input_tokens": 10, "output_tokens": words}},
            {"type": "message_stop"},
        ]  # fmt: skip
        return await self._events(request, [*opening, *deltas, *closing], first_delta=len(opening))

    async def _tool_use(self, request: web.Request, payload: dict[str, Any], path: str) -> web.StreamResponse:
        """Claude Code's ``Read`` of ``path``, as vLLM streams a tool call on the Messages API."""
        self.served += 1
        call = {"type": "tool_use", "id": f"toolu_{self.name}_{self.served}", "name": "Read", "input": {}}
        usage = {"input_tokens": 10, "output_tokens": 5}
        message = {"id": f"msg_{self.name}_{self.served}", "type": "message", "role": "assistant",
                   "content": [{**call, "input": {"file_path": path}}], "model": payload.get("model"),
                   "stop_reason": "tool_use", "stop_sequence": None, "usage": usage}  # fmt: skip
        if not payload.get("stream"):
            return web.Response(body=orjson.dumps(message), content_type="application/json")
        events: list[dict[str, Any]] = [
            {"type": "message_start", "message": {**message, "content": [], "stop_reason": None}},
            {"type": "content_block_start", "index": 0, "content_block": call},
            {"type": "content_block_delta", "index": 0,
             "delta": {"type": "input_json_delta", "partial_json": orjson.dumps({"file_path": path}).decode()}},
            {"type": "content_block_stop", "index": 0},
            {"type": "message_delta", "delta": {"stop_reason": "tool_use", "stop_sequence": None}, "usage": usage},
            {"type": "message_stop"},
        ]  # fmt: skip
        return await self._events(request, events, first_delta=2)

    async def _function_call(self, request: web.Request, payload: dict[str, Any], path: str) -> web.StreamResponse:
        """Codex's ``view_image`` of ``path``, as vLLM streams a function call on the Responses API."""
        self.served += 1
        rid = f"resp_{self.name}_{self.served}"
        arguments = orjson.dumps({"path": path}).decode()
        item = {
            "id": f"fc_{self.name}_{self.served}",
            "type": "function_call",
            "status": "completed",
            "call_id": f"call_{self.name}_{self.served}",
            "name": "view_image",
            "arguments": arguments,
        }
        usage = {"input_tokens": 10, "input_tokens_details": {"cached_tokens": 0}, "output_tokens": 5,
                 "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 15}  # fmt: skip

        def response(status: str, output: list[Any]) -> dict[str, Any]:
            return {"id": rid, "object": "response", "created_at": CREATED, "status": status,
                    "model": payload.get("model"), "output": output, "usage": usage if output else None,
                    "parallel_tool_calls": True, "tool_choice": "auto", "tools": [], "background": False}  # fmt: skip

        if not payload.get("stream"):
            return web.Response(body=orjson.dumps(response("completed", [item])), content_type="application/json")
        events: list[dict[str, Any]] = [
            {"type": "response.created", "response": response("in_progress", [])},
            {"type": "response.output_item.added", "output_index": 0,
             "item": {**item, "status": "in_progress", "arguments": ""}},
            {"type": "response.function_call_arguments.delta", "item_id": item["id"], "output_index": 0,
             "delta": arguments},
            {"type": "response.function_call_arguments.done", "item_id": item["id"], "output_index": 0,
             "arguments": arguments},
            {"type": "response.output_item.done", "output_index": 0, "item": item},
            {"type": "response.completed", "response": response("completed", [item])},
        ]  # fmt: skip
        numbered = [{**e, "sequence_number": n} for n, e in enumerate(events)]
        return await self._events(request, numbered, first_delta=2)

    async def _count_tokens(self, request: web.Request) -> web.StreamResponse:
        """``/v1/messages/count_tokens``, as vLLM answers it: ``{"input_tokens": N}`` (here 10, and
        one a block)."""
        payload, error = await self._record(request)
        if error is not None:
            return error
        messages = payload.get("messages", [])
        blocks = sum(len(m["content"]) if isinstance(m.get("content"), list) else 1 for m in messages)
        return web.json_response({"input_tokens": 10 + blocks})

    async def _embeddings(self, request: web.Request) -> web.StreamResponse:
        """A pooling model's embeddings, as vLLM answers them: one vector an input."""
        payload, error = await self._record(request)
        if error is not None:
            return error
        inputs = payload.get("input")
        count = len(inputs) if isinstance(inputs, list) and inputs and not isinstance(inputs[0], int) else 1
        data = [{"object": "embedding", "index": i, "embedding": [0.5, -0.25, 0.125]} for i in range(count)]
        usage = {"prompt_tokens": 10, "total_tokens": 10}
        return web.json_response({"id": f"embd-{self.name}", "object": "list", "created": CREATED,
                                  "model": payload.get("model"), "data": data, "usage": usage})  # fmt: skip

    async def _scores(self, request: web.Request) -> web.StreamResponse:
        """A scoring model's answer, as vLLM's /score and /rerank give it."""
        payload, error = await self._record(request)
        if error is not None:
            return error
        usage = {"prompt_tokens": 10, "total_tokens": 10}
        if request.path.endswith("score"):
            data = [{"index": 0, "object": "score", "score": 0.5}]
            return web.json_response({"id": f"score-{self.name}", "object": "list", "created": CREATED,
                                      "model": payload.get("model"), "data": data, "usage": usage})  # fmt: skip
        results = [{"index": 0, "document": {"text": "d"}, "relevance_score": 0.5}]
        return web.json_response({"id": f"rerank-{self.name}", "model": payload.get("model"), "usage": usage,
                                  "results": results})  # fmt: skip

    async def _images(self, request: web.Request) -> web.StreamResponse:
        """An image generation model's answer, as SGLang's diffusion server gives it (its
        ImageResponse; tests/conformance holds it to SGLang's model): ``n`` images (1 to 10, as
        SGLang clamps it), each a 1x1 PNG, inline (``b64_json``) or, as SGLang answers when the
        request says no ``response_format``, a URL of a file on this replica alone
        (``/v1/images/{id}/content``, relative: the client resolves it against where it asked).
        A ``response_format`` or ``size`` SGLang refuses is a 400 in FastAPI's shape."""
        payload, error = await self._record(request)
        if error is not None:
            return error
        fmt = payload.get("response_format") or "url"
        if not isinstance(fmt, str) or fmt.lower() not in ("url", "b64_json"):
            return web.json_response({"detail": "response_format must be 'url' or 'b64_json'"}, status=400)
        size = payload.get("size")
        if size and not re.fullmatch(r"[1-9][0-9]*x[1-9][0-9]*", str(size).lower().replace(" ", "")):
            return web.json_response({"detail": "size must be formatted as positive WIDTHxHEIGHT"}, status=400)
        n = payload.get("n")
        count = max(1, min(n if isinstance(n, int) and not isinstance(n, bool) else 1, 10))
        self.images_made += 1
        made = f"img-{self.name}-{self.images_made}"
        inline = fmt.lower() == "b64_json"
        data = [
            {
                "b64_json": TINY_PNG if inline else None,
                "url": None if inline else f"/v1/images/{made}/content" + (f"?variant={i}" if count > 1 else ""),
                "revised_prompt": payload.get("prompt"),
                "file_path": None,
                "resize": None,
            }
            for i in range(count)
        ]
        return web.json_response(
            {"id": made, "created": CREATED, "data": data, "peak_memory_mb": None, "inference_time_s": None,
             "usage": None}
        )  # fmt: skip

    async def _image_file(self, request: web.Request) -> web.StreamResponse:
        """A generated image's file, on the replica that made it only (SGLang's ``/content``)."""
        made = request.match_info["id"]
        if not made.startswith(f"img-{self.name}-"):
            return web.json_response({"detail": f"image {made} not found"}, status=404)
        return web.Response(body=base64.b64decode(TINY_PNG), content_type="image/png")

    async def _edits(self, request: web.Request) -> web.StreamResponse:
        """An image edit (OpenAI's images API, multipart): the edited image, inline; what it was
        sent is recorded as a transcription's form is (each field's name, file name, type and size)."""

        def text(value: str | None) -> str | None:  # a form's names may hold anything: recorded as UTF-8 can
            return None if value is None else value.encode("utf-8", "replace").decode()

        fields: list[list[Any]] = []
        try:
            async for part in await request.multipart():
                if isinstance(part, BodyPartReader) and part.name:
                    data = await part.read()
                    small = data.decode(errors="replace") if part.filename is None and len(data) < 4096 else None
                    fields.append(
                        [text(part.name), text(part.filename), part.headers.get("Content-Type"), len(data), small]
                    )
        except (ValueError, HttpProcessingError) as exc:  # a form it cannot read: a 400, as an engine answers
            error = {"message": f"malformed form: {exc}", "type": "BadRequestError", "param": None, "code": 400}
            return web.json_response({"error": error}, status=400)
        if self.record:
            self.received.append(
                Received(request.method, request.path_qs, CIMultiDict(request.headers), orjson.dumps(fields))
            )
        return web.json_response({"created": CREATED, "data": [{"b64_json": TINY_PNG}]})

    async def _realtime(self, request: web.Request) -> web.StreamResponse:
        """vLLM's realtime transcription (``vllm/entrypoints/speech_to_text/realtime/connection.py``):
        ``session.created`` first; ``session.update`` names the model (required before a commit);
        ``input_audio_buffer.commit`` starts a transcription, each ``append`` (base64 PCM16, 16
        kHz) after it answered with a ``transcription.delta`` (a word a tenth of a second), a
        ``commit`` with ``final: true`` with ``transcription.done`` (its text and usage); what
        vLLM refuses, an ``error`` event ``{"error", "code"}`` as vLLM sends it. Each client event
        is recorded (its text), and held to ``check`` where set."""
        ws = web.WebSocketResponse()
        await ws.prepare(request)
        self.sessions += 1
        number = self.sessions

        async def send(event: dict[str, Any]) -> None:
            await ws.send_str(orjson.dumps(event).decode())

        async def error(message: str, code: str) -> None:
            await send({"type": "error", "error": message, "code": code})

        await send({"type": "session.created", "id": f"sess-{self.name}-{number}", "created": CREATED})
        validated, generating, heard = False, False, 0
        words: list[str] = []
        events = 0
        async for message in ws:
            if message.type is not WSMsgType.TEXT:
                await ws.close(code=1003, message=b"text frames only")  # starlette's receive_text
                break
            events += 1
            if self.record:
                self.received.append(
                    Received("WS", request.path_qs, CIMultiDict(request.headers), message.data.encode())
                )
            if 0 <= self.realtime_break_after < events:
                assert request.transport is not None
                request.transport.abort()  # a replica gone mid-session: no close frame
                break
            try:
                event = orjson.loads(message.data)
            except orjson.JSONDecodeError:
                await error("Invalid JSON", "invalid_json")
                continue
            refused = self.check(request.path, event) if self.check is not None else None
            if refused is not None:
                await error(refused, "processing_error")
                continue
            kind = event.get("type") if isinstance(event, dict) else None
            if kind == "standin.close":  # not vLLM's: the engine ends the session with this code and reason
                await ws.close(code=int(event.get("code", 1000)), message=str(event.get("reason", "")).encode())
                break
            if kind == "standin.flood":  # not vLLM's: `count` deltas of `size` characters, sent as fast as taken
                for _ in range(int(event.get("count", 0))):
                    await send({"type": "transcription.delta", "delta": "x" * int(event.get("size", 1))})
                    self.flooded += 1
                continue
            if kind == "session.update":
                if event.get("model") is None:
                    await error("Missing required field: model", "invalid_event")
                else:
                    validated = True
            elif kind == "input_audio_buffer.append":
                try:
                    audio = base64.b64decode(event["audio"], validate=True)
                except (KeyError, TypeError, ValueError):
                    audio = b""
                if not audio:
                    await error("Invalid audio data", "invalid_audio")
                    continue
                heard += len(audio)
                if generating:
                    word = f"w{len(words) + 1}"
                    words.append(word)
                    await send({"type": "transcription.delta", "delta": f" {word}" if len(words) > 1 else word})
            elif kind == "input_audio_buffer.commit":
                if not validated:
                    await error(
                        "Model not validated. Make sure to validate the model by sending a session.update event.",
                        "model_not_validated",
                    )
                elif event.get("final"):
                    usage = {"prompt_tokens": heard // 3200, "completion_tokens": len(words),
                             "total_tokens": heard // 3200 + len(words)}  # fmt: skip
                    await send({"type": "transcription.done", "text": " ".join(words), "usage": usage})
                    generating, words, heard = False, [], 0
                else:
                    generating = True
            else:
                await error(f"Unknown event type: {kind}", "unknown_event")
        return ws

    async def _speech(self, request: web.Request) -> web.StreamResponse:
        """A text-to-speech model's answer (OpenAI's speech API): audio bytes, a WAV of silence
        as long as the input has words (a tenth of a second each)."""
        payload, error = await self._record(request)
        if error is not None:
            return error
        words = len(str(payload.get("input", "")).split())
        samples = 1600 * max(1, words)  # 16 kHz, 16-bit mono
        data = b"\x00\x00" * samples
        head = b"RIFF" + (36 + len(data)).to_bytes(4, "little") + b"WAVEfmt " + (16).to_bytes(4, "little")
        head += (1).to_bytes(2, "little") + (1).to_bytes(2, "little") + (16000).to_bytes(4, "little")
        head += (32000).to_bytes(4, "little") + (2).to_bytes(2, "little") + (16).to_bytes(2, "little")
        return web.Response(body=head + b"data" + len(data).to_bytes(4, "little") + data, content_type="audio/wav")

    def _break_after(self, request: web.Request) -> int:
        return int(request.headers.get("X-Standin-Break-After", self.break_after))

    async def _events(
        self, request: web.Request, events: list[dict[str, Any]], *, first_delta: int
    ) -> web.StreamResponse:
        """Named SSE events (``event: <type>``), as the Responses and Messages APIs stream; the
        knobs count the content deltas, which begin at ``first_delta``."""
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(request)
        break_after = self._break_after(request)
        chunk_delay = int(request.headers.get("X-Standin-Chunk-Delay-Ms", "0")) / 1000
        for n, event in enumerate(events):
            if break_after >= 0 and n == first_delta + break_after:
                assert request.transport is not None
                request.transport.close()
                return response
            await response.write(f"event: {event['type']}\ndata: ".encode() + orjson.dumps(event) + b"\n\n")
            if chunk_delay and n >= first_delta:
                await asyncio.sleep(chunk_delay)
        await response.write_eof()
        return response

    async def _answer(
        self, request: web.Request, payload: dict[str, Any], text: str, *, chat: bool
    ) -> web.StreamResponse:
        self.served += 1
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{self.name}-{self.served}"
        model = payload.get("model")
        usage = {"prompt_tokens": 10, "completion_tokens": len(text.split()), "total_tokens": 10 + len(text.split())}
        if not payload.get("stream"):
            if chat:
                choice = {
                    "index": 0,
                    "message": {"role": "assistant", "content": text},
                    "logprobs": None,
                    "finish_reason": "stop",
                }
            else:
                choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": "stop"}
            body = {
                "id": rid,
                "object": "chat.completion" if chat else "text_completion",
                "created": CREATED,
                "model": model,
                "choices": [choice],
                "usage": usage,
            }
            return web.Response(body=orjson.dumps(body), content_type="application/json")

        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(request)
        obj = "chat.completion.chunk" if chat else "text_completion"
        break_after = self._break_after(request)
        chunk_delay = int(request.headers.get("X-Standin-Chunk-Delay-Ms", "0")) / 1000

        async def send(choices: list[dict[str, Any]], **extra: Any) -> None:
            event = {"id": rid, "object": obj, "created": CREATED, "model": model, "choices": choices, **extra}
            await response.write(b"data: " + orjson.dumps(event) + b"\n\n")

        if chat:
            await send(
                [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}]
            )
        words = text.split(" ")
        for i, word in enumerate(words):
            if i == break_after:
                assert request.transport is not None
                request.transport.close()
                return response
            piece = word if i == 0 else " " + word
            delta = (
                {"index": 0, "delta": {"content": piece}, "logprobs": None, "finish_reason": None}
                if chat
                else {"index": 0, "text": piece, "logprobs": None, "finish_reason": None}
            )
            await send([delta])
            if chunk_delay:
                await asyncio.sleep(chunk_delay)
        last = (
            {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "stop"}
            if chat
            else {"index": 0, "text": "", "logprobs": None, "finish_reason": "stop"}
        )
        await send([last])
        options = payload.get("stream_options") or {}
        if options.get("include_usage"):
            await send([], usage=usage)
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    async def _models(self, request: web.Request) -> web.Response:
        data = [{"id": self.name, "object": "model", "created": CREATED, "owned_by": "standin"}]
        return web.json_response({"object": "list", "data": data})

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(text="ok") if self.healthy else web.Response(status=503, text="starting")


def _fixed_length(text: str, payload: dict[str, Any]) -> str:
    """``text``, or exactly ``max_tokens`` of its words (cycled) when the request sets ``ignore_eos``."""
    length = payload.get("max_tokens")
    if payload.get("ignore_eos") is not True or type(length) is not int or length < 1:
        return text
    words = text.split(" ")
    return " ".join(words[i % len(words)] for i in range(length))


def _pieces(text: str) -> list[str]:
    """A reply's words as its stream's deltas (the first without its space)."""
    return [word if i == 0 else " " + word for i, word in enumerate(text.split(" "))]


_READ = re.compile(r"@read (\S+)")


def _asked_to_read(messages: list[Any], payload: dict[str, Any], tool: str) -> str | None:
    """The path the newest user message asks an agent to read (``@read PATH``), where the request
    offers ``tool`` and no tool result has come back since that message."""
    offered = payload.get("tools")
    if not isinstance(offered, list) or not any(isinstance(t, dict) and t.get("name") == tool for t in offered):
        return None
    last = max((i for i, m in enumerate(messages) if isinstance(m, dict) and m.get("role") == "user"), default=-1)
    if last < 0:
        return None
    after = messages[last:]
    if any(isinstance(m, dict) and str(m.get("type", "")).endswith("_output") for m in after):
        return None  # a Responses tool output came back
    content = messages[last].get("content")
    blocks = content if isinstance(content, list) else [content]
    if any(isinstance(b, dict) and b.get("type") == "tool_result" for b in blocks):
        return None  # an Anthropic tool result came back
    texts = (b if isinstance(b, str) else b.get("text") for b in blocks if isinstance(b, str | dict))
    found = next((m for t in texts if isinstance(t, str) and (m := _READ.search(t))), None)
    return found.group(1) if found is not None else None


def describe(messages: list[Any]) -> str:
    """'messages=2 text=1 image_url=1': the part types received, in a stable order (parts in a
    Responses ``function_call_output`` or an Anthropic ``tool_result`` counted too)."""
    counts: Counter[str] = Counter()

    def count(content: Any) -> None:
        if isinstance(content, str):
            counts["text"] += 1
        elif isinstance(content, list):
            for part in content:
                kind = (part.get("type") or "untyped") if isinstance(part, dict) else "text"
                counts[kind] += 1
                if kind == "tool_result":
                    count(part.get("content"))

    for message in messages:
        if isinstance(message, dict):
            count(message.get("content", message.get("output")))
    return " ".join([f"messages={len(messages)}", *(f"{k}={v}" for k, v in sorted(counts.items()))])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--name", default="standin")
    parser.add_argument("--no-record", action="store_true", help="keep no copy of the requests (benchmarks)")
    args = parser.parse_args()
    print(f"stand-in upstream '{args.name}' on http://{args.host}:{args.port} ({time.strftime('%X')})", flush=True)
    try:
        web.run_app(StandIn(args.name, record=not args.no_record).app(), host=args.host, port=args.port, print=None)
    except OSError as exc:  # a port in use: one line, not a traceback (make demo VLLM_PORT=...)
        raise SystemExit(
            f"stand-in {args.name}: cannot listen on {args.host}:{args.port}: {exc.strerror or exc}"
        ) from None


if __name__ == "__main__":
    main()

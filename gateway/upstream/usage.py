"""What an engine says a request cost: the ``usage`` of its reply, read as the reply is relayed.

Every API says it in its own words, and this module reads them all as one :class:`Usage`:

- chat and completions: ``usage: {prompt_tokens, completion_tokens, prompt_tokens_details:
  {cached_tokens}}``; streamed, in the chunk before ``[DONE]`` when the client asked for it
  (``stream_options: {include_usage: true}``; vLLM's ``continuous_usage_stats`` puts it, cumulative,
  in every chunk: the last one holds);
- Responses: ``usage: {input_tokens, output_tokens, input_tokens_details: {cached_tokens}}``;
  streamed, in ``response.completed`` (or ``.incomplete``, ``.failed``) under ``response``;
- Anthropic Messages: ``usage: {input_tokens, output_tokens, cache_read_input_tokens,
  cache_creation_input_tokens}``, whose ``input_tokens`` leaves out what the cache read and wrote
  (the prompt is the sum of the three); streamed, ``message_start``'s ``message.usage``, then
  ``message_delta``'s ``usage``, cumulative, field by field;
- embeddings, score and rerank: ``usage: {prompt_tokens}``;
- transcriptions: vLLM's ``usage`` counts seconds of audio (``{type: duration}``), not tokens, and
  is not read; a ``{type: tokens}`` usage is.

A reply is never parsed whole for it: a body is searched from its end for its last ``"usage":``
object (every API puts the reply's own last), a stream line by line for the lines that hold one.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import orjson

_KEY = b'"usage"'
_SPACE = b" \t\r\n"
TAIL_BYTES = 64 * 1024  # of a large body relayed in chunks: its end, where the usage is
_TRIES = 4  # "usage": keys looked at from a body's end before giving up (one nested in a value, say)
_DEPTH = 8  # closing braces tried for a usage object's end (Responses' nests objects two deep)


class Usage(NamedTuple):
    """A reply's tokens: ``prompt`` (cached included), ``completion``, and ``cached`` (of the prompt)."""

    prompt: int
    completion: int
    cached: int

    @property
    def total(self) -> int:
        return self.prompt + self.completion


def _count(value: Any) -> int:
    """A token count as given (a non-negative int), else 0."""
    return value if type(value) is int and value >= 0 else 0


def usage_of(fields: dict[str, Any]) -> Usage | None:
    """A ``usage`` object read as :class:`Usage`; None when it counts no tokens (or not in tokens)."""
    if "prompt_tokens" in fields or "completion_tokens" in fields:  # chat, completions, pooling
        details = fields.get("prompt_tokens_details")
        cached = _count(details.get("cached_tokens")) if isinstance(details, dict) else 0
        return Usage(_count(fields.get("prompt_tokens")), _count(fields.get("completion_tokens")), cached)
    if "input_tokens" in fields or "output_tokens" in fields:  # Responses, Messages, a token-counted transcription
        if fields.get("type") == "duration":
            return None
        read = _count(fields.get("cache_read_input_tokens"))
        written = _count(fields.get("cache_creation_input_tokens"))
        details = fields.get("input_tokens_details")
        cached = read or (_count(details.get("cached_tokens")) if isinstance(details, dict) else 0)
        return Usage(_count(fields.get("input_tokens")) + read + written, _count(fields.get("output_tokens")), cached)
    return None


def usage_in_body(body: bytes) -> Usage | None:
    """The usage of a JSON reply: its last ``"usage": {...}`` object, cut out and parsed alone."""
    end = len(body)
    for _ in range(_TRIES):
        at = body.rfind(_KEY, 0, end)
        if at < 0:
            return None
        found = _object_after(body, at + len(_KEY))
        if found is not None:
            return usage_of(found)
        end = at
    return None


def _object_after(body: bytes, at: int) -> dict[str, Any] | None:
    """The object of a key whose name ends at ``at`` (``: {...}``), or None (a value of another kind).
    Its end is the first ``}`` that closes as many braces as opened (a usage nests one level), and
    orjson says whether that is an object: no Python loop over its bytes."""
    if body.startswith(b":{", at):  # as orjson and pydantic write it
        start = at + 1
    else:  # json.dumps's ": {", or any spacing
        colon = body.find(b":", at, at + 16)
        if colon < 0 or body[at:colon].strip(_SPACE):
            return None
        start = body.find(b"{", colon, colon + 16)
        if start < 0 or body[colon + 1 : start].strip(_SPACE):
            return None
    end = body.find(b"}", start)
    for _ in range(_DEPTH):
        if end < 0:
            return None
        if body.count(b"{", start, end) == body.count(b"}", start, end) + 1:
            try:
                value = orjson.loads(body[start : end + 1])
            except orjson.JSONDecodeError:
                return None
            return value if isinstance(value, dict) else None
        end = body.find(b"}", end + 1)
    return None


class StreamUsage:
    """The usage of an SSE stream, fed its chunks as they are relayed: each ``data:`` line that
    holds a ``"usage"`` is parsed, and its usage fields (the event's own, or its ``response``'s or
    ``message``'s) merged over the ones before, so the last value of each field holds."""

    __slots__ = ("_fields", "_tail")

    def __init__(self) -> None:
        self._tail = b""  # a line begun in one chunk and not yet ended
        self._fields: dict[str, Any] = {}  # every usage field seen, its last value

    def feed(self, chunk: bytes) -> None:
        if not self._tail and chunk[-1:] == b"\n" and _KEY not in chunk:  # whole events, none a usage
            return
        data = self._tail + chunk if self._tail else chunk
        end = data.rfind(b"\n")
        if end < 0:
            self._tail = data if len(data) <= TAIL_BYTES else b""  # a line longer than that: not a usage event
            return
        self._tail = data[end + 1 :] if end + 1 < len(data) else b""
        if data.find(_KEY, 0, end) < 0:
            return
        for line in data[:end].split(b"\n"):
            if line.startswith(b"data:") and _KEY in line:
                self._event(line[5:])

    def _event(self, data: bytes) -> None:
        try:
            event = orjson.loads(data)
        except orjson.JSONDecodeError:
            return
        if not isinstance(event, dict):
            return
        fields = event.get("usage")
        if not isinstance(fields, dict):
            inner = event.get("response") or event.get("message")
            fields = inner.get("usage") if isinstance(inner, dict) else None
        if isinstance(fields, dict):
            self._fields.update(fields)

    @property
    def usage(self) -> Usage | None:
        return usage_of(self._fields)


class BodyTail:
    """The last :data:`TAIL_BYTES` or more of a body relayed in chunks, for its usage."""

    __slots__ = ("_chunks", "_size")

    def __init__(self) -> None:
        self._chunks: list[bytes] = []
        self._size = 0

    def feed(self, chunk: bytes) -> None:
        self._chunks.append(chunk)
        self._size += len(chunk)
        while len(self._chunks) > 1 and self._size - len(self._chunks[0]) >= TAIL_BYTES:
            self._size -= len(self._chunks.pop(0))

    @property
    def usage(self) -> Usage | None:
        return usage_in_body(b"".join(self._chunks))

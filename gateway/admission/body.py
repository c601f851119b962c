"""Request bodies: read within a deadline, bounded before they are parsed, written back exactly.

Every byte a client sends may be hostile, and parsing is where a small body turns into a large
cost: 30 MB of ``{},`` becomes 10 million dicts (900 MB, seconds of event-loop time). So:

- :func:`read_body` bounds the time a body may take to arrive (``server.client_body_timeout_s``)
  and decodes ``Content-Encoding`` itself, within the body limit (a corrupt or truncated body is a
  400 at once; aiohttp's own decoding left the request hanging on a truncated deflate stream);
- :func:`parse_body` counts, before parsing, the bytes that can start a JSON value (``,`` ``[``
  ``{``): a C-speed scan that bounds the number of values and so the memory and time of the parse
  (``server.max_json_values``; bytes inside strings count too, which errs on the safe side). After
  parsing it bounds nesting (``server.max_json_depth``; orjson can write back at most 254 levels);
- :func:`dump_body` writes a body back. orjson reads integers beyond 64 bits as floats, which
  would silently change a ``seed`` of 2**70; a body that holds such a number is read again with
  the standard library, which keeps integers exact, and written with it.
"""

from __future__ import annotations

import asyncio
import json
import zlib
from typing import Any

import orjson
from aiohttp import StreamReader, web

from ..config import ServerConfig
from ..config.keys import MAX_JSON_DEPTH
from ..errors import (
    InvalidRequestError,
    PayloadTooLargeError,
    RequestTimeoutError,
    UnreadableBodyError,
    UnsupportedEncodingError,
    clip,
)
from . import strings

# orjson turns integers outside [-2**63, 2**64) into floats: any float this large that is a whole
# number may have been such an integer (or was written 1e19; reading it again changes nothing).
_INT_RANGE = float(2**63)
WALK_CONTAINERS = 4096  # a body with more '[' and '{' bytes has its nesting measured by orjson, in C
YIELD_BYTES = 1 << 20  # bodies larger than this are parsed in steps, the event loop running between them
DECODE_IN_THREAD_BYTES = 1 << 16
_FEW = 32
_COUNT_BYTES = 2048  # a body no longer has its structure bytes counted whole (bytes.count), not found one by one
_SLICE_BYTES = 1 << 20
_NOT_STRUCTURE = bytes(b for b in range(256) if b not in b",[{")
# Content-Encoding -> the zlib window bits to try: gzip; deflate as zlib data, then as raw deflate
_WBITS: dict[str, tuple[int, ...]] = {
    "gzip": (16 + zlib.MAX_WBITS,),
    "x-gzip": (16 + zlib.MAX_WBITS,),
    "deflate": (zlib.MAX_WBITS, -zlib.MAX_WBITS),
}


async def read_body(request: web.Request, *, timeout_s: float, max_bytes: int) -> bytes:
    """The whole body, decoded, or RequestTimeoutError (408) when it takes longer than ``timeout_s``.

    A declared length over ``max_bytes`` is refused before a byte of the body is read, a chunked
    body as soon as it passes the limit. The server hands bodies over as sent
    (``SERVER_OPTIONS``): ``Content-Encoding`` is decoded here, within ``max_bytes`` of output.
    """
    if request.content_length is not None and request.content_length > max_bytes:
        raise body_too_large(max_bytes)
    codings = _codings(request.headers.get("Content-Encoding", ""))
    try:
        if request.content.is_eof():  # all of it came with the headers (most chats): taken as it lies
            raw = request.content.read_nowait()
            if len(raw) > max_bytes:  # (chunked: no length declared)
                raise body_too_large(max_bytes)
        else:
            async with asyncio.timeout(timeout_s):
                raw = await _read_all(request.content, max_bytes)
    except TimeoutError:
        raise RequestTimeoutError(
            f"The request body did not arrive within {timeout_s:g}s (server.client_body_timeout_s)"
        ) from None
    except web.RequestPayloadError:
        # Nothing more of this body can be read: aiohttp would try to drain it after the answer,
        # meet the same error again and log it with a traceback. The connection closes instead.
        request.content.feed_eof()
        raise UnreadableBodyError("The request body could not be read: its framing is corrupt or truncated") from None
    for coding in reversed(codings):
        if len(raw) > DECODE_IN_THREAD_BYTES:  # zlib lets go of the GIL: the event loop runs meanwhile
            raw = await asyncio.to_thread(_decompress, raw, coding, max_bytes)
        else:
            raw = _decompress(raw, coding, max_bytes)
    return raw


async def _read_all(content: StreamReader, max_bytes: int) -> bytes:
    """The body's chunks as they come, joined once: one copy of a large body (``request.read()``
    grows a bytearray, then copies it into bytes), none of a body that came in one chunk; 413
    as soon as they pass ``max_bytes`` (a chunked body declares no length). The reader's buffer
    is left at aiohttp's 64 KiB (``request.read()`` raises it to the body limit): a 2 MiB body
    read either way cost the same CPU, within the noise of 16 rounds."""
    chunks: list[bytes] = []
    size = 0
    while chunk := await content.readany():
        size += len(chunk)
        if size > max_bytes:
            raise body_too_large(max_bytes)
        chunks.append(chunk)
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


def _codings(header: str) -> list[str]:
    if not header:
        return []
    codings = [c for c in (part.strip().lower() for part in header.split(",")) if c and c != "identity"]
    for coding in codings:
        if coding not in _WBITS:
            raise UnsupportedEncodingError(
                f"Content-Encoding '{clip(coding, 40)}' is not supported (send gzip, deflate or identity)"
            )
    return codings


def _decompress(data: bytes, coding: str, max_bytes: int) -> bytes:
    """Decoded ``data``, refused past ``max_bytes`` as soon as it gets there (a small gzip bomb
    never expands in full). ``deflate`` is zlib-wrapped, or raw as some clients send it."""
    for wbits in _WBITS[coding]:
        decoder = zlib.decompressobj(wbits)
        try:
            out = decoder.decompress(data, max_bytes + 1)
        except zlib.error:
            continue  # the other form of deflate, if there is one
        if len(out) > max_bytes:
            raise body_too_large(max_bytes)
        if not decoder.eof or decoder.unused_data:
            break
        return out
    raise UnreadableBodyError(
        f"The request body could not be read with Content-Encoding '{coding}': it is corrupt or truncated"
    )


def body_too_large(max_bytes: int) -> PayloadTooLargeError:
    return PayloadTooLargeError(f"Request body is larger than the limit of {max_bytes} bytes (server.max_body_bytes)")


def parse_body(raw: bytes, server: ServerConfig) -> dict[str, Any]:
    """Parse a JSON object within the server's bounds; 400 invalid_request otherwise."""
    skeleton, spans = strings.cut(raw)
    return _parse(raw, skeleton, spans, server, _count_brackets(skeleton, server))[0]


async def read_json(
    request: web.Request, server: ServerConfig, *, max_bytes: int
) -> tuple[bytes, dict[str, Any], strings.Deferred | None]:
    """:func:`read_body` then :func:`parse_body`, letting the event loop run between the passes
    over a large body (each pass over 30 MB holds it for ~30 ms). Its long media strings are cut
    out first (gateway.admission.strings): its structure is counted on the rest. Its images'
    data URLs are read as far as admission needs them (their headers); the rest of each, in the
    :class:`~gateway.admission.strings.Deferred` (None: nothing was), is read only if asked for."""
    raw = await read_body(request, timeout_s=server.client_body_timeout_s, max_bytes=max_bytes)
    if len(raw) > YIELD_BYTES:
        await asyncio.sleep(0)
    skeleton, spans = strings.cut(raw)
    brackets = _count_brackets(skeleton, server)
    if len(raw) > YIELD_BYTES:
        await asyncio.sleep(0)
    return (raw, *_parse(raw, skeleton, spans, server, brackets, defer=True))


def _count_brackets(raw: bytes, server: ServerConfig) -> int:
    """The '[' and '{' bytes of ``raw``, after refusing a body with too many values."""
    limit = server.max_json_values
    values, brackets = _structure(raw, limit)
    if values > limit:
        raise InvalidRequestError(
            f"Request body has more than {limit} JSON values (server.max_json_values; counted before parsing "
            "as its ',', '[' and '{' bytes)"
        )
    return brackets


def _structure(raw: bytes, limit: int) -> tuple[int, int]:
    """The ',' '[' '{' bytes of ``raw`` in all (counted up to just past ``limit``), and the '[' '{'
    among them.

    A large body is mostly strings (base64 media, long texts) with few of these: they are found
    with ``bytes.find`` (memchr: ~12 us a MiB). Past a few dozen, ``translate`` keeps only them,
    a slice at a time (~0.6 us a KiB; ``bytes.count`` takes ~0.5 us a KiB for each of the three).
    A body of a few hundred bytes (a chat, the skeleton of one with images) is counted whole:
    three counts cost a third of a find a byte found (1.2 us, 4 inside the server).
    """
    if len(raw) <= _COUNT_BYTES:
        opened = raw.count(b"[") + raw.count(b"{")
        return raw.count(b",") + opened, opened
    commas, squares, curlies = _count_few(raw, b","), _count_few(raw, b"["), _count_few(raw, b"{")
    if commas is not None and squares is not None and curlies is not None:
        return commas + squares + curlies, squares + curlies
    values = brackets = 0
    for start in range(0, len(raw), _SLICE_BYTES):
        kept = raw[start : start + _SLICE_BYTES].translate(None, _NOT_STRUCTURE)
        values += len(kept)
        brackets += len(kept) - kept.count(b",")
        if values > limit:
            break
    return values, brackets


def _count_few(raw: bytes, char: bytes) -> int | None:
    """How many ``char`` bytes ``raw`` holds, or None when more than a few."""
    count, at = 0, raw.find(char)
    while at != -1:
        count += 1
        if count > _FEW:
            return None
        at = raw.find(char, at + 1)
    return count


def _parse(
    raw: bytes, skeleton: bytes, spans: list[tuple[int, int]], server: ServerConfig, brackets: int, defer: bool = False
) -> tuple[dict[str, Any], strings.Deferred | None]:
    # orjson's dict, its long strings read aside (with ``defer``, images' as far as their headers)
    parsed = strings.parse(skeleton, raw, spans, defer=defer) if spans else None
    deferred = None
    if parsed is not None:
        body, deferred = parsed[0], parsed[1] or None
    else:
        if spans:  # the skeleton was not the body: its structure is counted whole before it is parsed
            brackets = _count_brackets(raw, server)
        try:
            body = orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            raise InvalidRequestError(f"Request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise InvalidRequestError("Request body must be a JSON object")
    if brackets > server.max_json_depth:  # fewer containers than that cannot nest deeper
        _check_depth(body, server.max_json_depth, brackets)
    return body, deferred


def exact(raw: bytes, body: dict[str, Any]) -> dict[str, Any]:
    """``body``, or ``raw`` read again with exact integers if orjson may have rounded one.

    Call it before a body is changed and written back (``raw`` is forwarded as is otherwise).
    """
    if not _has_rounded_integer(body):
        return body
    exact_body: dict[str, Any] = json.loads(raw)  # valid JSON of bounded depth: orjson read it
    return exact_body


def dump_body(body: Any) -> bytes:
    try:
        return orjson.dumps(body)
    except orjson.JSONEncodeError:  # an integer beyond 64 bits (exact() kept it)
        return json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode()


def _check_depth(body: dict[str, Any], limit: int, containers: int) -> None:
    """400 naming the top-level field in which arrays and objects nest deeper than ``limit``."""
    for key, value in body.items():
        if isinstance(value, dict | list) and _deeper_than(value, limit - 1, containers):
            raise InvalidRequestError(
                f"Request body nests arrays and objects deeper than {limit} levels in '{clip(key)}' "
                "(server.max_json_depth)",
                param=clip(key),
            )


def _deeper_than(value: dict[str, Any] | list[Any], limit: int, containers: int) -> bool:
    """Whether ``value`` nests more than ``limit`` levels (``value`` itself is one)."""
    if containers > WALK_CONTAINERS:
        # orjson writes at most MAX_JSON_DEPTH levels and refuses more, in C: wrapped in enough
        # lists, the value is refused exactly when it is too deep (a walk in Python takes ~0.7 us a
        # container, 85 ms for a 360 KB body of empty arrays)
        probe: Any = value
        for _ in range(MAX_JSON_DEPTH - limit):
            probe = [probe]
        try:
            orjson.dumps(probe)
        except orjson.JSONEncodeError:
            return True
        return False
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > limit:
            return True
        children = node.values() if isinstance(node, dict) else node
        stack.extend((c, depth + 1) for c in children if isinstance(c, dict | list))
    return False


def _has_rounded_integer(body: dict[str, Any]) -> bool:
    # On every rewrite: exact type checks (orjson builds plain dicts, lists and floats) walk a
    # chat twice as fast as isinstance does.
    stack: list[Any] = [body]
    while stack:
        node = stack.pop()
        for child in node.values() if type(node) is dict else node:
            kind = type(child)
            if kind is dict or kind is list:
                stack.append(child)
            elif kind is float and abs(child) >= _INT_RANGE and child.is_integer():
                return True
    return False

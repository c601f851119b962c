"""Hostile bodies (issue 6): generated and mutated requests never get a 5xx, never take the gateway
down, end fast, and leave no task or file descriptor behind.

Hypothesis drives a blocking client (``http.client``, so every byte and header is ours) from a worker
thread while the gateway and a stand-in upstream serve on the test's event loop: the fixtures are the
ones every end-to-end test uses, and the loop's tasks and this process's descriptors (both ends of
every connection) can be counted before and after a run.

Nothing here may reach beyond 127.0.0.1. Media URLs are data URLs or loopback URLs on a port where
nothing listens (``media.allow_private_networks`` is false, so they are refused before any connect);
the encoder listens nowhere and its model has ``on_encoder_error: passthrough``. The stand-in is always
up, so no 5xx is ever legitimate.
"""

from __future__ import annotations

import asyncio
import base64
import copy
import dataclasses
import functools
import gzip
import http.client
import json
import logging
import os
import time
import zlib
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from importlib.util import find_spec
from typing import Any

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from gateway.media.asking import CONCURRENCY
from tests.conftest import Gateway, free_port, routing
from tools.standin import Received

DEAD_PORT = free_port()  # media URLs point here; they must be refused before any connect
SECONDS_PER_REQUEST = 5.0  # "end fast": far above what any of these takes when nothing is wrong
# One more pooled keep-alive connection to the stand-in (both of its ends live in this process, and
# the stand-in's side has a handler task) is not a leak.
FD_SLACK = 2
TASK_SLACK = 1
MODELS = ("vision", "omni", "texty", "epd", "silent", "framed", "sampled")
# video sampled into frames where PyAV is (the video extra); without it, stripped and passed as sent
HAS_PYAV = find_spec("av") is not None
FRAMES = "{frames: 2}" if HAS_PYAV else "strip"
SAMPLE = "\n    video: {sample: {frames: 2}}" if HAS_PYAV else ""
TINY_PNG = (
    "data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAIAAACQd1PeAAAADElEQVR4nGP4z8AAAAMBAQDJ/pLvAAAAAElFTkSuQmCC"
)


def table(upstream: str, encoder: str, whisper: str) -> str:
    """Every decision the gateway makes: direct, rename, redirect, strip (muting a video's audio too),
    encode (with a dead encoder), video as frames or pre-sampled, audio transcribed (by a stand-in
    of its own, so that the chat stand-in receives only chat requests)."""
    return routing(
        f"""  - name: vision
    upstreams: [{upstream}]
    upstream_model: org/Vision-7B
    accepts: [text, image]
    limits: {{image: 4}}
    on_unsupported:
      video: {{redirect: omni}}
      audio: strip""",
        f"""  - name: omni
    upstreams: [{upstream}]
    accepts: [text, image, video, audio]
    apis: [chat, completions, responses, messages, embeddings, score, rerank]""",
        f"""  - name: texty
    upstreams: [{upstream}]
    accepts: [text]
    on_unsupported:
      image: strip
      video: strip
      audio: {{redirect: omni}}""",
        f"""  - name: epd
    upstreams: [{upstream}]
    upstream_model: org/EPD
    accepts: [text, image]
    encode: {{image: dead}}
    on_encoder_error: passthrough""",
        f"""  - name: silent
    upstreams: [{upstream}]
    accepts: [text, video]
    on_unsupported:
      audio: strip""",
        f"""  - name: framed
    upstreams: [{upstream}]
    accepts: [text, image]
    limits: {{image: 4}}
    on_unsupported:
      video: {FRAMES}
      audio: {{transcribe: whisper}}""",
        f"""  - name: sampled
    upstreams: [{upstream}]
    accepts: [text, video]{SAMPLE}
    on_unsupported:
      audio: {{transcribe: whisper, on_error: reject}}""",
        f"""  - name: whisper
    upstreams: [{whisper}]
    accepts: [text, audio]""",
        server="{max_json_depth: 254, max_body_bytes: 1048576}",
        extra=(
            "media: {allow_private_networks: false, fetch_timeout_s: 2}\n"
            f"encoders:\n  dead: {{kind: http, urls: ['{encoder}'], timeout_s: 2}}\n"
        ),
    )


# --- what is sent ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Raw:
    """A JSON token written as is (NaN, 1e400, a 5000-digit integer)."""

    text: str


@dataclass(frozen=True)
class Case:
    path: str
    body: bytes
    headers: tuple[tuple[str, str], ...] = (("Content-Type", "application/json"),)
    chunked: bool = False
    # aiohttp's HTTP parser refuses the message before the gateway sees it (bad framing) and
    # answers with its own plain-text 400; docs/security.md says so
    refused_by_aiohttp: bool = False


def to_json(value: Any, *, ascii: bool) -> str:
    """JSON text that may hold what the json module will not write: Raw tokens, lone surrogates."""
    if isinstance(value, Raw):
        return value.text
    if isinstance(value, dict):
        items = (f"{json.dumps(k, ensure_ascii=ascii)}:{to_json(v, ascii=ascii)}" for k, v in value.items())
        return "{" + ",".join(items) + "}"
    if isinstance(value, list):
        return "[" + ",".join(to_json(v, ascii=ascii) for v in value) + "]"
    return json.dumps(value, ensure_ascii=ascii)


@st.composite
def encoded(draw: st.DrawFn, value: Any) -> bytes:
    # ensure_ascii writes a lone surrogate as a \ud800 escape; without it, as the (invalid) UTF-8 bytes
    if draw(st.booleans()):
        return to_json(value, ascii=True).encode()
    return to_json(value, ascii=False).encode("utf-8", "surrogatepass")


# --- generated bodies -------------------------------------------------------------------------------

TEXT = st.text(max_size=12) | st.sampled_from(["", "\x00", "\ufeff", "\u2028", "🦀", "é" * 12])
SURROGATES = st.sampled_from(["\ud800", "\udfff", "a\udc00b", "\udbff\udbff"])  # lone, so not valid UTF-8
ODD_TEXT = TEXT | SURROGATES
BIG_INTS = [2**63 - 1, 2**63, 2**64 - 1, 2**64, -(2**63), -(2**63) - 1, 2**70, -(2**70), 10**30, 10**308, -(10**400)]
INTS = st.integers() | st.sampled_from(BIG_INTS)
RAW_TOKENS = ["NaN", "Infinity", "-Infinity", "1e400", "-0", "1E+2", "0.1e-400", "1" + "0" * 5000]
SCALARS = st.none() | st.booleans() | INTS | st.floats(allow_nan=False, allow_infinity=False) | ODD_TEXT
JSON_VALUES = st.recursive(
    SCALARS, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(ODD_TEXT, inner, max_size=3), max_leaves=8
)
MEDIA_URLS = st.sampled_from(
    [
        TINY_PNG,
        "data:image/png;base64,iVBORw0KGgo=",  # the PNG signature alone
        "data:image/png;base64,%%%",
        "data:image/png;base64,",
        "data:,",
        "data:text/plain,hello",
        "data:video/mp4;base64,AAAA",
        f"http://127.0.0.1:{DEAD_PORT}/cat.png",
        f"https://127.0.0.1:{DEAD_PORT}/cat.png",
        f"http://localhost:{DEAD_PORT}/cat.png",
        f"http://[::1]:{DEAD_PORT}/cat.png",
        f"http://2130706433:{DEAD_PORT}/cat.png",
        f"ftp://127.0.0.1:{DEAD_PORT}/cat.png",
        "file:///etc/passwd",
        "http://",
        "https://[",
        "",
    ]
) | TEXT.map(lambda t: "data:" + t)
B64 = st.sampled_from(["UklGRg==", "AAAA", "", "!!", "iVBORw0KGgo="])
UUIDS = st.sampled_from(["3f2a", "", "x" * 64])
KNOWN_KEYS = [
    "type", "text", "image_url", "url", "detail", "uuid", "input_audio", "data", "format", "video_url",
    "audio_url", "image_embeds", "audio_embeds", "file_id", "role", "content", "name", "model", "messages",
    "stream", "mm_processor_kwargs", "use_audio_in_video", "prompt", "seed", "n", "max_tokens",
]  # fmt: skip
KEYS = st.sampled_from(KNOWN_KEYS) | ODD_TEXT


def _part(kind: str, key: str, value: st.SearchStrategy[Any]) -> st.SearchStrategy[dict[str, Any]]:
    return st.fixed_dictionaries({"type": st.just(kind), key: value})


def _url_obj(urls: st.SearchStrategy[str]) -> st.SearchStrategy[dict[str, Any]]:
    return st.fixed_dictionaries({"url": urls}, optional={"detail": st.sampled_from(["auto", "low", "high"])})


_CACHED = st.sampled_from(["image_url", "video_url", "audio_url", "input_audio", "image_embeds", "audio_embeds"])
PARTS: st.SearchStrategy[Any] = st.one_of(
    *(_part(kind, "text", TEXT) for kind in ("text", "input_text", "output_text")),
    _part("refusal", "refusal", TEXT),
    _part("thinking", "thinking", TEXT),
    _part("tool_reference", "name", TEXT),
    _part("prompt_embeds", "data", B64),
    _part("image_url", "image_url", _url_obj(MEDIA_URLS)),
    _part("input_image", "image_url", MEDIA_URLS),
    _part("input_image", "file_id", st.just("file-abc")),
    _part("image_embeds", "image_embeds", B64 | st.dictionaries(st.sampled_from(["image_embeds", "grid"]), B64)),
    _part("video_url", "video_url", _url_obj(MEDIA_URLS)),
    _part("input_audio", "input_audio", st.fixed_dictionaries({"data": B64}, optional={"format": TEXT})),
    _part("audio_url", "audio_url", _url_obj(MEDIA_URLS)),
    _part("audio_embeds", "audio_embeds", B64),
    # vLLM's untyped parts, bare URL strings included
    st.builds(lambda k, u: {k: u}, st.sampled_from(["image_url", "video_url", "audio_url"]), MEDIA_URLS),
    st.builds(lambda k, u: {k: {"url": u}}, st.sampled_from(["image_url", "video_url", "audio_url"]), MEDIA_URLS),
    st.builds(lambda d: {"input_audio": {"data": d, "format": "wav"}}, B64),
    st.builds(lambda u: {"type": None, "image_url": {"url": u}}, MEDIA_URLS),  # a null type is no type
    # media the engine has cached: null, named by uuid
    st.builds(
        lambda k, u, typed: {**({"type": k} if typed else {}), k: None, "uuid": u}, _CACHED, UUIDS, st.booleans()
    ),
    _part("not_a_type", "x", TEXT),
    st.builds(lambda t: {"type": t}, TEXT),
    TEXT,  # a plain string in a content array
)
# Parts that are well formed, of every modality: bodies made of them get past admission, so what is
# added to them (deep nesting, say) reaches the rewrite and the upstream.
ADMISSIBLE_PARTS: st.SearchStrategy[Any] = st.one_of(
    _part("text", "text", st.text(max_size=12)),
    _part("input_text", "text", st.text(max_size=12)),
    _part("image_url", "image_url", _url_obj(st.sampled_from([TINY_PNG, f"http://127.0.0.1:{DEAD_PORT}/cat.png"]))),
    _part("input_image", "image_url", st.just(TINY_PNG)),
    _part("image_embeds", "image_embeds", st.just("AAAA")),
    _part("video_url", "video_url", _url_obj(st.just("data:video/mp4;base64,AAAA"))),
    _part("input_audio", "input_audio", st.just({"data": "UklGRg==", "format": "wav"})),
    _part("audio_url", "audio_url", _url_obj(st.just("data:audio/wav;base64,UklGRg=="))),
    st.just({"image_url": TINY_PNG}),
    st.builds(lambda k: {"type": k, k: None, "uuid": "3f2a"}, st.sampled_from(["image_url", "video_url", "audio_url"])),
)
OPTIONAL_FIELDS = {
    "stream": st.booleans(),
    "temperature": st.floats(allow_nan=False, allow_infinity=False),
    "seed": INTS,
    "max_tokens": INTS,
    "mm_processor_kwargs": st.fixed_dictionaries({"use_audio_in_video": st.booleans()}),
    "metadata": JSON_VALUES,
}
ROLES = st.sampled_from(["user", "system", "assistant", "tool", "developer"])
ADMISSIBLE_CHAT_BODIES = st.fixed_dictionaries(
    {
        "model": st.sampled_from(MODELS),
        "messages": st.lists(
            st.fixed_dictionaries(
                {"role": ROLES, "content": st.text(max_size=12) | st.lists(ADMISSIBLE_PARTS, max_size=4)}
            ),
            min_size=1,
            max_size=3,
        ),
    },
    optional=OPTIONAL_FIELDS,
)
MESSAGES = st.fixed_dictionaries(
    {"role": ROLES, "content": st.none() | ODD_TEXT | st.lists(PARTS, max_size=5)}, optional={"name": TEXT}
)
CHAT_BODIES = ADMISSIBLE_CHAT_BODIES | st.fixed_dictionaries(
    {"model": st.sampled_from(MODELS) | TEXT, "messages": st.lists(MESSAGES, min_size=1, max_size=4)},
    optional=OPTIONAL_FIELDS,
)
# The Responses API: its parts, its items (messages, tool outputs, items carrying no media), hostile too
RESPONSE_PARTS: st.SearchStrategy[Any] = st.one_of(
    *(_part(kind, "text", TEXT) for kind in ("input_text", "output_text")),
    _part("refusal", "refusal", TEXT),
    _part("input_image", "image_url", MEDIA_URLS | _url_obj(MEDIA_URLS)),
    _part("input_image", "file_id", TEXT),
    _part("input_file", "file_data", B64),
    _part("input_audio", "input_audio", st.fixed_dictionaries({"data": B64}, optional={"format": TEXT})),
    st.fixed_dictionaries({"type": st.just("input_audio"), "data": B64, "format": TEXT}),  # flat, as older SDKs
    _part("image_url", "image_url", _url_obj(MEDIA_URLS)),  # chat's: not a Responses part
    st.builds(lambda t: {"type": t}, TEXT),
    TEXT,
)
RESPONSE_CONTENT = ODD_TEXT | st.lists(RESPONSE_PARTS, max_size=4)
RESPONSE_ITEMS: st.SearchStrategy[Any] = st.one_of(
    st.fixed_dictionaries({"role": ROLES, "content": RESPONSE_CONTENT}, optional={"type": st.just("message")}),
    st.fixed_dictionaries(
        {"type": st.just("function_call_output"), "call_id": TEXT, "output": RESPONSE_CONTENT | st.none()}
    ),
    st.fixed_dictionaries({"type": st.sampled_from(["function_call", "reasoning", "item_reference"]), "id": TEXT}),
    st.fixed_dictionaries({"type": st.just("message"), "content": RESPONSE_CONTENT}),  # no role
    JSON_VALUES,
)
RESPONSE_BODIES = st.fixed_dictionaries(
    {"model": st.sampled_from(MODELS) | TEXT, "input": ODD_TEXT | st.lists(RESPONSE_ITEMS, max_size=4)},
    # previous_response_id is left out: the stand-in, as vLLM, answers 404 for one it does not hold
    # (tests/server/test_responses.py follows stored responses)
    optional={"instructions": TEXT | INTS, "stream": st.booleans()},
)
# The Anthropic Messages API: its blocks (tool results with blocks inside), hostile too
SOURCES = st.one_of(
    st.fixed_dictionaries({"type": st.just("base64"), "media_type": TEXT, "data": B64}),
    st.fixed_dictionaries({"type": st.just("url"), "url": MEDIA_URLS}),
    st.fixed_dictionaries({"type": st.sampled_from(["text", "file", "content", "nope"]), "data": TEXT}),
    JSON_VALUES,
)
BLOCKS: st.SearchStrategy[Any] = st.one_of(
    _part("text", "text", TEXT),
    _part("image", "source", SOURCES),
    _part("document", "source", SOURCES),
    st.fixed_dictionaries({"type": st.just("tool_use"), "id": TEXT, "name": TEXT, "input": JSON_VALUES}),
    _part("thinking", "thinking", TEXT),
    _part("redacted_thinking", "data", TEXT),
    st.builds(lambda t: {"type": t}, TEXT),
    TEXT,
)
BLOCKS_WITH_RESULTS = BLOCKS | st.fixed_dictionaries(
    {"type": st.just("tool_result"), "tool_use_id": TEXT},
    optional={"content": ODD_TEXT | st.lists(BLOCKS, max_size=3) | JSON_VALUES},
)
MESSAGE_BODIES = st.fixed_dictionaries(
    {
        "model": st.sampled_from(MODELS) | TEXT,
        "max_tokens": INTS,
        "messages": st.lists(
            st.fixed_dictionaries(
                {"role": st.sampled_from(["user", "assistant"]) | TEXT,
                 "content": ODD_TEXT | st.lists(BLOCKS_WITH_RESULTS, max_size=4)}
            ),
            max_size=3,
        ),
    },
    optional={"system": TEXT | st.lists(_part("text", "text", TEXT), max_size=2) | INTS, "stream": st.booleans()},
)  # fmt: skip
PROMPTS = TEXT | st.lists(TEXT, max_size=3) | st.lists(INTS, max_size=3) | st.lists(st.lists(INTS, max_size=3))
ADMISSIBLE_COMPLETION_BODIES = st.fixed_dictionaries(
    {"model": st.sampled_from(MODELS), "prompt": st.text(max_size=12) | st.lists(st.integers(0, 1000), max_size=3)}
)
COMPLETION_BODIES = ADMISSIBLE_COMPLETION_BODIES | st.fixed_dictionaries(
    {"model": st.sampled_from(MODELS) | TEXT, "prompt": PROMPTS},
    optional={"stream": st.booleans(), "seed": INTS, "max_tokens": INTS, "echo": st.booleans(), "suffix": TEXT},
)


# --- mutations of a parsed body ---------------------------------------------------------------------

Path = tuple[str | int, ...]
MUTABLE_DEPTH = 8  # mutations land this deep at most (a nested value added earlier is not walked)
DEPTHS = st.sampled_from([126, 127, 128, 129, 252, 253, 254, 255, 256, 300]) | st.integers(1, 300)


def paths(value: Any, path: Path = ()) -> Iterator[Path]:
    yield path
    if len(path) >= MUTABLE_DEPTH:
        return
    children = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, child in children:
        yield from paths(child, (*path, key))


def nest(value: Any, depth: int, *, as_list: bool) -> Any:
    for _ in range(depth):
        value = [value] if as_list else {"a": value}
    return value


@st.composite
def nested_values(draw: st.DrawFn) -> Any:
    leaf: Any = draw(st.sampled_from([[], {}, 0, "x", None]))
    return nest(leaf, draw(DEPTHS), as_list=draw(st.booleans()))


REPLACEMENTS: st.SearchStrategy[Any] = (
    JSON_VALUES
    | st.sampled_from(["", [], {}, None, 0, False, -1])
    | st.sampled_from(BIG_INTS)
    | st.sampled_from(RAW_TOKENS).map(Raw)
    | nested_values()
)


def _at(root: Any, path: Path) -> Any:
    for key in path:
        root = root[key]
    return root


@st.composite
def mutated(draw: st.DrawFn, bodies: st.SearchStrategy[dict[str, Any]]) -> Any:
    """A body with 1-3 mutations at any level: wrong types, missing keys, extra keys, deep nesting."""
    root: Any = copy.deepcopy(draw(bodies))

    def replacement() -> Any:  # a copy: a drawn value may be a strategy's constant, which must not change
        return copy.deepcopy(draw(REPLACEMENTS))

    for _ in range(draw(st.integers(1, 3))):
        path = draw(st.sampled_from(list(paths(root))[1:] or [()]))  # not the root: mutated_byte_bodies does that
        op = draw(st.sampled_from(["replace", "delete", "add"]))
        node = _at(root, path)
        if op == "add" and isinstance(node, dict | list):
            value = replacement()
            if isinstance(node, dict):
                node[draw(KEYS)] = value
            else:
                node.insert(draw(st.integers(0, len(node))), value)
        elif op == "delete" and path:
            del _at(root, path[:-1])[path[-1]]
        elif path:
            _at(root, path[:-1])[path[-1]] = replacement()
        else:
            root = replacement()
    return root


# --- mutations of the bytes -------------------------------------------------------------------------

BAD_UTF8 = [b"\xff", b"\xc0\xaf", b"\xed\xa0\x80", b"\xf4\x90\x80\x80", b"\x80", b"\xe2\x82"]
NOT_OBJECTS = [b"", b" ", b"[]", b"null", b"1", b'"x"', b"true", b"[{}]", b"{", b"}", b'{"model"}', b"\x00"]


@st.composite
def mutated_bytes(draw: st.DrawFn) -> bytes:
    body = draw(encoded(draw(CHAT_BODIES | COMPLETION_BODIES)))
    where = draw(st.integers(0, len(body)))
    op = draw(st.sampled_from(["truncate", "insert", "bad_utf8", "bad_utf8_in_string", "bom", "trailing", "dup"]))
    if op == "truncate":
        return body[:where]
    if op == "insert":
        return body[:where] + draw(st.binary(min_size=1, max_size=8)) + body[where:]
    if op == "bad_utf8":
        return body[:where] + draw(st.sampled_from(BAD_UTF8)) + body[where:]
    if op == "bad_utf8_in_string":
        quotes = [i + 1 for i, byte in enumerate(body) if byte == ord('"')]
        at = draw(st.sampled_from(quotes))
        return body[:at] + draw(st.sampled_from(BAD_UTF8)) + body[at:]
    if op == "bom":
        return b"\xef\xbb\xbf" + body
    if op == "trailing":
        return body + draw(st.sampled_from([b"x", b"{}", b"\x00", b" \n", b",", b"]", b"}"]))
    return b'{"model":' + draw(encoded(draw(st.sampled_from(MODELS) | JSON_VALUES))) + b"," + body[1:]


# --- odd transports ---------------------------------------------------------------------------------

CONTENT_TYPES = [
    None, "application/json", "text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=zz",
    "application/json; charset=latin-1", "application/octet-stream", "garbage", "",
]  # fmt: skip
ENDPOINTS = st.sampled_from(
    [
        "/v1/chat/completions",
        "/v1/completions",
        "/v1/responses",
        "/v1/messages",
        "/v1/embeddings",
        "/v1/rerank",
        "/score",
        "/v1/audio/transcriptions",  # JSON or bytes where a form belongs: a 400, never a 5xx
    ]
)


@functools.cache
def gzip_bomb() -> bytes:
    """8 MiB of JSON (spaces, then {}) in a few KiB: over server.max_body_bytes once inflated."""
    return gzip.compress(b" " * (8 << 20) + b"{}", compresslevel=9)


ENCODINGS = [
    "none", "identity", "gzip", "gzip-corrupt", "gzip-truncated", "gzip-plain", "deflate", "deflate-plain",
    "x-unknown", "gzip, gzip", "bomb",
]  # fmt: skip


@st.composite
def content_encoded(draw: st.DrawFn, body: bytes) -> tuple[str | None, bytes]:
    how = draw(st.sampled_from(ENCODINGS))
    if how == "none":
        return None, body
    if how == "gzip":
        return "gzip", gzip.compress(body)
    if how == "gzip-corrupt":
        flipped = bytearray(gzip.compress(body))
        for i in draw(st.lists(st.integers(0, len(flipped) - 1), min_size=1, max_size=4)):
            flipped[i] ^= draw(st.integers(1, 255))
        return "gzip", bytes(flipped)
    if how == "gzip-truncated":
        packed = gzip.compress(body)
        return "gzip", packed[: draw(st.integers(0, len(packed) - 1))]
    if how == "deflate":
        return "deflate", zlib.compress(body)
    if how == "bomb":
        return "gzip", gzip_bomb()
    return how.removesuffix("-plain"), body  # labelled, but not encoded that way


@st.composite
def content_encoded_requests(draw: st.DrawFn) -> Case:
    """Bodies sent compressed, corrupt, truncated, labelled with an encoding they do not have, or as
    a few KiB that inflate past server.max_body_bytes."""
    body = draw(encoded(draw(CHAT_BODIES | COMPLETION_BODIES)) | mutated_bytes())
    encoding, data = draw(content_encoded(body))
    headers = [("Content-Type", "application/json")]
    if encoding is not None:
        headers.append(("Content-Encoding", encoding))
    return Case(draw(ENDPOINTS), data, tuple(headers), chunked=draw(st.booleans()))


@st.composite
def odd_header_requests(draw: st.DrawFn) -> Case:
    """Content types that are not JSON (or none), Expect, chunked bodies, odd request ids."""
    body = draw(encoded(draw(CHAT_BODIES | COMPLETION_BODIES)) | mutated_bytes())
    headers: list[tuple[str, str]] = []
    content_type = draw(st.sampled_from(CONTENT_TYPES))
    if content_type is not None:
        headers.append(("Content-Type", content_type))
    expect = draw(st.sampled_from([None, "100-continue", "100-Continue", "something-else"]))
    if expect is not None:
        headers.append(("Expect", expect))
    if draw(st.booleans()):
        headers.append(("X-Request-Id", draw(st.sampled_from(["", "x" * 300, "a b", "\u00e9", "ok-1"]))))
    return Case(draw(ENDPOINTS), body, tuple(headers), chunked=draw(st.booleans()))


# What aiohttp's HTTP parser refuses before the gateway sees a request: bytes after the declared
# Content-Length (read as a next request), a Content-Encoding it cannot decode.
@st.composite
def overlong_bodies(draw: st.DrawFn) -> Case:
    body = draw(encoded(draw(CHAT_BODIES | COMPLETION_BODIES)))
    headers = (("Content-Type", "application/json"), ("Content-Length", str(draw(st.integers(0, len(body) - 1)))))
    return Case(draw(ENDPOINTS), body, headers)


@st.composite
def undecodable_encodings(draw: st.DrawFn) -> Case:
    body = draw(encoded(draw(CHAT_BODIES | COMPLETION_BODIES)))
    headers = (("Content-Type", "application/json"), ("Content-Encoding", draw(st.sampled_from(["br", "zstd"]))))
    return Case(draw(ENDPOINTS), body, headers)


# --- the exchange and its properties ----------------------------------------------------------------


class Target:
    """The gateway under test, what the stand-in behind it received, and what the gateway's request
    handlers let escape (collected by _CrashLog)."""

    def __init__(self, port: int, received: list[Received]) -> None:
        self.port = port
        self.received = received
        self.crashes: list[str] = []

    def __repr__(self) -> str:  # what a falsifying example shows
        return f"Target(port={self.port})"


class _CrashLog(logging.Handler):
    """Collects what the gateway logs as unhandled, and what aiohttp meets after a handler answered
    (its "Unhandled exception": a traceback in the log for every such request)."""

    def __init__(self, into: list[str]) -> None:
        super().__init__(logging.ERROR)
        self.into = into

    def emit(self, record: logging.LogRecord) -> None:
        if record.name.startswith("gateway") or record.getMessage().startswith("Unhandled exception"):
            error = record.exc_info[1] if record.exc_info else None
            self.into.append(f"{record.name}: {record.getMessage()}: {error!r}")


@dataclass(frozen=True)
class Reply:
    status: int  # 0: the connection closed without a response
    headers: http.client.HTTPMessage | None
    body: bytes
    seconds: float


def send(port: int, case: Case, method: str = "POST") -> Reply:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    started = time.monotonic()
    try:
        connection.putrequest(method, case.path, skip_accept_encoding=True)
        for name, value in case.headers:
            connection.putheader(name, value.encode())  # UTF-8, not http.client's latin-1
        if case.chunked:
            connection.putheader("Transfer-Encoding", "chunked")
        elif not any(name == "Content-Length" for name, _ in case.headers):
            connection.putheader("Content-Length", str(len(case.body)))
        try:
            connection.endheaders(_chunked(case.body) if case.chunked else case.body)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the gateway answered before reading it all (417, 413): read that answer
        try:
            response = connection.getresponse()
            body = response.read()
        except (http.client.RemoteDisconnected, ConnectionResetError):
            return Reply(0, None, b"", time.monotonic() - started)
        return Reply(response.status, response.headers, body, time.monotonic() - started)
    finally:
        connection.close()


def _chunked(body: bytes) -> bytes:
    half = len(body) // 2
    pieces = [p for p in (body[:half], body[half:]) if p]
    return b"".join(b"%X\r\n%s\r\n" % (len(p), p) for p in pieces) + b"0\r\n\r\n"


def assert_error(reply: Reply, path: str) -> None:
    """The error in the shape of the API it came in on."""
    if path.startswith("/v1/messages"):
        payload = json.loads(reply.body)
        assert set(payload) == {"type", "error"} and payload["type"] == "error", payload
        assert set(payload["error"]) == {"type", "message"}, payload
        assert all(isinstance(v, str) and v for v in payload["error"].values()), payload
        return
    assert_openai_error(reply)


def assert_openai_error(reply: Reply) -> None:
    payload = json.loads(reply.body)
    error = payload["error"]
    assert set(payload) == {"error"} and set(error) == {"message", "type", "param", "code"}, payload
    for key in ("message", "type", "code"):
        assert isinstance(error[key], str) and error[key], payload
    assert error["param"] is None or isinstance(error["param"], str), payload


# What the gateway may change on the way up: the model's name, the parts it strips (wherever the
# API keeps them), the flag it mutes.
REWRITTEN_FIELDS = frozenset({"model", "messages", "mm_processor_kwargs", "input", "instructions", "system"})


def assert_fields_kept(case: Case, received: list[Received]) -> None:
    """Every other top-level field reaches the upstream with the value the client sent (exact
    integers beyond 64 bits included), however the body was rewritten."""
    assert len(received) == 1, f"the stand-in received {len(received)} requests"
    sent = json.loads(_decoded(case))
    got = json.loads(received[0].body)
    kept = {k: v for k, v in sent.items() if k not in REWRITTEN_FIELDS}
    assert {k: got.get(k) for k in kept} == kept, "a field changed on its way upstream"


def _decoded(case: Case) -> bytes:
    encoding = dict(case.headers).get("Content-Encoding", "")
    if encoding == "gzip":
        return gzip.decompress(case.body)
    if encoding == "deflate":
        return zlib.decompress(case.body)
    return case.body


def exchange(target: Target, case: Case) -> None:
    crashes, received = len(target.crashes), len(target.received)
    reply = send(target.port, case)
    assert reply.seconds < SECONDS_PER_REQUEST, f"took {reply.seconds:.1f}s"
    assert reply.status != 0 and reply.headers is not None, "the connection closed without a response"
    if case.refused_by_aiohttp:
        assert reply.status == 400, f"{reply.status}: {reply.body[:500]!r}"
    elif "X-Gateway-Route" in reply.headers:  # relayed from the stand-in, which answers 200 to any JSON
        assert reply.status == 200, f"the stand-in answered {reply.status}: {reply.body[:500]!r}"
        assert_fields_kept(case, target.received[received:])
    else:
        assert reply.status < 500, f"{reply.status}: {reply.body[:500]!r}"
        if reply.status >= 400:
            assert_error(reply, case.path)
    health = send(target.port, Case("/healthz", b"", ()), method="GET")
    assert health.status == 200, "the gateway stopped answering /healthz"
    assert target.crashes[crashes:] == [], "an exception escaped a request handler"


# --- the properties ---------------------------------------------------------------------------------


def fuzz(max_examples: int) -> settings:
    return settings(
        max_examples=max_examples,
        deadline=None,
        derandomize=True,  # the same examples on every run, as CI needs
        database=None,
        phases=(Phase.explicit, Phase.generate, Phase.shrink),
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example],
        print_blob=False,
    )


@fuzz(300)
@given(body=CHAT_BODIES.flatmap(encoded))
def generated_chat_bodies(target: Target, body: bytes) -> None:
    exchange(target, Case("/v1/chat/completions", body))


@fuzz(400)
@given(value=mutated(CHAT_BODIES), data=st.data())
def mutated_chat_bodies(target: Target, value: Any, data: st.DataObject) -> None:
    exchange(target, Case("/v1/chat/completions", data.draw(encoded(value), label="body")))


@fuzz(300)
@given(
    path=ENDPOINTS,
    value=st.one_of(ADMISSIBLE_COMPLETION_BODIES, COMPLETION_BODIES, mutated(COMPLETION_BODIES)),
    data=st.data(),
)
def completions_bodies(target: Target, path: str, value: Any, data: st.DataObject) -> None:
    exchange(target, Case(path, data.draw(encoded(value), label="body")))


@fuzz(300)
@given(path=st.sampled_from(["/v1/responses", "/v1/messages"]), data=st.data())
def responses_and_messages_bodies(target: Target, path: str, data: st.DataObject) -> None:
    bodies = RESPONSE_BODIES if path == "/v1/responses" else MESSAGE_BODIES
    value = data.draw(bodies | mutated(bodies), label="value")
    exchange(target, Case(path, data.draw(encoded(value), label="body")))


@st.composite
def deeply_nested(draw: st.DrawFn) -> tuple[str, Any]:
    """A body that is fine but for one value nested up to 300 levels, somewhere a rewrite keeps it."""
    requests: st.SearchStrategy[tuple[str, dict[str, Any]]] = st.tuples(
        st.just("/v1/chat/completions"), ADMISSIBLE_CHAT_BODIES
    ) | st.tuples(ENDPOINTS, ADMISSIBLE_COMPLETION_BODIES)
    path, body = draw(requests)
    deep = draw(nested_values())
    where = draw(st.sampled_from(["top", "message", "part", "prompt"]))
    messages = body.get("messages", [])
    if where == "message" and messages:
        messages[0]["extra"] = deep
    elif where == "part" and messages and isinstance(messages[0]["content"], list) and messages[0]["content"]:
        part = messages[0]["content"][0]
        if isinstance(part, dict):
            part["extra"] = deep
        else:
            messages[0]["content"][0] = {"type": "text", "text": part, "extra": deep}
    elif where == "prompt" and "prompt" in body:
        body["prompt"] = deep
    else:
        body["extra"] = deep
    return path, body


@fuzz(200)
@given(request=deeply_nested(), data=st.data())
def deeply_nested_bodies(target: Target, request: tuple[str, Any], data: st.DataObject) -> None:
    path, value = request
    exchange(target, Case(path, data.draw(encoded(value), label="body")))


@fuzz(200)
@given(path=ENDPOINTS, body=mutated_bytes() | st.binary(max_size=64) | st.sampled_from(NOT_OBJECTS))
def mutated_byte_bodies(target: Target, path: str, body: bytes) -> None:
    exchange(target, Case(path, body))


@fuzz(250)
@given(case=content_encoded_requests())
def content_encodings(target: Target, case: Case) -> None:
    exchange(target, case)


@fuzz(250)
@given(case=odd_header_requests())
def odd_headers(target: Target, case: Case) -> None:
    exchange(target, case)


@fuzz(30)
@given(case=overlong_bodies())
def bytes_past_content_length(target: Target, case: Case) -> None:
    exchange(target, dataclasses.replace(case, refused_by_aiohttp=True))


@fuzz(30)
@given(case=undecodable_encodings())
def unsupported_content_encodings(target: Target, case: Case) -> None:
    exchange(target, case)  # 415 in the OpenAI shape: the gateway decodes bodies itself


# --- the tests: each property against a real gateway, counting what is left behind -----------------


@dataclass
class Run:
    gateway: Gateway
    target: Target


@pytest.fixture
async def run(gateway_factory, upstream_factory) -> AsyncIterator[Run]:
    upstream, whisper = await upstream_factory("up"), await upstream_factory("whisper")
    gateway = await gateway_factory(table(upstream.url, f"http://127.0.0.1:{free_port()}", whisper.url))
    assert gateway.server.port is not None
    target = Target(gateway.server.port, upstream.received)
    handler = _CrashLog(target.crashes)
    logging.getLogger().addHandler(handler)
    try:
        # warm up: the connection pools and the thread that runs the properties exist before counting
        for model in MODELS:
            body = {"model": model, "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]}
            await asyncio.to_thread(exchange, target, Case("/v1/chat/completions", json.dumps(body).encode()))
        # and the transcriber's pool: as many connections as it opens at once (asking.CONCURRENCY)
        clips = [base64.b64encode(f"clip {i}".encode()).decode() for i in range(CONCURRENCY)]  # distinct: not shared
        audio = [{"type": "input_audio", "input_audio": {"data": clip, "format": "wav"}} for clip in clips]
        body = {"model": "framed", "messages": [{"role": "user", "content": audio}]}
        await asyncio.to_thread(exchange, target, Case("/v1/chat/completions", json.dumps(body).encode()))
        assert len(whisper.received) == CONCURRENCY
        yield Run(gateway, target)
    finally:
        logging.getLogger().removeHandler(handler)


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


async def _counts() -> tuple[int, int]:
    await asyncio.sleep(0.05)  # closed connections are reaped a loop turn or two later
    return _open_fds(), len(asyncio.all_tasks())


async def _back_to(fds: int, tasks: int) -> tuple[int, int]:
    """The counts once they are back to ``fds`` and ``tasks``, or as they are after 2 s."""
    now = await _counts()
    for _ in range(40):
        if now[0] <= fds and now[1] <= tasks:
            break
        now = await _counts()
    return now


PROPERTIES: list[Callable[[Target], None]] = [
    generated_chat_bodies,
    mutated_chat_bodies,
    completions_bodies,
    responses_and_messages_bodies,
    deeply_nested_bodies,
    mutated_byte_bodies,
    content_encodings,
    odd_headers,
    bytes_past_content_length,
    unsupported_content_encodings,
]


@pytest.mark.parametrize("prop", PROPERTIES, ids=lambda p: p.__name__)
async def test_hostile_requests(run: Run, prop: Callable[[Target], None]) -> None:
    fds, tasks = await _counts()
    await asyncio.to_thread(prop, run.target)
    fds_after, tasks_after = await _back_to(fds + FD_SLACK, tasks + TASK_SLACK)
    assert fds_after <= fds + FD_SLACK, f"open file descriptors: {fds} before, {fds_after} after"
    assert tasks_after <= tasks + TASK_SLACK, f"asyncio tasks: {tasks} before, {tasks_after} after"
    assert run.gateway.sample("gateway_requests_in_flight") == 0
    assert run.target.crashes == []  # one logged after its example had ended would show only here

"""A request body parsed with its long media strings read aside: the same dict as ``orjson.loads``
gives, at a fraction of the cost for a body that is mostly base64.

orjson makes a ``str`` of a 100 KB data URL in ~40 µs (it validates and copies it character by
character class); ``bytes.decode("ascii")`` makes the same ``str`` in ~4 µs. So a long string
that is plain base64 (or a data URL of it) is cut out of the bytes, the rest parsed (a few
hundred bytes), and the string put back where the parse left its placeholder. Only strings that
are certainly the same either way are read aside:

- a string that begins ``"data:`` (a data URL), or the value of a ``"data"`` key (Anthropic's
  base64 source, ``input_audio.data``), whose quote no backslash precedes;
- at least :data:`LONG_STRING` bytes long, with no backslash (no escape to decode), and none of
  the control bytes a base64 writer breaks lines with (``\\n``, ``\\r``, ``\\t``), and ASCII;
- a string with another control byte in it, which orjson would refuse, is taken (the engine
  refuses it, or the gateway when it decodes the data).

Anything else, and any body whose parse with placeholders fails, is parsed whole by orjson, which
then says what is wrong with it. tests/admission/test_strings.py holds the result to orjson's.
"""

from __future__ import annotations

import secrets
from typing import Any

import orjson

LONG_STRING = 8 * 1024  # shorter strings cost orjson little: not worth the cut
# A placeholder: a NUL, then a nonce of this process's, then the string's index. No client string
# is one but by guessing the nonce; and one found twice, or not at all, sends the body to orjson.
_NONCE = secrets.token_hex(8)
_MARK = f"\x00gw{_NONCE}:"
_MARK_JSON = f"\\u0000gw{_NONCE}:".encode()


def loads(raw: bytes) -> Any:
    """``orjson.loads(raw)``, its long media strings read aside (see the module's docstring)."""
    skeleton, strings = cut(raw)
    body = parse(skeleton, strings) if strings else None
    return body if body is not None else orjson.loads(raw)


def cut(raw: bytes) -> tuple[bytes, list[str]]:
    """``raw`` with each long media string a placeholder (its skeleton: a few hundred bytes of a
    body that is mostly base64), and those strings; ``(raw, [])`` when it has none (or one is not
    ASCII). A body's structure is counted on its skeleton: what was cut out is strings."""
    if len(raw) < LONG_STRING:
        return raw, []
    spans = _long_strings(raw)
    if not spans:
        return raw, []
    pieces: list[bytes] = []
    strings: list[str] = []
    view = memoryview(raw)  # decoded from the body's own bytes: a slice's copy costs 5x the decode
    at = 0
    for start, end in spans:  # the quotes around each string, in order
        try:
            strings.append(str(view[start + 1 : end], "ascii"))
        except UnicodeDecodeError:
            return raw, []
        pieces += (raw[at : start + 1], _MARK_JSON, str(len(strings) - 1).encode())
        at = end
    pieces.append(raw[at:])
    return b"".join(pieces), strings


def parse(skeleton: bytes, strings: list[str]) -> Any:
    """The body whose :func:`cut` gave these: the skeleton parsed, each string put back where its
    placeholder is; None when that is not the body (the skeleton is not JSON, a placeholder is
    missing or twice there): the caller parses the client's bytes whole, and orjson says what is
    wrong with them."""
    try:
        body = orjson.loads(skeleton)
    except orjson.JSONDecodeError:
        return None
    return body if _put_back(body, strings) else None


def _long_strings(raw: bytes) -> list[tuple[int, int]]:
    """(opening quote, closing quote) of each long media string, in order. Found by windows of
    half :data:`LONG_STRING` with no quote in them (one ``memchr`` each: a multi-byte
    ``bytes.find`` crawls through base64 at ~0.6 µs a KiB), each inside a string or between two
    values; the quotes around it, then what comes before the first, say which."""
    spans: list[tuple[int, int]] = []
    width, size = LONG_STRING // 2, len(raw)
    at = low = 0  # low: no quote lies between it and `at` but what rfind may find (each byte scanned once)
    while at + width <= size:
        last = raw.rfind(b'"', at, at + width)
        if last != -1:
            at, low = at + width, last
            continue
        start, end = raw.rfind(b'"', low, at), raw.find(b'"', at + width)
        if end == -1:  # no quote after it: no string either
            break
        if start > 0 and _is_media(raw, start) and _unbroken(raw, start, end):
            spans.append((start, end))
        at, low = end + 1, end
    return spans


def _unbroken(raw: bytes, start: int, end: int) -> bool:
    """Whether ``raw[start:end]`` holds no backslash (an escape to decode) and none of the bytes a
    base64 writer breaks lines with: a ``memchr`` each, written out (a generator over them cost a
    third of their time)."""
    find = raw.find
    return (
        find(b"\\", start, end) == -1
        and find(b"\n", start, end) == -1
        and find(b"\r", start, end) == -1
        and find(b"\t", start, end) == -1
    )


def _is_media(raw: bytes, start: int) -> bool:
    """Whether the quote at ``start`` opens a data URL or the value of a ``"data"`` key."""
    if raw[start - 1] == 0x5C:  # an escaped quote, inside a string (0x5C: a backslash)
        return False
    if raw.startswith(b"data:", start + 1):
        return True
    before = raw[max(0, start - 72) : start].rstrip()
    if not before.endswith(b":"):
        return False
    key = before[:-1].rstrip()
    return key.endswith(b'"data"') and not key.endswith(b'\\"data"')


def _put_back(body: Any, strings: list[str]) -> bool:
    """Each placeholder of ``body`` replaced by its string; False unless each was found once."""
    found = 0
    stack = [body]
    while stack and found < len(strings):
        node = stack.pop()
        items = node.items() if type(node) is dict else enumerate(node)
        for key, value in items:
            kind = type(value)
            if kind is str:
                if value.startswith(_MARK):
                    index = value[len(_MARK) :]
                    if not index.isdigit() or int(index) >= len(strings):
                        return False
                    node[key] = strings[int(index)]
                    found += 1
            elif kind is dict or kind is list:
                stack.append(value)
    return found == len(strings)

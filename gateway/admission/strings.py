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
- a string with another control byte in it, which orjson would refuse, is taken: a body sent
  on as it came leaves it to the engine, whose JSON parser refuses it as orjson does; a body the
  gateway makes whole (``parse(..., defer=True)``: :meth:`Deferred.restore`, before any rewrite
  or conversion) is refused with orjson's 400 first, never written out as valid JSON (~0.4 µs a
  KiB, paid only by a body made whole: one sent on as it came never is).

Anything else, and any body whose parse with placeholders fails, is parsed whole by orjson, which
then says what is wrong with it. tests/admission/test_strings.py holds the result to orjson's.

**Held back** (``parse(..., defer=True)``, the request path): where an image's data lies (a chat
``image_url`` part's url, a Responses ``input_image``, an Anthropic base64 ``image`` block), the
string is its first :data:`PREFIX` characters only, enough for admission to read the image's
header (gateway.admission.dimensions); the rest stays in the client's bytes, and a request sent on
unchanged goes upstream in them, its 100 KB ``str`` never made (~6 µs, and the memory, a request).
:class:`Deferred` puts each whole string back in its place when a stage needs the body whole (a
rewrite, the encoder, a downscale: gateway.server.exchange's ``Exchange.body``), or when an
image's header goes on past its first characters. What lies past them is looked at only then: an
escape or a line break there is read by orjson (and refused as it refuses it, a 400); a body sent
on as it came leaves such bytes to the engine, as it does the control bytes above.
"""

from __future__ import annotations

import secrets
from typing import Any

import orjson

from ..errors import InvalidRequestError

LONG_STRING = 8 * 1024  # shorter strings cost orjson little: not worth the cut
PREFIX = 8 * 1024  # characters of a deferred image's data URL kept (6 KiB of image: its header, most often)
# A placeholder: a NUL, then a nonce of this process's, then the string's index. No client string
# is one but by guessing the nonce; and one found twice, or not at all, sends the body to orjson.
_NONCE = secrets.token_hex(8)
_MARK = f"\x00gw{_NONCE}:"
_MARK_JSON = f"\\u0000gw{_NONCE}:".encode()


def loads(raw: bytes) -> Any:
    """``orjson.loads(raw)``, its long media strings read aside (see the module's docstring)."""
    skeleton, spans = cut(raw)
    parsed = parse(skeleton, raw, spans) if spans else None
    return parsed[0] if parsed is not None else orjson.loads(raw)


def cut(raw: bytes) -> tuple[bytes, list[tuple[int, int]]]:
    """``raw`` with each long media string a placeholder (its skeleton: a few hundred bytes of a
    body that is mostly base64), and where those strings are (their quotes); ``(raw, [])`` when it
    has none. A body's structure is counted on its skeleton: what was cut out is strings."""
    if len(raw) < LONG_STRING:
        return raw, []
    spans = _long_strings(raw)
    if not spans:
        return raw, []
    pieces: list[bytes] = []
    at = 0
    for n, (start, end) in enumerate(spans):  # the quotes around each string, in order
        pieces += (raw[at : start + 1], _MARK_JSON, str(n).encode())
        at = end
    pieces.append(raw[at:])
    return b"".join(pieces), spans


class Deferred:
    """The image data URLs of a parsed body that hold their first :data:`PREFIX` characters
    only (admission reads an image's header, nothing more): the rest stays in the client's
    bytes, which go upstream as they are unless something rewrites the body. :meth:`restore`
    puts each whole string in its place, as orjson would have read it (once; 400 for bytes
    orjson refuses)."""

    __slots__ = ("_aside", "_places", "_prefixes", "_raw")

    def __init__(self, raw: bytes) -> None:
        self._raw = raw
        self._places: list[tuple[dict[str, Any], Any, int, int]] = []  # holder, key, the string's bytes
        self._prefixes: set[int] = set()  # id() of each prefix held (the body holds them, alive)
        self._aside: list[tuple[int, int]] = []  # the strings read aside whole: their control bytes not looked at

    def __bool__(self) -> bool:
        return bool(self._places or self._aside)

    def aside(self, start: int, end: int) -> None:
        """A string read aside whole, whose bytes past its head :meth:`restore` looks at."""
        self._aside.append((start, end))

    def add(self, holder: dict[str, Any], key: Any, start: int, end: int, prefix: str) -> None:
        holder[key] = prefix
        self._places.append((holder, key, start, end))
        self._prefixes.add(id(prefix))

    def holds(self, text: str) -> bool:
        """Whether ``text`` is one of the prefixes (the whole string is longer)."""
        return id(text) in self._prefixes and bool(self._places)

    def restore(self) -> None:
        """Each string whole, in its place, before the body is written again; a string orjson
        refuses (a control byte in one read aside, held back or not) raises its 400 and leaves it
        and those after it held back (asked again, the same 400: never a prefix taken for whole)."""
        raw, places = self._raw, self._places
        for start, end in self._aside:
            _refuse_controls(raw, start, end)
        self._aside.clear()
        view = memoryview(raw)
        while places:
            holder, key, start, end = places[-1]
            holder[key] = _whole(raw, view, start, end)
            places.pop()
        self._prefixes.clear()


_CONTROLS = bytes(range(0x20))  # what JSON forbids unescaped in a string


def _refuse_controls(raw: bytes, start: int, end: int) -> None:
    """orjson's 400 for a control byte in ``raw[start:end]`` (a string's bytes), where one is."""
    chunk = raw[start:end]
    if len(chunk.translate(None, _CONTROLS)) == len(chunk):
        return
    at = start + min(i for i in (chunk.find(bytes([c])) for c in _CONTROLS) if i != -1)
    raise InvalidRequestError(
        f"Request body is not valid JSON: control character (\\u{raw[at]:04x}) found while parsing a string "
        f"at char {at}"
    )


def _whole(raw: bytes, view: memoryview, start: int, end: int) -> Any:
    """The string of ``raw[start:end]`` (its first PREFIX bytes looked at as it was cut): ASCII
    without an escape or a line break, decoded; else as orjson reads the literal, or its 400 (the
    place said in the body's bytes: the string's opening quote, or the escape it refuses)."""
    if _unbroken(raw, start + PREFIX, end):
        _refuse_controls(raw, start, end)
        try:
            return str(view[start:end], "ascii")
        except UnicodeDecodeError:
            pass
    try:
        return orjson.loads(raw[start - 1 : end + 1])
    except orjson.JSONDecodeError as exc:
        raise InvalidRequestError(f"Request body is not valid JSON: {exc.msg} at char {start - 1 + exc.pos}") from None


def parse(
    skeleton: bytes, raw: bytes, spans: list[tuple[int, int]], *, defer: bool = False
) -> tuple[Any, Deferred | None] | None:
    """The body whose :func:`cut` gave these: the skeleton parsed, each string put back where its
    placeholder is (with ``defer``, an image's data URL as its first :data:`PREFIX` characters,
    the rest in the :class:`Deferred`); None when that is not the body (the skeleton is not JSON,
    a placeholder is missing or twice there, a string is not ASCII): the caller parses the
    client's bytes whole, and orjson says what is wrong with them."""
    try:
        body = orjson.loads(skeleton)
    except orjson.JSONDecodeError:
        return None
    deferred = Deferred(raw) if defer else None
    return (body, deferred) if _put_back(body, raw, spans, deferred) else None


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
        # its first PREFIX bytes unbroken, and its closing quote not escaped; the rest is looked at
        # as it is put back (or, for an image's data URL held back, if it ever is)
        head = min(end, start + 1 + PREFIX)
        if start > 0 and raw[end - 1] != 0x5C and _is_media(raw, start) and _unbroken(raw, start, head):
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


def _put_back(body: Any, raw: bytes, spans: list[tuple[int, int]], deferred: Deferred | None) -> bool:
    """Each placeholder of ``body`` replaced by its string (its prefix, in ``deferred``, where it
    is an image's data URL); False unless each was found once and is ASCII."""
    found = 0
    view = memoryview(raw)  # decoded from the body's own bytes: a slice's copy costs 5x the decode
    stack: list[tuple[Any, Any]] = [(body, None)]  # a container, and the one that holds it
    while stack and found < len(spans):
        node, parent = stack.pop()
        items = node.items() if type(node) is dict else enumerate(node)
        for key, value in items:
            kind = type(value)
            if kind is str:
                if value.startswith(_MARK):
                    index = value[len(_MARK) :]
                    if not index.isdigit() or int(index) >= len(spans):
                        return False
                    start, end = spans[int(index)]
                    start += 1  # past the opening quote
                    try:
                        if deferred is not None and end - start > PREFIX and _image_at(node, key, parent):
                            deferred.add(node, key, start, end, str(view[start : start + PREFIX], "ascii"))
                        elif end - start <= PREFIX or _unbroken(raw, start + PREFIX, end):  # no escape
                            node[key] = str(view[start:end], "ascii")
                            if deferred is not None:
                                deferred.aside(start, end)
                        else:  # an escape, or a line break, past its first PREFIX bytes: orjson reads it whole
                            return False
                    except UnicodeDecodeError:
                        return False
                    found += 1
            elif kind is dict or kind is list:
                stack.append((value, node))
    return found == len(spans)


def _image_at(node: Any, key: Any, parent: Any) -> bool:
    """Whether ``node[key]`` is where an image's data lies: a chat ``image_url`` part's url, a
    Responses ``input_image``'s ``image_url``, an Anthropic ``image`` block's base64 source."""
    if type(node) is not dict:
        return False
    if key == "url":
        return type(parent) is dict and parent.get("type") == "image_url" and parent.get("image_url") is node
    if key == "image_url":
        return node.get("type") == "input_image"
    if key == "data":
        return (
            node.get("type") == "base64"
            and type(parent) is dict
            and parent.get("type") == "image"
            and parent.get("source") is node
        )
    return False

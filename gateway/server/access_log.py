"""The access log: one line a request, cheap enough to leave on (``server.access_log``, default on).

aiohttp's own access logger sends every request through :mod:`logging`: a record made, the
caller's frame found, the line formatted by a generic formatter, then written and flushed, one
``write`` system call a request. Under load that was a fifth of the gateway's CPU
(docs/benchmarks.md). This one formats the line with one f-string and writes lines in batches:
when :data:`BATCH_BYTES` have gathered, at most :data:`FLUSH_S` seconds after a line, and when the
server stops. A process killed outright (SIGKILL, OOM) loses at most the last ``FLUSH_S`` of lines;
a SIGTERM drain loses none.

A line (to stderr, where the other logs go)::

    2026-12-01T05:40:01.123Z 127.0.0.1 "POST /v1/chat/completions HTTP/1.1" 200 389 0.001s
        rid=9f0c... model=qwen route=direct encoded=- "OpenAI/Python 1.40.0"

(one line; wrapped here): the time the answer ended (UTC), the client, the request line, the
status, the bytes sent (headers included), the seconds taken, then what the gateway decided, from its response
headers: the request id (``X-Request-Id``, which ties the line to the engine's logs), the model
that served it, the route and how many images were encoded (``-`` where there is none). Values a
client chose (path, user agent) have their quotes and control characters escaped, so a line
cannot be forged. A query is written as ``?REDACTED`` (a key sent as ``?api_key=`` must not reach
a log), and what aiohttp's parser refuses is not logged with the header bytes it quotes
(:class:`ParserErrorFilter`).
"""

from __future__ import annotations

import asyncio
import logging
import sys
import time
from typing import IO

from aiohttp import web
from aiohttp.abc import AbstractAccessLogger
from aiohttp.http_exceptions import HttpProcessingError

BATCH_BYTES = 64 * 1024
FLUSH_S = 0.5
WRITE_BYTES = 4096  # PIPE_BUF: a write this small to a pipe is never torn by another process's
_MAX_FIELD = 512  # a client-chosen field longer than this is cut (headers may be 8 KB)
_log = logging.getLogger("gateway.http")


class AccessLogWriter:
    """Lines gathered in memory and written to ``stream`` in batches (see the module docstring)."""

    def __init__(
        self, stream: IO[bytes] | None = None, *, batch_bytes: int = BATCH_BYTES, flush_s: float = FLUSH_S
    ) -> None:
        # sys.stderr is None when fd 2 was closed at start: lines then go nowhere
        self._stream = stream if stream is not None else getattr(sys.stderr, "buffer", None)
        self._batch_bytes, self._flush_s = batch_bytes, flush_s
        self._lines: list[str] = []
        self._size = 0
        self._timer: asyncio.TimerHandle | None = None
        self._second = -1  # the second whose text _stamp holds
        self._stamp = ""

    def write(self, line: str) -> None:
        self._lines.append(line)
        self._size += len(line)
        if self._size >= self._batch_bytes:
            self.flush()
        elif self._timer is None:
            try:
                self._timer = asyncio.get_running_loop().call_later(self._flush_s, self.flush)
            except RuntimeError:  # no loop (a test, or a line after the loop ended): write it now
                self.flush()

    def flush(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if not self._lines:
            return
        lines = self._lines
        self._lines = []
        self._size = 0
        if self._stream is None:
            return
        try:
            for piece in _pieces(lines):
                self._stream.write(piece)
                self._stream.flush()  # one write a piece: whole lines, never torn by another worker's
        except (OSError, ValueError) as exc:  # a closed or broken stderr must not fail requests
            logging.getLogger(__name__).debug("access log not written: %r", exc)

    def timestamp(self, now: float) -> str:
        """``now`` as ISO 8601 UTC with milliseconds; the part to the second is made once a second."""
        second = int(now)
        if second != self._second:
            self._second = second
            self._stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(second))
        return f"{self._stamp}.{int((now - second) * 1000):03d}Z"


def access_logger(writer: AccessLogWriter) -> type[AbstractAccessLogger]:
    """The ``access_log_class`` for aiohttp's runner (it makes one per connection; all share ``writer``)."""

    class AccessLog(AbstractAccessLogger):
        def log(self, request: web.BaseRequest, response: web.StreamResponse, time_s: float) -> None:
            headers = response.headers
            version = request.version
            writer.write(
                f"{writer.timestamp(time.time())} {request.remote or '-'} "
                f'"{request.method} {_safe(_target(request.raw_path))} HTTP/{version.major}.{version.minor}" '
                f"{response.status} {response.body_length} {time_s:.3f}s "
                f"rid={_safe(headers.get('X-Request-Id', '-'))} model={headers.get('X-Gateway-Model', '-')} "
                f"route={headers.get('X-Gateway-Route', '-')} encoded={headers.get('X-Gateway-Encoded', '-')} "
                f'"{_safe(request.headers.get("User-Agent", "-"))}"\n'
            )

    return AccessLog


def _target(path: str) -> str:
    """The request target with its query written as ``?REDACTED``: the gateway's API takes none,
    and a client that sends its key as ``?api_key=...`` (or as a bare ``?sk-...``) must not find
    it in a log."""
    target, sep, _ = path.partition("?")
    return target + "?REDACTED" if sep else path


class ParserErrorFilter(logging.Filter):
    """aiohttp logs a request its HTTP parser refuses (a control character in a header, an
    obs-folded line) at ERROR with a traceback whose message quotes the offending header line,
    an ``Authorization`` header's key included: ~0.7 KB of ERROR a request, for any client to
    send. This filter, on the ``aiohttp.server`` logger, drops those records and says the same at
    DEBUG in one line, the parser's reason without the bytes it quotes; the access log has the
    request's line and its 400 already."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if not isinstance(exc, HttpProcessingError):
            return True
        if _log.isEnabledFor(logging.DEBUG):
            reason = str(exc.message).split("\n", 1)[0].rstrip(": ")
            remote = record.args[0] if isinstance(record.args, tuple) and record.args else "-"
            _log.debug("HTTP request refused by the parser (%d) from %s: %s", exc.code, remote, reason)
        return False


def quiet_parser_errors(logger: logging.Logger | None = None) -> None:
    """Install :class:`ParserErrorFilter` on aiohttp's server logger, once."""
    logger = logger or logging.getLogger("aiohttp.server")
    if not any(isinstance(f, ParserErrorFilter) for f in logger.filters):
        logger.addFilter(ParserErrorFilter())


def _pieces(lines: list[str]) -> list[bytes]:
    """``lines`` encoded and joined into pieces of at most :data:`WRITE_BYTES`, each ending at a
    line's end. Workers of ``serve --workers N`` share one stderr, often a pipe: a write of up to
    PIPE_BUF bytes reaches it whole, a larger one may be interleaved with another process's."""
    pieces: list[bytes] = []
    piece: list[bytes] = []
    size = 0
    for line in lines:
        data = line.encode("utf-8", "backslashreplace")
        if size + len(data) > WRITE_BYTES and piece:
            pieces.append(b"".join(piece))
            piece, size = [], 0
        piece.append(data)
        size += len(data)
    if piece:
        pieces.append(b"".join(piece))
    return pieces


def _safe(value: str) -> str:
    """A client-chosen value, cut to a bounded length, with every character that is not printable
    (controls, U+0085 and U+2028 which some tools read as line breaks, bidirectional overrides),
    quotes and backslashes escaped."""
    if len(value) > _MAX_FIELD:
        value = value[:_MAX_FIELD] + "..."
    if value.isprintable() and '"' not in value and "\\" not in value:
        return value  # the common case: one C-speed check
    return "".join(_escape(c) for c in value)


def _escape(c: str) -> str:
    if c == '"' or c == "\\":
        return "\\" + c
    if c.isprintable():
        return c
    code = ord(c)
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}"

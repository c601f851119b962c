"""The gateway's own HTTP/1.1 client for the upstream hop: one request in one write, replies parsed
by llhttp (``httptools``, the parser uvicorn serves with), connections kept alive per replica.

aiohttp's ``ClientSession`` builds a request object, a response object, a timer context, a
connection wrapper and a payload writer for every request, and costs about 90 µs of CPU per
chat completion on the machines we measure (docs/benchmarks.md); what an upstream hop needs of
it is small, because the gateway talks to known engines (vLLM, SGLang: uvicorn) with requests it
built itself. This client does that much, on an :class:`asyncio.Protocol`:

- ``POST`` with ``Content-Length`` (head and body in one write; a body over 1 MiB goes as a second
  write, not copied into the head), to ``http://`` or ``https://`` replicas, IPv6 included;
- replies parsed by llhttp, strictly: framed by ``Content-Length``, ``chunked`` (the only
  ``Transfer-Encoding`` taken: any other coding, or chunked twice, is refused rather than relayed
  as a body it is not) or the end of the connection; statuses 100 to 599 only, 1xx interim
  answers skipped; heads of at most :data:`MAX_HEAD_BYTES` however they arrive; lines that end in
  anything but CRLF, control characters in a header or the reason phrase, refused; bodies passed
  on as they arrive, undecoded (``Content-Encoding`` is the client's business);
- keep-alive per replica, idle connections let go after :data:`KEEPALIVE_S` (engines close theirs
  after 5 s: a connection reused as the engine closes it would fail a POST), a connection the
  engine closed while idle, or that holds bytes nobody asked for, never reused (bytes that arrived
  before a request was written never answer it), and a reused connection that breaks before any
  byte of the reply tried once more on a fresh one (the engine closed it as we wrote); at most
  :data:`MAX_CONNECTIONS` open to one replica, a request past them waiting for one within its
  connect timeout;
- reading paused while more than :data:`HIGH_WATER` bytes wait for a slow client, so a large reply
  costs bounded memory; a silence longer than ``read_timeout`` fails the reply
  (:class:`ReadTimeout`), checked by one lazily re-armed timer rather than one per read;
- a reply not read to its end (the client left, a retried status) closes its connection, which
  tells the engine to stop.

What it does not do, because the upstream hop never needs it: redirects, cookies, proxies,
decompression, ``Expect: 100-continue``, upgrades, pipelining.

Errors are :class:`Http1Error`; :mod:`gateway.upstream.failures` reads them as it reads aiohttp's.
It is the hop's one transport (aiohttp's client was a second until issue 41).
"""

from __future__ import annotations

from ..wire import KEEPALIVE_S
from .client import MAX_CONNECTIONS, Http1Client, Waits
from .connection import MAX_HEAD_BYTES, MAX_INTERIM, MAX_TRAILERS, SPLICE_BYTES, STALE_WINDOW_S, _Connection
from .errors import (
    ConnectError,
    ConnectTimeout,
    Disconnected,
    Http1Error,
    PoolFull,
    ProtocolError,
    ReadTimeout,
    UnsendableHeader,
)
from .reply import _CHUNKED, _LENGTH, _NONE, _UNTIL_CLOSE, HIGH_WATER, Reply

__all__ = [
    "HIGH_WATER",
    "KEEPALIVE_S",
    "MAX_CONNECTIONS",
    "MAX_HEAD_BYTES",
    "MAX_INTERIM",
    "MAX_TRAILERS",
    "SPLICE_BYTES",
    "STALE_WINDOW_S",
    "_CHUNKED",
    "_LENGTH",
    "_NONE",
    "_UNTIL_CLOSE",
    "ConnectError",
    "ConnectTimeout",
    "Disconnected",
    "Http1Client",
    "Http1Error",
    "PoolFull",
    "ProtocolError",
    "ReadTimeout",
    "Reply",
    "UnsendableHeader",
    "Waits",
    "_Connection",
]

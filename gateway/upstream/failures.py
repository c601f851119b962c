"""What a client error means, for the upstream and encoder clients alike: the one place where
aiohttp's exceptions, and those of the gateway's own upstream client (:mod:`gateway.upstream.http1`), are read.

    connect   nothing reached the replica (refused, unreachable, connect timeout): safe to retry
    timeout   the replica accepted the request and went silent: it may be working on it
    reset     the connection broke before a response (the replica died, or closed a kept-alive
              connection as it was reused): nothing came back, a retry is safe for idempotent work
    protocol  what came back is not HTTP, or broke the client otherwise: not retried
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Literal

import aiohttp

from . import http1

Kind = Literal["connect", "timeout", "reset", "protocol"]
# errors the clients catch around a request (CancelledError is not one: the client left)
CLIENT_ERRORS = (aiohttp.ClientError, http1.Http1Error, TimeoutError)
ClientFailure = aiohttp.ClientError | http1.Http1Error | TimeoutError  # what an `except CLIENT_ERRORS` catches


@dataclass(frozen=True, slots=True)
class Failure:
    kind: Kind
    reason: str  # for logs and a replica's last_error; never sent to clients

    @property
    def outcome(self) -> str:
        """The ``outcome`` label of the request counters."""
        return {"connect": "connect_error", "timeout": "timeout", "reset": "reset", "protocol": "error"}[self.kind]


def failure_of(exc: ClientFailure) -> Failure:
    if isinstance(exc, http1.Http1Error):
        return _http1_failure(exc)
    # order matters: ConnectionTimeoutError is a ServerTimeoutError, ClientConnectorError a ClientOSError
    if isinstance(exc, aiohttp.ConnectionTimeoutError):
        return Failure("connect", "connect timeout")
    if isinstance(exc, aiohttp.ClientConnectorError):
        os_error = exc.os_error
        if isinstance(os_error, ConnectionRefusedError):
            return Failure("connect", "connection refused")
        return Failure("connect", f"{type(os_error).__name__}: {os_error.strerror or os_error}")
    if isinstance(exc, TimeoutError | aiohttp.ServerTimeoutError):
        return Failure("timeout", "read timeout")
    if isinstance(exc, aiohttp.ServerDisconnectedError | aiohttp.ClientOSError):
        return Failure("reset", type(exc).__name__)
    if isinstance(exc, ReplyTooLargeError):
        return Failure("protocol", str(exc))
    return Failure("protocol", type(exc).__name__)


class ReplyTooLargeError(aiohttp.ClientPayloadError):
    """A small reply (:func:`read_capped`) that is not small: not what the server should send."""


def being_cancelled() -> bool:
    """Whether the running task itself is being cancelled (its client left), as opposed to an
    awaited task that was cancelled, or a CancelledError that is nobody's leaving."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


def _http1_failure(exc: http1.Http1Error) -> Failure:
    if isinstance(exc, http1.ConnectTimeout):
        return Failure("connect", "connect timeout")
    if isinstance(exc, http1.ConnectError):
        return Failure("connect", str(exc))
    if isinstance(exc, http1.ReadTimeout):
        return Failure("timeout", "read timeout")
    if isinstance(exc, http1.Disconnected):
        return Failure("reset", str(exc))
    return Failure("protocol", f"{type(exc).__name__}: {exc}")


async def read_capped(response: aiohttp.ClientResponse, max_bytes: int) -> bytes:
    """A small reply read whole (an encoder's metadata, a transcript); one over ``max_bytes`` is
    not what the server should send: a protocol failure (ClientPayloadError), like a broken body."""
    if response.content_length is not None and response.content_length > max_bytes:
        raise ReplyTooLargeError(f"a reply over {max_bytes} bytes")
    data = bytearray()
    async for chunk in response.content.iter_any():
        data += chunk
        if len(data) > max_bytes:
            raise ReplyTooLargeError(f"a reply over {max_bytes} bytes")
    return bytes(data)

"""The one reading of aiohttp's client errors."""

from __future__ import annotations

import aiohttp
import pytest
from aiohttp.client_reqrep import ConnectionKey

from gateway.upstream import http1
from gateway.upstream.failures import failure_of

KEY = ConnectionKey("127.0.0.1", 9, False, True, None, None, None)


@pytest.mark.parametrize(
    ("exc", "kind", "outcome", "reason"),
    [
        (aiohttp.ClientConnectorError(KEY, ConnectionRefusedError(111, "refused")), "connect", "connect_error",
         "connection refused"),
        (aiohttp.ClientConnectorError(KEY, OSError(113, "No route to host")), "connect", "connect_error",
         "OSError: No route to host"),
        (aiohttp.ConnectionTimeoutError("slow"), "connect", "connect_error", "connect timeout"),
        (aiohttp.SocketTimeoutError("silent"), "timeout", "timeout", "read timeout"),
        (TimeoutError(), "timeout", "timeout", "read timeout"),
        (aiohttp.ServerDisconnectedError(), "reset", "reset", "ServerDisconnectedError"),
        (aiohttp.ClientOSError(104, "Connection reset by peer"), "reset", "reset", "ClientOSError"),
        (aiohttp.ClientPayloadError("bad chunk"), "protocol", "error", "ClientPayloadError"),
        # the gateway's own upstream client (gateway/upstream/http1.py)
        (http1.ConnectError("connection refused", ConnectionRefusedError(111, "refused")), "connect",
         "connect_error", "connection refused"),
        (http1.ConnectTimeout("connect to 10.0.0.1:8000 timed out after 5s"), "connect", "connect_error",
         "connect timeout"),
        (http1.ReadTimeout("no bytes for 600s"), "timeout", "timeout", "read timeout"),
        (http1.Disconnected("the server closed the connection"), "reset", "reset", "the server closed the connection"),
        (http1.ProtocolError("bad Content-Length"), "protocol", "error", "ProtocolError: bad Content-Length"),
    ],
)  # fmt: skip
def test_each_client_error_has_one_meaning(exc, kind, outcome, reason) -> None:
    failure = failure_of(exc)
    assert (failure.kind, failure.outcome, failure.reason) == (kind, outcome, reason)

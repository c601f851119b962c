"""What fails an exchange of the upstream HTTP/1.1 client (gateway.upstream.failures reads them)."""

from __future__ import annotations


class Http1Error(Exception):
    """A failed exchange; ``str()`` is for logs (addresses are never told to clients)."""


class ConnectError(Http1Error):
    """The replica could not be reached: nothing was sent."""

    def __init__(self, message: str, os_error: OSError | None = None) -> None:
        super().__init__(message)
        self.os_error = os_error


class ConnectTimeout(ConnectError):
    pass


class PoolFull(ConnectTimeout):
    """MAX_CONNECTIONS are open to the replica, all busy, for the whole connect timeout: nothing
    was sent. The replica is saturated from this gateway's side, not failing: the upstream client
    passes it over for a moment without counting it against its breaker."""


class ReadTimeout(Http1Error, TimeoutError):
    """The replica went silent for longer than the exchange allows (a TimeoutError, as aiohttp's)."""


class Disconnected(Http1Error):
    """The connection ended before the reply did."""


class ProtocolError(Http1Error):
    """What came back is not HTTP/1.1 the client can read."""


class UnsendableHeader(ValueError):
    """A header value holds a line break: the gateway's own fault (its config), never the replica's,
    so not an :class:`Http1Error` (no replica is blamed or tried again); the upstream client
    answers it 502."""

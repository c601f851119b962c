"""What every HTTP client of the gateway's sends on the wire, whichever it is (the upstream hop's
two transports, the encoder client, a conversion's request to a model of the table): how long an
idle connection is kept, and a request body written in one piece."""

from __future__ import annotations

from aiohttp.payload import BytesPayload, Payload

KEEPALIVE_S = 4.0  # < the 5 s after which uvicorn (vLLM, SGLang) closes an idle connection
LARGE_BODY_BYTES = 1 << 20  # aiohttp's own threshold for a "large" bytes body


def whole_body(body: bytes, content_type: str) -> Payload:
    """``body`` as one aiohttp payload written in one piece, whatever its size (see _WholeBody),
    built here: no lookup in aiohttp's payload registry."""
    if len(body) < LARGE_BODY_BYTES:
        return BytesPayload(body, content_type=content_type)
    return _WholeBody(body, content_type)


class _WholeBody(BytesPayload):
    """A large body, written in one piece as a small one is. aiohttp warns about large bytes and
    would have a BytesIO instead, which it writes 64 KiB at a time with a turn of the event loop
    between pieces: 32 turns and writes for a 2 MiB image request. The body is in memory already,
    so one write costs a copy into the socket's buffer (the transport keeps what the kernel does
    not take yet); the event loop is not held any longer than by the copy."""

    def __init__(self, value: bytes, content_type: str) -> None:
        Payload.__init__(self, value, content_type=content_type)  # BytesPayload's warns
        self._size = len(value)

"""Which replica holds a stored response: the Responses API's ``previous_response_id``.

vLLM keeps the responses it stores (``VLLM_ENABLE_RESPONSES_API_STORE=1``) in the memory of the
process that served them, and SGLang likewise: a follow-up that names one
(``previous_response_id``) can be served by that replica only; any other answers 404. The gateway
learns each response's id from the reply it relays (the ``id`` of a response object, or of a
stream's ``response.created`` event) and sends a request naming it to that replica first,
while it admits requests (its breaker closed or probing, not checked down). When it does not,
or the id is not known here, the request goes as any other would, and the replica's own answer
reaches the client.

Bounded: :data:`MAX_IDS` ids at most, the least recently used let go first, none kept longer
than :data:`MAX_AGE_S`. Each gateway process learns what it relayed: behind several gateway
replicas, a follow-up that reaches another gateway than its response did goes as any request
(docs/routing.md says so).
"""

from __future__ import annotations

import re
import time
from collections import OrderedDict
from collections.abc import Callable

import orjson

MAX_IDS = 100_000  # ~100 bytes each
MAX_AGE_S = 24 * 3600.0  # vLLM's store keeps them for the life of the process
MAX_ID_CHARS = 256
PEEK_BYTES = 64 * 1024  # of a stream, read for its response.created event at most


class Holders:
    """Response id -> the URL of the replica that served it."""

    def __init__(
        self, *, clock: Callable[[], float] = time.monotonic, max_ids: int = MAX_IDS, max_age_s: float = MAX_AGE_S
    ) -> None:
        self._clock, self._max_ids, self._max_age_s = clock, max_ids, max_age_s
        self._held: OrderedDict[str, tuple[str, float]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._held)

    def remember(self, response_id: str, url: str) -> None:
        held = self._held
        held[response_id] = (url, self._clock())
        held.move_to_end(response_id)
        while len(held) > self._max_ids:
            held.popitem(last=False)

    def find(self, response_id: str) -> str | None:
        """The URL of the replica that served ``response_id``, if this process relayed it lately."""
        found = self._held.get(response_id)
        if found is None:
            return None
        url, at = found
        if self._clock() - at > self._max_age_s:
            del self._held[response_id]
            return None
        self._held.move_to_end(response_id)
        return url


# vLLM and SGLang write a response object's id first: read without parsing the whole reply
_LEADING_ID = re.compile(rb'\A\s*\{\s*"id"\s*:\s*"([A-Za-z0-9_\-.:]{1,256})"')


def id_of_response(body: bytes) -> str | None:
    """The ``id`` of a response object (a non-streamed Responses reply)."""
    leading = _LEADING_ID.match(body)
    if leading is not None:
        return leading.group(1).decode()
    try:
        reply = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    return _valid(reply.get("id")) if isinstance(reply, dict) else None


_CREATED = re.compile(rb'^data: *(\{.*"type" *: *"response\.created".*\})\r?$', re.MULTILINE)


def id_of_stream(opening: bytes) -> str | None:
    """The response's ``id`` from a stream's opening, its ``response.created`` event."""
    found = _CREATED.search(opening)
    if found is None:
        return None
    try:
        event = orjson.loads(found.group(1))
    except orjson.JSONDecodeError:
        return None
    response = event.get("response") if isinstance(event, dict) else None
    return _valid(response.get("id")) if isinstance(response, dict) else None


def _valid(value: object) -> str | None:
    return value if isinstance(value, str) and 0 < len(value) <= MAX_ID_CHARS else None

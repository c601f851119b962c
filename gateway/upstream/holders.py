"""Which replica holds a stored response: the Responses API's ``previous_response_id``.

vLLM keeps the responses it stores (``VLLM_ENABLE_RESPONSES_API_STORE=1``) in the memory of the
process that served them, and SGLang likewise: a follow-up that names one
(``previous_response_id``) can be served by that replica only; any other answers 404. The gateway
learns each response's id from the reply it relays (the ``id`` of a response object, or of a
stream's ``response.created`` event) and sends a request naming it to that replica first,
while it admits requests (its breaker closed or probing, not checked down). When it does not,
or the id is not known here, the request goes as any other would, and the replica's own answer
reaches the client.

Bounded, in two generations of ids (the cheapest bounded table there is: one dict write a
reply, no ordering kept, nothing for the garbage collector to walk): new ids go into the young
one; once it holds half of :data:`MAX_IDS`, or is half of :data:`MAX_AGE_S` old, the old
generation is let go and the young one takes its place. An id is kept for at least half the
age and the most recent half of the count, and never longer than :data:`MAX_AGE_S` (a
conversation goes on with the id of its newest response, learned anew each turn). Each gateway
process learns what it relayed: behind several gateway replicas, a follow-up that reaches
another gateway than its response did goes as any request (docs/routing.md says so).
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable

import orjson

Held = tuple[str, str | None]  # the replica's URL, the key's name
MAX_IDS = 100_000  # ~100 bytes each
MAX_AGE_S = 24 * 3600.0  # vLLM's store keeps them for the life of the process
MAX_ID_CHARS = 256
PEEK_BYTES = 64 * 1024  # of a stream, read for its response.created event at most


class Holders:
    """Response id -> the URL of the replica that served it, and the API key it was made with
    (None: auth off). A follow-up of another key is not continued (:meth:`find`'s caller answers
    404, as the engine answers an id it does not hold): a stored response is its key's."""

    def __init__(
        self, *, clock: Callable[[], float] = time.monotonic, max_ids: int = MAX_IDS, max_age_s: float = MAX_AGE_S
    ) -> None:
        self._clock, self._max_age_s = clock, max_age_s
        self._per_generation, self._generation_s = max(1, max_ids // 2), max_age_s / 2
        self._young: dict[str, Held] = {}  # ids learned since _young_since: less than a generation's time
        self._old: dict[str, Held] = {}  # the generation before, begun at _old_since
        self._young_since = self._old_since = clock()

    def __len__(self) -> int:
        return len(self._young) + len(self._old)

    def remember(self, response_id: str, url: str, owner: str | None = None) -> None:
        now = self._clock()
        if len(self._young) >= self._per_generation or now - self._young_since >= self._generation_s:
            self._turn(now)
        elif now - self._old_since > self._max_age_s:
            self._old = {}
        self._young[response_id] = (url, owner)

    def find(self, response_id: str) -> Held | None:
        """The replica that served ``response_id`` and its key, if this process relayed it lately."""
        now = self._clock()
        if now - self._young_since >= self._generation_s:
            self._turn(now)
        elif now - self._old_since > self._max_age_s:
            self._old = {}
        url = self._young.get(response_id)
        return url if url is not None else self._old.get(response_id)

    def _turn(self, now: float) -> None:
        """The old generation let go, the young one old. A generation begun longer than the age
        ago may hold an id past it: it is let go whole (what it holds is at least half the age
        old: a generation takes ids for half the age at most)."""
        young = self._young if now - self._young_since <= self._max_age_s else {}
        self._old, self._young = young, {}
        self._old_since, self._young_since = self._young_since, now


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

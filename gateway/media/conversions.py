"""What the gateway made of a medium it converted, kept for the next request that carries it.

Chat clients send the whole conversation every turn: an audio clip or a video in the first turn
comes back in every later one. Without a cache each turn transcribes the audio again (an upstream
call, seconds of a GPU, and a transcript that may differ from the last turn's, which breaks the
engine's prefix cache) and decodes the video again (tens to hundreds of ms of CPU). The gateway
keeps what it made, by the sha256 of the medium's bytes and everything else that shaped the result:

- ``("transcript", model, upstream model, sha256, format)``: the transcript;
- ``("frames", frames, fps, max_side, timestamps, sha256)``: a video's frames, as chat parts;
- ``("presample", frames, fps, max_side, sha256)``: a video in vLLM's pre-sampled form;
- ``("downscale", width, height, sha256)``: an image resized (``on_oversize: downscale``).
- ``("description", model, upstream model, prompt, sha256)``: an image's description
  (``on_unsupported: {image: {describe: M}}``).

One LRU per process (each worker of ``serve --workers N`` has its own), bounded in bytes
(``media.cache_bytes``; 0 turns it off, and then nothing is hashed or counted). The bound counts
each value's bytes as its maker reckons them plus :data:`ENTRY_OVERHEAD`, which covers the key and
the Python objects around the bytes (measured: real memory is within ~10% of the bound). Values
are treated as immutable: whoever takes one copies what it changes. Hits and misses are counted in
``gateway_media_cache_requests_total{kind, result}``.

Requests that carry the same medium at the same time (a batch asking ten questions about one
video) share one conversion (:meth:`ConversionCache.get_or_make`): the others wait for it,
counted as ``result="shared"``. A caller that leaves does not end it for the others; when the
last one leaves it is cancelled. A failure of the medium itself (an undecodable video, one that
takes too long to sample, audio the transcription model refuses) is shared, and each caller names
its own part in it; any other failure is not: each waiting caller then converts for itself.

The cache is shared by every API key: a client could tell from the time an answer takes that
someone sent the same clip to the same process shortly before (docs/security.md).
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Hashable
from dataclasses import dataclass
from typing import Any, TypeVar

from ..metrics import GatewayMetrics
from ..upstream.failures import being_cancelled

# bytes an entry costs beyond its value's own: the key and its 64-character sha256, the dict slot,
# the tuples and strings around the value (tracemalloc: 200k small transcripts cost ~390 bytes each
# beyond their text)
ENTRY_OVERHEAD = 512
V = TypeVar("V")


@dataclass(slots=True)
class _Flight:
    task: asyncio.Future[Any]
    waiters: int = 0


class ConversionCache:
    """An LRU of converted media, bounded in bytes (the sizes its callers give)."""

    def __init__(self, max_bytes: int, metrics: GatewayMetrics | None = None) -> None:
        self.max_bytes = max_bytes
        self.size = 0
        self._entries: OrderedDict[Hashable, tuple[Any, int]] = OrderedDict()
        self._flights: dict[Hashable, _Flight] = {}  # conversions under way, by key
        self._metrics = metrics

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: object) -> bool:
        """Whether ``key`` is kept or being made: a request that asks for it now converts nothing."""
        return key in self._entries or key in self._flights

    @property
    def enabled(self) -> bool:
        """False with ``media.cache_bytes: 0``: callers skip hashing and looking up."""
        return self.max_bytes > 0

    def resize(self, max_bytes: int) -> None:
        """A reload's ``media.cache_bytes``: the least recently used entries go until it fits."""
        self.max_bytes = max_bytes
        self._evict()

    def get(self, key: tuple[Hashable, ...]) -> Any:
        """The value kept for ``key``, or None; counted as a hit or a miss of ``key[0]``."""
        entry = self._entries.get(key)
        if entry is not None:
            self._entries.move_to_end(key)
        self._count(str(key[0]), "hit" if entry is not None else "miss")
        return entry[0] if entry is not None else None

    async def get_or_make(
        self,
        key: tuple[Hashable, ...],
        make: Callable[[], Awaitable[V]],
        size_of: Callable[[V], int],
        keep: Callable[[V], bool] = lambda value: True,
        shared_errors: tuple[type[Exception], ...] = (),
    ) -> V:
        """The value kept for ``key``; else the one a conversion under way for it makes; else
        ``make()``'s, kept when ``keep`` says so (``size_of`` bytes). Raises what ``make`` raises;
        a waiter gets the conversion's error too when it is one of ``shared_errors`` (the medium's
        own fault, which would come again: the caller says it at its own part), and otherwise
        converts for itself."""
        entry = self._entries.get(key)
        if entry is not None:
            self._entries.move_to_end(key)
            self._count(str(key[0]), "hit")
            return entry[0]  # type: ignore[no-any-return]
        flight = self._flights.get(key)
        if flight is not None:
            self._count(str(key[0]), "shared")
            try:
                return await self._join(key, flight)  # type: ignore[no-any-return]
            except asyncio.CancelledError:
                if being_cancelled():
                    raise
                return await make()  # the conversion was stopped, not this caller: it converts for itself
            except shared_errors:
                raise
            except Exception:  # its maker's failure (an upstream's, maybe passing): this caller tries itself
                return await make()
        self._count(str(key[0]), "miss")
        task = asyncio.ensure_future(make())
        flight = self._flights[key] = _Flight(task)

        def landed(done: asyncio.Future[Any]) -> None:
            if self._flights.get(key) is flight:
                del self._flights[key]
            if not done.cancelled() and done.exception() is None and keep(done.result()):
                self.put(key, done.result(), size_of(done.result()))

        task.add_done_callback(landed)
        try:
            return await self._join(key, flight)  # type: ignore[no-any-return]
        except asyncio.CancelledError:
            if being_cancelled():
                raise
            return await make()

    async def _join(self, key: Hashable, flight: _Flight) -> Any:
        """Wait for a conversion; the last caller to leave cancels it, and a caller that comes
        after that starts another rather than joining one that is ending."""
        flight.waiters += 1
        try:
            return await asyncio.shield(flight.task)
        finally:
            flight.waiters -= 1
            if flight.waiters == 0 and not flight.task.done():
                flight.task.cancel()
                if self._flights.get(key) is flight:
                    del self._flights[key]

    def put(self, key: tuple[Hashable, ...], value: Any, size: int) -> None:
        """Keep ``value`` (``size`` bytes, as its maker reckons them); a value larger than the
        whole cache is not kept."""
        size += ENTRY_OVERHEAD
        old = self._entries.pop(key, None)
        if old is not None:
            self.size -= old[1]
        if size > self.max_bytes:
            self._gauge()
            return
        self._entries[key] = (value, size)
        self.size += size
        self._evict()

    def _evict(self) -> None:
        while self.size > self.max_bytes and self._entries:
            _, (_, size) = self._entries.popitem(last=False)
            self.size -= size
        self._gauge()

    def _count(self, kind: str, result: str) -> None:
        if self._metrics is not None:
            self._metrics.media_cache_requests.labels(kind, result).inc()

    def _gauge(self) -> None:
        if self._metrics is not None:
            self._metrics.media_cache_bytes.set(self.size)

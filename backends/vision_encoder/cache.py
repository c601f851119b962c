"""An LRU of encoded replies with a byte budget; concurrent misses on one key share one computation.

Keys are ``fingerprint/sha256(image bytes)``: the same image under other weights or other
preprocessing is another key.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from typing import Any, Generic, TypeVar

T = TypeVar("T")


class EmbeddingCache(Generic[T]):
    def __init__(self, max_bytes: int, size_of: Callable[[T], int]) -> None:
        self.max_bytes = max_bytes
        self._size_of = size_of
        self._entries: OrderedDict[str, tuple[T, int]] = OrderedDict()
        self._inflight: dict[str, asyncio.Future[T]] = {}
        self.bytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: str) -> T | None:
        entry = self._entries.get(key)
        if entry is None:
            return None
        self._entries.move_to_end(key)
        return entry[0]

    def put(self, key: str, value: T) -> None:
        size = self._size_of(value)
        if size > self.max_bytes:
            return  # would evict everything and still not fit
        old = self._entries.pop(key, None)
        if old is not None:
            self.bytes -= old[1]
        self._entries[key] = (value, size)
        self.bytes += size
        while self.bytes > self.max_bytes:
            _, (_, evicted) = self._entries.popitem(last=False)
            self.bytes -= evicted

    async def get_or_compute(self, key: str, compute: Callable[[], Awaitable[T]]) -> tuple[T, bool]:
        """(value, hit). A hit is a cached value or a computation already under way for the key.

        The computation runs as its own task: a caller that stops waiting (a timeout, a client
        gone) neither cancels it for the others nor loses its result for the cache.
        """
        value = self.get(key)
        if value is not None:
            return value, True
        task = self._inflight.get(key)
        hit = task is not None
        if task is None:
            task = asyncio.ensure_future(self._compute(key, compute))
            task.add_done_callback(_retrieve)
            self._inflight[key] = task
        return await asyncio.shield(task), hit

    async def _compute(self, key: str, compute: Callable[[], Awaitable[T]]) -> T:
        try:
            value = await compute()
        finally:
            self._inflight.pop(key, None)
        self.put(key, value)
        return value


def _retrieve(task: asyncio.Future[Any]) -> None:
    """Mark a failure as seen: when every waiter has given up, nobody else will."""
    if not task.cancelled():
        task.exception()

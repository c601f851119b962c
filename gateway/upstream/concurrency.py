"""Per-model concurrency: at most ``max_concurrency`` requests of a model upstream at once.

The rest wait in a bounded FIFO queue (``queue.size``, ``queue.timeout_s``). A request that finds
the queue full is shed at once with 429 ``queue_full``; one that waited ``queue.timeout_s`` gets
503 ``queue_timeout``; both carry ``Retry-After``, which the OpenAI SDKs honour. A slot is held
from the first upstream attempt to the last byte relayed (the engine works the whole time), and
handed straight to the longest waiter when it frees. Gates are kept by model name across reloads;
a reload that changes the limit applies to the gate from the model's next request on: a lowered
limit lets no new request in until the requests in flight are under it, a raised one lets
waiters in at once.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager, nullcontext

from ..config import ModelConfig
from ..errors import QueueFullError, QueueTimeoutError


class Gate:
    """One model's slots and its queue."""

    __slots__ = ("_on_shed", "_waiters", "active", "limit")

    def __init__(self, on_shed: Callable[[str, str], None] = lambda model, reason: None) -> None:
        self.active = 0
        self.limit = 0  # the latest request's max_concurrency: a reload changes it for all at once
        self._waiters: deque[asyncio.Future[None]] = deque()
        self._on_shed = on_shed

    @property
    def queued(self) -> int:
        return len(self._waiters)

    @asynccontextmanager
    async def slot(self, model: ModelConfig) -> AsyncIterator[None]:
        limit = model.max_concurrency
        if limit is None:
            yield
            return
        if limit != self.limit:
            self.limit = limit
            self._hand_over()  # a raised limit frees slots for the waiters at once
        await self._acquire(model, limit)
        try:
            yield
        finally:
            self._release()

    async def _acquire(self, model: ModelConfig, limit: int) -> None:
        if self.active < limit and not self._waiters:
            self.active += 1
            return
        queue = model.queue
        if len(self._waiters) >= queue.size:
            self._on_shed(model.name, "queue_full")
            raise QueueFullError(
                f"Model '{model.name}' is at its {limit} concurrent requests and {queue.size} waiting; retry later",
                headers={"Retry-After": "1"},
            )
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            async with asyncio.timeout(queue.timeout_s):
                await waiter
        except TimeoutError:
            if waiter.done() and not waiter.cancelled():
                return  # the slot came in the same instant the wait ran out: take it
            self._forget(waiter)
            self._on_shed(model.name, "queue_timeout")
            raise QueueTimeoutError(
                f"Model '{model.name}' had no free slot within {queue.timeout_s:g}s; retry later",
                headers={"Retry-After": "1"},
            ) from None
        except asyncio.CancelledError:  # the client left while waiting
            if waiter.done() and not waiter.cancelled():
                self._release()  # a slot was handed over just before: pass it on
            self._forget(waiter)
            raise

    def _release(self) -> None:
        self.active -= 1
        self._hand_over()

    def _hand_over(self) -> None:
        while self._waiters and self.active < self.limit:
            waiter = self._waiters.popleft()
            if not waiter.done():
                self.active += 1
                waiter.set_result(None)

    def _forget(self, waiter: asyncio.Future[None]) -> None:
        try:
            self._waiters.remove(waiter)
        except ValueError:
            pass


class Gates:
    """Every model's gate, by name, for the life of the gateway."""

    def __init__(self, on_shed: Callable[[str, str], None] = lambda model, reason: None) -> None:
        self._by_model: dict[str, Gate] = {}
        self._on_shed = on_shed

    def __call__(self, model: str) -> Gate:
        return self._by_model.get(model) or self._by_model.setdefault(model, Gate(self._on_shed))

    def slot(self, model: ModelConfig) -> AbstractAsyncContextManager[None]:
        """A slot of the model's gate; nothing to wait for (and no gate, no gauges) without a limit."""
        if model.max_concurrency is None:
            return nullcontext()
        return self(model.name).slot(model)

    def items(self) -> list[tuple[str, Gate]]:
        return sorted(self._by_model.items())

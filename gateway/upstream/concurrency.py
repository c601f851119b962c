"""Per-model concurrency: at most ``max_concurrency`` requests of a model upstream at once, served
by priority class.

The rest wait in a bounded queue (``queue.size``, ``queue.timeout_s``), one line per class
(:data:`~gateway.config.PRIORITIES`: ``system``, ``interactive``, ``default``, ``bulk``; the
request's class comes from ``x-priority``, capped by its key: :mod:`gateway.admission.priority`).
A freed slot goes to the longest waiter of the highest class waiting; ``queue.reserved`` of the
slots only ``system`` requests may take, so the top class finds room however busy the others
keep the model. A request that finds the queue full takes the place of the newest waiter of the
lowest class below its own, which is shed with 503 ``preempted``: a waiter has sent nothing
upstream yet, so no request is ever shed after its first upstream byte. Without a lower waiter
it is shed itself, at once, with 429 ``queue_full``; one that waited ``queue.timeout_s`` gets 503
``queue_timeout``; all three carry ``Retry-After``, which the OpenAI SDKs honour.

A slot is held from the first upstream attempt to the last byte relayed (the engine works the
whole time). With a limits store (``server.limits_store``) a model's ``max_concurrency`` is
divided among the live gateway processes (``slots``: this process's part, from the store's count
of them, gateway.admission.shared), and ``queue.reserved`` holds within each part (one slot at
least left to the other classes). Gates are kept by model name across reloads; a reload that changes the limit
applies to the gate from the model's next request on: a lowered limit lets no new request in
until the requests in flight are under it, a raised one lets waiters in at once.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager, nullcontext
from typing import TypeVar

from ..config import PRIORITIES, ModelConfig
from ..errors import PreemptedError, QueueFullError, QueueTimeoutError
from ..tracing import Span, Tracing

T = TypeVar("T")

TOP = 0  # the rank of the highest class (system): the only one that may take reserved slots
DEFAULT_RANK = PRIORITIES.index("default")  # a slot's class when none is said (gateway.admission.priority's)

OnShed = Callable[[str, str, str], None]  # (model, reason, priority)
OnWait = Callable[[str, str, float], None]  # (model, priority, seconds waited)
Slots = Callable[[int], int]  # a model's max_concurrency -> this process's part of it


def _whole(limit: int) -> int:
    return limit


def _no_shed(model: str, reason: str, priority: str) -> None: ...


def _no_wait(model: str, priority: str, seconds: float) -> None: ...


class Gate:
    """One model's slots and its queue, a line per priority class."""

    __slots__ = ("_configured", "_lines", "_on_shed", "_on_wait", "_slots", "active", "limit", "reserved")

    def __init__(self, on_shed: OnShed = _no_shed, on_wait: OnWait = _no_wait, slots: Slots = _whole) -> None:
        self.active = 0
        self.limit = 0  # this process's part of the latest request's max_concurrency: a reload changes it for all
        self.reserved = 0  # and of its queue.reserved
        self._configured = (0, 0)  # the latest request's max_concurrency and queue.reserved, as configured
        self._lines: tuple[deque[asyncio.Future[None]], ...] = tuple(deque() for _ in PRIORITIES)
        self._on_shed, self._on_wait, self._slots = on_shed, on_wait, slots

    @property
    def queued(self) -> int:
        return sum(len(line) for line in self._lines)

    @property
    def slots(self) -> int:
        """This process's part of the model's max_concurrency as it stands now (read only: the
        gate takes it up at its next request or release)."""
        configured, _ = self._configured
        return self._slots(configured) if configured else self.limit

    def queued_at(self, rank: int) -> int:
        """The waiters of one class (its index in PRIORITIES)."""
        return len(self._lines[rank])

    @asynccontextmanager
    async def slot(self, model: ModelConfig, rank: int = DEFAULT_RANK) -> AsyncIterator[None]:
        limit = model.max_concurrency
        if limit is None:
            yield
            return
        self._configured = (limit, model.queue.reserved)
        if self._resize():
            self._hand_over()  # a raised limit frees slots for the waiters at once
        await self._acquire(model, rank)
        try:
            yield
        finally:
            self._release()

    def _resize(self) -> bool:
        """The limit from the configured one and this process's part of it; whether it changed."""
        configured, reserved = self._configured
        limit = self._slots(configured)
        reserved = min(reserved, limit - 1)
        changed = limit != self.limit or reserved != self.reserved
        self.limit, self.reserved = limit, reserved
        return changed

    def _room(self, rank: int) -> bool:
        return self.active < (self.limit if rank == TOP else self.limit - self.reserved)

    async def _acquire(self, model: ModelConfig, rank: int) -> None:
        loop = asyncio.get_running_loop()
        if self._room(rank) and not any(self._lines[r] for r in range(rank + 1)):
            self.active += 1
            self._on_wait(model.name, PRIORITIES[rank], 0.0)
            return
        queue = model.queue
        if self.queued >= queue.size and not self._preempt_below(model.name, rank):
            self._on_shed(model.name, "queue_full", PRIORITIES[rank])
            raise QueueFullError(
                f"Model '{model.name}' is at its {self.limit} concurrent requests and {queue.size} waiting; "
                "retry later",
                headers={"Retry-After": "1"},
            )
        waiter = loop.create_future()
        line, began = self._lines[rank], loop.time()
        line.append(waiter)
        try:
            async with asyncio.timeout(queue.timeout_s):
                await waiter
        except TimeoutError:
            if waiter.done() and not waiter.cancelled():  # settled in the same instant the wait ran out
                if (shed := waiter.exception()) is not None:
                    raise shed from None
                # a slot: take it
            else:
                _forget(line, waiter)
                self._on_shed(model.name, "queue_timeout", PRIORITIES[rank])
                raise QueueTimeoutError(
                    f"Model '{model.name}' had no free slot within {queue.timeout_s:g}s; retry later",
                    headers={"Retry-After": "1"},
                ) from None
        except asyncio.CancelledError:  # the client left while waiting
            if waiter.done() and not waiter.cancelled() and waiter.exception() is None:
                self._release()  # a slot was handed over just before: pass it on
            _forget(line, waiter)
            raise
        self._on_wait(model.name, PRIORITIES[rank], loop.time() - began)

    def _preempt_below(self, model: str, rank: int) -> bool:
        """Shed the newest waiter of the lowest class below ``rank``, for a request of that
        class to take its place in the full queue; False when there is none."""
        for lower in range(len(PRIORITIES) - 1, rank, -1):
            line = self._lines[lower]
            while line:
                waiter = line.pop()
                if waiter.done():  # it left in the same instant; the next one
                    continue
                self._on_shed(model, "preempted", PRIORITIES[lower])
                waiter.set_exception(
                    PreemptedError(
                        f"Model '{model}' is at its {self.limit} concurrent requests with a full queue, and this "
                        f"{PRIORITIES[lower]} request gave its place to one of a higher priority class; retry later",
                        headers={"Retry-After": "1"},
                    )
                )
                return True
        return False

    def _release(self) -> None:
        self.active -= 1
        self._resize()  # the part may have grown since (a process gone)
        self._hand_over()

    def _hand_over(self) -> None:
        for rank, line in enumerate(self._lines):
            while line and self._room(rank):
                waiter = line.popleft()
                if not waiter.done():
                    self.active += 1
                    waiter.set_result(None)
            if line:  # a class that waits holds back the ones below it
                return


def _forget(line: deque[asyncio.Future[None]], waiter: asyncio.Future[None]) -> None:
    try:
        line.remove(waiter)
    except ValueError:
        pass


class Gates:
    """Every model's gate, by name, for the life of the gateway."""

    def __init__(self, on_shed: OnShed = _no_shed, on_wait: OnWait = _no_wait, slots: Slots = _whole) -> None:
        self._by_model: dict[str, Gate] = {}
        self._on_shed, self._on_wait, self._slots = on_shed, on_wait, slots

    def __call__(self, model: str) -> Gate:
        found = self._by_model.get(model)
        if found is None:
            found = self._by_model.setdefault(model, Gate(self._on_shed, self._on_wait, self._slots))
        return found

    def slot(self, model: ModelConfig, rank: int = DEFAULT_RANK) -> AbstractAsyncContextManager[None]:
        """A slot of the model's gate; nothing to wait for (and no gate, no gauges) without a limit."""
        if model.max_concurrency is None:
            return nullcontext()
        return self(model.name).slot(model, rank)

    def items(self) -> list[tuple[str, Gate]]:
        return sorted(self._by_model.items())


async def gated(
    gates: Gates, tracing: Tracing | None, model: ModelConfig, rank: int, exchange: Callable[[], Awaitable[T]]
) -> T:
    """The exchange, begun once the model's gate gives it a slot (``max_concurrency``), in the
    order of its priority class (``rank``): its deadlines and retry budget count from then; its
    wait a span of its own (``gateway.queue``), where the request is traced."""
    if tracing is None or not tracing.recording():
        async with gates.slot(model, rank):
            return await exchange()
    waiting: Span | None = tracing.start("gateway.queue", {"gateway.priority": PRIORITIES[rank]})
    try:
        async with gates.slot(model, rank):
            assert waiting is not None
            waiting.end()
            waiting = None
            return await exchange()
    except BaseException as exc:
        if waiting is not None:  # shed, or the client left, while it waited
            tracing.failed(waiting, exc)
            waiting.end()
        raise

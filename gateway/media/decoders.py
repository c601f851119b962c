"""The process's media decoding threads: few at once, a bounded queue, and stops that hold.

Decoding a video is CPU work for seconds that must not run on the event loop, nor take the cores
the gateway serves with. :class:`DecoderPool` runs at most :data:`THREADS` decodes at once on its
own threads (apart from the default executor, which DNS lookups and large data URLs use). A
request that finds them busy waits in a queue of at most :data:`QUEUE` requests, for at most
:data:`WAIT_S`; past either it is refused with 503 ``decoders_busy`` and ``Retry-After``: the
gateway's saturation, which clients retry, not the video's fault. The wait is not part of the
decode's own time limit (it was: 50 valid clips at once got 400 ``invalid_video`` for waiting).

The threads are shared fairly among tenants (a request's API key; without ``auth:``, the
client's address), read from :data:`TENANT`, which the exchange sets for its request: each
tenant waits in a queue of its own, and a thread that comes free goes to the next tenant in
turn, not to the oldest waiter. One key's hundred PDFs wait behind each other, and another key's
one document waits at most for a decode to end (the threads all busy), not for the hundred. A
tenant may fill the queue but for :data:`TENANT_QUEUE` places, which stay the others' (behind a
load balancer, without ``auth:``, every client is one address: 96 of the 128 places are theirs).

A decode is handed a :class:`threading.Event` that the pool sets when the request that waits for
it ends (the client left, its time ran out, a sibling part failed): the decoder looks at it
between two frames and stops. A thread is given back to the pool only when its decode has
returned, so the threads bound the CPU really spent, not the requests still waiting.
"""

from __future__ import annotations

import asyncio
import functools
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextvars import ContextVar
from typing import Any, TypeVar

from ..errors import DecodersBusyError

T = TypeVar("T")

THREADS = 2  # decodes at once in a gateway process: the other cores stay for serving
QUEUE = 128  # requests waiting for a thread (each holds its video's bytes); one more is refused at once
WAIT_S = 30.0  # the longest wait for a thread: as long as a request's decoding may take
TENANT_QUEUE = 32  # places of the queue one tenant leaves to the others (a quarter of a smaller queue)
TENANT: ContextVar[str] = ContextVar("decode_tenant", default="")  # whose decodes these are (set per request)


class DecoderPool:
    """Runs decodes on :data:`THREADS` threads of its own (see the module docstring)."""

    def __init__(self, threads: int | None = None, *, queue: int | None = None, wait_s: float | None = None) -> None:
        threads = THREADS if threads is None else threads
        self._executor = ThreadPoolExecutor(threads, thread_name_prefix="decode")
        self._free = threads
        self._queue = QUEUE if queue is None else queue
        self._wait_s = WAIT_S if wait_s is None else wait_s
        self._waiters: dict[str, deque[asyncio.Future[None]]] = {}  # by tenant
        self._turns: deque[str] = deque()  # the tenants that wait, in the order they are served
        self._running: set[threading.Event] = set()
        self._closed = False

    @property
    def waiting(self) -> int:
        return sum(len(queue) for queue in self._waiters.values())

    @property
    def running(self) -> int:
        return len(self._running)

    async def run(self, work: Callable[[threading.Event], T]) -> T:
        """``work(stop)`` on a thread of the pool, once one is free; DecodersBusyError when the
        queue is full or the wait too long. A caller that leaves sets ``stop``."""
        await self._acquire()
        stop = threading.Event()
        self._running.add(stop)
        try:
            future = asyncio.get_running_loop().run_in_executor(self._executor, work, stop)
        except BaseException:  # the pool was shut down
            self._running.discard(stop)
            self._release()
            raise
        future.add_done_callback(functools.partial(self._done, stop))
        try:
            return await asyncio.shield(future)
        except BaseException:
            stop.set()  # the decode ends at its next frame; its thread is given back then
            raise

    def close(self) -> None:
        """Stop every decode at its next frame, refuse new ones and those waiting, and let the
        threads go."""
        self._closed = True
        for stop in self._running:
            stop.set()
        for queue in self._waiters.values():
            for waiter in queue:
                if not waiter.done():
                    waiter.set_exception(_closing())
        self._waiters.clear()
        self._turns.clear()
        self._executor.shutdown(wait=False, cancel_futures=True)

    async def _acquire(self) -> None:
        if self._closed:
            raise _closing()
        if self._free > 0 and not self._waiters:
            self._free -= 1
            return
        tenant = TENANT.get()
        queue = self._waiters.get(tenant)
        most = self._queue - min(TENANT_QUEUE, self._queue // 4)  # one tenant's most: the rest stay the others'
        if self.waiting >= self._queue or (queue is not None and len(queue) >= most):
            mine = queue is not None and len(queue) >= most
            raise DecodersBusyError(
                f"Every media decoder of this gateway (video, images, documents) is busy and {most} requests "
                "of the same key (or, without auth, the same address) wait for one; retry shortly"
                if mine
                else f"Every media decoder of this gateway (video, images, documents) is busy and {self._queue} "
                "requests wait for one; retry shortly",
                reason="queue_full",
            )
        if queue is None:
            queue = self._waiters[tenant] = deque()
            self._turns.append(tenant)
        waiter = asyncio.get_running_loop().create_future()
        queue.append(waiter)
        try:
            async with asyncio.timeout(self._wait_s):
                await waiter
        except BaseException as exc:
            if waiter.done() and not waiter.cancelled() and waiter.exception() is None:
                self._release()  # handed a thread just as it gave up
            if isinstance(exc, TimeoutError):
                raise DecodersBusyError(
                    "Every media decoder of this gateway (video, images, documents) was busy "
                    f"for {self._wait_s:g}s; retry shortly",
                    reason="queue_timeout",
                ) from None
            raise
        finally:
            if not waiter.done() or waiter.cancelled():
                self._forget(tenant, waiter)

    def _forget(self, tenant: str, waiter: asyncio.Future[None]) -> None:
        """A waiter that left, out of its tenant's queue (and the tenant out of turn, if none is left)."""
        queue = self._waiters.get(tenant)
        if queue is None:
            return
        try:
            queue.remove(waiter)
        except ValueError:
            return
        if not queue:
            del self._waiters[tenant]
            self._turns.remove(tenant)

    def _done(self, stop: threading.Event, future: asyncio.Future[Any]) -> None:
        if not future.cancelled():
            future.exception()  # retrieved: a decode stopped for a caller that left ends in DecodeStopped
        self._running.discard(stop)
        self._release()

    def _release(self) -> None:
        """A thread free: to the first waiter of the next tenant in turn, else back to the pool."""
        if self._closed:
            return
        while self._turns:
            tenant = self._turns.popleft()
            queue = self._waiters[tenant]
            waiter = queue.popleft()
            if queue:
                self._turns.append(tenant)  # its next waiter after every other tenant's
            else:
                del self._waiters[tenant]
            if not waiter.done():
                waiter.set_result(None)
                return
        self._free += 1


def _closing() -> DecodersBusyError:
    return DecodersBusyError("The gateway is shutting down; retry on another", reason="queue_full")

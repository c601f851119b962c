"""One dynamic batcher feeding one executor thread.

Requests queue up while a batch runs on the device; the next batch takes what is queued, up to
``max_batch_size`` images and ``max_batch_tokens`` embedding rows (always at least one image). With
``max_batch_delay_ms`` > 0 an idle batcher waits that long for company before starting a small
batch; the default 0 never delays a lone request. The queue is bounded: a full queue refuses at
once (the server answers 503 with Retry-After) instead of letting latency grow without limit.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from .towers import Encoded, Prepared, VisionTower


class QueueFullError(Exception):
    pass


@dataclass
class _Job:
    prepared: Prepared
    future: asyncio.Future[Encoded]
    enqueued: float = field(default_factory=time.perf_counter)


@dataclass
class BatchStats:
    """Observers for the metrics; the batcher itself does not know Prometheus."""

    on_batch: Callable[[int, float], None] = lambda size, forward_s: None
    on_queue_wait: Callable[[float], None] = lambda seconds: None


class DynamicBatcher:
    def __init__(
        self,
        tower: VisionTower,
        *,
        max_batch_size: int = 32,
        max_batch_tokens: int = 65536,
        max_batch_delay_ms: float = 0.0,
        max_queue: int = 1024,
        stats: BatchStats | None = None,
    ) -> None:
        self.tower = tower
        self.max_batch_size = max_batch_size
        self.max_batch_tokens = max_batch_tokens
        self.max_batch_delay_s = max_batch_delay_ms / 1000
        self.max_queue = max_queue
        self.stats = stats or BatchStats()
        self._pending: deque[_Job] = deque()
        self._wakeup = asyncio.Event()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="encoder-forward")
        self._task: asyncio.Task[None] | None = None
        self.running = 0  # images in the batch on the device now
        self.batches = 0
        self.images = 0
        self.last_progress = time.monotonic()  # the last time a batch finished or the queue was empty

    @property
    def queued(self) -> int:
        return len(self._pending)

    @property
    def busy(self) -> bool:
        return bool(self._pending) or self.running > 0

    @property
    def alive(self) -> bool:
        """False once the batching task has ended (it only ends by a bug or at shutdown)."""
        return self._task is not None and not self._task.done()

    def stalled_for(self) -> float:
        """Seconds the batcher has had work without finishing a batch (0 when idle)."""
        return time.monotonic() - self.last_progress if self.busy else 0.0

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name="encoder-batcher")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        for job in self._pending:
            if not job.future.done():
                job.future.set_exception(RuntimeError("encoder is shutting down"))
        self._executor.shutdown(wait=True)

    async def submit(self, prepared: Prepared, *, timeout: float | None = None) -> Encoded:
        if len(self._pending) >= self.max_queue:
            raise QueueFullError(f"encode queue is full ({self.max_queue} images waiting)")
        future: asyncio.Future[Encoded] = asyncio.get_running_loop().create_future()
        self._pending.append(_Job(prepared, future))
        self._wakeup.set()
        # on timeout the future is cancelled, and the batcher skips it
        return await asyncio.wait_for(future, timeout)

    def _take(self) -> list[_Job]:
        batch: list[_Job] = []
        tokens = 0
        while self._pending and len(batch) < self.max_batch_size:
            job = self._pending[0]
            if job.future.done():  # timed out or cancelled while waiting
                self._pending.popleft()
                continue
            if batch and tokens + job.prepared.tokens > self.max_batch_tokens:
                break
            self._pending.popleft()
            batch.append(job)
            tokens += job.prepared.tokens
        return batch

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            if not self._pending:
                self.last_progress = time.monotonic()
                self._wakeup.clear()
                await self._wakeup.wait()
                self.last_progress = time.monotonic()
            if self.max_batch_delay_s and len(self._pending) < self.max_batch_size:
                await asyncio.sleep(self.max_batch_delay_s)
            batch = self._take()
            if not batch:
                continue
            now = time.perf_counter()
            for job in batch:
                self.stats.on_queue_wait(now - job.enqueued)
            self.running = len(batch)
            started = time.perf_counter()
            try:
                results = await loop.run_in_executor(self._executor, self._forward, [j.prepared for j in batch])
            except Exception as exc:
                for job in batch:
                    if not job.future.done():
                        job.future.set_exception(exc)
                self.last_progress = time.monotonic()
                continue
            finally:
                self.running = 0
            self.stats.on_batch(len(batch), time.perf_counter() - started)
            self.last_progress = time.monotonic()
            self.batches += 1
            self.images += len(batch)
            for job, result in zip(batch, results, strict=True):
                if not job.future.done():
                    job.future.set_result(result)

    def _forward(self, batch: Sequence[Prepared]) -> list[Encoded]:
        with torch.inference_mode():
            return self.tower.forward(batch)

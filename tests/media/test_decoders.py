"""The process's decoding threads (gateway/media/decoders.py): few at once, a bounded queue, a 503 for
saturation, and a decode stopped when its caller leaves, its thread given back only then."""

from __future__ import annotations

import asyncio
import threading

import pytest

from gateway.errors import DecodersBusyError
from gateway.media.decoders import TENANT, TENANT_QUEUE, DecoderPool


class Held:
    """Work that runs until released (or stopped), on a pool thread."""

    def __init__(self) -> None:
        self.started = threading.Event()
        self.release = threading.Event()
        self.saw_stop = threading.Event()

    def __call__(self, stop: threading.Event) -> str:
        self.started.set()
        while not self.release.wait(0.005):
            if stop.is_set():
                self.saw_stop.set()
                return "stopped"
        return "done"


async def started(held: Held) -> None:
    assert await asyncio.to_thread(held.started.wait, 5)


async def holding(pool: DecoderPool) -> tuple[asyncio.Task[str], Held]:
    """A decode that holds one of the pool's threads until released."""
    held = Held()
    task = asyncio.create_task(pool.run(held))
    await started(held)
    return task, held


async def test_decodes_run_on_few_threads_and_the_rest_wait_their_turn() -> None:
    pool = DecoderPool(1, queue=4, wait_s=30)
    first, second = Held(), Held()
    one = asyncio.create_task(pool.run(first))
    await started(first)
    two = asyncio.create_task(pool.run(second))
    await asyncio.sleep(0)
    assert (pool.running, pool.waiting) == (1, 1) and not second.started.is_set()
    first.release.set()
    assert await one == "done"
    await started(second)
    second.release.set()
    assert await two == "done"
    assert (pool.running, pool.waiting) == (0, 0)
    pool.close()


@pytest.mark.parametrize(
    ("queue", "wait_s", "reason"), [(0, 30.0, "queue_full"), (4, 0.01, "queue_timeout")], ids=["full", "too long"]
)
async def test_a_full_queue_or_a_wait_too_long_is_a_503(queue: int, wait_s: float, reason: str) -> None:
    pool = DecoderPool(1, queue=queue, wait_s=wait_s)
    running, held = await holding(pool)
    with pytest.raises(DecodersBusyError) as caught:
        await pool.run(Held())
    assert (caught.value.status, caught.value.code, caught.value.reason) == (503, "decoders_busy", reason)
    assert caught.value.headers == {"Retry-After": "1"}
    assert pool.waiting == 0  # a caller that gave up left the queue
    held.release.set()
    await running
    pool.close()


async def test_a_caller_that_leaves_the_queue_gives_its_turn_to_the_next() -> None:
    pool = DecoderPool(1, queue=4, wait_s=30)
    running, held = await holding(pool)
    after = Held()
    leaving = asyncio.create_task(pool.run(Held()))
    staying = asyncio.create_task(pool.run(after))
    await asyncio.sleep(0)
    leaving.cancel()
    with pytest.raises(asyncio.CancelledError):
        await leaving
    held.release.set()
    await running
    await started(after)
    after.release.set()
    assert await staying == "done"
    pool.close()


def as_tenant(tenant: str, pool: DecoderPool, work: Held) -> asyncio.Task[str]:
    """``pool.run(work)`` on behalf of ``tenant`` (a task copies the context it is made in)."""
    token = TENANT.set(tenant)
    try:
        return asyncio.create_task(pool.run(work))
    finally:
        TENANT.reset(token)


async def test_a_freed_thread_goes_to_the_next_tenant_in_turn_not_to_the_oldest_waiter() -> None:
    """Issue 40, finding 3: key a's many queued decodes do not hold key b's one behind them all."""
    pool = DecoderPool(1, queue=64, wait_s=30)
    running, held = await holding(pool)
    a = [Held() for _ in range(5)]
    b = Held()
    a_tasks = [as_tenant("a", pool, w) for w in a]
    await asyncio.sleep(0)
    b_task = as_tenant("b", pool, b)
    await asyncio.sleep(0)
    assert pool.waiting == 6
    held.release.set()
    await running
    await started(a[0])  # a waited first: its first decode runs
    a[0].release.set()
    await started(b)  # then b's turn, before a's other four
    assert not any(w.started.is_set() for w in a[1:])
    b.release.set()
    assert await b_task == "done"
    for w in a[1:]:
        w.release.set()
    assert await asyncio.gather(*a_tasks) == ["done"] * 5
    pool.close()


async def test_one_tenant_cannot_fill_the_queue_for_the_others() -> None:
    """A tenant may take the queue but for TENANT_QUEUE places, which stay the others' (one
    address behind a load balancer still has most of the queue)."""
    pool = DecoderPool(1, queue=TENANT_QUEUE + 96, wait_s=30)
    running, held = await holding(pool)
    mine = [as_tenant("a", pool, Held()) for _ in range(96)]
    await asyncio.sleep(0)
    with pytest.raises(DecodersBusyError) as caught:
        await as_tenant("a", pool, Held())
    assert caught.value.reason == "queue_full" and "of the same key" in caught.value.message
    theirs = [as_tenant("b", pool, Held()) for _ in range(TENANT_QUEUE)]  # room for the others
    await asyncio.sleep(0)
    assert pool.waiting == TENANT_QUEUE + 96
    pool.close()
    held.release.set()
    await asyncio.gather(running, *mine, *theirs, return_exceptions=True)


async def test_a_caller_that_leaves_stops_its_decode_and_the_thread_comes_back_when_it_ends() -> None:
    pool = DecoderPool(1, queue=4, wait_s=30)
    task, held = await holding(pool)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert await asyncio.to_thread(held.saw_stop.wait, 5)  # stopped between two "frames"
    for _ in range(500):  # the thread is given back once the work has returned (bounded: 5 s)
        if pool.running == 0:
            break
        await asyncio.sleep(0.01)
    assert pool.running == 0
    nxt = Held()
    nxt.release.set()
    assert await pool.run(nxt) == "done"
    pool.close()


async def test_closing_stops_what_runs() -> None:
    pool = DecoderPool(1)
    task, _ = await holding(pool)
    pool.close()
    assert await task == "stopped"


async def test_closing_refuses_those_waiting_and_those_to_come() -> None:
    pool = DecoderPool(1, queue=4, wait_s=30)
    task, _ = await holding(pool)
    waiting = asyncio.create_task(pool.run(Held()))
    await asyncio.sleep(0)
    pool.close()
    with pytest.raises(DecodersBusyError):
        await waiting
    with pytest.raises(DecodersBusyError):
        await pool.run(Held())
    assert await task == "stopped"

"""Per-model concurrency: slots, the bounded queue by priority class, shedding, preemption, and
clients that leave."""

from __future__ import annotations

import asyncio
from contextlib import AsyncExitStack
from typing import Any

import pytest

from gateway.config import PRIORITIES, ModelConfig, QueueConfig
from gateway.errors import PreemptedError, QueueFullError, QueueTimeoutError
from gateway.modalities import Modality
from gateway.upstream.concurrency import Gate, Gates

SYSTEM, INTERACTIVE, DEFAULT, BULK = range(len(PRIORITIES))


def model(limit: int | None = 2, size: int = 1, timeout_s: float = 30.0, reserved: int = 0) -> ModelConfig:
    queue = QueueConfig(size=size, timeout_s=timeout_s, reserved=reserved)
    return ModelConfig("m", ("http://a",), (Modality.TEXT,), max_concurrency=limit, queue=queue)


async def waiting(gate: Gate, n: int) -> None:
    while gate.queued < n:  # bounded by the test's timeout
        await asyncio.sleep(0)


async def test_requests_beyond_the_limit_wait_in_order_and_one_more_than_the_queue_is_shed() -> None:
    shed: list[tuple[str, str, str]] = []
    gate, m = Gates(on_shed=lambda *shed_one: shed.append(shed_one))("m"), model(limit=2, size=2)
    order: list[int] = []
    async with AsyncExitStack() as held:
        await held.enter_async_context(gate.slot(m))
        await held.enter_async_context(gate.slot(m))
        assert gate.active == 2

        async def queued(i: int) -> None:
            async with gate.slot(m):
                order.append(i)

        tasks = [asyncio.create_task(queued(i)) for i in range(2)]
        await waiting(gate, 2)
        with pytest.raises(QueueFullError) as caught:
            async with gate.slot(m):
                pass
        assert caught.value.status == 429 and caught.value.headers["Retry-After"] == "1"
        assert shed == [("m", "queue_full", "default")]
    await asyncio.gather(*tasks)
    assert order == [0, 1] and gate.active == 0 and gate.queued == 0


async def test_a_request_that_waits_too_long_is_a_503_and_leaves_the_queue() -> None:
    gate, m = Gate(), model(limit=1, size=4, timeout_s=0.05)
    async with gate.slot(m):
        with pytest.raises(QueueTimeoutError) as caught:
            async with gate.slot(m):
                pass
        assert caught.value.status == 503 and gate.queued == 0
    assert gate.active == 0


async def test_a_client_that_leaves_while_waiting_takes_no_slot_with_it() -> None:
    gate, m = Gate(), model(limit=1, size=4)
    async with gate.slot(m):
        leaving = asyncio.create_task(gate.slot(m).__aenter__())
        await waiting(gate, 1)
        leaving.cancel()
        with pytest.raises(asyncio.CancelledError):
            await leaving
        assert gate.queued == 0
    assert gate.active == 0
    async with gate.slot(m):  # the slot is free for the next one
        assert gate.active == 1


async def test_a_slot_handed_to_a_waiter_that_just_left_passes_to_the_next() -> None:
    gate, m = Gate(), model(limit=1, size=4)
    first = gate.slot(m)
    await first.__aenter__()
    leaving = asyncio.create_task(gate.slot(m).__aenter__())
    served = asyncio.Event()

    async def patient() -> None:
        async with gate.slot(m):
            served.set()

    next_one = asyncio.create_task(patient())
    await waiting(gate, 2)
    await first.__aexit__(None, None, None)  # hands the slot to `leaving`...
    leaving.cancel()  # ...which leaves before it runs again
    with pytest.raises(asyncio.CancelledError):
        await leaving
    await asyncio.wait_for(served.wait(), 5)
    await next_one
    assert gate.active == 0 and gate.queued == 0


async def test_no_limit_means_no_gate() -> None:
    gate = Gate()
    async with gate.slot(model(limit=None)), gate.slot(model(limit=None)):
        assert gate.active == 0


async def test_a_slot_handed_over_in_the_instant_the_wait_runs_out_is_taken_not_leaked(monkeypatch) -> None:
    gate, m = Gate(), model(limit=1, size=4, timeout_s=0.05)
    holder = gate.slot(m)
    await holder.__aenter__()
    loop = asyncio.get_running_loop()
    call_at = loop.call_at
    exits: list[asyncio.Task[Any]] = []

    def release_then_time_out(when: float, callback: Any, *args: Any, **kwargs: Any) -> asyncio.TimerHandle:
        if type(getattr(callback, "__self__", None)).__name__ == "Timeout":

            def both() -> None:
                exits.append(asyncio.create_task(holder.__aexit__(None, None, None)))  # frees the slot...
                loop.call_soon(callback, *args)  # ...and the waiter's time runs out in the same pass

            return call_at(when, both)
        return call_at(when, callback, *args, **kwargs)

    monkeypatch.setattr(loop, "call_at", release_then_time_out)
    async with gate.slot(m):  # served: the slot came as the wait ran out
        assert gate.active == 1
    monkeypatch.undo()
    await asyncio.gather(*exits)
    assert gate.active == 0 and gate.queued == 0


async def test_a_reload_that_changes_the_limit_applies_to_requests_already_in_and_waiting() -> None:
    gate = Gate()
    wide, narrow = model(limit=3, size=8), model(limit=1, size=8)
    held = [gate.slot(narrow) for _ in range(3)]  # context managers kept: each holds its slot
    async with AsyncExitStack() as stack:
        for _ in range(3):
            await stack.enter_async_context(gate.slot(wide))
        waiter = asyncio.create_task(held[0].__aenter__())  # the limit is 1 now
        await waiting(gate, 1)
    # the three left: with a limit of 1, only the waiter got in (not three at once)
    await waiter
    assert gate.active == 1 and gate.queued == 0
    late = [asyncio.create_task(cm.__aenter__()) for cm in held[1:]]
    await waiting(gate, 2)
    async with gate.slot(model(limit=4, size=8)):  # raised: the two waiters get in at once, and this one
        await asyncio.gather(*late)
        assert gate.active == 4
    for cm in held:
        await cm.__aexit__(None, None, None)
    assert gate.active == 0


async def test_a_freed_slot_goes_to_the_highest_class_waiting_first_come_within_a_class() -> None:
    waits: list[tuple[str, str]] = []
    gate, m = Gates(on_wait=lambda model, priority, waited: waits.append((model, priority)))("m"), model(1, size=8)
    order: list[str] = []

    async def queued(name: str, rank: int) -> None:
        async with gate.slot(m, rank):
            order.append(name)

    async with gate.slot(m, BULK):
        tasks = []
        for name, rank in [("bulk", BULK), ("default", DEFAULT), ("interactive-1", INTERACTIVE)]:
            tasks.append(asyncio.create_task(queued(name, rank)))
            await waiting(gate, len(tasks))
        tasks += [asyncio.create_task(queued("interactive-2", INTERACTIVE)), asyncio.create_task(queued("system", 0))]
        await waiting(gate, 5)
        assert [gate.queued_at(r) for r in range(4)] == [1, 2, 1, 1]
    await asyncio.gather(*tasks)
    assert order == ["system", "interactive-1", "interactive-2", "default", "bulk"]
    assert waits[0] == ("m", "bulk") and sorted(p for _, p in waits) == sorted(["bulk"] * 2 + ["default"] + [
        "interactive"] * 2 + ["system"])  # fmt: skip
    assert gate.active == 0 and gate.queued == 0


async def test_reserved_slots_let_the_top_class_in_while_the_others_wait() -> None:
    gate, m = Gate(), model(limit=2, size=4, reserved=1)
    later = gate.slot(m, INTERACTIVE)
    async with gate.slot(m, INTERACTIVE):  # one slot for everyone
        interactive = asyncio.create_task(later.__aenter__())
        await waiting(gate, 1)
        async with gate.slot(m, SYSTEM):  # the reserved one: at once, past the waiter
            assert gate.active == 2 and gate.queued == 1
        assert not interactive.done()  # the reserved slot freed is the top class's still
        await asyncio.sleep(0)
        assert gate.queued == 1
    await interactive
    assert gate.active == 1 and gate.queued == 0
    await later.__aexit__(None, None, None)
    assert gate.active == 0


async def test_a_full_queue_sheds_the_newest_of_the_lowest_class_for_a_higher_one() -> None:
    shed: list[tuple[str, str, str]] = []
    gate, m = Gates(on_shed=lambda *one: shed.append(one))("m"), model(limit=1, size=3)
    order: list[str] = []

    async def queued(name: str, rank: int) -> None:
        async with gate.slot(m, rank):
            order.append(name)

    async with gate.slot(m, DEFAULT):
        early = [asyncio.create_task(queued(n, r)) for n, r in [("bulk-1", BULK), ("default", DEFAULT)]]
        await waiting(gate, 2)
        newest = asyncio.create_task(queued("bulk-2", BULK))
        await waiting(gate, 3)
        urgent = asyncio.create_task(queued("interactive", INTERACTIVE))  # the queue is full
        with pytest.raises(PreemptedError) as caught:
            await newest
        assert caught.value.status == 503 and caught.value.code == "preempted"
        assert caught.value.headers["Retry-After"] == "1" and "bulk" in caught.value.message
        assert shed == [("m", "preempted", "bulk")] and gate.queued == 3
        with pytest.raises(QueueFullError):  # no class below bulk: bulk is shed itself
            async with gate.slot(m, BULK):
                pass
        assert shed[-1] == ("m", "queue_full", "bulk")
    await asyncio.gather(urgent, *early)
    assert order == ["interactive", "default", "bulk-1"] and gate.queued == 0 and gate.active == 0


async def test_a_request_is_never_shed_for_its_own_class_or_one_below() -> None:
    gate, m = Gate(), model(limit=1, size=1)
    later = gate.slot(m, INTERACTIVE)
    async with gate.slot(m, INTERACTIVE):
        waiter = asyncio.create_task(later.__aenter__())
        await waiting(gate, 1)
        for rank in (INTERACTIVE, DEFAULT, BULK):
            with pytest.raises(QueueFullError):
                async with gate.slot(m, rank):
                    pass
        assert not waiter.done()
    await waiter
    await later.__aexit__(None, None, None)
    assert gate.active == 0 and gate.queued == 0


async def test_a_request_holding_a_slot_is_never_shed() -> None:
    """Preemption takes waiters only: a request in flight (its bytes going upstream) keeps its slot."""
    gate, m = Gate(), model(limit=1, size=0)
    async with gate.slot(m, BULK):
        with pytest.raises(QueueFullError):  # nothing waits to be shed, and the bulk one holds on
            async with gate.slot(m, SYSTEM):
                pass
        assert gate.active == 1
    assert gate.active == 0

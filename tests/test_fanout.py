"""gateway/fanout.py: a request's pieces of work at once; the first failure stops the others."""

from __future__ import annotations

import asyncio

import pytest

from gateway.fanout import gather_all


async def test_the_results_come_in_order() -> None:
    async def after(seconds: float, value: int) -> int:
        await asyncio.sleep(seconds)
        return value

    assert await gather_all(after(0.02, 1), after(0, 2), after(0.01, 3)) == [1, 2, 3]
    assert await gather_all() == []


async def test_the_first_failure_stops_the_others_at_once_and_is_raised_as_it_is() -> None:
    stopped = asyncio.Event()

    async def forever() -> int:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            stopped.set()
            raise
        return 0

    async def refuse() -> int:
        raise ValueError("refused")

    with pytest.raises(ValueError, match="refused"):  # not an ExceptionGroup
        await gather_all(forever(), refuse())
    assert stopped.is_set()


async def test_of_failures_together_the_first_submitted_is_raised() -> None:
    async def fail(message: str) -> int:
        raise KeyError(message)

    with pytest.raises(KeyError, match="first"):
        await gather_all(fail("first"), fail("second"))


async def test_the_caller_is_left_as_it_was_after_a_failure() -> None:
    """Python 3.11's TaskGroup left its own cancel of the caller counted: the caller's
    asyncio.timeout() and being_cancelled() then read a cancel that was nobody's."""

    async def refuse() -> int:
        raise ValueError("refused")

    async def slow() -> int:
        await asyncio.sleep(1)
        return 0

    current = asyncio.current_task()
    assert current is not None
    with pytest.raises(ValueError):
        await gather_all(slow(), refuse())
    assert current.cancelling() == 0
    async with asyncio.timeout(5):
        await asyncio.sleep(0)


async def test_a_caller_cancelled_is_cancelled_whatever_its_pieces_raise_as_they_stop() -> None:
    async def noisy() -> int:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            raise ValueError("raised while stopping") from None
        return 0

    task = asyncio.ensure_future(gather_all(noisy(), noisy()))
    await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task

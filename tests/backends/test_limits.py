"""The decode limits: their validation, and the pixel budget's grants, order and cancellation."""

from __future__ import annotations

import asyncio
import re

import pytest

from backends.vision_encoder.limits import DecodeLimits, PixelBudget


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"max_pixels": 0}, "max_pixels must be at least 1, got 0"),
        ({"max_aspect_ratio": 0.5}, "max_aspect_ratio must be at least 1, got 0.5"),
        ({"max_aspect_ratio": float("nan")}, "max_aspect_ratio must be at least 1, got nan"),
        ({"budget_pixels": -1}, "budget_pixels must be at least 1, got -1"),
    ],
)
def test_limits_below_one_are_refused(options: dict[str, float], message: str) -> None:
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        DecodeLimits(**options)


async def started(budget: PixelBudget, pixels: int) -> asyncio.Task[None]:
    """acquire() as a task, run up to its first wait (or to its grant)."""
    task = asyncio.ensure_future(budget.acquire(pixels))
    await asyncio.sleep(0)
    return task


async def test_images_are_granted_while_they_fit_and_wait_in_order_when_they_do_not() -> None:
    budget = PixelBudget(100)
    await budget.acquire(60)
    big = await started(budget, 60)
    small = await started(budget, 30)  # it would fit (90), but it does not overtake the big one
    assert not big.done() and not small.done() and budget.waiting == 2
    budget.release(60)
    await asyncio.gather(big, small)  # the big one gets the room, and the small one fits beside it
    assert budget.in_flight == 90 and budget.waiting == 0


async def test_an_image_over_the_whole_budget_goes_alone() -> None:
    budget = PixelBudget(100)
    await budget.acquire(10)
    huge = await started(budget, 250)
    assert not huge.done()  # not while anything else is in flight
    budget.release(10)
    await huge  # no deadlock: alone it goes
    after = await started(budget, 1)
    assert not after.done() and budget.in_flight == 250
    budget.release(250)
    await after
    assert budget.in_flight == 1


async def test_a_cancelled_waiter_leaves_the_queue_and_unblocks_the_next() -> None:
    budget = PixelBudget(100)
    await budget.acquire(50)
    blocked = await started(budget, 80)
    behind = await started(budget, 40)
    blocked.cancel()
    await behind  # the head left, and 50 + 40 fits
    assert blocked.cancelled() and budget.in_flight == 90 and budget.waiting == 0


async def test_a_waiter_cancelled_just_as_it_is_granted_gives_its_room_back() -> None:
    budget = PixelBudget(100)
    await budget.acquire(100)
    granted = await started(budget, 70)
    budget.release(100)  # grants the waiter, which has not run yet
    granted.cancel()
    with pytest.raises(asyncio.CancelledError):
        await granted
    assert budget.in_flight == 0


async def test_a_waiter_cancelled_just_before_a_release_is_skipped() -> None:
    budget = PixelBudget(100)
    await budget.acquire(100)
    cancelled = await started(budget, 70)
    behind = await started(budget, 20)
    cancelled.cancel()  # its future is cancelled at once; its task runs later
    budget.release(100)  # in the same turn: the cancelled waiter must be skipped, not granted
    with pytest.raises(asyncio.CancelledError):
        await cancelled
    await behind
    assert budget.in_flight == 20 and budget.waiting == 0
    budget.release(20)
    assert budget.in_flight == 0

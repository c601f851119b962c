"""A call's timeout in the store's time, not the event loop's (gateway.admission.shared): a loop
held by a huge body or a busy machine spends a step of it, not all of it."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

MOST_S = 1.0  # a call's bound, looked at each step, however slow the loop (or 10 x timeout_ms, if longer)
TICKS = 10  # timeout_ms is counted in this many steps, each at least one turn of the loop
GRACE_TURNS = 3  # turns of the loop after the last step: an answer already in the socket is read


@contextlib.asynccontextmanager
async def store_time(seconds: float) -> AsyncIterator[None]:
    """A timeout of ``seconds`` of the store's time, not of the loop's: counted in TICKS steps
    of seconds/TICKS, each on a timer of its own, so that a loop held for 200 ms (a huge body
    parsed, a busy machine) spends one step, not the whole timeout, and a loop whose every turn
    is slow gives the store at least TICKS turns to be heard (a request waits turns to be written
    and its answer turns to be read: a store that answered in time was not heard by a busy loop).
    After the last step, a few turns more (GRACE_TURNS and the timeout's own: an answer already
    in the socket is read); then TimeoutError. On an idle loop, ``seconds`` and a turn or two;
    the bound, max(MOST_S, 10 x seconds), is looked at as each step comes due (a single stall
    longer than it passes it by that stall)."""
    loop = asyncio.get_running_loop()
    step = seconds / TICKS
    last = loop.time() + max(MOST_S, 10 * seconds)
    async with asyncio.timeout(None) as timeout:

        def tick(left: int) -> None:
            if left > 1 and loop.time() < last:
                armed[0] = loop.call_later(step, tick, left - 1)
            else:
                armed[0] = loop.call_soon(turn, GRACE_TURNS)

        def turn(left: int) -> None:
            if left:
                armed[0] = loop.call_soon(turn, left - 1)
            else:
                timeout.reschedule(loop.time())

        armed: list[asyncio.Handle] = [loop.call_later(step, tick, TICKS)]
        try:
            yield
        finally:
            armed[0].cancel()

"""A request's pieces of work run at once (its images fetched or encoded, its clips transcribed,
its priming requests): all of their results, or the first failure, which stops the others at
once rather than after they are all done, as ``asyncio.gather(return_exceptions=True)`` would."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


async def gather_all(*work: Coroutine[Any, Any, T]) -> list[T]:
    """The results of ``work``, run at once, in order. The first to fail cancels the others (an
    asyncio.TaskGroup) and its exception is raised as it is, not in an ExceptionGroup: when several
    fail together, the one submitted first (the request's earliest part). A caller cancelled
    meanwhile gets its CancelledError, whatever its pieces raised as they stopped."""
    current = asyncio.current_task()
    before = current.cancelling() if current is not None else 0
    group = asyncio.TaskGroup()
    tasks: list[asyncio.Task[T]] = []
    try:
        async with group:
            tasks = [group.create_task(w) for w in work]
    except BaseExceptionGroup:
        if current is not None:
            # Python 3.11's TaskGroup cancels its caller to stop the others and leaves that cancel
            # counted (3.12 takes it back): taken back here, or asyncio.timeout() and the like in
            # the caller would read a cancel that is nobody's
            if getattr(group, "_parent_cancel_requested", False) and current.cancelling() > before:
                current.uncancel()
            if current.cancelling() > before:  # someone else cancelled the caller meanwhile
                raise asyncio.CancelledError from None
        for task in tasks:
            if task.done() and not task.cancelled() and (exc := task.exception()) is not None:
                raise exc from None
        raise
    return [task.result() for task in tasks]

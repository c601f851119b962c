"""The cache of converted media (gateway/media/conversions.py): an LRU bounded in bytes, counted."""

from __future__ import annotations

import asyncio
import contextlib

import pytest
from prometheus_client import CollectorRegistry

from gateway.media.conversions import ENTRY_OVERHEAD, ConversionCache
from gateway.metrics import GatewayMetrics


def cache(max_bytes: int) -> tuple[ConversionCache, CollectorRegistry]:
    registry = CollectorRegistry()
    return ConversionCache(max_bytes, GatewayMetrics(registry)), registry


def test_the_least_recently_used_go_first_when_the_bytes_run_out() -> None:
    c, registry = cache(3 * (100 + ENTRY_OVERHEAD))
    for name in "abc":
        c.put(("frames", name), name.upper(), 100)
    assert c.get(("frames", "a")) == "A"  # now the most recently used
    c.put(("frames", "d"), "D", 100)
    assert [c.get(("frames", n)) for n in "abcd"] == ["A", None, "C", "D"]
    assert c.size == 3 * (100 + ENTRY_OVERHEAD) and len(c) == 3
    sample = registry.get_sample_value
    assert sample("gateway_media_cache_requests_total", {"kind": "frames", "result": "hit"}) == 4
    assert sample("gateway_media_cache_requests_total", {"kind": "frames", "result": "miss"}) == 1
    assert sample("gateway_media_cache_bytes") == c.size


def test_a_value_larger_than_the_cache_is_not_kept_and_a_key_put_again_replaces_its_value() -> None:
    c, _ = cache(1000)
    c.put(("transcript", "x"), "small", 10)
    c.put(("transcript", "huge"), "H", 5000)
    assert c.get(("transcript", "huge")) is None and c.get(("transcript", "x")) == "small"
    c.put(("transcript", "x"), "again", 20)
    assert c.get(("transcript", "x")) == "again" and c.size == 20 + ENTRY_OVERHEAD


def test_resizing_evicts_and_zero_keeps_nothing() -> None:
    c, registry = cache(10_000)
    for i in range(5):
        c.put(("presample", i), i, 1000)
    c.resize(2 * (1000 + ENTRY_OVERHEAD))
    assert len(c) == 2 and c.get(("presample", 4)) == 4 and c.get(("presample", 0)) is None
    c.resize(0)
    assert len(c) == 0 and c.size == 0 and registry.get_sample_value("gateway_media_cache_bytes") == 0
    assert not c.enabled  # callers skip hashing and looking up
    c.put(("presample", 9), 9, 1)
    assert c.get(("presample", 9)) is None


# --- one conversion for callers that ask at once (get_or_make) -----------------------------------


class Maker:
    """A conversion the test lets finish (or fail) when it says."""

    def __init__(self) -> None:
        self.calls = 0
        self.cancelled = 0
        self.go = asyncio.Event()
        self.fail: Exception | None = None

    async def __call__(self) -> str:
        self.calls += 1
        n = self.calls
        try:
            await self.go.wait()
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        if self.fail is not None and n == 1:
            raise self.fail
        return f"made {n}"


def two_callers(key: tuple[str, str]) -> tuple[ConversionCache, Maker, list[asyncio.Future[str]]]:
    """A cache, a conversion not finished yet, and two callers asking for it at once."""
    c, _ = cache(10_000)
    make = Maker()
    return c, make, [asyncio.ensure_future(c.get_or_make(key, make, len)) for _ in range(2)]


async def test_callers_that_ask_at_once_share_one_conversion() -> None:
    c, registry = cache(10_000)
    make = Maker()
    callers = [asyncio.ensure_future(c.get_or_make(("frames", "v"), make, len)) for _ in range(5)]
    await asyncio.sleep(0)
    make.go.set()
    assert await asyncio.gather(*callers) == ["made 1"] * 5 and make.calls == 1
    assert await c.get_or_make(("frames", "v"), make, len) == "made 1"  # kept
    sample = registry.get_sample_value
    assert [
        sample("gateway_media_cache_requests_total", {"kind": "frames", "result": r}) for r in ("miss", "shared", "hit")
    ] == [1, 4, 1]


async def test_the_first_caller_leaving_does_not_end_it_for_the_others_the_last_does() -> None:
    c, make, (first, second) = two_callers(("transcript", "a"))
    await asyncio.sleep(0)
    first.cancel()
    await asyncio.sleep(0)
    make.go.set()
    assert await second == "made 1" and make.cancelled == 0
    assert first.cancelled() and c.get(("transcript", "a")) == "made 1"

    alone = Maker()
    only = asyncio.ensure_future(c.get_or_make(("transcript", "b"), alone, len))
    await asyncio.sleep(0)
    only.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await only
    await asyncio.sleep(0)
    assert alone.cancelled == 1 and c.get(("transcript", "b")) is None  # nobody waits: stopped, not kept


async def test_a_failed_conversion_is_not_shared_each_waiter_converts_for_itself() -> None:
    c, _ = cache(10_000)
    make = Maker()
    make.fail = ValueError("the first caller's video is at messages[0].content[3]")
    first = asyncio.ensure_future(c.get_or_make(("frames", "v"), make, len))
    second = asyncio.ensure_future(c.get_or_make(("frames", "v"), make, len))
    await asyncio.sleep(0)
    make.go.set()
    with pytest.raises(ValueError, match="content\\[3\\]"):
        await first
    assert await second == "made 2" and make.calls == 2  # its own conversion, its own outcome
    assert c.get(("frames", "v")) is None  # a waiter's own conversion is not kept


async def test_what_keep_refuses_is_shared_but_not_kept() -> None:
    c, _ = cache(10_000)
    make = Maker()
    make.go.set()
    assert await c.get_or_make(("transcript", "x"), make, len, keep=lambda v: False) == "made 1"
    assert c.get(("transcript", "x")) is None


async def test_a_caller_that_comes_as_the_last_one_leaves_starts_afresh() -> None:
    c, _ = cache(10_000)
    make = Maker()
    leaving = asyncio.ensure_future(c.get_or_make(("frames", "v"), make, len))
    await asyncio.sleep(0)
    leaving.cancel()
    await asyncio.sleep(0)  # it has left, and its conversion is being cancelled (not done yet)
    coming = asyncio.ensure_future(c.get_or_make(("frames", "v"), make, len))
    await asyncio.sleep(0)
    make.go.set()
    assert await coming == "made 2"  # a conversion of its own, not the one that was ending
    assert make.cancelled == 1


async def test_a_waiter_whose_conversion_is_stopped_by_someone_else_converts_for_itself() -> None:
    c, make, (first, second) = two_callers(("transcript", "a"))
    await asyncio.sleep(0)
    await asyncio.sleep(0)  # the conversion has started
    c._flights[("transcript", "a")].task.cancel()  # neither caller was cancelled
    await asyncio.sleep(0)
    make.go.set()
    assert sorted(await asyncio.gather(first, second)) == ["made 2", "made 3"]
    assert make.cancelled == 1


async def test_a_failure_of_the_medium_itself_is_shared_and_said_at_each_callers_part() -> None:
    from gateway.errors import InvalidVideoError

    c, _ = cache(10_000)
    make = Maker()
    make.fail = InvalidVideoError("messages[0].content[3]: the video cannot be decoded", param="messages[0].content[3]")
    callers = [
        asyncio.ensure_future(c.get_or_make(("frames", "bad"), make, len, shared_errors=(InvalidVideoError,)))
        for _ in range(3)
    ]
    await asyncio.sleep(0)
    make.go.set()
    errors = await asyncio.gather(*callers, return_exceptions=True)
    assert make.calls == 1 and all(isinstance(e, InvalidVideoError) for e in errors)  # decoded once, failed once
    assert c.get(("frames", "bad")) is None
    failed = errors[2]
    assert isinstance(failed, InvalidVideoError)
    error = failed.located_at("messages[2].content[0]")  # as the caller whose part is there says it
    assert (error.param, error.message) == (
        "messages[2].content[0]",
        "messages[2].content[0]: the video cannot be decoded",
    )
    assert error.code == "invalid_video" and isinstance(error, InvalidVideoError)

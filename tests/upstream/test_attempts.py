"""The one attempt loop (gateway/upstream/attempts.py): replica choice, retries, budget, backoff,
deadline; on real pools, an injected clock for the budget and an injected sleep for the backoff."""

from __future__ import annotations

import asyncio
import random
from typing import Any

import aiohttp
from prometheus_client import CollectorRegistry

from gateway.config import BreakerConfig, ModelConfig, RetryConfig
from gateway.metrics import GatewayMetrics
from gateway.modalities import Modality
from gateway.upstream.attempts import Attempts
from gateway.upstream.replicas import Pool, ReplicaSet
from gateway.upstream.retries import RetryBook
from tests.upstream.test_replicas import Clock


class Book:
    """A RetryBook whose backoff waits are written down, not slept."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.clock = Clock()
        self.slept: list[float] = []
        self.book = RetryBook(GatewayMetrics(self.registry), clock=self.clock, rng=random.Random(1), sleep=self._sleep)

    async def _sleep(self, seconds: float) -> None:
        self.slept.append(seconds)

    def retries(self, reason: str) -> float:
        return self.registry.get_sample_value("gateway_retries_total", {"model": "m", "reason": reason}) or 0.0

    def refused(self) -> float:
        return self.registry.get_sample_value("gateway_retries_refused_total", {"model": "m"}) or 0.0


def model(**retries: Any) -> ModelConfig:
    return ModelConfig(
        name="m", upstreams=("http://a", "http://b", "http://c"), accepts=frozenset({Modality.TEXT}),
        retries=RetryConfig(**retries),
    )  # fmt: skip


def pool(n: int = 3, *, balance: str = "round_robin") -> Pool:
    urls = [f"http://{chr(97 + i)}" for i in range(n)]
    return ReplicaSet(rng=random.Random(3)).pool("m", urls, balance=balance, breaker=BreakerConfig(failures=1))


async def test_without_retries_every_replica_is_tried_once() -> None:
    attempts = Attempts(pool())
    seen = []
    while (lease := await attempts.next()) is not None:
        with lease:
            seen.append(lease.replica.url)
            assert attempts.again("anything")
    assert sorted(seen) == ["http://a", "http://b", "http://c"]


async def test_panic_sends_the_first_try_when_every_breaker_is_open() -> None:
    p = pool(2)
    for replica in p.replicas:
        lease = p.lease_on(replica)
        lease.failure("down")  # failures: 1 opens it
        lease.__exit__()
    assert await Attempts(p).next() is None
    attempts = Attempts(p, panic=True)
    first = await attempts.next()
    assert first is not None
    first.__exit__()
    assert await attempts.next() is None  # only the first try panics


async def test_counted_retries_stop_at_attempts_and_free_ones_cost_none() -> None:
    book = Book()
    attempts = Attempts(pool(), retries=book.book.of(model(attempts=1)))
    assert attempts.again("connect_error", free=True)  # a refused connection: free, counted
    assert attempts.again("reset")
    assert not attempts.again("reset")  # attempts: 1
    assert (book.retries("connect_error"), book.retries("reset"), attempts.retried) == (1, 1, 1)


async def test_a_retry_waits_its_backoff_clipped_to_the_deadline() -> None:
    book = Book()
    retries = book.book.of(model(attempts=2, backoff_s=5.0, max_backoff_s=5.0))
    loop = asyncio.get_running_loop()
    attempts = Attempts(pool(), retries=retries, deadline=loop.time() + 0.5)
    assert (await attempts.next()) is not None
    assert attempts.again("http_503")
    await attempts.next()
    assert len(book.slept) == 1 and 0 < book.slept[0] <= 0.5  # 2.5-5 s of backoff, cut to what is left


async def test_no_try_starts_past_the_deadline() -> None:
    loop = asyncio.get_running_loop()
    attempts = Attempts(pool(), deadline=loop.time() - 1)
    assert attempts.expired and attempts.left() == 0.0
    assert await attempts.next() is None
    assert attempts.tried == []


async def test_a_spent_budget_refuses_the_retry_and_says_so() -> None:
    book = Book()
    attempts = Attempts(pool(), retries=book.book.of(model(attempts=3, budget=0.0, min_per_s=0.0)))
    assert not attempts.again("http_503")
    assert (book.retries("http_503"), book.refused()) == (0, 1)


async def test_anew_lets_the_failed_replica_take_the_next_try_within_attempts() -> None:
    # vLLM's EC consumer missed an embedding: not the replica's fault, and no backoff
    book = Book()
    attempts = Attempts(pool(1), retries=book.book.of(model(attempts=1)))
    lease = await attempts.next()
    assert lease is not None
    lease.__exit__()
    assert not attempts.again("reset")  # no other replica
    assert attempts.again("ec_error", anew=True)
    assert (await attempts.next()) is not None and book.slept == []
    assert not attempts.again("ec_error", anew=True)  # attempts: 1 spent
    assert book.retries("ec_error") == 1


async def test_a_failure_is_read_logged_and_told_to_the_breaker() -> None:
    p = pool(1)
    attempts = Attempts(p)
    lease = await attempts.next()
    assert lease is not None
    with lease:
        failure = attempts.failed(lease, aiohttp.ServerDisconnectedError())
    assert failure.kind == "reset" and p.replicas[0].state == "open"


async def test_every_request_of_a_model_shares_one_budget() -> None:
    book = Book()
    one, two = book.book.of(model()), book.book.of(model())
    assert one.budget is two.budget


async def test_the_preferred_replica_takes_the_first_try_while_it_admits_whatever_its_load() -> None:
    p = pool(3, balance="p2c")
    busy = p.replicas[2]
    busy.in_flight = 50  # far above the others: p2c would never choose it
    attempts = Attempts(p, prefer=busy.url)
    first = await attempts.next()
    assert first is not None and first.replica is busy
    first.__exit__()
    lease = p.lease_on(busy)
    lease.failure("down")  # its breaker opens (failures: 1)
    lease.__exit__()
    second = await Attempts(p, prefer=busy.url).next()
    assert second is not None and second.replica is not busy  # not admitting: another one
    second.__exit__()

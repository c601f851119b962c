"""The retry budget and the backoff."""

from __future__ import annotations

import random

from gateway.config import RetryConfig
from gateway.upstream.retries import RetryBudget, backoff


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_the_budget_is_a_fraction_of_the_last_10_s_of_requests_plus_a_floor_per_second() -> None:
    clock = Clock()
    budget = RetryBudget(clock)
    config = RetryConfig(budget=0.2, min_per_s=0.5)  # a floor of 5 retries per window
    for _ in range(50):
        budget.request()
    assert sum(budget.withdraw(config) for _ in range(20)) == 15  # 0.2 * 50 + 5
    clock.now += 5
    for _ in range(10):
        budget.request()
    assert sum(budget.withdraw(config) for _ in range(20)) == 2  # 0.2 * 60 + 5 = 17
    clock.now += 5.5  # the first burst left the window
    assert sum(budget.withdraw(config) for _ in range(20)) == 5  # 0.2 * 10 + 5 - 2
    assert not RetryBudget(clock).withdraw(RetryConfig(budget=0, min_per_s=0))


def test_backoff_is_jittered_exponential_and_capped() -> None:
    config = RetryConfig(backoff_s=0.1, max_backoff_s=0.35)
    rng = random.Random(1)
    for retry, ceiling in ((1, 0.1), (2, 0.2), (3, 0.35), (6, 0.35)):
        waits = [backoff(retry, config, rng) for _ in range(200)]
        assert all(ceiling / 2 <= w <= ceiling for w in waits)
        assert max(waits) - min(waits) > ceiling / 4  # jittered
    assert backoff(1, RetryConfig(backoff_s=0), rng) == 0

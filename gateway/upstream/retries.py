"""When a failed attempt is tried again, and how long to wait first.

A request is retried on another replica only when nothing of the answer reached the client yet,
and only for failures where the engine did no work or refused it: a connect error, a reset
before the response, or a status in ``retries.on_status`` (429, 502, 503, 504 by default; 500 only
where configured, since it may be the request's own fault). A read timeout is not retried: the
engine may still be generating, and a second try doubles the load it was too slow for.

The retry budget (Finagle's, as Envoy and linkerd use it): over the last :data:`WINDOW_S`
seconds, a model's retries are at most ``retries.budget`` of its requests, plus
``retries.min_per_s`` per second so that a model with little traffic can still retry. An outage
then costs a bounded fraction of extra load instead of multiplying it by the attempts. A refused
connection is retried without touching the budget: nothing reached an engine.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Callable

from ..config import ModelConfig, RetryConfig
from ..metrics import GatewayMetrics

WINDOW_S = 10


class RetryBudget:
    """Requests and retries of one model over the last :data:`WINDOW_S` seconds, in 1 s slots."""

    __slots__ = ("_clock", "_slots")

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._slots = [[-WINDOW_S, 0, 0] for _ in range(WINDOW_S)]  # [second, requests, retries]

    def request(self) -> None:
        self._slot()[1] += 1

    def withdraw(self, config: RetryConfig) -> bool:
        """Take one retry from the budget; False (and nothing taken) when it is spent."""
        now = int(self._clock())
        requests = retries = 0
        for second, req, ret in self._slots:
            if now - second < WINDOW_S:
                requests += req
                retries += ret
        if retries >= config.budget * requests + config.min_per_s * WINDOW_S:
            return False
        self._slot()[2] += 1
        return True

    def _slot(self) -> list[int]:
        second = int(self._clock())
        slot = self._slots[second % WINDOW_S]
        if slot[0] != second:
            slot[:] = [second, 0, 0]
        return slot


def backoff(retry: int, config: RetryConfig, rng: random.Random) -> float:
    """Seconds to wait before retry number ``retry`` (1-based): jittered, exponential, capped."""
    ceiling = min(config.max_backoff_s, config.backoff_s * 2.0 ** (retry - 1))
    return ceiling / 2 + rng.uniform(0, ceiling / 2)


class Retries:
    """A model's retries as one request meets them: its ``retries:`` rules, its budget (shared by
    every request of the model), the counters, and the backoff's draws and sleep."""

    __slots__ = ("_book", "budget", "config", "model")

    def __init__(self, book: RetryBook, model: str, config: RetryConfig, budget: RetryBudget) -> None:
        self._book, self.model, self.config, self.budget = book, model, config, budget

    def withdraw(self, reason: str) -> bool:
        """One retry taken from the budget, counted as taken (by ``reason``) or as refused."""
        if not self.budget.withdraw(self.config):
            self._book.metrics.retries_refused.labels(self.model).inc()
            return False
        self.count(reason)
        return True

    def count(self, reason: str) -> None:
        """A retry that costs no budget (nothing reached the replica), counted."""
        self._book.metrics.retries.labels(self.model, reason).inc()

    def backoff(self, retry: int) -> float:
        return backoff(retry, self.config, self._book.rng)

    def sleep(self, seconds: float) -> Awaitable[None]:
        return self._book.sleep(seconds)


class RetryBook:
    """Every model's retry budget, kept by name across reloads, for every client that sends a
    model work (the upstream hop, transcription): one budget a model, whoever retries."""

    def __init__(
        self,
        metrics: GatewayMetrics,
        *,
        clock: Callable[[], float] = time.monotonic,
        rng: random.Random | None = None,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        self.metrics, self.rng, self.sleep = metrics, rng or random.Random(), sleep
        self._clock = clock
        self._budgets: dict[str, RetryBudget] = {}
        self._retries: dict[str, Retries] = {}  # by model name: made again when a reload changes its rules

    def of(self, model: ModelConfig) -> Retries:
        """The model's retries for one request, which counts in its budget."""
        retries = self._retries.get(model.name)
        if retries is None or retries.config is not model.retries:
            budget = self._budgets.get(model.name) or self._budgets.setdefault(model.name, RetryBudget(self._clock))
            retries = self._retries[model.name] = Retries(self, model.name, model.retries, budget)
        retries.budget.request()
        return retries

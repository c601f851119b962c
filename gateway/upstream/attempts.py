"""The one attempt loop: how a piece of work goes through a pool of replicas, whoever sends it.

The upstream hop (:mod:`gateway.upstream.client`), the encoder backends
(:mod:`gateway.encode.client`), vLLM's encoder instances (:mod:`gateway.encode.epd`) and the
transcription model's upstreams (:mod:`gateway.media.transcribe`) all go through it::

    attempts = Attempts(pool, retries=book.of(model), deadline=...)
    while (lease := await attempts.next()) is not None:
        with lease:
            try:
                reply = await send(lease.replica.url)
            except CLIENT_ERRORS as exc:
                failure = attempts.failed(lease, exc)      # read, logged, told to the breaker
                if attempts.again(failure.outcome, free=failure.kind == "connect"):
                    continue                               # the next replica
                raise ...
            ...
            return reply
    raise attempts.failure or ...                          # no replica left, or out of time

What is decided here, once for all of them:

- **the replica**: the pool's choice (``key``: affinity), never one tried already; ``panic``: with
  no replica admitting work, the first try goes anyway (a URL may be a fleet behind a Service);
- **the lease** it is sent under (its load, and its outcome for the breaker);
- **the failure read** from a client error (:mod:`gateway.upstream.failures`);
- **whether to go on**: ``retries`` (a model's :class:`~gateway.upstream.retries.Retries`) allows
  ``retries.attempts`` counted retries within the model's retry budget, each after its backoff;
  without it (idempotent work that costs no engine its generation: encoding, priming) every
  replica is tried once. A ``free`` retry (nothing reached the replica) spends nothing. Every
  retry is counted by its reason in ``gateway_retries_total``, every refusal by the budget in
  ``gateway_retries_refused_total``;
- **the deadline** (loop time) over every try: no backoff waits past it, no try starts after it
  (:attr:`Attempts.expired`).
"""

from __future__ import annotations

import asyncio
import logging

from ..errors import GatewayError
from .failures import ClientFailure, Failure, failure_of
from .replicas import Lease, Pool, Replica
from .retries import Retries

log = logging.getLogger(__name__)


class Attempts:
    """One piece of work's way through ``pool``; see the module docstring."""

    __slots__ = ("_delay", "_retries", "deadline", "failure", "key", "panic", "pool", "prefer", "retried", "tried")

    def __init__(
        self,
        pool: Pool,
        *,
        retries: Retries | None = None,
        key: bytes | None = None,
        panic: bool = False,
        deadline: float | None = None,
        prefer: str | None = None,
    ) -> None:
        self.pool, self.key, self.panic, self.deadline = pool, key, panic, deadline
        self.prefer = prefer  # the replica that alone can serve it (a stored response's), while it admits
        self._retries = retries
        self.tried: list[Replica] = []
        self.retried = 0  # retries that counted (a free one does not)
        self.failure: GatewayError | None = None  # what the caller tells the client when none is left
        self._delay = 0.0  # the backoff before the next try

    async def next(self) -> Lease | None:
        """The lease for the next try, once the backoff of a retry is waited; None when no
        replica is left to try, or the deadline passed."""
        if self._delay:
            assert self._retries is not None
            await self._retries.sleep(self._delay)
            self._delay = 0.0
        return self.take()

    @property
    def waits(self) -> bool:
        """Whether the next try waits for a retry's backoff first (:meth:`next`); without one,
        :meth:`take` gives it at once (on a request's path: no coroutine of ``next``'s)."""
        return self._delay > 0

    def take(self) -> Lease | None:
        """The lease for the next try now, no backoff waited; None when no replica is left to
        try, or the deadline passed."""
        if self.expired:
            return None
        lease = self.pool.lease(exclude=self.tried, key=self.key, panic=self.panic, prefer=self.prefer)
        if lease is not None:
            self.tried.append(lease.replica)
        return lease

    def place(self) -> Replica | None:
        """The replica the next try would go to, taken as tried, without a lease (the caller
        sends several pieces of work together under a lease of its own: vLLM priming)."""
        replica = self.pool.choose(exclude=self.tried, key=self.key, panic=self.panic)
        if replica is not None:
            self.tried.append(replica)
        return replica

    def failed(self, lease: Lease, exc: ClientFailure) -> Failure:
        """:func:`failed`, said of this work's pool."""
        return failed(lease, exc, self.pool.name)

    def again(self, reason: str, *, free: bool = False, anew: bool = False) -> bool:
        """Whether the work whose try just failed for ``reason`` is tried once more; counted
        either way it goes. ``free``: nothing reached the replica (no retry is spent). ``anew``:
        the failure was not the replica's (vLLM's EC consumer missed an embedding), so every
        replica may take the next try, the one that failed too."""
        retries = self._retries
        if retries is None:  # each replica once
            return True
        if anew:  # no backoff either: no replica is to be spared
            if self.retried >= retries.config.attempts or not retries.withdraw(reason):
                return False
            self.retried += 1
            self.tried.clear()
            return True
        elif not self.pool.available(exclude=self.tried):
            return False
        elif free:
            retries.count(reason)
            return True
        elif self.retried >= retries.config.attempts or not retries.withdraw(reason):
            return False
        self.retried += 1
        self._delay = retries.backoff(self.retried)
        if self.deadline is not None:  # no wait past the deadline
            self._delay = min(self._delay, max(0.0, self.deadline - asyncio.get_running_loop().time()))
        return True

    def left(self) -> float | None:
        """Seconds to the deadline (None: none), never below 0."""
        if self.deadline is None:
            return None
        return max(0.0, self.deadline - asyncio.get_running_loop().time())

    @property
    def expired(self) -> bool:
        return self.deadline is not None and asyncio.get_running_loop().time() >= self.deadline


def failed(lease: Lease, exc: ClientFailure, pool: str) -> Failure:
    """A client error of the try under ``lease``, read, logged (``pool``: the model or encoder
    whose replica it is) and reported to the replica's breaker."""
    failure = failure_of(exc)
    log.warning("%s replica %s: %s", pool, lease.replica.url, failure.reason)
    lease.failure(failure.reason)
    return failure

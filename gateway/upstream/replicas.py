"""Replica pools: which replica takes a request, how loaded and how healthy each one is.

One pool serves a model's upstreams or an encoder's backends; both clients use it the same way::

    with pool.lease(exclude=tried) as lease:   # None when no replica admits a request now
        ...send to lease.replica.url...
        lease.success()  or  lease.failure("connection refused")

A lease counts the request in flight on its replica from the moment it is taken until the block
ends, whatever happens in it; nobody counts by hand.

**Health** is a circuit breaker per replica, kept by URL in a :class:`ReplicaSet` (so it survives
reloads, and a URL two pools share has one state)::

    closed ──(breaker.failures consecutive failures)──► open ──(breaker.open_s)──► half_open
      ▲                                                   ▲                           │
      └────────(breaker.successes consecutive successes)──┼───────────────────────────┤
                                                          └──────(one failure)────────┘

Half-open lets one request through at a time, as a probe. A failure is what the caller reports:
a connect error or timeout, a reset, a read timeout, a 5xx. An open replica is not chosen; when no
replica of a pool admits a request, :meth:`Pool.lease` gives None and :meth:`Pool.retry_after`
says when one will. A replica that answered 429 is passed over for its ``Retry-After`` (1 s
if it gave none, 30 s at most) while others are free. Active health checks, where a model has
them (:mod:`gateway.upstream.health`), also take a replica out (``checked_down``) until a probe succeeds.

**Choice** (``balance``), among the replicas that admit a request and were not tried yet:

- ``p2c`` (default): two replicas drawn at random, in proportion to their weights; the one with
  fewer requests in flight per unit of weight takes it. Least-loaded without herding: every
  gateway replica does not pile onto the same "least loaded" engine at once.
- ``round_robin``: smooth weighted round robin (nginx's): turns in proportion to the weights,
  evenly interleaved.
- ``affinity``: requests with the same affinity key (:mod:`gateway.admission.affinity`: the conversation's
  opening, its first image included) go to the same replica, so that the engine's prefix and
  multimodal caches hit turn after turn. Consistent hashing with bounded loads (Mirrokni,
  Thorup, Zadimoghaddam 2018): the key's point on a ring of virtual nodes (``VNODES`` per unit
  of weight), then clockwise to the first replica whose requests in flight per unit of weight stay
  within ``AFFINITY_LOAD`` times the mean. A request with no key falls back to ``p2c``.
"""

from __future__ import annotations

import bisect
import hashlib
import math
import random
import time
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass
from typing import Literal

from ..config import BALANCE_POLICIES, BreakerConfig

BreakerState = Literal["closed", "open", "half_open"]
BREAKER_STATES: tuple[BreakerState, ...] = ("closed", "half_open", "open")
DEFAULT_BREAKER = BreakerConfig()
VNODES = 64  # ring points per unit of weight
AFFINITY_LOAD = 1.25  # the most in flight a replica takes for its keys, relative to the mean


@dataclass(eq=False, slots=True)
class Replica:
    """One URL's load and health; shared by every pool that lists the URL."""

    url: str
    in_flight: int = 0
    state: BreakerState = "closed"
    failures: int = 0  # consecutive, while closed
    successes: int = 0  # consecutive, while half-open
    opened_at: float = 0.0
    probes: int = 0  # half-open requests in flight
    epoch: int = 0  # how many times the breaker opened: outcomes of leases from before are stale
    last_error: str = ""
    current_weight: float = 0.0  # smooth weighted round robin
    busy_until: float = 0.0  # answered 429: passed over until then while others are free
    probe_failures: int = 0  # consecutive failed active health checks (gateway.upstream.health)
    checked_down: bool = False  # out until an active health check succeeds

    @property
    def healthy(self) -> bool:
        return self.state != "open" and not self.checked_down

    def admits(self, now: float, breaker: BreakerConfig) -> bool:
        if self.checked_down:
            return False
        if self.state == "open":
            if now < self.opened_at + breaker.open_s:
                return False
            self.state, self.successes = "half_open", 0
        return self.state == "closed" or self.probes == 0

    def succeeded(self, breaker: BreakerConfig) -> None:
        self.failures = 0
        if self.state == "half_open":
            self.successes += 1
            if self.successes >= breaker.successes:
                self.state, self.last_error = "closed", ""

    def failed(self, now: float, breaker: BreakerConfig, reason: str) -> bool:
        """Count a failure; True when it opened the breaker."""
        self.last_error = reason
        if self.state == "half_open" or (self.state == "closed" and self.failures + 1 >= breaker.failures):
            self.state, self.opened_at, self.failures = "open", now, 0
            self.epoch += 1
            return True
        if self.state == "closed":
            self.failures += 1
        return False


class Lease:
    """A replica taken for one attempt; see the module docstring.

    Its outcome counts only for the breaker state it was taken in: a request sent before the
    breaker opened says nothing about the replica since (``epoch``), and while half-open only the
    probe's outcome counts. A probe frees its place as soon as its outcome is known (the response
    headers), not at the end of a long stream."""

    __slots__ = ("_epoch", "_holds_probe", "_pool", "_probe", "replica")

    def __init__(self, pool: Pool, replica: Replica, *, probe: bool) -> None:
        self._pool, self.replica, self._probe, self._epoch = pool, replica, probe, replica.epoch
        self._holds_probe = probe
        replica.in_flight += 1
        if probe:
            replica.probes += 1

    def __enter__(self) -> Lease:
        return self

    def __exit__(self, *exc: object) -> None:
        self.replica.in_flight -= 1
        self._end_probe()

    def success(self) -> None:
        replica = self.replica
        if replica.epoch == self._epoch and (self._probe or replica.state == "closed"):
            replica.succeeded(self._pool.breaker)
        self._end_probe()

    def busy(self, seconds: float) -> None:
        """The replica answered 429: pass it over for ``seconds`` (no breaker failure)."""
        self.replica.busy_until = self._pool.clock() + seconds

    def failure(self, reason: str) -> None:
        replica = self.replica
        if replica.epoch == self._epoch and (self._probe or replica.state == "closed"):
            if replica.failed(self._pool.clock(), self._pool.breaker, reason):
                self._pool.on_open(self._pool.name, replica.url)
        self._end_probe()

    def _end_probe(self) -> None:
        if self._holds_probe:
            self._holds_probe = False
            self.replica.probes -= 1


class Pool:
    """The replicas of one model (or encoder) in one config generation, and how to choose."""

    def __init__(
        self,
        name: str,
        replicas: Sequence[Replica],
        *,
        weights: Sequence[int] = (),
        balance: str = "p2c",
        breaker: BreakerConfig = DEFAULT_BREAKER,
        owner: ReplicaSet | None = None,
    ) -> None:
        if balance not in BALANCE_POLICIES:
            raise ValueError(f"unknown balance {balance!r}")
        self.name, self.replicas, self.balance, self.breaker = name, tuple(replicas), balance, breaker
        self.weights = tuple(weights) or (1,) * len(self.replicas)
        owner = owner or ReplicaSet()  # the clock, the draws and the breaker's listener
        self.clock, self.on_open, self._rng = owner.clock, owner.on_open, owner.rng
        self._weight = {id(r): w for r, w in zip(self.replicas, self.weights, strict=True)}
        self._ring: list[tuple[int, int]] = []  # (point, replica index), sorted; affinity only
        if balance == "affinity":
            self._ring = sorted(
                (_point(f"{r.url}#{v}".encode()), i)
                for i, (r, w) in enumerate(zip(self.replicas, self.weights, strict=True))
                for v in range(VNODES * w)
            )

    def lease(
        self,
        exclude: Collection[Replica] = (),
        *,
        key: bytes | None = None,
        panic: bool = False,
        prefer: str | None = None,
    ) -> Lease | None:
        """A lease on the replica that should take the next attempt; None if none admits one.
        ``key``: the request's affinity key (used by ``balance: affinity``). ``panic``: when no
        replica admits one, take one anyway (Envoy's panic routing: better a try than nothing).
        ``prefer``: the URL of the one replica that can serve it (a stored response's), whenever
        it admits a request, whatever its load."""
        chosen = self.choose(exclude, key=key, panic=panic, prefer=prefer)
        return None if chosen is None else Lease(self, chosen, probe=chosen.state == "half_open" and chosen.probes == 0)

    def lease_on(self, replica: Replica) -> Lease:
        """A lease on a replica chosen before (:meth:`choose`); the probe, if it is half-open and free."""
        return Lease(self, replica, probe=replica.state == "half_open" and replica.probes == 0)

    def choose(
        self,
        exclude: Collection[Replica] = (),
        *,
        key: bytes | None = None,
        panic: bool = False,
        prefer: str | None = None,
    ) -> Replica | None:
        """The replica :meth:`lease` would lease, without a lease: nothing counted on it."""
        now = self.clock()
        candidates = [r for r in self.replicas if r not in exclude and r.admits(now, self.breaker)]
        if not candidates and panic and not exclude:
            candidates = list(self.replicas)
        if not candidates:
            return None
        if prefer is not None:
            for r in candidates:
                if r.url == prefer:
                    return r
        # an engine that said 429 answers fast and so looks idle: without this it would draw the load
        candidates = [r for r in candidates if r.busy_until <= now] or candidates
        if self.balance == "round_robin":
            return self._round_robin(candidates)
        if self.balance == "affinity" and key is not None:
            return self._affinity(candidates, key)
        return self._p2c(candidates)

    def available(self, exclude: Collection[Replica] = ()) -> bool:
        """Whether :meth:`lease` would find a replica now."""
        now = self.clock()
        return any(r not in exclude and r.admits(now, self.breaker) for r in self.replicas)

    def retry_after(self) -> int:
        """Whole seconds until an open replica lets a probe through (at least 1)."""
        now = self.clock()
        waits = [r.opened_at + self.breaker.open_s - now for r in self.replicas if r.state == "open"]
        return max(1, math.ceil(min(waits, default=1.0)))

    def _p2c(self, candidates: list[Replica]) -> Replica:
        if len(candidates) == 1:
            return candidates[0]
        weights = [self._weight[id(r)] for r in candidates]
        first = self._rng.choices(range(len(candidates)), weights)[0]
        rest = [i for i in range(len(candidates)) if i != first]
        second = self._rng.choices(rest, [weights[i] for i in rest])[0]
        a, b = candidates[first], candidates[second]
        return b if b.in_flight * weights[first] < a.in_flight * weights[second] else a

    def _affinity(self, candidates: list[Replica], key: bytes) -> Replica:
        weights = {id(r): self._weight[id(r)] for r in candidates}
        # the bound, per unit of weight, counting this request
        bound = AFFINITY_LOAD * (sum(r.in_flight for r in candidates) + 1) / sum(weights.values())
        start = bisect.bisect(self._ring, (_point(key), -1))
        for step in range(len(self._ring)):
            replica = self.replicas[self._ring[(start + step) % len(self._ring)][1]]
            weight = weights.get(id(replica))
            if weight is not None and replica.in_flight + 1 <= math.ceil(bound * weight):
                return replica
        return self._p2c(candidates)  # not reached: some candidate is always within the bound

    def _round_robin(self, candidates: list[Replica]) -> Replica:
        total = 0
        for r in candidates:
            weight = self._weight[id(r)]
            r.current_weight += weight
            total += weight
        chosen = max(candidates, key=lambda r: r.current_weight)
        chosen.current_weight -= total
        return chosen


class ReplicaSet:
    """Every replica's state, by URL, for the life of the gateway; makes the pools of each generation."""

    def __init__(
        self,
        *,
        clock: Callable[[], float] = time.monotonic,
        rng: random.Random | None = None,
        on_open: Callable[[str, str], None] = lambda pool, url: None,
    ) -> None:
        self._by_url: dict[str, Replica] = {}
        self.clock, self.on_open = clock, on_open
        self.rng = rng or random.Random()

    def pool(
        self,
        name: str,
        urls: Sequence[str],
        *,
        weights: Sequence[int] = (),
        balance: str = "p2c",
        breaker: BreakerConfig = DEFAULT_BREAKER,
    ) -> Pool:
        replicas = [self._by_url.get(u) or self._by_url.setdefault(u, Replica(u)) for u in urls]
        return Pool(name, replicas, weights=weights, balance=balance, breaker=breaker, owner=self)

    def retain(self, urls: Iterable[str]) -> None:
        """Forget the URLs no pool lists any more (a request still holding one keeps its object)."""
        keep = set(urls)
        self._by_url = {u: r for u, r in self._by_url.items() if u in keep}

    def snapshot(self) -> list[dict[str, object]]:
        return [
            {"url": u, "in_flight": r.in_flight, "healthy": r.healthy, "breaker": r.state, "last_error": r.last_error}
            for u, r in sorted(self._by_url.items())
        ]


def _point(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big")

"""A process's lease of one key's shared limits (``server.limits_store``), so that a keyed request
costs a local check, not a round trip to the store.

A key without ``max_concurrency`` (whose requests in flight need no count across processes) is
held so, in each process:

- **requests** (``requests_per_minute``): a slice of the key's bucket is taken from the store at
  once (the LEASE script of gateway.admission.scripts) and spent here, a request each. The slice is
  what this process spends in HORIZON_S at its own rate, and at most ERROR of the key's allowance
  (its burst and a second of refill) divided among the live processes: a slice taken before a
  window and spent in it is the most a key can get past its limit, so over every process the key
  gets at most ERROR more than its limit, or a request a process for a key too small for that
  (and the slices are taken out of the same bucket: never more than it holds). A slice is
  renewed ahead of need (half spent, in the background), and what is left unspent HOLD_S after
  it was taken goes back to the store. When the store had no request to give, the key is
  refused here until its bucket would hold one again, without asking.
- **token budgets** (``tokens_per_minute``, ``tokens_per_day``): their levels as last read, refilled
  here at their rate, less what replies cost here since (each spent as it ends, as a process's
  own buckets are); what they cost is written back within SYNC_S (with the next renewal, or by a
  lease of its own; SYNC_S after a lease the store is slow to answer), and levels older than SYNC_S
  are read again (both with the next lease), in the background; levels older than TRUSTED_S (an
  idle key, or a store that fails: then its ``on_failure`` answers) are read before the request.
  A budget holds across processes to what they spent in the last SYNC_S (they are spent after
  each reply anyway).

A request's visual tokens, once known, are held to those budgets here too (:meth:`Leases.budgets`),
unless the key has a ``visual_tokens_per_minute``: that bucket is spent by one script a request
(gateway.admission.shared). A key with ``max_concurrency`` keeps one script a request (admission,
then the end): a slot kept by a process between its requests would refuse another process's
request while it sat unused (a key of ``max_concurrency: 1`` used by one client in turn over two
processes would be refused half the time)."""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Awaitable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from ..config import ApiKey, RateLimit
from .auth import DAY_S, NO_LIMITS, Said, requests_verdict, tokens_verdict
from .scripts import arg

# a slice is what this process spends of a key in this long: a busy key renewed every half of it,
# in step with its levels' SYNC_S (one script a SYNC_S does both: each is ~120 µs of redis-py)
HORIZON_S = 0.2
HOLD_S = 0.25  # requests leased and unspent this long go back to the store
SYNC_S = 0.1  # token budgets' levels are read again, and what was spent written, at least this often
TRUSTED_S = 1.0  # levels older than this (the store failing, or a key idle) are read before a request
ERROR = 0.025  # the slices, over all processes: at most this share of a key's burst and a second's refill
RATE_WINDOW_S = 0.1  # a key's request rate here is counted over windows this long
RETRY_S = 1.0  # what a failed lease did not write is written again after this long
SLICE_EVERY = 16  # a slice's size (for when to renew) is worked out again every so many requests of a window
# The leases' clock on a request's path: read without asking for the loop, whose
# asyncio.get_running_loop() is a getpid system call in CPython 3.11 (it checks the loop is this
# process's), two a keyed request otherwise. What the leases' timers compare (``held_at``) is on
# the loop's own clock, off the path: uvloop's is libuv's, in whole milliseconds, and a timer set
# for HOLD_S may fire a little before HOLD_S of this one has passed; a hold within CLOCK_SLACK_S
# of HOLD_S has lapsed.
clock = time.monotonic
CLOCK_SLACK_S = 0.002


@dataclass(slots=True)
class Lease:
    """One key's lease in this process."""

    key: ApiKey | None = None  # the key, as the generation of its last request has it
    held: int = 0  # requests taken from the store, not spent yet
    held_at: float = 0.0  # when they were taken: the loop's clock, its timers' (off the request's path)
    left: float = 0.0  # the store's requests left after the last lease
    # the token budgets' levels at ``levels_at``, as this process knows them: the last lease's read,
    # refilled since and less what replies cost here since, each when it was spent
    minute: float | None = None
    day: float | None = None
    levels_at: float = 0.0
    synced_at: float = -math.inf  # when the last lease answered
    unsynced: int = 0  # tokens replies cost here since, not written yet
    sent_at: float = -math.inf  # when the last lease went, with what was spent until then (the loop's clock)
    empty_until: float = 0.0  # the store had no request to give: none is asked for until then
    rate: float = 0.0  # requests a second here, over the last window
    window_at: float = 0.0  # the current window's start
    seen: int = 0  # its requests (counted as each is admitted)
    cut: float = 0.0  # renewed ahead of need below this many held: half a slice, seen anew every SLICE_EVERY
    cut_next: int = 0  # the window's count at which it is (0 at a window's start: its first request)
    syncing: asyncio.Task[bool] | None = None  # the lease under way
    waiting: int = 0  # requests waiting for it
    flush: asyncio.TimerHandle | None = None  # what replies cost, to be written
    said: Said = field(default_factory=Said)  # the last answer's x-ratelimit-* headers

    def count(self, now: float) -> None:
        """One more request of the key here: in its window, or the first of a new one."""
        if now - self.window_at >= RATE_WINDOW_S:
            self.rate = self.seen / (now - self.window_at) if self.seen > 0 else 0.0
            self.window_at, self.seen, self.cut_next = now, 1, 0
        else:
            self.seen += 1

    def slice(self, limit: RateLimit, members: int, now: float) -> int:
        """How many requests a lease takes: HORIZON_S of this process's rate (the last window's,
        or the current one's so far, if higher: a key that turns busy is seen so at once), within
        its share of the error the key may have (one at least)."""
        assert limit.requests_per_minute is not None
        allowance = limit.burst + limit.requests_per_minute / 60
        most = max(1, int(ERROR * allowance / max(1, members)))
        rate = max(self.rate, self.seen / max(now - self.window_at, RATE_WINDOW_S / 10))
        return max(1, min(most, math.ceil(rate * HORIZON_S)))

    def levels(self, limit: RateLimit, now: float) -> tuple[float, float]:
        """The token budgets' levels now, as this process knows them: the last read, refilled
        since at their rates (to their capacity), less what replies cost here since (0 for a
        budget the key has not, or not read yet)."""
        elapsed = now - self.levels_at if now > self.levels_at else 0.0
        minute = day = 0.0
        if (budget := limit.tokens_per_minute) is not None and self.minute is not None:
            minute = self.minute + elapsed * budget / 60
            minute = minute if minute < budget else budget
        if (budget := limit.tokens_per_day) is not None and self.day is not None:
            day = self.day + elapsed * budget / DAY_S
            day = day if day < budget else budget
        return minute, day

    def spend(self, limit: RateLimit, tokens: int, now: float) -> None:
        """A reply's ``tokens``, spent of the levels here as it ends (as a process's own buckets
        are: a budget refilled to its capacity between two replies is full at the second)."""
        minute, day = self.levels(limit, now)
        if limit.tokens_per_minute is not None and self.minute is not None:
            self.minute = minute - tokens
        if limit.tokens_per_day is not None and self.day is not None:
            self.day = day - tokens
        self.levels_at = now

    def knows(self, limit: RateLimit) -> bool:
        """Whether the key's token budgets were read (since the last settle, and as the key has
        them now: a reload may have given it one)."""
        return (
            self.synced_at > -math.inf
            and (limit.tokens_per_minute is None or self.minute is not None)
            and (limit.tokens_per_day is None or self.day is not None)
        )

    def spent(self, limit: RateLimit, now: float) -> bool:
        """Whether one of the key's token budgets is spent, as this process knows them."""
        minute, day = self.levels(limit, now)
        return (limit.tokens_per_minute is not None and minute < 1) or (limit.tokens_per_day is not None and day < 1)

    def taken(self, now: float, taken: int, left: float, per_s: float, held_at: float) -> None:
        """A lease's requests: held from now (``held_at`` on the loop's clock); none given, none
        asked for until one would be."""
        if taken:
            self.held += taken
            self.held_at = held_at
        self.left = left
        if self.held < 1:
            self.empty_until = now + max(0.0, 1 - left) / per_s


class Store(Protocol):
    """What the leases ask of the store (gateway.admission.shared.SharedLimits)."""

    members: int  # the live gateway processes

    @property
    def closed(self) -> bool: ...

    def renew(self, op: str, key: ApiKey, args: list[str]) -> Awaitable[list[str] | None]: ...

    def track(self, task: asyncio.Task[Any]) -> None: ...

    def failed(self) -> dict[str, str]: ...

    def end(self, key: ApiKey, tokens: int, member: str | None) -> None: ...


class Leases:
    """Every key's lease in this process (the module's docstring), renewed through ``store``."""

    def __init__(self, store: Store) -> None:
        self._store = store
        self._by_name: dict[str, Lease] = {}

    def __getitem__(self, name: str) -> Lease:
        """The lease of the key of this name (KeyError: none yet)."""
        return self._by_name[name]

    def finish(self, key: ApiKey, tokens: int, member: str | None = None) -> None:
        """A request's end (gateway.admission.shared's ``finish``, this itself: no call between):
        its reply's tokens, spent here and written within SYNC_S (:meth:`_write_spent` says when),
        of the budgets the key has now: under the newest limits (its last request's generation),
        so that a request admitted before a reload that raised a budget does not cap the level
        read since at the older one, nor one admitted before a reload that gave the key its
        budget go uncounted (a key with limits when it came: one with none then is not asked of
        them at all, as in a process's own, gateway.server.middlewares). A key with
        ``max_concurrency`` ends in the store (``member``: its slot)."""
        if key.max_concurrency is not None:
            self._store.end(key, tokens, member)
            return
        if tokens <= 0:
            return
        lease = self._by_name.get(key.name)
        if lease is None:  # a key never leased here (no limits when it came): nothing to spend of
            return
        limit = (lease.key or key).rate_limit
        if limit is None or (limit.tokens_per_minute is None and limit.tokens_per_day is None):
            return
        lease.spend(limit, tokens, clock())
        lease.unsynced += tokens
        if lease.flush is None:
            lease.flush = asyncio.get_running_loop().call_later(SYNC_S, self._write_spent, key, lease)

    def _lease(self, key: ApiKey) -> Lease:
        lease = self._by_name.get(key.name)
        if lease is None:
            lease = self._by_name[key.name] = Lease()
        lease.key = key  # the generation's: a reload may change the key's limits
        return lease

    def admit_now(self, key: ApiKey) -> tuple[Mapping[str, str], None] | None:
        """A request of the key admitted at once (gateway.admission.shared's ``admit_now``, this
        itself: no call between): from its lease, as in the common case (requests held here, the
        budgets' levels read lately), or with nothing to hold it to (no requests rate, no token
        budget); its x-ratelimit-* headers, or its refusal. None where the store must be asked
        first (:meth:`admit`), as for a key with ``max_concurrency`` (one script a request).
        The front door asks this without a coroutine (gateway.server.middlewares)."""
        if key.max_concurrency is not None:
            return None
        if (limit := key.rate_limit) is None:
            return NO_LIMITS
        budgets = limit.tokens_per_minute is not None or limit.tokens_per_day is not None
        if limit.requests_per_minute is None and not budgets:
            return NO_LIMITS
        lease = self._by_name.get(key.name)
        if lease is None:  # the key's first request here
            return None
        lease.key = key  # (as _lease: straight through, a call less on every keyed request)
        now = clock()
        if budgets and (now - lease.synced_at > TRUSTED_S or not lease.knows(limit)):
            return None
        if (limit.requests_per_minute is not None and lease.held < 1 and now >= lease.empty_until
                and not (budgets and lease.spent(limit, now))):  # fmt: skip
            return None
        return self._admitted(key, lease, limit, budgets, now), None

    async def admit(self, key: ApiKey, limit: RateLimit, budgets: bool) -> Mapping[str, str]:
        """A request admitted from the key's lease: the store asked only when this process has
        nothing to go on (no request left here and the store may have one; the budgets never
        read), and ahead of need otherwise, off the request's path."""
        lease = self._lease(key)
        now = clock()  # (read again after each wait)
        rpm = limit.requests_per_minute
        lease.count(now)  # seen while it waits (a lease it starts is sized for it); counted again as admitted
        try:
            for _ in range(2):  # (a lease under way for the key of an earlier generation may not read them)
                if not budgets or (lease.knows(limit) and now - lease.synced_at <= TRUSTED_S):
                    break
                if not await self._renewed(key, lease):
                    return self._store.failed()
                now = clock()
            # the store asked again while it has requests that others waiting took first, and the
            # key's token budgets hold (a spent one refuses below)
            while rpm is not None and lease.held < 1 and now >= lease.empty_until:
                if budgets and lease.spent(limit, now):
                    break
                if not await self._renewed(key, lease):
                    return self._store.failed()
                now = clock()
        finally:
            lease.seen = max(0, lease.seen - 1)  # (a window begun meanwhile counts from 1)
        return self._admitted(key, lease, limit, budgets, now)

    def _admitted(self, key: ApiKey, lease: Lease, limit: RateLimit, budgets: bool, now: float) -> Mapping[str, str]:
        """The request, its lease asked what it needs: renewed ahead of need, off its path (its
        budgets' levels older than SYNC_S, or half its slice spent); its headers, or its refusal."""
        rpm = limit.requests_per_minute
        lease.count(now)
        if rpm is not None and (seen := lease.seen) >= lease.cut_next:  # as a window begins, then every so often
            lease.cut = lease.slice(limit, self._store.members, now) / 2
            lease.cut_next = seen + SLICE_EVERY
        if lease.syncing is None and (
            now - lease.synced_at > SYNC_S
            # a key refused is not asked for until it would have one
            or (rpm is not None and now >= lease.empty_until and lease.held < lease.cut)
        ):
            self._renew(key, lease, "admit")
        minute, day = lease.levels(limit, now) if budgets else (0.0, 0.0)
        if budgets and ((limit.tokens_per_minute is not None and minute < 1) or
                        (limit.tokens_per_day is not None and day < 1)):  # fmt: skip
            tokens_verdict(limit, minute, day, 1)  # raises
        left = None
        if rpm is not None:
            # the key's requests left as this process knows them (for the headers, and a refusal's
            # wait): its own, and the store's at the last lease, refilled since
            left = lease.held + lease.left + (now - lease.synced_at if now > lease.synced_at else 0.0) * rpm / 60
            if not left < limit.burst:
                left = float(limit.burst)
            if lease.held < 1:
                requests_verdict(limit, left, False)  # raises
            lease.held -= 1
            left -= 1
        return lease.said.headers(limit, left, minute, day)

    async def budgets(self, key: ApiKey, limit: RateLimit, need: int) -> dict[str, str]:
        """A request's visual tokens, once known, held to the key's token budgets as this process
        knows them (read first where older than TRUSTED_S, as for a request): their headers, or
        TokensRateLimitedError. Nothing is spent: the reply spends what it cost."""
        lease = self._lease(key)
        now = clock()
        for _ in range(2):
            if lease.knows(limit) and now - lease.synced_at <= TRUSTED_S:
                break
            if lease.syncing is None:
                self._renew(key, lease, "visual", 0)
            assert lease.syncing is not None
            if not await asyncio.shield(lease.syncing):
                return self._store.failed()
            now = clock()
        return tokens_verdict(limit, *lease.levels(limit, now), need)

    async def _renewed(self, key: ApiKey, lease: Lease) -> bool:
        """The lease renewed (one renewal for every request that waits on it, with a request for
        each of those waiting as it went); whether the store answered."""
        lease.waiting += 1
        try:
            if lease.syncing is None:
                self._renew(key, lease, "admit", lease.waiting)
            assert lease.syncing is not None
            return await asyncio.shield(lease.syncing)
        finally:
            lease.waiting -= 1

    def _renew(self, key: ApiKey, lease: Lease, op: str, want: int | None = None) -> None:
        task = asyncio.get_running_loop().create_task(self._sync(key, lease, op, want))
        lease.syncing = task
        self._store.track(task)

    async def _sync(self, key: ApiKey, lease: Lease, op: str, want: int | None, everything: bool = False) -> bool:
        """One LEASE script: what replies cost written, requests held HOLD_S (or, with
        ``everything``, all) given back, a slice taken (``want``: at least so many; 0: none),
        the levels read. Under the key's newest limits (a timer's ``key`` may be of an older
        generation: the store's buckets are capped at what is sent)."""
        key = lease.key or key
        limit = key.rate_limit or RateLimit(None, 1)
        rpm, loop = limit.requests_per_minute, asyncio.get_running_loop()
        now = clock()
        lapsed = loop.time() - lease.held_at >= HOLD_S - CLOCK_SLACK_S
        back = lease.held if rpm is not None and (everything or lapsed) else 0
        lease.held -= back
        wanted = 0
        if rpm is not None and want != 0:
            wanted = max(want or 0, lease.slice(limit, self._store.members, now) - lease.held)
        spent, lease.unsynced, lease.sent_at = lease.unsynced, 0, loop.time()
        args = [arg(rpm), arg(limit.burst), arg(limit.tokens_per_minute), arg(limit.tokens_per_day),
                str(wanted), str(back), str(spent)]  # fmt: skip
        try:
            answer = await self._store.renew(op, key, args)
        finally:
            if lease.syncing is asyncio.current_task():
                lease.syncing = None
        if answer is None:  # written again with the next: a reply's cost is never forgotten
            lease.unsynced += spent
            if lease.unsynced and lease.flush is None and not self._store.closed:
                lease.flush = loop.call_later(RETRY_S, self._write_spent, key, lease)
            if lease.held and not self._store.closed:
                loop.call_later(HOLD_S, self._idle, key, lease)
            return False
        taken, left, minute, day = answer
        # the store's levels, with what it was sent; less what replies cost here since it was
        lease.minute = float(minute) - lease.unsynced if limit.tokens_per_minute is not None else None
        lease.day = float(day) - lease.unsynced if limit.tokens_per_day is not None else None
        lease.synced_at = lease.levels_at = clock()
        if rpm is not None:
            lease.taken(lease.synced_at, int(taken), float(left), rpm / 60, loop.time())
            if lease.held:  # unspent by then: given back
                loop.call_later(HOLD_S, self._idle, key, lease)
        return True

    def _write_spent(self, key: ApiKey, lease: Lease) -> None:
        """What replies cost here, written SYNC_S after the first of it (a lease under way then: SYNC_S
        later again): by a lease of its own only where none went since (a busy key's renewals
        write it; none is added)."""
        lease.flush = None
        if not lease.unsynced or self._store.closed:
            return
        loop = asyncio.get_running_loop()
        now = loop.time()
        if lease.syncing is not None:  # it took what was spent before it went; the rest after it, not
            # before it is answered (a store slower than SYNC_S: no timer a few ms meanwhile)
            lease.flush = loop.call_later(SYNC_S, self._write_spent, key, lease)
        elif now >= lease.sent_at + SYNC_S - CLOCK_SLACK_S:
            self._renew(key, lease, "finish", 0)
        else:  # a lease went since: the rest with the next, or SYNC_S after it (all of it spent after it went)
            lease.flush = loop.call_at(lease.sent_at + SYNC_S, self._write_spent, key, lease)

    def _idle(self, key: ApiKey, lease: Lease) -> None:
        """Requests held HOLD_S unspent: back to the store (the others' now)."""
        if not lease.held or self._store.closed:
            return
        loop = asyncio.get_running_loop()
        if loop.time() - lease.held_at < HOLD_S - CLOCK_SLACK_S:
            return  # taken again since: that take's own timer gives it back
        if lease.syncing is None:
            self._renew(key, lease, "finish", 0)
        else:  # the lease under way gives them back, or takes them again for requests that came
            loop.call_later(HOLD_S, self._idle, key, lease)

    async def settle(self) -> None:
        """Every lease given back and what replies cost written; the levels read again at the
        next request (at close; tests wait on it to see each process's spending in the store)."""
        leases = list(self._by_name.values())
        under_way = [lease.syncing for lease in leases if lease.syncing is not None]
        if under_way:
            await asyncio.wait(under_way)
        ending = []
        for lease in leases:
            if lease.flush is not None:
                lease.flush.cancel()
                lease.flush = None
            if lease.key is not None and (lease.held or lease.unsynced):  # all in one pipeline
                ending.append(self._sync(lease.key, lease, "finish", 0, everything=True))
        await asyncio.gather(*ending)
        for lease in leases:
            lease.synced_at, lease.empty_until = -math.inf, 0.0

"""A process's lease of one key's shared limits (``server.limits_store``), so that a keyed request
costs a local check, not a round trip to the store.

A key without ``max_concurrency`` (whose requests in flight need no count across processes) is
held so, in each process:

- **requests** (``requests_per_minute``): a slice of the key's bucket is taken from the store at
  once (the LEASE script of gateway.admission.scripts) and spent here, a request each. The slice is
  what this process spends in HORIZON_S at its own rate, and at most ERROR of the key's allowance
  (its burst and a second of refill) divided among the live processes: a slice taken before a
  window and spent in it is the most a key can get past its limit, so over every process the key
  gets at most ERROR more than its limit (and the slices are taken out of the same bucket: never
  more than it holds). A slice is renewed ahead of need (half spent, in the background), and what
  is left unspent HOLD_S after it was taken goes back to the store. When the store had no request
  to give, the key is refused here until its bucket would hold one again.
- **token budgets** (``tokens_per_minute``, ``tokens_per_day``): their levels as last read, refilled
  here at their rate, less what replies cost here since; what they cost is written back within
  SYNC_S, and levels older than SYNC_S are read again (both with the next lease). A budget holds
  across processes to what they spent in the last SYNC_S (they are spent after each reply anyway).

A key with ``max_concurrency`` keeps one script a request (admission, then the end), and a
request's visual tokens are one script when known (gateway.admission.shared)."""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass

from ..config import ApiKey, RateLimit
from .auth import DAY_S

HORIZON_S = 0.05  # a slice is what this process spends of a key in this long
HOLD_S = 0.25  # requests leased and unspent this long go back to the store
SYNC_S = 0.1  # token budgets' levels are read again, and what was spent written, at least this often
ERROR = 0.025  # the slices, over all processes: at most this share of a key's burst and a second's refill
RATE_WINDOW_S = 0.1  # a key's request rate here is counted over windows this long


@dataclass(slots=True)
class Lease:
    """One key's lease in this process."""

    key: ApiKey | None = None  # the key, as the generation of its last request has it
    held: int = 0  # requests taken from the store, not spent yet
    held_at: float = 0.0  # when they were taken (the loop's clock)
    left: float = 0.0  # the store's requests left after the last lease
    minute: float | None = None  # the token budgets' levels at the last lease
    day: float | None = None
    synced_at: float = -math.inf  # when the last lease answered
    unsynced: int = 0  # tokens replies cost here since, not written yet
    empty_until: float = 0.0  # the store had no request to give: none is asked for until then
    rate: float = 0.0  # requests a second here, over the last window
    window: tuple[float, int] = (0.0, 0)  # the current window: its start, its requests
    syncing: asyncio.Task[bool] | None = None  # the lease under way
    waiting: int = 0  # requests waiting for it
    flush: asyncio.TimerHandle | None = None  # what replies cost, to be written

    def count(self, now: float) -> None:
        """One more request of the key here."""
        start, seen = self.window
        if now - start >= RATE_WINDOW_S:
            self.rate = seen / (now - start) if seen else 0.0
            self.window = (now, 1)
        else:
            self.window = (start, seen + 1)

    def slice(self, limit: RateLimit, members: int, now: float) -> int:
        """How many requests a lease takes: HORIZON_S of this process's rate (the last window's,
        or the current one's so far, if higher: a key that turns busy is seen so at once), within
        its share of the error the key may have (one at least)."""
        assert limit.requests_per_minute is not None
        allowance = limit.burst + limit.requests_per_minute / 60
        most = max(1, int(ERROR * allowance / max(1, members)))
        start, seen = self.window
        rate = max(self.rate, seen / max(now - start, RATE_WINDOW_S / 10))
        return max(1, min(most, math.ceil(rate * HORIZON_S)))

    def levels(self, limit: RateLimit, now: float) -> tuple[float, float]:
        """The token budgets' levels now, as this process knows them: the last read, refilled
        since at their rates, less what replies cost here since."""
        elapsed = max(0.0, now - self.synced_at)
        minute = day = 0.0
        if limit.tokens_per_minute is not None and self.minute is not None:
            per_s = limit.tokens_per_minute / 60
            minute = min(limit.tokens_per_minute, self.minute + elapsed * per_s) - self.unsynced
        if limit.tokens_per_day is not None and self.day is not None:
            day = min(limit.tokens_per_day, self.day + elapsed * limit.tokens_per_day / DAY_S) - self.unsynced
        return minute, day

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

    def requests_left(self, limit: RateLimit, now: float) -> float:
        """The key's requests left as this process knows them: its own, and the store's at the
        last lease, refilled since (for the headers, and a refusal's wait)."""
        assert limit.requests_per_minute is not None
        refilled = self.left + max(0.0, now - self.synced_at) * limit.requests_per_minute / 60
        return self.held + min(float(limit.burst), refilled)

    def taken(self, now: float, taken: int, left: float, per_s: float) -> None:
        """A lease's requests: held from now; none given, none asked for until one would be."""
        if taken:
            self.held += taken
            self.held_at = now
        self.left = left
        if self.held < 1:
            self.empty_until = now + max(0.0, 1 - left) / per_s

"""Who may come in: API keys, the models each key may use, and each key's limits.

With an ``auth:`` section, every ``/v1/*`` request must carry ``Authorization: Bearer KEY`` (how
the OpenAI SDKs send ``api_key``). The gateway never holds a key: it holds the sha256 of each
(read from ``key_env`` when a generation is built, or given as ``key_sha256``: the
:class:`~gateway.config.generation.Keyring` of the generation) and compares the
sha256 of what a client sends with every one of them in constant time, so neither the answer nor
its timing says how close a guess came. No key and a wrong key are the same 401
``invalid_api_key``; a model outside the key's ``models`` is the same 404 as a model that does not
exist, and ``/v1/models`` lists only the key's models.

Limits are per key and per gateway process: ``rate_limit`` is a token bucket
(``requests_per_minute`` refill, ``burst`` at once) answering 429 ``rate_limit_exceeded`` with
``Retry-After``; ``max_concurrency`` caps the key's requests in flight (429
``concurrency_limit_exceeded``). Responses to a key with a rate limit carry the headers OpenAI
clients read: ``x-ratelimit-limit-requests``, ``x-ratelimit-remaining-requests``,
``x-ratelimit-reset-requests``. ``visual_tokens_per_minute`` is a bucket of a minute's visual
tokens, spent by each admitted request's images (gateway.admission.visual): 429 with Retry-After
and ``x-ratelimit-{limit,remaining,reset}-visual-tokens``. N gateway replicas behind a load balancer let a key through N
times as fast: divide the limits by N (docs/security.md).
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from ..config import ApiKey, GatewayConfig, RateLimit
from ..errors import (
    ConcurrencyLimitError,
    RateLimitedError,
    TokensRateLimitedError,
    VisualTokensRateLimitedError,
)

DAY_S = 86_400.0
NOTHING_SAID = (math.nan, math.nan, math.nan)  # (nan equals nothing: the first headers are made)
# a request of a key with nothing to hold it to (the front door's, and the leases'): no headers, no slot
NO_LIMITS: tuple[Mapping[str, str], None] = (MappingProxyType({}), None)


@dataclass(slots=True)
class Said:
    """The x-ratelimit-* headers a key's last answer carried, and the levels they said: made again
    only when a level changed. A key below its limits finds its buckets full (refilled to their
    capacity) request after request, and its requests share one set of headers (nine strings
    formatted a request, ~3 µs of a 100 µs request, otherwise). The headers are shared: read,
    never changed (a request that adds its own makes a new mapping)."""

    limit: RateLimit | None = None
    levels: tuple[float | None, float | None, float | None] = NOTHING_SAID
    said: Mapping[str, str] = field(default_factory=dict)

    def headers(self, limit: RateLimit, requests: float | None, minute: float, day: float) -> Mapping[str, str]:
        """:func:`key_headers` of these levels: the last ones, if they said the same."""
        levels = (requests, minute, day)
        if levels != self.levels or limit is not self.limit:
            self.said, self.levels, self.limit = key_headers(limit, requests, minute, day), levels, limit
        return self.said


@dataclass(slots=True)
class _Key:
    """One key's buckets, each a level and when it was last refilled (``nan``: not asked for
    yet, so full), and its requests in flight. One object a key, its buckets its fields: a
    request touches one."""

    requests: float = math.nan
    requests_at: float = 0.0
    minute: float = math.nan  # tokens_per_minute's
    minute_at: float = 0.0
    day: float = math.nan  # tokens_per_day's
    day_at: float = 0.0
    visual: float = math.nan  # visual_tokens_per_minute's
    visual_at: float = 0.0
    active: int = 0
    limit: RateLimit | None = None  # what the buckets were last refilled under (a reload makes another)
    said: Said = field(default_factory=Said)  # its last answer's headers

    def settle(self, limit: RateLimit, now: float) -> None:
        """Under ``limit`` from ``now`` on: the time before it refilled at the rates it had then (a
        reload that lowers a key's rate does not take back what the key earned before it)."""
        old, self.limit = self.limit, limit
        if old is None:
            return
        if (rpm := old.requests_per_minute) is not None and self.requests == self.requests:
            self.requests = _refilled(self.requests, now - self.requests_at, float(old.burst), rpm / 60.0)
            self.requests_at = now
        self.budgets(old, now)
        if (per_minute := old.visual_tokens_per_minute) is not None and self.visual == self.visual:
            self.visual = _refilled(self.visual, now - self.visual_at, per_minute, per_minute / 60.0)
            self.visual_at = now

    def budgets(self, limit: RateLimit, now: float) -> tuple[float, float]:
        """The token budgets' levels (0 for a budget the key has not), refilled to ``now``."""
        minute = day = 0.0
        if (budget := limit.tokens_per_minute) is not None:  # (_refilled, inline: every keyed request twice)
            minute = self.minute + (now - self.minute_at) * budget / 60.0
            self.minute = minute = minute if minute < budget else budget  # (nan, never asked for: full)
            self.minute_at = now
        if (budget := limit.tokens_per_day) is not None:
            day = self.day + (now - self.day_at) * budget / DAY_S
            self.day = day = day if day < budget else budget
            self.day_at = now
        return minute, day


def _refilled(level: float, elapsed: float, capacity: float, per_s: float) -> float:
    """A bucket's level after ``elapsed`` seconds of refill (``nan``: never asked for, so full)."""
    refilled = level + elapsed * per_s
    return refilled if refilled < capacity else capacity  # (nan is not less: full)


class KeyLimits:
    """Every key's buckets (requests, tokens, visual tokens) and requests in flight, by key name,
    for the life of the process (a store shared by processes: gateway.admission.shared)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock  # seconds, monotonic; a test sets its own
        self._keys: dict[str, _Key] = {}

    def _key(self, name: str) -> _Key:
        held = self._keys.get(name)
        if held is None:
            held = self._keys[name] = _Key()
        return held

    def reloaded(self, config: GatewayConfig) -> None:
        """A new generation is live: each key's buckets refilled to now at the rates they had, and
        under the key's new limits from now on (a rate a reload lowered applies from the reload on,
        not to the time before it; a key's next request would settle it too, later)."""
        now = self.clock()
        limits = {key.name: key.rate_limit for key in config.auth.keys} if config.auth is not None else {}
        for name, held in self._keys.items():
            if (limit := limits.get(name)) is not None and held.limit is not limit:
                held.settle(limit, now)

    async def admit(self, key: ApiKey) -> tuple[Mapping[str, str], str | None]:
        """:meth:`admit_now`, as the shared store's is asked (gateway.admission.shared)."""
        return self.admit_now(key)

    def admit_now(self, key: ApiKey) -> tuple[Mapping[str, str], str | None]:
        """A request of the key admitted (its token budgets hold, a request spent, a slot taken):
        its x-ratelimit-* headers and its slot (None: none), or the key's RateLimitedError. At
        once: the front door asks it without a coroutine (gateway.server.middlewares)."""
        held = self._keys.get(key.name)
        if held is None:
            held = self._key(key.name)
        limit, most = key.rate_limit, key.max_concurrency
        headers: Mapping[str, str] = {}
        if limit is not None:
            now = self.clock()
            if held.limit is not limit:  # a reload since the key's last request
                held.settle(limit, now)
            minute, day = held.budgets(limit, now)  # before a request is spent: a refusal costs none
            if (minute < 1 and limit.tokens_per_minute is not None) or (day < 1 and limit.tokens_per_day is not None):
                tokens_verdict(limit, minute, day, 1)  # raises
            if most is not None and held.active >= most:  # as the shared store: a refusal spends no request
                raise concurrency_refusal(most)
            left: float | None = None
            if (rpm := limit.requests_per_minute) is not None:
                left = held.requests + (now - held.requests_at) * rpm / 60.0  # (_refilled, inline)
                if not left < limit.burst:  # (nan, never asked for: full)
                    left = float(limit.burst)
                held.requests_at = now
                if left < 1:
                    held.requests = left
                    requests_verdict(limit, left, False)  # raises
                held.requests = left = left - 1
            headers = held.said.headers(limit, left, minute, day)
        elif most is not None and held.active >= most:
            raise concurrency_refusal(most)
        if most is None:
            return headers, None
        held.active += 1
        return headers, SLOT

    async def visual(self, key: ApiKey, tokens: int) -> dict[str, str]:
        """A request's visual tokens, once known: held to the key's token budgets (they are tokens
        of its prompt) and spent of its ``visual_tokens_per_minute``; their headers, or the refusal."""
        budgets = self.check_tokens(key, tokens)
        spent = self.spend_visual(key, tokens)
        return {**budgets, **spent} if spent and budgets else spent or budgets

    def finish(self, key: ApiKey, tokens: int, slot: str | None) -> None:
        """The request's end: the tokens its reply cost spent, its slot given back."""
        held = self._keys.get(key.name)
        # under the newest limits the key was admitted or reloaded under: a request admitted
        # before a reload ends after it, and must not bring the older rates back (nor leave a
        # budget the reload gave the key unspent)
        limit = key.rate_limit
        if limit is not None and held is not None and held.limit is not None:
            limit = held.limit
        if (
            tokens > 0
            and limit is not None
            and (limit.tokens_per_minute is not None or limit.tokens_per_day is not None)
        ):
            held, now = held or self._key(key.name), self.clock()
            held.budgets(limit, now)
            # a budget may go below 0 (a reply costs what it costs): the key's next requests wait
            # until it refills past 0. Only those the key has now (a budget a reload took away
            # keeps its level, and is full again if it comes back)
            if limit.tokens_per_minute is not None:
                held.minute -= tokens
            if limit.tokens_per_day is not None:
                held.day -= tokens
        if slot is not None:
            self._key(key.name).active -= 1

    async def close(self) -> None:
        """Nothing to close: the buckets go with the process."""

    def spend_visual(self, key: ApiKey, tokens: int) -> dict[str, str]:
        """Spend a request's visual tokens of the key's ``visual_tokens_per_minute`` (a bucket of a
        minute's worth): the x-ratelimit-*-visual-tokens headers, or VisualTokensRateLimitedError."""
        limit = key.rate_limit
        if limit is None or limit.visual_tokens_per_minute is None:
            return {}
        held = self._key(key.name)
        limit = held.limit or limit  # the newest (finish says why)
        if limit.visual_tokens_per_minute is None:
            return {}
        per_minute, now = limit.visual_tokens_per_minute, self.clock()
        left = _refilled(held.visual, now - held.visual_at, per_minute, per_minute / 60.0)
        held.visual_at = now
        allowed = left >= tokens
        if allowed:
            left -= tokens
        held.visual = left
        return visual_verdict(limit, left, tokens, allowed)

    def check_tokens(self, key: ApiKey, need: int = 1) -> dict[str, str]:
        """Whether the key's token budgets (``tokens_per_minute``, ``tokens_per_day``) hold ``need``
        tokens now (1: any at all; a request's visual tokens, once counted): their
        x-ratelimit-*-tokens headers, or TokensRateLimitedError. Nothing is spent here: a reply
        spends what it cost (:meth:`finish`), so a budget is held from what is already spent."""
        limit = key.rate_limit
        if limit is None or not limit.budgets_tokens:
            return {}
        held = self._key(key.name)
        limit = held.limit or limit  # the newest (finish says why)
        return tokens_verdict(limit, *held.budgets(limit, self.clock()), need)


SLOT = "local"  # the slot KeyLimits.admit took (the process's count of the key's requests in flight)


def key_headers(limit: RateLimit, requests: float | None, minute: float | None, day: float | None) -> dict[str, str]:
    """The x-ratelimit-* headers OpenAI's clients read, of a key's request bucket with
    ``requests`` left and its token budgets with ``minute`` and ``day`` left (of those it has;
    None: not said). One function, straight through: every request to a limited key makes them."""
    headers: dict[str, str] = {}
    # (_remaining inline: what is left, whole, 0 below 1)
    if requests is not None and (rpm := limit.requests_per_minute) is not None:
        headers["x-ratelimit-limit-requests"] = _number(rpm)
        headers["x-ratelimit-remaining-requests"] = str(int(requests)) if requests >= 1 else "0"
        headers["x-ratelimit-reset-requests"] = _duration((limit.burst - requests) * 60.0 / rpm)
    if minute is not None and (budget := limit.tokens_per_minute) is not None:
        headers["x-ratelimit-limit-tokens"] = _number(budget)
        headers["x-ratelimit-remaining-tokens"] = str(int(minute)) if minute >= 1 else "0"
        headers["x-ratelimit-reset-tokens"] = _duration((budget - minute) * 60.0 / budget)
    if day is not None and (budget := limit.tokens_per_day) is not None:
        headers["x-ratelimit-limit-tokens-day"] = _number(budget)
        headers["x-ratelimit-remaining-tokens-day"] = str(int(day)) if day >= 1 else "0"
        headers["x-ratelimit-reset-tokens-day"] = _duration((budget - day) * DAY_S / budget)
    return headers


def requests_verdict(limit: RateLimit, left: float, allowed: bool) -> dict[str, str]:
    """The x-ratelimit-*-requests headers of a request bucket with ``left`` requests (after this
    one's, if ``allowed``), or its RateLimitedError."""
    rpm = limit.requests_per_minute
    assert rpm is not None
    headers = key_headers(limit, left, None, None)
    if not allowed:
        wait = math.ceil((1 - left) * 60.0 / rpm)
        raise RateLimitedError(
            f"Rate limit of {_number(rpm)} requests per minute reached for this key; retry in {wait}s",
            headers={**headers, "Retry-After": str(max(1, wait))},
        )
    return headers


def visual_verdict(limit: RateLimit, left: float, tokens: int, allowed: bool) -> dict[str, str]:
    """The x-ratelimit-*-visual-tokens headers of a visual bucket with ``left`` (after this
    request's ``tokens``, if ``allowed``), or its VisualTokensRateLimitedError."""
    per_minute = limit.visual_tokens_per_minute
    assert per_minute is not None
    per_s = per_minute / 60
    headers = {
        "x-ratelimit-limit-visual-tokens": _number(per_minute),
        "x-ratelimit-remaining-visual-tokens": _remaining(left),
        "x-ratelimit-reset-visual-tokens": _duration((per_minute - left) / per_s),
    }
    if allowed:
        return headers
    if tokens > per_minute:  # as OpenAI answers a request larger than a minute's tokens: never passes
        raise VisualTokensRateLimitedError(
            f"This request's images come to {tokens} visual tokens, more than this key's "
            f"{_number(per_minute)} a minute: it cannot pass; send fewer or smaller images",
            headers=headers,
        )
    wait = math.ceil((tokens - left) / per_s)
    raise VisualTokensRateLimitedError(
        f"Rate limit of {_number(per_minute)} visual tokens per minute reached for this key: this request's "
        f"images come to {tokens}, {max(0, math.floor(left))} are left; retry in {wait}s",
        headers={**headers, "Retry-After": str(max(1, wait))},
    )


def tokens_verdict(limit: RateLimit, minute: float, day: float, need: int) -> dict[str, str]:
    """The x-ratelimit-*-tokens headers of the key's token budgets with ``minute`` and ``day``
    left (of those it has), or TokensRateLimitedError when one holds fewer than ``need``."""
    headers = key_headers(limit, None, minute, day)
    if (limit.tokens_per_minute is not None and minute < need) or (limit.tokens_per_day is not None and day < need):
        _refuse_tokens(limit, minute, day, need, headers)
    return headers


def _refuse_tokens(limit: RateLimit, minute: float, day: float, need: int, headers: dict[str, str]) -> None:
    """The TokensRateLimitedError of budgets of which one holds fewer than ``need`` (the first
    short one is told; Retry-After is its wait)."""
    for budget, left, span, kind in ((limit.tokens_per_minute, minute, 60.0, "minute"),
                                     (limit.tokens_per_day, day, DAY_S, "day")):  # fmt: skip
        if budget is None or left >= need:
            continue
        if need > budget:
            raise TokensRateLimitedError(
                f"This request's images alone come to {need} tokens, more than this key's {_number(budget)} a "
                f"{kind}: it cannot pass; send fewer or smaller images",
                headers=headers,
            )
        wait = math.ceil((need - left) * span / budget)
        raise TokensRateLimitedError(
            f"Token budget of {_number(budget)} tokens per {kind} reached for this key "
            f"({_remaining(left)} left, {need} needed); retry in {_duration(wait)}",
            headers={**headers, "Retry-After": str(max(1, wait))},
        )


def concurrency_refusal(limit: int) -> ConcurrencyLimitError:
    """The 429 of a key with ``limit`` requests in flight already."""
    return ConcurrencyLimitError(
        f"This key already has {limit} requests in flight (its max_concurrency); retry when one ends",
        headers={"Retry-After": "1"},
    )


@functools.lru_cache(maxsize=1024)
def _number(value: float) -> str:
    """A limit as its header writes it (a limit of a key's config: the same few values again)."""
    return str(int(value)) if value == int(value) else f"{value:g}"


def _remaining(left: float) -> str:
    """What is left of a bucket, whole (0 when it is below 0)."""
    return str(int(left)) if left >= 1 else "0"


_MILLISECONDS = tuple(f"{ms}ms" for ms in range(1001))  # a reset under a second, written once


def _duration(seconds: float) -> str:
    """As OpenAI writes x-ratelimit-reset-*: ``20ms``, ``1.5s``, ``6m0s``."""
    if seconds < 1:
        return _MILLISECONDS[round(seconds * 1000)] if seconds > 0 else "0ms"
    if seconds < 60:
        return f"{seconds:.3g}s"
    minutes, rest = divmod(round(seconds), 60)
    return f"{minutes}m{rest}s"

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

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from ..config import ApiKey, RateLimit
from ..errors import (
    ConcurrencyLimitError,
    RateLimitedError,
    TokensRateLimitedError,
    VisualTokensRateLimitedError,
)


@dataclass(slots=True)
class _Bucket:
    tokens: float
    updated: float


DAY_S = 86_400.0


class KeyLimits:
    """Every key's buckets (requests, tokens, visual tokens) and requests in flight, by key name,
    for the life of the process (a store shared by processes: gateway.admission.shared)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock  # seconds, monotonic; a test sets its own
        self._buckets: dict[tuple[str, str], _Bucket] = {}  # (key name, what it counts)
        self._active: dict[str, int] = {}

    def _filled(self, name: str, kind: str, capacity: float, per_s: float) -> _Bucket:
        """The key's bucket of ``kind``, refilled to now (full the first time)."""
        now = self.clock()
        bucket = self._buckets.get((name, kind))
        if bucket is None:
            bucket = self._buckets[(name, kind)] = _Bucket(capacity, now)
        bucket.tokens = min(capacity, bucket.tokens + (now - bucket.updated) * per_s)
        bucket.updated = now
        return bucket

    async def admit(self, key: ApiKey) -> tuple[dict[str, str], str | None]:
        """A request of the key admitted (its token budgets hold, a request spent, a slot taken):
        its x-ratelimit-* headers and its slot (None: none), or the key's RateLimitedError."""
        headers = self.check_tokens(key)  # before the request is spent: a refusal costs none
        limit = key.max_concurrency
        active = self._active.get(key.name, 0)
        if limit is not None and active >= limit:  # as the shared store: a refusal spends no request
            raise concurrency_refusal(limit)
        if key.rate_limit is not None and key.rate_limit.requests_per_minute is not None:
            headers = {**headers, **self.take(key)} if headers else self.take(key)
        if limit is None:
            return headers, None
        self._active[key.name] = active + 1
        return headers, SLOT

    async def visual(self, key: ApiKey, tokens: int) -> dict[str, str]:
        """A request's visual tokens, once known: held to the key's token budgets (they are tokens
        of its prompt) and spent of its ``visual_tokens_per_minute``; their headers, or the refusal."""
        budgets = self.check_tokens(key, tokens)
        spent = self.spend_visual(key, tokens)
        return {**budgets, **spent} if spent and budgets else spent or budgets

    def finish(self, key: ApiKey, tokens: int, slot: str | None) -> None:
        """The request's end: the tokens its reply cost spent, its slot given back."""
        self.spend_tokens(key, tokens)
        if slot is not None:
            self._active[key.name] -= 1

    async def close(self) -> None:
        """Nothing to close: the buckets go with the process."""

    def take(self, key: ApiKey) -> dict[str, str]:
        """Spend one request of the key's rate limit: the x-ratelimit-* headers, or RateLimitedError."""
        limit = key.rate_limit
        if limit is None or limit.requests_per_minute is None:
            return {}
        bucket = self._filled(key.name, "requests", float(limit.burst), limit.requests_per_minute / 60)
        allowed = bucket.tokens >= 1
        if allowed:
            bucket.tokens -= 1
        return requests_verdict(limit, bucket.tokens, allowed)

    def spend_visual(self, key: ApiKey, tokens: int) -> dict[str, str]:
        """Spend a request's visual tokens of the key's ``visual_tokens_per_minute`` (a bucket of a
        minute's worth): the x-ratelimit-*-visual-tokens headers, or VisualTokensRateLimitedError."""
        limit = key.rate_limit
        if limit is None or limit.visual_tokens_per_minute is None:
            return {}
        per_minute = limit.visual_tokens_per_minute
        bucket = self._filled(key.name, "visual", per_minute, per_minute / 60)
        allowed = bucket.tokens >= tokens
        if allowed:
            bucket.tokens -= tokens
        return visual_verdict(limit, bucket.tokens, tokens, allowed)

    def check_tokens(self, key: ApiKey, need: int = 1) -> dict[str, str]:
        """Whether the key's token budgets (``tokens_per_minute``, ``tokens_per_day``) hold ``need``
        tokens now (1: any at all; a request's visual tokens, once counted): their
        x-ratelimit-*-tokens headers, or TokensRateLimitedError. Nothing is spent here: a reply
        spends what it cost (:meth:`spend_tokens`), so a budget is held from what is already spent."""
        limit = key.rate_limit
        if limit is None or (limit.tokens_per_minute is None and limit.tokens_per_day is None):
            return {}
        minute = day = 0.0
        if limit.tokens_per_minute is not None:
            minute = self._filled(
                key.name, "tokens_minute", limit.tokens_per_minute, limit.tokens_per_minute / 60
            ).tokens
        if limit.tokens_per_day is not None:
            day = self._filled(key.name, "tokens_day", limit.tokens_per_day, limit.tokens_per_day / DAY_S).tokens
        return tokens_verdict(limit, minute, day, need)

    def spend_tokens(self, key: ApiKey, tokens: int) -> None:
        """A reply's tokens spent of the key's token budgets. A bucket may go below 0 (a reply
        costs what it costs): the key's next requests wait until it refills past 0."""
        limit = key.rate_limit
        if limit is None or tokens <= 0:
            return
        for budget, span, kind in ((limit.tokens_per_minute, 60.0, "minute"), (limit.tokens_per_day, DAY_S, "day")):
            if budget is not None:
                self._filled(key.name, f"tokens_{kind}", budget, budget / span).tokens -= tokens


SLOT = "local"  # the slot KeyLimits.admit took (the process's count of the key's requests in flight)


def requests_verdict(limit: RateLimit, left: float, allowed: bool) -> dict[str, str]:
    """The x-ratelimit-*-requests headers of a request bucket with ``left`` requests (after this
    one's, if ``allowed``), or its RateLimitedError."""
    assert limit.requests_per_minute is not None
    per_s = limit.requests_per_minute / 60
    headers = {
        "x-ratelimit-limit-requests": _number(limit.requests_per_minute),
        "x-ratelimit-remaining-requests": str(max(0, math.floor(left))),
        "x-ratelimit-reset-requests": _duration((limit.burst - left) / per_s),
    }
    if not allowed:
        wait = math.ceil((1 - left) / per_s)
        raise RateLimitedError(
            f"Rate limit of {_number(limit.requests_per_minute)} requests per minute reached for this key; "
            f"retry in {wait}s",
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
        "x-ratelimit-remaining-visual-tokens": str(max(0, math.floor(left))),
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
    headers: dict[str, str] = {}
    refusal: str | None = None
    wait = 0
    for budget, left, span, kind, suffix in (
        (limit.tokens_per_minute, minute, 60.0, "minute", ""),
        (limit.tokens_per_day, day, DAY_S, "day", "-day"),
    ):
        if budget is None:
            continue
        per_s = budget / span
        headers[f"x-ratelimit-limit-tokens{suffix}"] = _number(budget)
        headers[f"x-ratelimit-remaining-tokens{suffix}"] = str(max(0, math.floor(left)))
        headers[f"x-ratelimit-reset-tokens{suffix}"] = _duration((budget - left) / per_s)
        if left >= need or refusal is not None:
            continue
        if need > budget:
            raise TokensRateLimitedError(
                f"This request's images alone come to {need} tokens, more than this key's {_number(budget)} a "
                f"{kind}: it cannot pass; send fewer or smaller images",
                headers=headers,
            )
        wait = math.ceil((need - left) / per_s)
        refusal = (
            f"Token budget of {_number(budget)} tokens per {kind} reached for this key "
            f"({max(0, math.floor(left))} left, {need} needed); retry in {_duration(wait)}"
        )
    if refusal is not None:
        raise TokensRateLimitedError(refusal, headers={**headers, "Retry-After": str(max(1, wait))})
    return headers


def concurrency_refusal(limit: int) -> ConcurrencyLimitError:
    """The 429 of a key with ``limit`` requests in flight already."""
    return ConcurrencyLimitError(
        f"This key already has {limit} requests in flight (its max_concurrency); retry when one ends",
        headers={"Retry-After": "1"},
    )


def _number(value: float) -> str:
    return str(int(value)) if value == int(value) else f"{value:g}"


def _duration(seconds: float) -> str:
    """As OpenAI writes x-ratelimit-reset-*: ``20ms``, ``1.5s``, ``6m0s``."""
    if seconds < 1:
        return f"{max(0, round(seconds * 1000))}ms"
    if seconds < 60:
        return f"{seconds:.3g}s"
    minutes, rest = divmod(round(seconds), 60)
    return f"{minutes}m{rest}s"

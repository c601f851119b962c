"""Key limits shared by every gateway process that points at the same store (``server.limits_store``).

Without a store each process holds its own buckets (:class:`gateway.admission.auth.KeyLimits`):
N replicas let a key through N times its limits. With ``limits_store: {url: redis://...}``,
a key's request rate, token budgets, visual tokens and requests in flight live in Redis, and each
step is one Lua script, atomic on the server, whose clock (``TIME``) every process shares:

- **a lease** (a key without ``max_concurrency``: gateway.admission.leases): a slice of the key's
  request bucket taken, what replies cost written, the token budgets read; then each request is
  a local check, and the lease is renewed ahead of need, off the requests' path;
- **admission** (a key with ``max_concurrency``, one round trip): the token budgets hold, the
  request bucket has a request, the key is under its ``max_concurrency``; if all do, a request
  is spent and a slot taken (a lease: a gateway that dies mid-request frees its slots when they
  lapse);
- **visual tokens** (a request with counted images, to a key with a ``visual_tokens_per_minute``, or
  with ``max_concurrency`` and a token budget: a second round trip, once they are known; a key's
  token budgets alone hold them from its lease);
- **the end** (after the last byte, off the request's path): its tokens spent, its slot given back
  (a key without ``max_concurrency``: written with the next lease, within SYNC_S);
- **the heartbeat** (every second, off every request's path): this process counted among the live
  ones, whose number divides each model's ``max_concurrency`` (:func:`share`; the gate of
  gateway.upstream.concurrency fills this process's part).

The scripts of one turn of the event loop (every request admitted or ended in it) go to the store
together, in one pipeline: one round trip, and one connection taken from the pool, for all of
them (a busy gateway admits many requests a turn; the store's CPU, and the gateway's, go to the
scripts, not to the trips).

A key's buckets are under ``mg:<sha256 of the key's name>:...``; no key, nor any part of a
request, is ever written to the store. Each call has ``timeout_ms`` of the store's time, not of
this process's event loop (:func:`store_time`: a loop held by a huge body or a busy machine
spends a step of it, not all; an answer that came meanwhile is read); a store that fails or is slow is counted
(``gateway_limits_store_errors_total{op}``) and, for a second, not asked again; meanwhile
``on_failure: open`` admits requests as if the key had no limits, ``closed`` answers 503
``limits_store_unavailable`` with ``Retry-After``.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import itertools
import logging
import os
import socket
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from ..config import ApiKey, LimitsStoreConfig, RateLimit
from ..errors import LimitsStoreUnavailableError
from ..metrics import GatewayMetrics
from .auth import concurrency_refusal, requests_verdict, tokens_verdict, visual_verdict
from .leases import Leases
from .scripts import ADMIT, FINISH, LEASE, MEMBERS, VISUAL, arg
from .store_time import MOST_S, store_time

log = logging.getLogger(__name__)

LEASE_S = 900  # a slot's lease: the longest a request may hold it before it lapses (a gateway gone)
PAUSE_S = 1.0  # after a failure, the store is not asked for this long (the policy answers)
END_RETRIES_S = (1.0, 2.0)  # a request's end that failed is sent again after these waits
MAX_PIPELINE = 256  # scripts in one pipeline at most
MEMBERS_KEY = "mg:gateways"
HEARTBEAT_S = 1.0  # each process says it is alive this often
MEMBER_TTL_S = 3.0  # and is counted out this long after its last word


def share(limit: int, rank: int, members: int) -> int:
    """A process's part of a limit divided among ``members`` processes, by its ``rank`` among
    them (the parts add up to the limit); one at least: a limit below the number of processes
    lets each have one slot (docs/operations.md)."""
    part = limit // members + (1 if rank < limit % members else 0)
    return max(1, part)


def _texts(answer: list[Any]) -> list[str]:
    return [x.decode() if isinstance(x, bytes) else str(x) for x in answer]


def _budgets(limit: RateLimit, minute: str, day: str, need: int, refused: bool) -> dict[str, str]:
    """The token budgets' headers, or their refusal: the store's word holds, whatever the
    rounding of the numbers it sends says (``tostring`` keeps 14 digits: 0.999999999999997 is "1")."""
    m, d = float(minute), float(day)
    if refused:
        m, d = (min(x, need - 0.5) if x < need + 0.5 else x for x in (m, d))
    return tokens_verdict(limit, m, d, need)  # raises where a budget holds fewer than need


class SharedLimits:
    """The key limits of :class:`~gateway.admission.auth.KeyLimits`, held in Redis (module docstring)."""

    def __init__(self, spec: LimitsStoreConfig, metrics: GatewayMetrics) -> None:
        import redis.asyncio  # only where a store is configured
        from redis.asyncio.retry import Retry
        from redis.backoff import NoBackoff

        self.spec = spec
        self._metrics = metrics
        # a bounded pool whose callers wait for a connection, not fail; store_time bounds each
        # call (redis-py's own timeouts would time the loop: as long as store_time's longest)
        most = max(MOST_S, 10 * spec.timeout_ms / 1000)
        pool = redis.asyncio.BlockingConnectionPool.from_url(
            spec.url, max_connections=256, timeout=most, socket_timeout=most, socket_connect_timeout=most
        )
        self._redis: Any = redis.asyncio.Redis(connection_pool=pool, retry=Retry(NoBackoff(), 0))
        self._errors: tuple[type[BaseException], ...] = (redis.RedisError, OSError, TimeoutError)
        self._no_script: type[BaseException] = redis.exceptions.NoScriptError
        self._admit = self._redis.register_script(ADMIT)
        self._visual = self._redis.register_script(VISUAL)
        self._finish = self._redis.register_script(FINISH)
        self._members_script = self._redis.register_script(MEMBERS)
        self._lease_script = self._redis.register_script(LEASE)
        self._leases = Leases(self)  # each key's lease in this process (a key without max_concurrency)
        # :meth:`admit` at once, where it needs no wait (a key with nothing to lease, or whose lease
        # holds what its request needs: the common case); None otherwise. The leases' own: no call between
        self.admit_now: Callable[[ApiKey], tuple[Mapping[str, str], str | None] | None] = self._leases.admit_now
        # the request's end: its tokens spent, its slot given back, off its path (a key without
        # max_concurrency: spent of its lease, written within SYNC_S; with: :meth:`end`). The leases' own
        self.finish: Callable[[ApiKey, int, str | None], None] = self._leases.finish
        # this process among the live ones: a model's max_concurrency is divided among them
        self.member = f"{socket.gethostname()}:{os.getpid()}:{os.urandom(4).hex()}"
        self.rank, self.members = 0, 1  # until the store first answers: the whole limit here
        self._paused_until = 0.0
        self._members = (f"{os.getpid()}:{os.urandom(4).hex()}:{n}" for n in itertools.count())
        self._ending: set[asyncio.Future[Any]] = set()  # requests' ends not answered yet
        self._names: dict[str, str] = {}
        self._queued: list[tuple[Any, list[str], list[str], asyncio.Future[Any]]] = []  # this turn's scripts
        self._sending: set[asyncio.Task[Any]] = set()
        self.round_trips = 0  # pipelines sent (bench.limits reads it)
        self._closed = False

    def _keys(self, key: ApiKey, *kinds: str) -> list[str]:
        prefix = self._names.get(key.name)
        if prefix is None:
            digest = hashlib.sha256(key.name.encode("utf-8", "surrogatepass")).hexdigest()[:32]
            prefix = self._names[key.name] = f"mg:{digest}"
        return [f"{prefix}:{kind}" for kind in kinds]

    async def _call(self, op: str, script: Any, keys: list[str], args: list[str]) -> Any:
        """One script; None when the store failed (counted, and not asked again for a second:
        a request's end goes all the same, :meth:`_send_end`)."""
        loop = asyncio.get_running_loop()
        if loop.time() < self._paused_until:
            self._metrics.child(self._metrics.limits_store_errors, op).inc()
            return None
        answer = self._pipelined(script, keys, args)
        try:
            async with store_time(self.spec.timeout_ms / 1000):
                return await answer
        except self._errors as exc:
            self._store_failed(op, exc)
            return None
        finally:  # given up in the instant its answer came: retrieved, so that nothing logs it as lost
            if answer.done() and not answer.cancelled():
                answer.exception()

    def _store_failed(self, op: str, exc: BaseException) -> None:
        """A call that failed: counted, said once, and the store left alone for PAUSE_S."""
        loop = asyncio.get_running_loop()
        self._metrics.child(self._metrics.limits_store_errors, op).inc()
        if loop.time() >= self._paused_until:
            log.warning("limits store %s failed (%s: %s); on_failure: %s for %gs", op, type(exc).__name__, exc,
                        self.spec.on_failure, PAUSE_S)  # fmt: skip
        self._paused_until = loop.time() + PAUSE_S

    def _pipelined(self, script: Any, keys: list[str], args: list[str]) -> asyncio.Future[Any]:
        """The script's answer, once the pipeline of this turn's scripts is back."""
        loop = asyncio.get_running_loop()
        answer = loop.create_future()
        if not self._queued:
            loop.call_soon(self._flush)
        self._queued.append((script, keys, args, answer))
        return answer

    def _flush(self) -> None:
        queued, self._queued = self._queued, []
        for start in range(0, len(queued), MAX_PIPELINE):
            task = asyncio.get_running_loop().create_task(self._send(queued[start : start + MAX_PIPELINE]))
            self._sending.add(task)
            task.add_done_callback(self._sending.discard)

    async def _send(self, batch: list[tuple[Any, list[str], list[str], asyncio.Future[Any]]]) -> None:
        """One pipeline; each answer to its caller (an error too) as soon as it is known. A
        script the store lacks (it restarted empty) is loaded, and those calls alone sent once
        more: a failure then is theirs, never that of a script that ran (none runs twice)."""
        try:
            async with store_time(self.spec.timeout_ms / 1000):
                results = await self._answered(batch, self._execute(batch))
                missing = [batch[i] for i, r in enumerate(results) if isinstance(r, self._no_script)]
                if missing:
                    await self._answered(missing, self._reload_and_execute(missing))
        except TimeoutError:  # told to the callers still waiting (_answered)
            pass

    async def _answered(
        self, batch: list[tuple[Any, list[str], list[str], asyncio.Future[Any]]], sent: Awaitable[list[Any]]
    ) -> list[Any]:
        """``sent``'s results told to their callers (a script the store lacks: left to the
        caller of this); its failure told to every one of them."""
        try:
            results = await sent
        except BaseException as exc:  # the pipeline's failure is each call's
            failure = exc if isinstance(exc, Exception) else TimeoutError("the limits store did not answer in time")
            for *_, answer in batch:
                if not answer.done():
                    answer.set_exception(failure)
            if not isinstance(exc, Exception):
                raise
            return []
        for (*_, answer), result in zip(batch, results, strict=True):
            if answer.done() or isinstance(result, self._no_script):  # its caller gave up; or sent again
                continue
            if isinstance(result, BaseException):
                answer.set_exception(result)
            else:
                answer.set_result(result)
        return results

    async def _reload_and_execute(
        self, batch: list[tuple[Any, list[str], list[str], asyncio.Future[Any]]]
    ) -> list[Any]:
        for script in {id(call[0]): call[0] for call in batch}.values():
            await self._redis.script_load(script.script)
        return await self._execute(batch)

    async def _execute(self, batch: list[tuple[Any, list[str], list[str], asyncio.Future[Any]]]) -> list[Any]:
        self.round_trips += 1
        pipe = self._redis.pipeline(transaction=False)
        for script, keys, args, _ in batch:
            pipe.evalsha(script.sha, len(keys), *keys, *args)
        results: list[Any] = await pipe.execute(raise_on_error=False)
        return results

    def failed(self) -> dict[str, str]:
        """The policy's answer while the store fails: admitted without limits, or a 503."""
        if self.spec.on_failure == "closed":
            raise LimitsStoreUnavailableError(
                "The gateway's limits store is unavailable and its policy is to refuse meanwhile; retry shortly",
                headers={"Retry-After": "1"},
            )
        return {}

    async def admit(self, key: ApiKey) -> tuple[Mapping[str, str], str | None]:
        """A request of the key admitted: its x-ratelimit-* headers and the slot it holds (None:
        none), or the key's RateLimitedError: from this process's lease of the key's limits
        (gateway.admission.leases), or, for a key with ``max_concurrency``, in one round trip."""
        limit = key.rate_limit or RateLimit(None, 1)
        budgets = limit.tokens_per_minute is not None or limit.tokens_per_day is not None
        if limit.requests_per_minute is None and not budgets and key.max_concurrency is None:
            return {}, None
        if key.max_concurrency is None:  # nothing in flight to count across processes: a lease of the key's limits
            return await self._leases.admit(key, limit, budgets), None
        member = next(self._members)
        keys = self._keys(key, "requests", "tokens_minute", "tokens_day", "slots")
        args = [arg(limit.requests_per_minute), arg(limit.burst), arg(limit.tokens_per_minute),
                arg(limit.tokens_per_day), arg(key.max_concurrency), member or "", str(LEASE_S)]  # fmt: skip
        try:
            answer = await self._call("admit", self._admit, keys, args)
        except asyncio.CancelledError:  # the client left: the script may have taken the slot
            self._give_back(keys, member)
            raise
        if answer is None:  # it may have run, past the timeout: its slot given back, if it took one
            self._give_back(keys, member)
            return self.failed(), None
        refused, left, minute, day = _texts(answer)
        headers = _budgets(limit, minute, day, 1, refused == "tokens") if budgets else {}
        if limit.requests_per_minute is not None:
            headers |= requests_verdict(limit, float(left), refused != "rate")
        if refused == "concurrency":
            assert key.max_concurrency is not None
            raise concurrency_refusal(key.max_concurrency)
        return headers, member

    async def visual(self, key: ApiKey, tokens: int) -> dict[str, str]:
        """A request's visual tokens held to the key's token budgets and spent of its
        ``visual_tokens_per_minute``: their headers, or the refusal."""
        limit = key.rate_limit
        if limit is None or (
            limit.tokens_per_minute is None and limit.tokens_per_day is None and limit.visual_tokens_per_minute is None
        ):
            return {}
        if key.max_concurrency is None and limit.visual_tokens_per_minute is None:  # the budgets alone: leased
            return await self._leases.budgets(key, limit, tokens)
        keys = self._keys(key, "tokens_minute", "tokens_day", "visual")
        args = [arg(limit.tokens_per_minute), arg(limit.tokens_per_day), arg(limit.visual_tokens_per_minute),
                str(tokens)]  # fmt: skip
        answer = await self._call("visual", self._visual, keys, args)
        if answer is None:
            return self.failed()
        over, short, minute, day, visual = _texts(answer)
        headers = _budgets(limit, minute, day, tokens, over == "1")
        if limit.visual_tokens_per_minute is not None:
            headers |= visual_verdict(limit, float(visual), tokens, short == "0")
        return headers

    def end(self, key: ApiKey, tokens: int, member: str | None) -> None:
        """The end of a request of a key with ``max_concurrency`` (its ``finish``, which the
        leases answer: gateway.admission.leases): its tokens spent, its slot given back, in this
        turn's pipeline, off its path."""
        limit = key.rate_limit
        budgets = limit is not None and (limit.tokens_per_minute is not None or limit.tokens_per_day is not None)
        if member is None and not (budgets and tokens > 0):
            return
        keys = self._keys(key, "tokens_minute", "tokens_day", "slots")
        args = [arg(limit.tokens_per_minute if limit else None), arg(limit.tokens_per_day if limit else None),
                str(tokens), member or ""]  # fmt: skip
        self._send_end(keys, args)

    # --- what gateway.admission.leases asks of the store ---------------------------------------

    @property
    def closed(self) -> bool:
        return self._closed

    async def renew(self, op: str, key: ApiKey, args: list[str]) -> list[str] | None:
        """One LEASE script for ``key`` (its answer as text), or None when the store failed."""
        keys = self._keys(key, "requests", "tokens_minute", "tokens_day")
        answer = await self._call(op, self._lease_script, keys, args)
        return None if answer is None else _texts(answer)

    async def settle(self) -> None:
        """Every lease given back and what replies cost written (gateway.admission.leases)."""
        await self._leases.settle()

    def track(self, task: asyncio.Task[Any]) -> None:
        """A call off a request's path, waited for (or cancelled) at close."""
        self._sending.add(task)
        task.add_done_callback(self._sending.discard)

    def _give_back(self, keys: list[str], member: str | None) -> None:
        """A slot an admission may have taken, given back (its answer never came)."""
        if member is not None:
            self._send_end([keys[1], keys[2], keys[3]], ["", "", "0", member])

    def _send_end(self, keys: list[str], args: list[str], tried: int = 0) -> None:
        """A request's end, in this turn's pipeline: no task of its own. One that fails is sent
        again after 1 s, then 2 s (a slot not given back is held until its lease lapses); the
        store's pause does not hold it back."""
        if self._closed:  # a retry that came due as the gateway stopped: the lease lapses instead
            return
        answer = self._pipelined(self._finish, keys, args)
        self._ending.add(answer)
        answer.add_done_callback(functools.partial(self._ended, keys, args, tried))

    def _ended(self, keys: list[str], args: list[str], tried: int, answer: asyncio.Future[Any]) -> None:
        self._ending.discard(answer)
        if answer.cancelled() or (exc := answer.exception()) is None:
            return
        self._store_failed("finish", exc)
        if tried < len(END_RETRIES_S):
            asyncio.get_running_loop().call_later(END_RETRIES_S[tried], self._send_end, keys, args, tried + 1)

    def slots(self, limit: int) -> int:
        """This process's part of a model's ``max_concurrency`` (gateway.upstream.concurrency)."""
        return limit if self.members == 1 else share(limit, self.rank, self.members)

    async def heartbeat(self) -> None:
        """This process said alive, and the live ones counted: its rank and their number. A
        store that fails leaves the last count (counted in gateway_limits_store_errors_total)."""
        answer = await self._call("members", self._members_script, [MEMBERS_KEY], [self.member, str(MEMBER_TTL_S)])
        if answer is None:
            return
        members = sorted(m.decode() if isinstance(m, bytes) else str(m) for m in answer)
        if self.member in members:
            self.rank, self.members = members.index(self.member), len(members)

    async def keep_alive(self) -> None:
        """:meth:`heartbeat` every HEARTBEAT_S, until cancelled."""
        while True:
            await asyncio.sleep(HEARTBEAT_S)
            await self.heartbeat()

    async def close(self) -> None:
        with contextlib.suppress(*self._errors):  # the leases given back: the other processes' now
            async with asyncio.timeout(self.spec.timeout_ms / 1000 * 4):
                await self.settle()
        self._closed = True
        with contextlib.suppress(*self._errors):  # counted out at once: the others' parts grow now
            async with asyncio.timeout(self.spec.timeout_ms / 1000):
                await self._redis.zrem(MEMBERS_KEY, self.member)
        waiting: set[asyncio.Future[Any]] = {*self._ending, *self._sending}
        if waiting:
            _, pending = await asyncio.wait(waiting, timeout=self.spec.timeout_ms / 1000 * 4)
            for left in pending:
                left.cancel()
            if pending:
                await asyncio.wait(pending)
        await self._redis.aclose(close_connection_pool=True)  # the pool is its own: closed with it

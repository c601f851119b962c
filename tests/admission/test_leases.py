"""gateway.admission.leases: a key's shared limits leased by each process from a real
redis-server on loopback, so that a keyed request costs a local check: no round trip in the
common case, one key's limit held across processes, what is not spent given back."""

from __future__ import annotations

import asyncio
import math
import os
import shutil
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from gateway.admission.leases import CLOCK_SLACK_S, ERROR, HOLD_S, SYNC_S, Lease, clock
from gateway.admission.shared import SharedLimits
from gateway.config import ApiKey, LimitsStoreConfig, RateLimit
from gateway.errors import RateLimitedError, TokensRateLimitedError
from gateway.metrics import GatewayMetrics
from tools.redis_server import RedisServer

pytestmark = [
    pytest.mark.timeout(60),
    pytest.mark.skipif(
        shutil.which("redis-server") is None and os.environ.get("CI") != "true",
        reason="needs Debian's redis-server (make test installs it)",
    ),
]


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path)
    yield server
    server.kill()


@pytest.fixture
async def processes(redis_server: RedisServer) -> AsyncIterator[list[SharedLimits]]:
    """Two processes' limits on one store (each its own client, leases and pipeline)."""
    spec = LimitsStoreConfig(redis_server.url, 5000.0)  # generous: a loaded machine is not a failing store
    both = [SharedLimits(spec, GatewayMetrics(CollectorRegistry())) for _ in range(2)]
    for shared in both:
        await shared.heartbeat()  # each counted among the live ones: the slices are shared by two
    yield both
    for shared in both:
        await shared.close()


def store_level(redis_server: RedisServer, kind: str) -> float:
    import redis

    store = redis.Redis.from_url(redis_server.url, decode_responses=True)
    try:
        (bucket,) = store.keys(f"mg:*:{kind}")
        return float(store.hget(bucket, "t"))
    finally:
        store.close()


async def test_a_busy_keys_requests_cost_no_round_trip_but_one_a_slice(
    processes: list[SharedLimits], redis_server: RedisServer
) -> None:
    shared = processes[0]
    key = ApiKey("busy", key_sha256="0" * 64, rate_limit=RateLimit(60_000_000, 1_000_000, tokens_per_day=1e9))
    loop = asyncio.get_running_loop()
    started, before = loop.time(), shared.round_trips
    for _ in range(3000):  # one after another, as fast as this loop goes: a high rate, large slices
        headers, slot = await shared.admit(key)
        assert slot is None and "x-ratelimit-remaining-requests" in headers
        shared.finish(key, 10, slot)
    trips = shared.round_trips - before
    assert trips < 3000 / 20, trips  # a lease a slice and a write of the spent tokens, not a trip a request
    await shared.settle()  # every token the replies cost written
    refilled = (loop.time() - started) * 1e9 / 86_400
    assert 1e9 - 30_000 <= store_level(redis_server, "tokens_day") <= 1e9 - 30_000 + refilled + 1


async def test_two_processes_never_pass_the_keys_limit_and_leave_little_of_it(
    processes: list[SharedLimits],
) -> None:
    """A burst far over the key's limit, from both processes at once: the slices come out of the
    one bucket (never more than it holds), and what the processes hold unspent at the end is at
    most ERROR of the key's allowance."""
    key = ApiKey("team", key_sha256="1" * 64, rate_limit=RateLimit(60, 400))  # a request a second refills
    loop = asyncio.get_running_loop()
    started = loop.time()

    async def one(shared: SharedLimits) -> bool:
        try:
            await shared.admit(key)
            return True
        except RateLimitedError:
            return False

    admitted = await asyncio.gather(*(one(processes[n % 2]) for n in range(1000)))
    elapsed = loop.time() - started
    served = sum(admitted)
    allowed = 400 + math.ceil(elapsed)  # the burst and what refilled meanwhile
    assert served <= allowed + 1, (served, elapsed)
    held = sum(p._leases["team"].held for p in processes)
    assert served + held >= 400 - 1, (served, held)
    assert held <= math.ceil(ERROR * (400 + 1)), held  # the slices: a share of the allowance


async def test_what_a_process_holds_unspent_goes_back_to_the_store(
    processes: list[SharedLimits], redis_server: RedisServer
) -> None:
    first, second = processes
    key = ApiKey("team", key_sha256="2" * 64, rate_limit=RateLimit(6, 100))  # a tenth of a request a second
    for _ in range(3):
        await first.admit(key)
    lease = first._leases["team"]
    assert lease.held >= 1  # taken ahead of need
    await asyncio.sleep(HOLD_S * 2)  # the hold lapses: what it held goes back by itself
    while lease.held or lease.syncing is not None:
        await asyncio.sleep(0.01)
    assert store_level(redis_server, "requests") == pytest.approx(97, abs=0.2)  # 100, less the 3 spent
    headers, _ = await second.admit(key)
    assert int(headers["x-ratelimit-remaining-requests"]) >= 95


async def test_a_token_budget_spent_in_one_process_is_seen_by_the_other(processes: list[SharedLimits]) -> None:
    first, second = processes
    key = ApiKey("team", key_sha256="3" * 64, rate_limit=RateLimit(None, 1, tokens_per_minute=100))
    await first.admit(key)
    first.finish(key, 150, None)  # a reply that cost more than the budget: spent after it
    lease = first._leases["team"]
    while lease.flush is not None or lease.syncing is not None:  # written within SYNC_S, by itself
        await asyncio.sleep(0.01)
    with pytest.raises(TokensRateLimitedError):
        await second.admit(key)  # its first request reads the store
    with pytest.raises(TokensRateLimitedError):
        await first.admit(key)  # its own spending, known here at once


def test_a_slice_is_the_processs_rate_within_its_share_of_the_error() -> None:
    limit = RateLimit(60_000, 1000)  # a burst of 1000 and 1000 a second: an allowance of 2000
    lease = Lease()
    assert lease.slice(limit, 1, 100.0) == 1  # no request seen yet: one
    lease.rate = 1000.0
    assert lease.slice(limit, 1, 100.0) == 50  # 200 ms of 1,000 a second, within 2.5% of 2000
    lease.rate = 150.0
    assert lease.slice(limit, 1, 100.0) == 30  # 200 ms of 150 a second
    lease.rate = 1e9
    assert lease.slice(limit, 1, 100.0) == 50 and lease.slice(limit, 4, 100.0) == 12  # a share of four
    assert Lease(rate=1e9).slice(RateLimit(6, 5), 2, 100.0) == 1  # a small key: one at a time
    busy = Lease()
    busy.count(100.0)
    busy.count(100.001)  # a key that turns busy: 2 requests in the window's first ms, the last window idle
    assert busy.slice(limit, 1, 100.002) == 40  # at least 200 a second so far (2 in 10 ms): 200 ms of it


async def test_a_refused_key_is_refused_here_without_asking_the_store(processes: list[SharedLimits]) -> None:
    shared = processes[0]
    key = ApiKey("team", key_sha256="4" * 64, rate_limit=RateLimit(6, 3))  # a request every 10 s
    for _ in range(3):
        await shared.admit(key)
    with pytest.raises(RateLimitedError):
        await shared.admit(key)  # the store asked: it has none to give
    before = shared.round_trips
    for _ in range(200):
        with pytest.raises(RateLimitedError) as refused:
            await shared.admit(key)
    assert shared.round_trips == before  # a flood refused, the store never asked
    assert 1 <= int(refused.value.headers["Retry-After"]) <= 10


async def test_a_store_gone_answers_as_on_failure_says_once_what_a_process_knew_is_old(
    redis_server: RedisServer,
) -> None:
    """A key of token budgets alone holds nothing to spend: once its levels are TRUSTED_S old
    and the store cannot be read, ``on_failure: closed`` refuses, as it did a request at a time."""
    from gateway.admission.leases import TRUSTED_S
    from gateway.errors import LimitsStoreUnavailableError

    shared = SharedLimits(LimitsStoreConfig(redis_server.url, 200.0, "closed"), GatewayMetrics(CollectorRegistry()))
    key = ApiKey("team", key_sha256="5" * 64, rate_limit=RateLimit(None, 1, tokens_per_minute=1000))
    try:
        await shared.admit(key)
        redis_server.kill()
        await shared.admit(key)  # what it read a moment ago holds
        await asyncio.sleep(TRUSTED_S * 1.2)  # (waits for the levels to be old: no race)
        with pytest.raises(LimitsStoreUnavailableError):
            await shared.admit(key)
    finally:
        await shared.close()


def test_tokens_are_spent_here_as_replies_end_and_refill_as_a_processs_own_buckets_do() -> None:
    limit = RateLimit(None, 1, tokens_per_minute=600)  # 10 a second
    lease = Lease(minute=500.0, levels_at=10.0, synced_at=10.0)
    lease.spend(limit, 20, 10.0)
    assert lease.levels(limit, 10.0) == (480.0, 0.0)
    assert lease.levels(limit, 11.0) == (490.0, 0.0)  # refilled since
    assert lease.levels(limit, 100.0) == (600.0, 0.0)  # to its capacity, no more
    lease.spend(limit, 30, 100.0)  # full, then spent: a full budget less this reply
    assert lease.levels(limit, 100.0) == (570.0, 0.0)
    assert Lease().levels(limit, 5.0) == (0.0, 0.0)  # never read: nothing to go on


async def test_what_replies_cost_while_a_lease_is_under_way_is_spent_of_the_levels_it_reads(
    processes: list[SharedLimits],
) -> None:
    """A reply that ends while the store is asked is in neither the store's answer nor lost:
    the levels read, less it."""
    shared = processes[0]
    limit = RateLimit(None, 1, tokens_per_day=1_000_000)
    key = ApiKey("inflight", key_sha256="0" * 64, rate_limit=limit)
    started = clock()
    await shared.admit(key)
    leases = shared._leases
    lease = leases["inflight"]

    def no_flush() -> None:  # the test starts the lease itself: no timer of its own starts another
        if lease.flush is not None:
            lease.flush.cancel()
            lease.flush = None

    shared.finish(key, 1000, None)  # written with the next lease
    no_flush()
    leases._renew(key, lease, "finish", 0)
    renewing = lease.syncing
    assert renewing is not None
    await asyncio.sleep(0)  # the lease under way, the 1000 in it
    shared.finish(key, 500, None)  # while it is: not in what it reads
    no_flush()
    assert await renewing
    _, day = lease.levels(limit, clock())
    refilled = (clock() - started) * 1_000_000 / 86_400
    assert 1_000_000 - 1500 <= day <= 1_000_000 - 1500 + refilled + 1


async def test_what_replies_cost_is_written_by_the_leases_that_go_and_alone_only_where_none_went(
    processes: list[SharedLimits], redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A busy key's renewals write what its replies cost; the write of its own waits for SYNC_S
    after the last lease went (everything unwritten was spent after it), and goes then: no
    script a SYNC_S more for a key renewed anyway, and no reply's cost older than SYNC_S unwritten."""
    shared = processes[0]
    limit = RateLimit(None, 1, tokens_per_day=1_000_000)
    key = ApiKey("written", key_sha256="9" * 64, rate_limit=limit)
    await shared.admit(key)
    leases, loop = shared._leases, asyncio.get_running_loop()
    lease = leases["written"]
    sent: list[tuple[float, str]] = []  # when each lease went, and what it wrote
    real = shared.renew

    async def renew(op: str, key: ApiKey, args: list[str]) -> list[str] | None:
        sent.append((loop.time(), args[-1]))
        return await real(op, key, args)

    def timer_now() -> None:  # the write's timer, fired by the test (none of its own)
        assert lease.flush is not None
        lease.flush.cancel()
        leases._write_spent(key, lease)

    monkeypatch.setattr(shared, "renew", renew)
    shared.finish(key, 100, None)
    leases._renew(key, lease, "admit")  # a renewal goes first (a busy key's): it takes the 100
    assert lease.syncing is not None and await lease.syncing
    went = lease.sent_at
    shared.finish(key, 50, None)  # after it went
    timer_now()  # its write, due: none goes (all of it was spent after the renewal went)...
    assert len(sent) == 1 and lease.unsynced == 50 and lease.flush is not None
    while lease.unsynced:  # ...until SYNC_S after it (its own timer: waited for, not raced)
        await asyncio.sleep(SYNC_S / 4)
    assert [written for _, written in sent] == ["100", "50"]  # one write of its own, after the renewal
    assert sent[1][0] >= went + SYNC_S - CLOCK_SLACK_S  # deferred to SYNC_S after the lease that went
    await shared.settle()
    assert store_level(redis_server, "tokens_day") <= 1_000_000 - 150 + 5  # both written (a few refilled since)


async def test_a_requests_visual_tokens_are_held_to_the_budgets_the_process_leased(
    processes: list[SharedLimits],
) -> None:
    """A key with token budgets (no visual_tokens_per_minute): a request's visual tokens are held
    to them as the process knows them, with no round trip; what a reply cost in another process
    refuses them once read."""
    one, other = processes
    key = ApiKey("eyes", key_sha256="0" * 64, rate_limit=RateLimit(600, 100, tokens_per_minute=10_000))
    _, slot = await one.admit(key)
    before = one.round_trips
    held = await one.visual(key, 4_000)
    assert one.round_trips == before  # from the lease
    assert held["x-ratelimit-remaining-tokens"] == "10000"  # held, not spent: the reply spends
    one.finish(key, 8_000, slot)
    await one.settle()  # written: 2,000 left in the store
    _, slot = await other.admit(key)  # the other process reads the levels as it leases
    with pytest.raises(TokensRateLimitedError) as short:
        await other.visual(key, 4_000)
    assert int(short.value.headers["x-ratelimit-remaining-tokens"]) < 4_000
    other.finish(key, 0, slot)


async def test_a_request_its_lease_covers_is_admitted_at_once_and_one_it_does_not_waits_for_the_store(
    processes: list[SharedLimits],
) -> None:
    """``admit_now`` (the front door's, without a coroutine) answers from the lease, or says
    None where the store must be asked first: nothing known yet, a lease spent (not a refusal:
    the store may have more), a key whose requests in flight are counted in the store."""
    shared = processes[0]
    key = ApiKey("now", key_sha256="0" * 64, rate_limit=RateLimit(60_000_000, 1_000_000, tokens_per_day=1e9))
    assert shared.admit_now(key) is None  # its budgets never read
    await shared.admit(key)
    answered = shared.admit_now(key)
    assert answered is not None and answered[1] is None and "x-ratelimit-remaining-requests" in answered[0]
    for _ in range(10_000):  # the slice spent, with no wait for the renewal it started
        if shared.admit_now(key) is None:
            break
    else:
        raise AssertionError("a lease that never runs out")
    headers, _ = await shared.admit(key)  # the store asked: it has plenty
    assert int(headers["x-ratelimit-remaining-requests"]) > 0
    counted = ApiKey("slots", key_sha256="1" * 64, rate_limit=RateLimit(600, 10), max_concurrency=2)
    assert shared.admit_now(counted) is None
    assert shared.admit_now(ApiKey("free", key_sha256="2" * 64)) == ({}, None)


def test_what_a_process_holds_unspent_goes_back_on_uvloop_too(redis_server: RedisServer) -> None:
    """uvloop's timers run on libuv's clock (cached a turn, in milliseconds), not the monotonic
    one the request path reads: a lease's hold is timed on the loop's own, so that a timer set
    for HOLD_S never finds it a little short and drops it (the requests stuck here, unspent)."""
    import uvloop

    async def scenario() -> list[int]:
        spec = LimitsStoreConfig(redis_server.url, 5000.0)
        shared = SharedLimits(spec, GatewayMetrics(CollectorRegistry()))
        try:
            await shared.heartbeat()
            keys = [ApiKey(f"idle-{i}", key_sha256=f"{i:064x}", rate_limit=RateLimit(600, 100)) for i in range(12)]
            for key in keys:
                await shared.admit(key)
            leases = [shared._leases[key.name] for key in keys]
            loop = asyncio.get_running_loop()
            deadline = loop.time() + HOLD_S * 40  # a bound against a hang, not a bet on speed
            while any(lease.held or lease.syncing is not None for lease in leases) and loop.time() < deadline:
                await asyncio.sleep(0.01)
            return [lease.held for lease in leases]
        finally:
            await shared.close()

    assert uvloop.run(scenario()) == [0] * 12


class _Store:
    """A store that answers every lease with what it is given, and keeps what it was sent."""

    members, closed = 1, False

    def __init__(self, minute: str = "9000") -> None:
        self.sent: list[tuple[ApiKey, list[str]]] = []
        self.minute = minute

    async def renew(self, op: str, key: ApiKey, args: list[str]) -> list[str]:
        self.sent.append((key, args))
        return ["0", "0", self.minute, ""]

    def track(self, task: asyncio.Task[object]) -> None: ...

    def failed(self) -> dict[str, str]:
        return {}


async def test_a_reply_admitted_before_a_reload_is_spent_and_written_under_the_newest_limits() -> None:
    """A request admitted before a reload that raised a key's budget, ending after the lease read
    the level under the new one: spent of that level, not capped first at the old budget, and
    written to the store with the new budget (the store's bucket is capped at what it is sent)."""
    from gateway.admission.leases import Leases

    store = _Store()
    leases = Leases(store)
    old = ApiKey("k", key_sha256="0" * 64, rate_limit=RateLimit(None, 1, tokens_per_minute=100))
    new = ApiKey("k", key_sha256="0" * 64, rate_limit=RateLimit(None, 1, tokens_per_minute=10_000))
    lease = leases._lease(new)  # the reload's key, its level read under the new budget
    read_at = clock()
    lease.minute, lease.levels_at, lease.synced_at = 9000.0, read_at, read_at
    leases.finish(old, 150)
    refilled = (clock() - read_at) * 10_000 / 60
    assert lease.flush is not None
    assert 8850 <= lease.minute <= 8850 + refilled + 1e-6  # (was -50: capped at 100 first)
    lease.flush.cancel()
    assert await leases._sync(old, lease, "finish", 0)  # as the flush's timer, made with the old key, asks
    (sent_for, args), *_ = store.sent
    assert sent_for is new and args[2] == "10000" and args[6] == "150"  # the new budget, what was spent


async def test_a_hold_that_lapsed_by_the_loops_clock_goes_back_whatever_its_milliseconds() -> None:
    """uvloop's clock is in whole milliseconds: a timer set for HOLD_S finds the hold lapsed, and
    the lease it starts gives the requests back (within the clock's slack), not a lease that
    gives back none and holds them a cycle more."""
    from gateway.admission.leases import Leases

    store = _Store()
    leases = Leases(store)
    key = ApiKey("k", key_sha256="0" * 64, rate_limit=RateLimit(600, 100))
    lease = leases._lease(key)
    lease.held, lease.held_at = 5, asyncio.get_running_loop().time() - HOLD_S + 0.0005
    assert await leases._sync(key, lease, "finish", 0)
    (_, args), *_ = store.sent
    assert args[5] == "5" and lease.held == 0  # all given back


async def test_what_replies_cost_waits_a_whole_sync_for_a_slow_lease_under_way() -> None:
    """A lease the store is slow to answer (slower than SYNC_S) holds the write of what was spent
    after it went until SYNC_S later again: one timer, not one every few milliseconds while it
    is under way."""
    from gateway.admission.leases import Leases

    answer = asyncio.Event()

    class Slow(_Store):
        async def renew(self, op: str, key: ApiKey, args: list[str]) -> list[str]:
            self.sent.append((key, args))
            await answer.wait()
            return ["0", "0", "9000", "1000000"]

    store = Slow()
    leases, loop = Leases(store), asyncio.get_running_loop()
    key = ApiKey("slow", key_sha256="0" * 64, rate_limit=RateLimit(None, 1, tokens_per_day=1_000_000))
    lease = leases._lease(key)
    lease.day, lease.levels_at, lease.synced_at = 1e6, clock(), clock()
    leases._renew(key, lease, "admit")  # under way, and slow
    await asyncio.sleep(0)
    assert lease.syncing is not None and len(store.sent) == 1
    leases.finish(key, 50)  # after it went
    assert lease.flush is not None
    lease.flush.cancel()
    lease.sent_at = loop.time() - 1  # its write long due...
    before = loop.time()
    leases._write_spent(key, lease)  # ...as its timer fires: the lease still under way
    assert lease.flush is not None and lease.flush.when() >= before + SYNC_S  # (it was 2 ms)
    lease.flush.cancel()  # (no timer of its own left to fire while the test goes on)
    assert len(store.sent) == 1 and lease.unsynced == 50  # nothing more sent meanwhile; the 50 still to write
    answer.set()
    assert await lease.syncing

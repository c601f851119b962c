"""Replica pools: choice, leases, and each replica's circuit breaker, on an injected clock."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from gateway.config import BreakerConfig
from gateway.upstream.replicas import Pool, Replica, ReplicaSet

BREAKER = BreakerConfig(failures=3, open_s=10.0, successes=2)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def make(*urls: str, balance: str = "p2c", weights: tuple[int, ...] = (), seed: int = 7) -> tuple[Pool, Clock]:
    clock = Clock()
    replicas = ReplicaSet(clock=clock, rng=random.Random(seed))
    return replicas.pool("m", urls, weights=weights, balance=balance, breaker=BREAKER), clock


def state(replica: Replica) -> str:
    return replica.state  # read anew each time (mypy would narrow the attribute)


def take(pool: Pool, exclude: tuple[Replica, ...] = ()) -> Replica:
    lease = pool.lease(exclude)
    assert lease is not None
    with lease:
        return lease.replica


def fail(pool: Pool, replica: Replica, times: int = 1) -> None:
    for _ in range(times):
        lease = pool.lease([r for r in pool.replicas if r is not replica])
        assert lease is not None and lease.replica is replica
        with lease:
            lease.failure("HTTP 503")


def test_a_lease_counts_the_request_in_flight_until_its_block_ends_whatever_happens() -> None:
    pool, _ = make("http://a")
    lease = pool.lease()
    assert lease is not None
    with pytest.raises(RuntimeError), lease:
        assert lease.replica.in_flight == 1
        raise RuntimeError("the attempt failed")
    assert lease.replica.in_flight == 0


def test_p2c_never_picks_the_busier_of_two_when_the_other_is_idle() -> None:
    pool, _ = make("http://a", "http://b", "http://c")
    busy = pool.replicas[0]
    busy.in_flight = 5
    picks = Counter(take(pool).url for _ in range(300))
    assert picks["http://a"] == 0
    assert picks["http://b"] > 100 and picks["http://c"] > 100


def test_p2c_draws_in_proportion_to_the_weights() -> None:
    pool, _ = make("http://a", "http://b", weights=(3, 1))
    picks = Counter(take(pool).url for _ in range(4000))
    # idle replicas: the first drawn wins, and it is drawn 3 times in 4
    assert 0.70 < picks["http://a"] / 4000 < 0.80


def test_p2c_compares_load_per_unit_of_weight() -> None:
    pool, _ = make("http://a", "http://b", weights=(4, 1))
    pool.replicas[0].in_flight = 3  # 3/4 per unit of weight, less than b's 1/1
    pool.replicas[1].in_flight = 1
    assert {take(pool).url for _ in range(50)} == {"http://a"}


def test_round_robin_interleaves_turns_in_proportion_to_the_weights() -> None:
    pool, _ = make("http://a", "http://b", "http://c", balance="round_robin", weights=(2, 1, 1))
    picks = [take(pool).url[-1] for _ in range(8)]
    assert picks == ["a", "b", "c", "a", "a", "b", "c", "a"]


def test_excluded_replicas_are_not_chosen_and_none_is_left_when_all_are() -> None:
    pool, _ = make("http://a", "http://b")
    a, b = pool.replicas
    assert {take(pool, (a,)).url for _ in range(20)} == {"http://b"}
    assert pool.lease((a, b)) is None
    assert not pool.available((a, b)) and pool.available((a,))


def test_the_breaker_opens_after_consecutive_failures_and_a_success_resets_the_count() -> None:
    pool, _ = make("http://a", "http://b")
    a = pool.replicas[0]
    fail(pool, a, 2)
    lease = pool.lease([pool.replicas[1]])
    assert lease is not None
    with lease:
        lease.success()
    fail(pool, a, 2)
    assert state(a) == "closed"  # 2, success, 2: never 3 in a row
    fail(pool, a)
    assert state(a) == "open" and not a.healthy and a.last_error == "HTTP 503"
    assert {take(pool).url for _ in range(20)} == {"http://b"}


def test_an_open_breaker_lets_one_probe_at_a_time_after_open_s_and_closes_after_successes() -> None:
    pool, clock = make("http://a")
    a = pool.replicas[0]
    fail(pool, a, 3)
    assert pool.lease() is None
    assert pool.retry_after() == 10
    clock.now += 9.5
    assert pool.lease() is None and pool.retry_after() == 1
    clock.now += 0.5
    probe = pool.lease()
    assert probe is not None and a.state == "half_open"
    with probe:
        assert pool.lease() is None  # one probe at a time
        probe.success()
    assert state(a) == "half_open"  # one success of two
    second = pool.lease()
    assert second is not None
    with second:
        second.success()
    assert state(a) == "closed" and a.healthy and a.last_error == ""
    x, y = pool.lease(), pool.lease()
    assert x is not None and y is not None
    assert x.replica is y.replica is a  # closed: no limit on concurrent requests


def test_a_failed_probe_opens_the_breaker_again_for_a_full_open_s() -> None:
    opened: list[tuple[str, str]] = []
    clock = Clock()
    pool = ReplicaSet(clock=clock, on_open=lambda p, u: opened.append((p, u))).pool("m", ["http://a"], breaker=BREAKER)
    a = pool.replicas[0]
    fail(pool, a, 3)
    clock.now += 10
    fail(pool, a)
    assert a.state == "open" and pool.retry_after() == 10
    assert opened == [("m", "http://a"), ("m", "http://a")]


def test_state_is_kept_by_url_across_pools_and_generations_and_forgotten_when_unlisted() -> None:
    clock = Clock()
    replicas = ReplicaSet(clock=clock)
    first = replicas.pool("m", ["http://a", "http://b"], breaker=BREAKER)
    fail(first, first.replicas[0], 3)
    second = replicas.pool("m", ["http://a", "http://c"], breaker=BREAKER)  # the next generation
    assert second.replicas[0] is first.replicas[0] and second.replicas[0].state == "open"
    replicas.retain(["http://a", "http://c"])
    assert [r["url"] for r in replicas.snapshot()] == ["http://a", "http://c"]
    assert [r["breaker"] for r in replicas.snapshot()] == ["open", "closed"]
    # a request still holding the old generation's pool keeps a working replica object
    assert take(first, (first.replicas[0],)).url == "http://b"


def test_an_unknown_balance_policy_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown balance"):
        Pool("m", [Replica("http://a")], balance="random")


def test_affinity_sends_a_key_to_one_replica_and_spreads_keys_over_all() -> None:
    pool, _ = make("http://a", "http://b", "http://c", "http://d", balance="affinity")
    for key in (b"chat-1", b"chat-2"):
        lease = pool.lease(key=key)
        assert lease is not None
        with lease:
            home = lease.replica
        assert {take_key(pool, key) for _ in range(20)} == {home.url}
    homes = Counter(take_key(pool, f"chat-{i}".encode()) for i in range(2000))
    assert set(homes) == {"http://a", "http://b", "http://c", "http://d"}
    assert all(300 < n < 700 for n in homes.values())  # about 500 each


def test_affinity_moves_a_key_on_when_its_replica_is_over_the_load_bound_or_excluded() -> None:
    pool, _ = make("http://a", "http://b", balance="affinity")
    home = next(r for r in pool.replicas if r.url == take_key(pool, b"k"))
    other = next(r for r in pool.replicas if r is not home)
    home.in_flight = 2  # bound: ceil(1.25 * (2 + 0 + 1) / 2) = 2, and 2 + 1 > 2
    assert take_key(pool, b"k") == other.url
    home.in_flight = 1  # ceil(1.25 * 2 / 2) = 2: within it
    assert take_key(pool, b"k") == home.url
    lease = pool.lease([home], key=b"k")  # a retry goes on around the ring
    assert lease is not None and lease.replica is other


def test_affinity_without_a_key_is_p2c() -> None:
    pool, _ = make("http://a", "http://b", balance="affinity")
    pool.replicas[0].in_flight = 3
    assert {take(pool).url for _ in range(20)} == {"http://b"}


def take_key(pool: Pool, key: bytes) -> str:
    lease = pool.lease(key=key)
    assert lease is not None
    with lease:
        return lease.replica.url


def test_a_replica_that_said_429_is_passed_over_while_another_is_free() -> None:
    pool, clock = make("http://a", "http://b")
    a, b = pool.replicas
    lease = pool.lease([b])
    assert lease is not None
    with lease:
        lease.busy(2.0)
    assert a.healthy and {take(pool).url for _ in range(20)} == {"http://b"}
    assert take(pool, (b,)).url == "http://a"  # the only one left: still tried
    clock.now += 2.0
    assert {take(pool).url for _ in range(40)} == {"http://a", "http://b"}


def test_outcomes_of_requests_sent_before_the_breaker_opened_do_not_move_it() -> None:
    pool, clock = make("http://a")
    a = pool.replicas[0]
    slow = pool.lease()  # sent while closed; it will answer long after
    assert slow is not None
    fail(pool, a, 3)
    clock.now += 10
    probe = pool.lease()
    assert probe is not None and state(a) == "half_open"
    with slow:
        slow.success()  # stale: says nothing about the replica since it opened
        slow.failure("late")  # nor this
    assert state(a) == "half_open" and a.epoch == 1
    with probe:
        probe.success()  # the probe's outcome is known: its place frees at once
        assert a.probes == 0 and pool.lease() is not None
        probe.failure("broke off mid-stream")  # and a later break still counts
    assert state(a) == "open"


def test_panic_takes_a_replica_when_none_admits_a_request() -> None:
    pool, _ = make("http://service")  # one URL: a whole fleet behind a Service
    fail(pool, pool.replicas[0], 3)
    assert pool.lease() is None
    lease = pool.lease(panic=True)
    assert lease is not None and lease.replica.url == "http://service"
    with lease:
        assert pool.lease([lease.replica], panic=True) is None  # a retry still goes elsewhere or nowhere

"""What a keyed request's limits cost: per process (KeyLimits) against shared through a real
redis-server on loopback (SharedLimits), side by side in one run.

    python -m bench.limits [--requests 2000] [--concurrency 1 32] [--repeats 5]

For each arm, ``requests`` admissions (at once where no wait is needed, as the front door asks
them: ``admit_now``, else ``admit``) and ends of one key with a request rate, token budgets and
``max_concurrency`` (each end spending 100 tokens), ``concurrency`` at a time; the median over
``repeats`` of the wall µs a request, the scripts the store ran a request (its commandstats)
and the round trips a request took (pipelines: the scripts of one event-loop turn go together).
Bounded: it stops by itself, and the redis-server it starts goes with it.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry

from gateway.admission.auth import KeyLimits
from gateway.admission.shared import SharedLimits
from gateway.config import ApiKey, LimitsStoreConfig, RateLimit
from gateway.metrics import GatewayMetrics
from tools.redis_server import RedisServer

KEY = ApiKey("bench", key_sha256="0" * 64, rate_limit=RateLimit(1e9, 10**9, None, 1e12, 1e13), max_concurrency=10**6)
# the same limits without max_concurrency: leased by the process (gateway.admission.leases)
LEASED = ApiKey("leased", key_sha256="1" * 64, rate_limit=RateLimit(1e9, 10**9, None, 1e12, 1e13))


async def _run(limits: Any, requests: int, concurrency: int, key: ApiKey = KEY) -> float:
    """Wall seconds for ``requests`` admissions and ends, ``concurrency`` at a time (a leased
    key's: with what it spent written and its lease given back)."""
    left = requests

    async def worker() -> None:
        nonlocal left
        while left > 0:
            left -= 1
            _, slot = limits.admit_now(key) or await limits.admit(key)  # as the front door asks
            limits.finish(key, 100, slot)

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    if isinstance(limits, SharedLimits):
        if limits._ending:
            await asyncio.wait(limits._ending)
        await limits.settle()
    return time.perf_counter() - started


def _calls(client: Any) -> int:
    stats = client.info("commandstats")
    return sum(v["calls"] for k, v in stats.items() if k in ("cmdstat_evalsha", "cmdstat_eval"))


async def main_async(args: argparse.Namespace) -> None:
    import redis

    with tempfile.TemporaryDirectory() as where:
        server = RedisServer(Path(where))
        try:
            counter = redis.Redis.from_url(server.url)
            shared = SharedLimits(LimitsStoreConfig(server.url, 1000.0), GatewayMetrics(CollectorRegistry()))
            local = KeyLimits()
            print(
                "| concurrency | per process µs a request | shared (Redis) µs a request | x | scripts a request "
                "| round trips a request | leased (no max_concurrency) µs a request | x | scripts a request |"
            )
            print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
            for concurrency in args.concurrency:
                await _run(shared, 200, concurrency)  # warm: the scripts loaded, the connections open
                await _run(shared, 200, concurrency, LEASED)
                times: dict[str, list[float]] = {"local": [], "shared": [], "leased": []}
                scripts: list[float] = []
                leased: list[float] = []
                trips: list[float] = []
                for _ in range(args.repeats):  # alternating, so that the machine's drift hits both
                    times["local"].append(await _run(local, args.requests, concurrency))
                    before, sent = _calls(counter), shared.round_trips
                    times["shared"].append(await _run(shared, args.requests, concurrency))
                    scripts.append((_calls(counter) - before) / args.requests)
                    trips.append((shared.round_trips - sent) / args.requests)
                    before = _calls(counter)
                    times["leased"].append(await _run(shared, args.requests, concurrency, LEASED))
                    leased.append((_calls(counter) - before) / args.requests)
                a = statistics.median(times["local"]) / args.requests * 1e6
                b = statistics.median(times["shared"]) / args.requests * 1e6
                c = statistics.median(times["leased"]) / args.requests * 1e6
                print(
                    f"| {concurrency} | {a:.1f} | {b:.1f} | {b / a:.1f} | {statistics.median(scripts):.2f} "
                    f"| {statistics.median(trips):.2f} | {c:.1f} | {c / a:.1f} | {statistics.median(leased):.3f} |"
                )
            counter.close()
            await shared.close()
        finally:
            server.kill()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--repeats", type=int, default=5)
    asyncio.run(main_async(parser.parse_args()))


if __name__ == "__main__":
    main()

"""A key's admitted rate across gateway processes, against its limit: ``serve --workers 2`` with
the key's limits per process, then shared through a real redis-server on loopback.

    python -m bench.across [--rate 1200] [--burst 20] [--duration 10] [--connections 32]

A third arm runs two gateways of one process each on the same store, wrk's connections divided
between them (two wrk at once): the key's limit across gateways, not only across workers.

Each arm starts a stand-in upstream, the gateway (two workers: the kernel spreads wrk's
connections over them) and, for the shared arm, redis-server; wrk sends the key's requests from
``connections`` connections for ``duration`` seconds, far more than the key may send. What a
limit allows in that time is ``burst + rate/60 * duration``; the report gives what each arm
admitted (2xx) against it. Bounded: every run stops by itself, and its processes go with it.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import hashlib
import json
import os
import tempfile
import time
import urllib.request
from pathlib import Path

from bench import wrk
from bench.common import free_port
from bench.hop import chat_body, gateway_command, start_server, start_standin, stop
from tools.redis_server import RedisServer

KEY = "sk-across-0123456789"
TIMEOUT_MS = 500  # a store call that outlasts it admits the request (on_failure: open)
ADMIN_TOKEN = "bench-across-admin"  # the gateways' admin token: /readyz says which worker answered


def both_workers(url: str, n: int = 2) -> None:
    """Until each worker has answered a new connection (bounded): wrk's connections then spread
    over all of them, not over the first one up."""
    seen: set[int] = set()
    deadline = time.monotonic() + 30
    while len(seen) < n:
        if time.monotonic() > deadline:
            raise RuntimeError(f"only workers {sorted(seen)} answered")
        ask = urllib.request.Request(url + "/readyz", headers={"Authorization": f"Bearer {ADMIN_TOKEN}"})
        with urllib.request.urlopen(ask, timeout=5) as response:  # a new connection each time
            seen.add(json.loads(response.read())["worker"]["index"])


def config(port: int, upstream: str, rate: float, burst: int, store: str | None) -> str:
    digest = hashlib.sha256(KEY.encode()).hexdigest()
    shared = f", limits_store: {{url: '{store}', timeout_ms: {TIMEOUT_MS}}}" if store else ""
    return (
        "version: 1\n"
        f"server: {{host: 127.0.0.1, port: {port}, reload_interval_s: 0, access_log: false, "
        f"drain_grace_s: 0{shared}}}\n"
        "auth:\n  keys:\n"
        f"    - {{name: tenant, key_sha256: {digest}, rate_limit: {{requests_per_minute: {rate:g}, burst: {burst}}}}}\n"
        f"models:\n  - {{name: bench, upstreams: [{upstream}], accepts: [text]}}\n"
    )


def arm(tmp: Path, args: argparse.Namespace, shared: bool, gateways: int = 1) -> tuple[int, int, float]:
    """(admitted, refused, seconds wrk ran) of one run: one gateway of two workers, or
    ``gateways`` gateways of one process each (wrk's connections divided among them, run at once)."""
    redis = RedisServer(tmp) if shared else None
    servers = []
    try:
        upstream = start_standin("stand-in upstream", tmp)
        servers.append(upstream)
        urls = []
        for n in range(gateways):
            port = free_port()
            path = tmp / f"routing-{port}.yaml"
            path.write_text(config(port, upstream.url, args.rate, args.burst, redis.url if redis else None))
            workers = 2 if gateways == 1 else 1
            gateway = start_server(f"gateway {n}", gateway_command(path, workers), f"http://127.0.0.1:{port}",
                                   "/healthz", tmp)  # fmt: skip
            servers.append(gateway)
            if workers > 1:
                both_workers(gateway.url)
            urls.append(gateway.url)
        body = tmp / "body.json"
        body.write_bytes(chat_body("bench"))
        script = tmp / "post.lua"
        script.write_text(
            wrk.lua_script([body], {"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"})
        )
        connections = max(1, args.connections // len(urls))
        with concurrent.futures.ThreadPoolExecutor(len(urls)) as pool:
            runs = list(
                pool.map(
                    lambda url: wrk.run(
                        url + "/v1/chat/completions", script, connections=connections, duration_s=args.duration
                    ),
                    urls,
                )
            )
        admitted = sum(r.requests - r.non_2xx for r in runs)
        return admitted, sum(r.non_2xx for r in runs), max(r.duration_s for r in runs)
    finally:
        for server in reversed(servers):
            stop(server)
        if redis is not None:
            redis.kill()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rate", type=float, default=1200.0, help="the key's requests_per_minute")
    parser.add_argument("--burst", type=int, default=20)
    parser.add_argument("--duration", type=int, default=10)
    parser.add_argument("--connections", type=int, default=32)
    args = parser.parse_args()
    os.environ["GATEWAY_ADMIN_TOKEN"] = ADMIN_TOKEN  # the gateways it starts inherit it
    print(f"a key of {args.rate:g} requests a minute, burst {args.burst}, {args.connections} connections")
    print(
        "| limits | seconds | allowed (burst + rate x seconds) | admitted (2xx) | refused (non-2xx) "
        "| admitted / allowed |"
    )
    print("|---|---:|---:|---:|---:|---:|")
    for shared, gateways in ((False, 1), (True, 1), (True, 2)):
        with tempfile.TemporaryDirectory() as where:
            admitted, refused, seconds = arm(Path(where), args, shared, gateways)
        allowed = args.burst + args.rate / 60 * seconds
        name = "shared (server.limits_store)" if shared else "per process"
        where_ = "2 workers" if gateways == 1 else f"{gateways} gateways"
        print(
            f"| {name}, {where_} | {seconds:.2f} | {allowed:.0f} | {admitted} | {refused} | {admitted / allowed:.2f} |"
        )


if __name__ == "__main__":
    main()

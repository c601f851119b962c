"""What the client sees when replicas fail (issue 8, "a front door that loses no request"): the
"Faults and what the client saw" table of docs/reliability.md.

Each scenario starts a fresh gateway (create_app, served as `serve` serves it) in front of stand-in
upstreams (tools.standin), all in this process on 127.0.0.1, breaks some replicas the way the
scenario says, sends a bounded load of chat requests (``--requests`` at ``--concurrency``, every
one with a timeout), and reads the gateway's own metrics afterwards. Nothing outside loopback,
nothing left running: every server is closed at the end of its scenario, errors included.

    .venv/bin/python -m bench.faults [--requests 400] [--concurrency 16] [--only NAME ...]

"failed" counts what a client would call a failure: any status but 200, or a connection error.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import platform
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

import aiohttp
import orjson
from aiohttp import web
from aiohttp.typedefs import Handler
from prometheus_client import CollectorRegistry

from bench.common import free_port, percentile_ms
from gateway.config import parse_config
from gateway.server.app import SERVER_OPTIONS, create_app
from tools.standin import StandIn

MODEL = "m"
BODY = orjson.dumps({"model": MODEL, "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]})
REQUEST_TIMEOUT_S = 30.0  # per client request; nothing here should come near it
KILL_AFTER = 50  # the killed replica goes down when this many requests reached it (fewer for a short load)
KILLED_DELAY_MS = 10  # both replicas' answer time in that scenario


# --- servers ----------------------------------------------------------------------------------


@dataclass
class Server:
    runner: web.AppRunner
    url: str

    async def kill(self) -> None:
        """What SIGKILL does to an engine: the listener goes (new connections are refused) and every
        open connection is dropped, requests in flight included."""
        for site in list(self.runner.sites):
            await site.stop()
        server = self.runner.server
        assert server is not None
        for handler in server.connections:
            if handler.transport is not None:
                handler.transport.abort()


async def serve(app: web.Application, **options: object) -> Server:
    runner = web.AppRunner(app, shutdown_timeout=1.0, **options)  # type: ignore[arg-type]
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    host, port = runner.addresses[0][:2]
    return Server(runner, f"http://{host}:{port}")


@dataclass
class Replica:
    """A stand-in upstream; ``url`` only (no server) for a port nothing listens on."""

    name: str
    standin: StandIn
    url: str
    server: Server | None = None


@dataclass
class Lab:
    replicas: list[Replica]
    gateway_url: str
    registry: CollectorRegistry

    def total(self, metric: str, **labels: str) -> float:
        """The sum of a metric's samples whose labels include ``labels``."""
        return sum(
            s.value
            for family in self.registry.collect()
            for s in family.samples
            if s.name == metric and all(s.labels.get(k) == v for k, v in labels.items())
        )

    def by_label(self, metric: str, label: str) -> dict[str, float]:
        out: dict[str, float] = {}
        for family in self.registry.collect():
            for s in family.samples:
                if s.name == metric and s.value:
                    out[s.labels[label]] = out.get(s.labels[label], 0.0) + s.value
        return out


@contextlib.asynccontextmanager
async def lab(
    names: list[str],
    *,
    options: str = "",
    refused: tuple[str, ...] = (),
    prepare: Callable[[str, StandIn, web.Application], None] = lambda name, standin, app: None,
) -> AsyncIterator[Lab]:
    """Stand-ins named ``names`` (those in ``refused``: a loopback port nothing listens on) behind
    a gateway whose model ``m`` lists them all, with ``options`` added to the model's entry;
    ``prepare`` sees each stand-in's app before it is served."""
    async with contextlib.AsyncExitStack() as stack:
        replicas = []
        for name in names:
            standin = StandIn(name)
            if name in refused:
                replicas.append(Replica(name, standin, f"http://127.0.0.1:{free_port()}"))
                continue
            app = standin.app()
            prepare(name, standin, app)
            server = await serve(app)
            stack.push_async_callback(server.runner.cleanup)
            replicas.append(Replica(name, standin, server.url, server))
        urls = ", ".join(r.url for r in replicas)
        extra = f", {options}" if options else ""
        routing = f"""version: 1
server: {{reload_interval_s: 0}}
models:
  - {{name: {MODEL}, upstreams: [{urls}], accepts: [text]{extra}}}
"""
        registry = CollectorRegistry()
        gateway = await serve(create_app(parse_config(routing), registry=registry, watch=False), **SERVER_OPTIONS)
        stack.push_async_callback(gateway.runner.cleanup)
        yield Lab(replicas, gateway.url, registry)


# --- load -------------------------------------------------------------------------------------


@dataclass
class Load:
    statuses: Counter[int] = field(default_factory=Counter)  # 0: a connection error
    codes: Counter[str] = field(default_factory=Counter)  # "503 no_healthy_upstream", ...
    retry_after: Counter[str] = field(default_factory=Counter)
    latencies: list[float] = field(default_factory=list)
    elapsed: float = 0.0

    @property
    def ok(self) -> int:
        return self.statuses[200]

    @property
    def failed(self) -> int:
        return sum(n for status, n in self.statuses.items() if status != 200)

    def seen(self) -> str:
        """What the client saw besides 200s, e.g. ``503 no_healthy_upstream x395 (Retry-After: 5)``."""
        parts = [f"{code} x{n}" for code, n in self.codes.most_common()]
        if self.retry_after:
            parts.append("Retry-After: " + "/".join(sorted(self.retry_after, key=float)))
        return ", ".join(parts)


async def load(url: str, n: int, concurrency: int) -> Load:
    """``n`` chat requests, ``concurrency`` at a time."""
    result = Load()
    numbers = iter(range(n))
    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
    connector = aiohttp.TCPConnector(limit=concurrency)
    headers = {"Content-Type": "application/json"}
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:

        async def worker() -> None:
            for _ in numbers:
                t0 = time.perf_counter()
                try:
                    async with session.post(f"{url}/v1/chat/completions", data=BODY, headers=headers) as resp:
                        payload = await resp.read()
                        status = resp.status
                        if status != 200:
                            result.codes[f"{status} {_error_code(payload)}"] += 1
                            if "Retry-After" in resp.headers:
                                result.retry_after[resp.headers["Retry-After"]] += 1
                except (aiohttp.ClientError, TimeoutError) as exc:
                    status = 0
                    result.codes[f"connection error ({type(exc).__name__})"] += 1
                result.statuses[status] += 1
                result.latencies.append(time.perf_counter() - t0)

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        result.elapsed = time.perf_counter() - t0
    result.latencies.sort()
    return result


def _error_code(payload: bytes) -> str:
    """The error's ``code``: the gateway's own (no_healthy_upstream), or the engine's, relayed."""
    try:
        error = orjson.loads(payload)["error"]
    except (orjson.JSONDecodeError, KeyError, TypeError):
        return "(no error body)"
    code = error.get("code")
    if isinstance(code, str):
        return code
    return "relayed from the engine"  # the stand-in's code is its status, an int


# --- scenarios --------------------------------------------------------------------------------


@dataclass
class Row:
    scenario: str
    requests: int
    ok: int
    failed: int
    retries: float
    ejections: float
    note: str


def row(name: str, lab_: Lab, result: Load, *notes: str) -> Row:
    return Row(
        name,
        sum(result.statuses.values()),
        result.ok,
        result.failed,
        lab_.total("gateway_retries_total"),
        lab_.total("gateway_upstream_ejections_total"),
        "; ".join(n for n in notes if n),
    )


def share(lab_: Lab) -> str:
    """Who served the 200s (the stand-in counts the answers it completed)."""
    total = sum(r.standin.served for r in lab_.replicas) or 1
    return " / ".join(f"{r.name} {100 * r.standin.served / total:.0f}%" for r in lab_.replicas)


def attempts(lab_: Lab, *names: str) -> str:
    """Requests that reached each named replica (the stand-in records every one it read)."""
    return ", ".join(f"{r.name} got {len(r.standin.received)}" for r in lab_.replicas if r.name in names)


def reasons(lab_: Lab) -> str:
    by = lab_.by_label("gateway_retries_total", "reason")
    return "retries: " + ", ".join(f"{k} {v:.0f}" for k, v in sorted(by.items())) if by else ""


def speed(result: Load) -> str:
    p50, p99 = percentile_ms(result.latencies, 0.5), percentile_ms(result.latencies, 0.99)
    return f"{len(result.latencies) / result.elapsed:,.0f} req/s, p50 {p50:.0f} ms, p99 {p99:.0f} ms"


Args = argparse.Namespace
Scenario = Callable[[Args], Awaitable[Row]]


async def healthy(args: Args) -> Row:
    async with lab(["a", "b"]) as lab_:
        result = await load(lab_.gateway_url, args.requests, args.concurrency)
        return row("healthy baseline", lab_, result, share(lab_), speed(result))


async def refused(args: Args) -> Row:
    async with lab(["down", "up"], refused=("down",)) as lab_:
        result = await load(lab_.gateway_url, args.requests, args.concurrency)
        return row(
            "one replica refuses connections", lab_, result, "connect errors: free of the budget",
            reasons(lab_), result.seen(),
        )  # fmt: skip


async def _faulty(args: Args, name: str, set_fault: Callable[[StandIn], None], *extra: str) -> Row:
    async with lab(["bad", "good"]) as lab_:
        set_fault(lab_.replicas[0].standin)
        result = await load(lab_.gateway_url, args.requests, args.concurrency)
        refused_ = lab_.total("gateway_retries_refused_total")
        return row(
            name, lab_, result, attempts(lab_, "bad"), reasons(lab_),
            f"retries_refused {refused_:.0f}" if refused_ else "", *extra, result.seen(),
        )  # fmt: skip


async def status_503(args: Args) -> Row:
    return await _faulty(args, "one replica answers 503", lambda s: setattr(s, "fail_status", 503))


async def status_429(args: Args) -> Row:
    return await _faulty(
        args, "one replica answers 429", lambda s: setattr(s, "fail_status", 429),
        "a 429 does not count against the breaker: never ejected",
    )  # fmt: skip


async def resets(args: Args) -> Row:
    return await _faulty(args, "one replica resets every connection", lambda s: setattr(s, "reset", True))


async def killed(args: Args) -> Row:
    kill_after = max(1, min(KILL_AFTER, args.requests // 8))
    reached = asyncio.Event()
    in_hand = [0]  # requests the doomed replica is working on

    def watch(name: str, standin: StandIn, app: web.Application) -> None:
        @web.middleware
        async def count(request: web.Request, handler: Handler) -> web.StreamResponse:
            if len(standin.received) + 1 >= kill_after:  # dies while this one is in its hands
                reached.set()
            in_hand[0] += 1
            try:
                return await handler(request)
            finally:
                in_hand[0] -= 1

        if name == "doomed":
            app.middlewares.append(count)

    async with lab(["doomed", "survivor"], prepare=watch) as lab_:
        doomed = lab_.replicas[0]
        assert doomed.server is not None
        for r in lab_.replicas:  # an engine takes a while: requests are in flight on it when it dies
            r.standin.delay_ms = KILLED_DELAY_MS
        at_death: list[int] = []

        async def kill_when_reached(server: Server) -> None:
            await reached.wait()
            at_death.extend((doomed.standin.served, in_hand[0]))
            await server.kill()

        killer = asyncio.create_task(kill_when_reached(doomed.server))
        try:
            result = await load(lab_.gateway_url, args.requests, args.concurrency)
        finally:
            killer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await killer
        death = (
            f"doomed had served {at_death[0]} and had {at_death[1]} in flight when it died"
            if at_death
            else "NOT KILLED (load too short)"
        )
        return row(
            "one replica killed mid-load", lab_, result, f"both answer in {KILLED_DELAY_MS} ms", death, reasons(lab_),
            result.seen(),
        )  # fmt: skip


async def _slow(args: Args, balance: str) -> Row:
    async with lab(["slow", "fast"], options=f"balance: {balance}") as lab_:
        lab_.replicas[0].standin.delay_ms = 100
        result = await load(lab_.gateway_url, args.requests, args.concurrency)
        return row(f"one slow replica (+100 ms), {balance}", lab_, result, share(lab_), speed(result))


async def slow_p2c(args: Args) -> Row:
    return await _slow(args, "p2c")


async def slow_round_robin(args: Args) -> Row:
    return await _slow(args, "round_robin")


async def all_503(args: Args) -> Row:
    async with lab(["a", "b"]) as lab_:
        for r in lab_.replicas:
            r.standin.fail_status = 503
        result = await load(lab_.gateway_url, args.requests, args.concurrency)
        return row("all replicas answer 503", lab_, result, attempts(lab_, "a", "b"), "client saw: " + result.seen())


async def budget(args: Args) -> Row:
    # Breakers that never open, so that every request meets every failing replica: the budget alone
    # bounds the extra load (with breakers, all four would be ejected after ~20 requests).
    options = "retries: {attempts: 3, budget: 0.1, min_per_s: 1}, breaker: {failures: 1000000}"
    async with lab(["u1", "u2", "u3", "u4"], options=options) as lab_:
        for r in lab_.replicas:
            r.standin.fail_status = 503
        result = await load(lab_.gateway_url, args.requests, args.concurrency)
        sent = sum(len(r.standin.received) for r in lab_.replicas)
        n = sum(result.statuses.values())
        refused_ = lab_.total("gateway_retries_refused_total")
        return row(
            "retry budget: 4 replicas all 503 (attempts 3, budget 0.1, min_per_s 1, breakers kept closed)",
            lab_, result, f"retries_refused {refused_:.0f}",
            f"{sent} upstream attempts = {sent / n:.2f} per request (4 with no budget)", "client saw: " + result.seen(),
        )  # fmt: skip


SCENARIOS: dict[str, Scenario] = {
    "healthy": healthy,
    "refused": refused,
    "503": status_503,
    "429": status_429,
    "reset": resets,
    "killed": killed,
    "slow-p2c": slow_p2c,
    "slow-round-robin": slow_round_robin,
    "all-503": all_503,
    "budget": budget,
}


def print_table(rows: list[Row]) -> None:
    print("| scenario | requests | 200s | failed | retries | ejections | note |")
    print("|---|---:|---:|---:|---:|---:|---|")
    for r in rows:
        numbers = [str(r.requests), str(r.ok), str(r.failed), f"{r.retries:.0f}", f"{r.ejections:.0f}"]
        cells = [r.scenario, *numbers, r.note]
        print("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |", flush=True)


async def main(args: Args) -> None:
    started = time.monotonic()
    rows = []
    for name in args.only or SCENARIOS:
        t0 = time.monotonic()
        rows.append(await SCENARIOS[name](args))
        print(f"  {name}: {time.monotonic() - t0:.1f} s", file=sys.stderr, flush=True)
    elapsed = time.monotonic() - started
    print(
        f"\n{args.requests} requests per scenario, {args.concurrency} concurrent; "
        f"python {platform.python_version()}, aiohttp {aiohttp.__version__}; {elapsed:.1f} s in all\n"
    )
    print_table(rows)


def parse_args(argv: list[str] | None = None) -> Args:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=400, help="chat requests per scenario (default 400)")
    parser.add_argument("--concurrency", type=int, default=16, help="requests in flight at once (default 16)")
    parser.add_argument("--only", nargs="+", choices=list(SCENARIOS), help="run only these scenarios")
    parser.add_argument("--log-level", default="critical", help="the gateway's log level (default: critical)")
    args = parser.parse_args(argv)
    if args.requests < 1 or args.concurrency < 1:
        parser.error("--requests and --concurrency must be at least 1")
    return args


if __name__ == "__main__":
    arguments = parse_args()
    logging.basicConfig(level=arguments.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    asyncio.run(main(arguments))

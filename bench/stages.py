"""The gateway's request stages timed where they run: inside a live gateway, between requests.

A stage timed in a hot loop (the same body admitted 20,000 times over) comes out two to three
times cheaper than the same stage inside the server, where every request runs the whole stack
between one call of it and the next (aiohttp's parser, the upstream client, the relay), and
finds its code and data cold. A change sized in a hot loop can look like a tenth of a request's
cost and move nothing; this measures each stage in place.

It runs a stand-in upstream and the gateway in one process on loopback, sends ``n`` requests of
each scenario through it (one at a time, keep-alive, the scenarios interleaved), and wraps each
stage function of the gateway (every module that imported it sees the wrapper) with a
``perf_counter_ns`` on each side: inclusive time, µs a request, median of the rounds. A wrapper
costs ~0.2 µs a call; the hot-loop column runs the stage's own call on the same body.

    .venv/bin/python -m bench.stages                       # text, 100 KiB image, counted and not
    .venv/bin/python -m bench.stages -n 500 --rounds 7 --size 2097152
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import inspect
import statistics
import sys
import time
import timeit
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import aiohttp
import orjson

from bench.calls import _serve, config_text
from bench.hop import image_body
from gateway.admission import body, dimensions, plan, strings, tokens, visual
from gateway.config import parse_config
from gateway.server.app import SERVER_OPTIONS, create_app
from tools.standin import StandIn

# (module, function): what a request's admission does, in the order it does it
STAGES = (
    (strings, "cut"),
    (body, "_count_brackets"),
    (strings, "parse"),
    (plan, "lookup"),
    (plan, "admit"),
    (plan, "_measure"),
    (visual, "_size"),
    (dimensions, "encoded_dimensions"),
    (tokens, "count"),
)
TEXT = b'{"model":"m","messages":[{"role":"user","content":"Hello there, how are you today?"}],"max_tokens":16}'


def scenarios(size: int) -> dict[str, bytes]:
    """Text; an image of ``size`` bytes to a model that counts its visual tokens; and not."""
    return {"text": TEXT, "image, counted": image_body("counted", size), "image, not counted": image_body("m", size)}


@contextmanager
def timed(stages: tuple[tuple[Any, str], ...]) -> Iterator[dict[str, int]]:
    """Each stage wrapped, in its module and wherever a gateway module imported it; the
    nanoseconds each spent, by name, in the dict yielded."""
    spent: dict[str, int] = {}
    patched: list[tuple[Any, str, Any]] = []
    for module, name in stages:
        original = getattr(module, name)
        assert not inspect.iscoroutinefunction(original), f"{name}: awaited, its time would be the wall's"

        def wrapper(*args: Any, __f: Callable[..., Any] = original, __name: str = name, **kwargs: Any) -> Any:
            started = time.perf_counter_ns()
            try:
                return __f(*args, **kwargs)
            finally:
                spent[__name] = spent.get(__name, 0) + time.perf_counter_ns() - started

        functools.update_wrapper(wrapper, original)
        for holder in [m for n, m in sys.modules.items() if n == "gateway" or n.startswith("gateway.")]:
            for attr, value in list(vars(holder).items()):
                if value is original:
                    setattr(holder, attr, wrapper)
                    patched.append((holder, attr, original))
    try:
        yield spent
    finally:
        for holder, attr, original in patched:
            setattr(holder, attr, original)


async def measure(size: int, n: int, rounds: int) -> dict[str, dict[str, float]]:
    """µs a request each stage took inside the gateway, by scenario (medians of ``rounds``);
    ``process`` is the whole process's CPU (client, upstream and gateway)."""
    upstream_runner, upstream = await _serve(StandIn().app())
    config = parse_config(config_text(upstream), filename="bench")
    gateway_runner, gateway = await _serve(create_app(config), **SERVER_OPTIONS)
    bodies = scenarios(size)
    rounds_of: dict[str, list[dict[str, float]]] = {name: [] for name in bodies}
    headers = {"Content-Type": "application/json"}
    try:
        async with aiohttp.ClientSession() as session:

            async def send(raw: bytes, times: int) -> None:
                for _ in range(times):
                    async with session.post(f"{gateway}/v1/chat/completions", data=raw, headers=headers) as resp:
                        if resp.status != 200:
                            raise SystemExit(f"the gateway answered {resp.status}: {await resp.text()}")
                        await resp.read()

            for raw in bodies.values():
                await send(raw, 30)  # connections open, first-call costs paid
            names = list(bodies)
            for r in range(rounds):
                for name in names[r % len(names) :] + names[: r % len(names)]:
                    with timed(STAGES) as spent:
                        cpu = time.process_time()
                        await send(bodies[name], n)
                        cpu = time.process_time() - cpu
                    row = {stage: ns / n / 1000 for stage, ns in spent.items()}
                    rounds_of[name].append(row | {"process": cpu / n * 1e6})
    finally:
        await gateway_runner.cleanup()
        await upstream_runner.cleanup()
    return {name: {k: statistics.median(r[k] for r in rows) for k in rows[0]} for name, rows in rounds_of.items()}


def hot(size: int, number: int = 2000) -> dict[str, dict[str, float]]:
    """The same work outside the server: each body parsed and admitted ``number`` times over."""
    config = parse_config(config_text("http://127.0.0.1:9"), filename="bench")
    server = config.server
    out: dict[str, dict[str, float]] = {}
    for name, raw in scenarios(size).items():
        parsed = orjson.loads(raw)

        def best(f: Callable[[], object]) -> float:
            return min(timeit.repeat(f, number=number, repeat=5)) / number * 1e6

        out[name] = {
            "parse_body": best(lambda raw=raw: body.parse_body(raw, server)),  # type: ignore[misc]
            "admit": best(lambda parsed=parsed: plan.admit(config, parsed)),  # type: ignore[misc]
        }
    return out


def render(inside: dict[str, dict[str, float]], outside: dict[str, dict[str, float]]) -> str:
    names = list(inside)
    lines = ["| stage | " + " | ".join(names) + " |", "|---|" + "---:|" * len(names)]
    for stage in [s for _, s in STAGES] + ["process"]:
        cells = [f"{inside[n].get(stage, 0):.1f}" for n in names]
        lines.append(f"| `{stage}` | " + " | ".join(cells) + " |")
    lines.append("")
    lines.append("| in a hot loop | " + " | ".join(names) + " |")
    lines.append("|---|" + "---:|" * len(names))
    for stage in ("parse_body", "admit"):
        lines.append(f"| `{stage}` | " + " | ".join(f"{outside[n][stage]:.1f}" for n in names) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-n", type=int, default=300, help="requests a scenario a round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--size", type=int, default=100 * 1024, help="the image request's body, bytes")
    parser.add_argument("--uvloop", action="store_true", help="on uvloop (as serve runs)")
    args = parser.parse_args(argv)
    coroutine = measure(args.size, args.n, args.rounds)
    if args.uvloop:
        import uvloop

        inside = uvloop.run(coroutine)
    else:
        inside = asyncio.run(coroutine)
    print("µs a request, inside the gateway (inclusive; medians of the rounds):\n")
    print(render(inside, hot(args.size)), end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

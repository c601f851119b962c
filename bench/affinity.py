"""How often a conversation's next turn reaches the replica that served its last one, by policy.

A replayed multi-turn trace: ``--chats`` conversations of ``--turns`` turns each, every one opening
with its own image (a data URL of ``--image-kb``) and resending its whole history each turn, as
chat clients do. Turns are sent ``--concurrency`` at a time, in an order shuffled with a fixed
seed (turn n of a chat only after its turn n-1 answered), through a real in-process gateway to
``--replicas`` stand-in engines that take ``--delay-ms`` a request, under ``round_robin``,
``p2c`` and ``affinity``.

"Same replica" is the fraction of turns after the first that went to the replica of the chat's
previous turn: where an engine's prefix cache (vLLM automatic prefix caching, SGLang radix cache)
and multimodal cache can hit at all. "Load" is the busiest replica's requests over the mean.

    .venv/bin/python -m bench.affinity [--chats 64] [--turns 6] [--replicas 4] [--concurrency 16]
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import random
import statistics
from collections import Counter

import aiohttp
from aiohttp import web
from aiohttp.test_utils import TestServer
from prometheus_client import CollectorRegistry

from gateway.config import parse_config
from gateway.server.app import SERVER_OPTIONS, create_app
from tools.standin import StandIn

POLICIES = ("round_robin", "p2c", "affinity")


async def start(app: web.Application) -> TestServer:
    server = TestServer(app, host="127.0.0.1", port=0)
    await server.start_server(**{k: v for k, v in SERVER_OPTIONS.items() if k != "handler_cancellation"})
    return server


def messages(chat: int, turn: int, image: str) -> list[dict[str, object]]:
    history: list[dict[str, object]] = [
        {"role": "system", "content": "You describe pictures."},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": f"chat {chat}: what is this?"},
                {"type": "image_url", "image_url": {"url": image}},
            ],
        },
    ]
    for i in range(turn):
        history += [{"role": "assistant", "content": f"answer {i}"}, {"role": "user", "content": f"and then {i}?"}]
    return history


async def replay(policy: str, args: argparse.Namespace, images: list[str]) -> tuple[float, float]:
    standins = [StandIn(f"r{i}", delay_ms=args.delay_ms) for i in range(args.replicas)]
    servers = [await start(s.app()) for s in standins]
    urls = [str(s.make_url("")).rstrip("/") for s in servers]
    config = parse_config(
        "version: 1\nserver: {reload_interval_s: 0}\nmodels:\n"
        f"  - {{name: m, upstreams: [{', '.join(urls)}], accepts: [text, image], balance: {policy}}}\n"
    )
    gateway = await start(create_app(config, registry=CollectorRegistry()))
    url = f"{str(gateway.make_url('')).rstrip('/')}/v1/chat/completions"
    rng = random.Random(7)
    next_turn = [0] * args.chats
    ready = list(range(args.chats))
    served_by: dict[tuple[int, int], int] = {}
    wake = asyncio.Condition()
    try:
        async with aiohttp.ClientSession() as session:

            async def worker() -> None:
                while True:
                    async with wake:
                        while not ready and any(t < args.turns for t in next_turn):
                            await wake.wait()
                        if not ready:
                            return
                        chat = ready.pop(rng.randrange(len(ready)))
                    turn = next_turn[chat]
                    body = {"model": "m", "max_tokens": 8, "messages": messages(chat, turn, images[chat])}
                    async with session.post(url, json=body) as resp:
                        reply = await resp.json()
                    assert resp.status == 200, reply
                    served_by[(chat, turn)] = int(reply["choices"][0]["message"]["content"][2:].split("]")[0])
                    async with wake:
                        next_turn[chat] += 1
                        if next_turn[chat] < args.turns:
                            ready.append(chat)
                        wake.notify_all()

            await asyncio.gather(*(worker() for _ in range(args.concurrency)))
    finally:
        await gateway.close()
        for server in servers:
            await server.close()
    same = sum(served_by[(c, t)] == served_by[(c, t - 1)] for c in range(args.chats) for t in range(1, args.turns))
    load = Counter(served_by.values())
    return same / (args.chats * (args.turns - 1)), max(load.values()) / statistics.mean(load.values())


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--chats", type=int, default=64)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--delay-ms", type=int, default=20)
    parser.add_argument("--image-kb", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    rng = random.Random(1)
    images = [
        "data:image/png;base64," + base64.b64encode(rng.randbytes(args.image_kb * 768)).decode()
        for _ in range(args.chats)
    ]
    print(f"{args.chats} chats x {args.turns} turns, {args.replicas} replicas, concurrency {args.concurrency}")
    print("| policy | same replica as the previous turn | busiest replica / mean |")
    print("|---|---|---|")
    for policy in POLICIES:
        runs = [await replay(policy, args, images) for _ in range(args.repeats)]
        hit = statistics.median(r[0] for r in runs)
        load = statistics.median(r[1] for r in runs)
        print(f"| {policy} | {hit:.0%} | {load:.2f} |")


if __name__ == "__main__":
    asyncio.run(main())

"""How long an edit of routing.yaml takes to be live, with the default polling, under a light load.

A real in-process gateway watches its file (``server.reload_interval_s`` at its default, 0.5 s)
while a client keeps ``--concurrency`` requests going; each repeat rewrites the file with a new
model name and times until a request for the new name is answered 200. Bounded: ``--repeats``
edits, then it stops.

    .venv/bin/python -m bench.reload [--repeats 20] [--concurrency 4]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path

import aiohttp
from aiohttp.test_utils import TestServer
from prometheus_client import CollectorRegistry

from gateway.config import load_config
from gateway.server.app import SERVER_OPTIONS, create_app
from tools.standin import StandIn


def table(upstream: str, name: str) -> str:
    return f"version: 1\nmodels:\n  - {{name: {name}, upstreams: [{upstream}], accepts: [text]}}\n"


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--concurrency", type=int, default=4)
    args = parser.parse_args()
    options = {k: v for k, v in SERVER_OPTIONS.items() if k != "handler_cancellation"}
    engine = TestServer(StandIn("engine").app(), host="127.0.0.1", port=0)
    await engine.start_server(**options)
    upstream = str(engine.make_url("")).rstrip("/")
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "routing.yaml"
        path.write_text(table(upstream, "m0"))
        app = create_app(load_config(path), registry=CollectorRegistry(), config_path=str(path), watch=True)
        gateway = TestServer(app, host="127.0.0.1", port=0)
        await gateway.start_server(**options)
        url = f"{str(gateway.make_url('')).rstrip('/')}/v1/chat/completions"
        current = {"name": "m0"}
        stop = asyncio.Event()
        failed = 0
        async with aiohttp.ClientSession() as session:

            async def load() -> None:  # requests for the live name: none may fail across the edits
                nonlocal failed
                while not stop.is_set():
                    body = {"model": current["name"], "messages": [{"role": "user", "content": "hi"}]}
                    async with session.post(url, json=body) as resp:
                        await resp.read()
                        failed += resp.status not in (200, 404)  # 404: a name just replaced

            async def live(name: str) -> bool:
                body = {"model": name, "messages": [{"role": "user", "content": "hi"}]}
                async with session.post(url, json=body) as resp:
                    await resp.read()
                    return resp.status == 200

            loaders = [asyncio.create_task(load()) for _ in range(args.concurrency)]
            delays = []
            for i in range(1, args.repeats + 1):
                await asyncio.sleep(0.13 * (i % 4))  # edits at different phases of the polling
                name = f"m{i}"
                written = time.perf_counter()
                path.write_text(table(upstream, name))
                while not await live(name):
                    pass
                delays.append(time.perf_counter() - written)
                current["name"] = name
            stop.set()
            await asyncio.gather(*loaders)
        await gateway.close()
    await engine.close()
    delays.sort()
    print(
        f"{args.repeats} edits, reload_interval_s 0.5, {args.concurrency} requests in flight: write to live "
        f"median {statistics.median(delays) * 1000:.0f} ms, max {delays[-1] * 1000:.0f} ms; "
        f"failed requests: {failed}"
    )


if __name__ == "__main__":
    asyncio.run(main())

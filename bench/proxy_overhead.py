"""What the gateway adds to a request: latency and throughput through it vs straight to the upstream.

Runs a stand-in upstream and the gateway as separate processes on 127.0.0.1, then drives each
path from this process with aiohttp, side by side in one run: bounded (requests x repeats), stops
by itself. Reports medians over repeats.

    .venv/bin/python -m bench.proxy_overhead [--requests 300] [--repeats 5] [--concurrency 8]
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import aiohttp
import orjson

from bench.common import free_port, percentile_ms, wait_up
from gateway.admission.plan import admit
from gateway.config import parse_config


def body(model: str, image_bytes: int) -> bytes:
    content: list[dict[str, object]] = [{"type": "text", "text": "Describe the picture in one sentence."}]
    if model == "textonly":  # a part the text-only model refuses, so admission rejects the request
        content.append({"type": "video_url", "video_url": {"url": "data:video/mp4;base64,AAAA"}})
    if image_bytes:
        data = base64.b64encode(os.urandom(image_bytes * 3 // 4)).decode()
        content.append({"type": "image_url", "image_url": {"url": f"data:image/png;base64,{data}"}})
    return orjson.dumps({"model": model, "max_tokens": 16, "messages": [{"role": "user", "content": content}]})


async def run(url: str, payload: bytes, n: int, concurrency: int) -> tuple[float, float, float]:
    """(requests/s, p50 ms, p99 ms) for n requests at the given concurrency."""
    latencies: list[float] = []
    queue = iter(range(n))
    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=connector) as session:

        async def worker() -> None:
            for _ in queue:
                t0 = time.perf_counter()
                async with session.post(url, data=payload, headers={"Content-Type": "application/json"}) as resp:
                    await resp.read()
                latencies.append(time.perf_counter() - t0)

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        elapsed = time.perf_counter() - t0
    latencies.sort()
    return n / elapsed, percentile_ms(latencies, 0.50), percentile_ms(latencies, 0.99)


def micro(fn: Callable[[], object], repeats: int = 7, number: int = 200) -> float:
    """Median microseconds per call."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(number):
            fn()
        times.append((time.perf_counter() - t0) / number * 1e6)
    return statistics.median(times)


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--concurrency", type=int, default=8)
    args = parser.parse_args()

    up_port, gw_port = free_port(), free_port()
    up = f"http://127.0.0.1:{up_port}"
    routing = f"""version: 1
server: {{port: {gw_port}, max_body_bytes: 67108864, reload_interval_s: 0}}
models:
  - {{name: same, upstreams: [{up}], accepts: [text, image]}}
  - {{name: renamed, upstreams: [{up}], upstream_model: org/Renamed, accepts: [text, image]}}
  - {{name: textonly, upstreams: [{up}], accepts: [text]}}
"""
    with tempfile.TemporaryDirectory() as tmp:
        config = Path(tmp) / "routing.yaml"
        config.write_text(routing)
        procs = [
            await asyncio.create_subprocess_exec(
                sys.executable, "-m", "tools.standin", "--port", str(up_port), "--name", "bench",
                stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL),
            await asyncio.create_subprocess_exec(
                sys.executable, "-m", "gateway", "serve", "--config", str(config), "--log-level", "warning",
                stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL),
        ]  # fmt: skip
        try:
            await wait_up(f"{up}/health")
            await wait_up(f"http://127.0.0.1:{gw_port}/healthz")
            gw = f"http://127.0.0.1:{gw_port}/v1/chat/completions"
            paths = {
                "direct to upstream": (f"{up}/v1/chat/completions", "same"),
                "gateway, bytes forwarded as sent": (gw, "same"),
                "gateway, body rewritten (upstream_model)": (gw, "renamed"),
                "gateway, rejected at admission (400)": (gw, "textonly"),
            }
            print(f"{args.requests} requests x {args.repeats} repeats, concurrency {args.concurrency}; medians\n")
            print("| payload | path | req/s | p50 ms | p99 ms |")
            print("|---|---|---:|---:|---:|")
            for label, size in (("text, 0.2 KB", 0), ("text + 1 MiB image", 1 << 20)):
                payloads = {name: body(name, size) for name in ("same", "renamed", "textonly")}
                results: dict[str, list[tuple[float, float, float]]] = {p: [] for p in paths}
                for url, model in paths.values():  # warm-up
                    await run(url, payloads[model], 50, args.concurrency)
                for _ in range(args.repeats):  # interleaved, so drift hits every path alike
                    for path, (url, model) in paths.items():
                        results[path].append(await run(url, payloads[model], args.requests, args.concurrency))
                for path, rows in results.items():
                    rps, p50, p99 = (statistics.median(r[i] for r in rows) for i in range(3))
                    print(f"| {label} | {path} | {rps:,.0f} | {p50:.2f} | {p99:.2f} |")
        finally:
            for proc in procs:
                proc.terminate()
                await proc.wait()

    config_obj = parse_config(routing)
    print()
    for parts in (1, 64):
        content = [{"type": "image_url", "image_url": {"url": "data:,"}} for _ in range(parts)]
        request = {"model": "same", "messages": [{"role": "user", "content": content}]}
        us = micro(lambda: admit(config_obj, request))  # noqa: B023 - called at once
        print(f"admission (classify + decide), {parts} image part(s): {us:.1f} us")
    big = body("same", 1 << 20)
    print(
        f"orjson.loads of a 1 MiB body: {micro(lambda: orjson.loads(big), number=50):.0f} us; "
        f"orjson.dumps: {micro(lambda: orjson.dumps(orjson.loads(big)), number=50):.0f} us (loads + dumps)"
    )


if __name__ == "__main__":
    asyncio.run(main())

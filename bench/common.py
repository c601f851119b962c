"""What the benchmarks share: loopback ports, waiting for a server, percentiles."""

from __future__ import annotations

import asyncio
import socket

import aiohttp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


async def wait_up(url: str, *, attempts: int = 600) -> None:
    """Poll ``url`` until it answers below 500 (bounded: about a minute)."""
    async with aiohttp.ClientSession() as session:
        for _ in range(attempts):
            try:
                async with session.get(url) as resp:
                    if resp.status < 500:
                        return
            except aiohttp.ClientConnectionError:
                pass
            await asyncio.sleep(0.1)
    raise RuntimeError(f"{url} did not come up")


def percentile_ms(sorted_seconds: list[float], q: float) -> float:
    return sorted_seconds[min(len(sorted_seconds) - 1, int(q * len(sorted_seconds)))] * 1000

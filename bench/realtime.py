"""Realtime sessions relayed: the gateway's CPU a second of audio, beside the least an aiohttp
WebSocket relay can do (``bench.minimal_ws_proxy``), measured side by side in one run.

It starts, as processes of their own on free loopback ports, the stand-in engine (``tools.standin``,
vLLM's realtime protocol), the minimal relay and the gateway (a model of ``apis: [realtime]``),
then runs the same sessions through each in turn, round after round (the order rotating): SESSIONS
sessions at once, each ``session.update``, a ``commit``, APPENDS appends of a tenth of a second of
PCM16 at 16 kHz (each answered with a ``transcription.delta`` before the next is sent) and a final
``commit`` answered with ``transcription.done``. Reported, medians of the rounds: the relay
process's CPU µs a second of audio, and the appends a second. Bounded: every round sends a fixed
count, and each wait is bounded.

    .venv/bin/python -m bench.realtime [--rounds 5] [--sessions 16] [--appends 1000]
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

from . import procstat
from .common import free_port
from .hop import gateway_command, start_server, start_standin, stop

TENTH = base64.b64encode(b"\x01\x00" * 1600).decode()  # a tenth of a second, PCM16 at 16 kHz
WAIT_S = 30.0


async def _session(session: aiohttp.ClientSession, url: str, appends: int) -> None:
    async with session.ws_connect(url) as ws:
        await asyncio.wait_for(ws.receive_str(), WAIT_S)  # session.created
        await ws.send_str(json.dumps({"type": "session.update", "model": "bench"}))
        await ws.send_str(json.dumps({"type": "input_audio_buffer.commit"}))
        event = json.dumps({"type": "input_audio_buffer.append", "audio": TENTH})
        for _ in range(appends):
            await ws.send_str(event)
            await asyncio.wait_for(ws.receive_str(), WAIT_S)  # its delta
        await ws.send_str(json.dumps({"type": "input_audio_buffer.commit", "final": True}))
        done = json.loads(await asyncio.wait_for(ws.receive_str(), WAIT_S))
        assert done["type"] == "transcription.done", done


async def _round(url: str, sessions: int, appends: int) -> float:
    async with aiohttp.ClientSession() as session:
        started = time.perf_counter()
        await asyncio.gather(*(_session(session, url, appends) for _ in range(sessions)))
        return time.perf_counter() - started


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--sessions", type=int, default=16)
    parser.add_argument("--appends", type=int, default=1000)
    args = parser.parse_args(argv)
    tmp = Path(tempfile.mkdtemp(prefix="bench-realtime-"))
    engine = start_standin("engine", tmp)
    servers = [engine]
    try:
        port = free_port()
        minimal = start_server(
            "minimal WebSocket relay",
            [sys.executable, "-m", "bench.minimal_ws_proxy", "--port", str(port), "--upstream", engine.url],
            f"http://127.0.0.1:{port}",
            "/health",
            tmp,
        )
        servers.append(minimal)
        port = free_port()
        config = tmp / "routing.yaml"
        config.write_text(
            "version: 1\n"
            f"server: {{host: 127.0.0.1, port: {port}, access_log: false, reload_interval_s: 0}}\n"
            "models:\n"
            f"  - {{name: bench, upstreams: [{engine.url}], accepts: [text, audio], apis: [realtime],\n"
            "     realtime: {audio_speed: 100000, audio_burst_s: 100000}}\n"
        )
        gateway = start_server("gateway", gateway_command(config, 1), f"http://127.0.0.1:{port}", "/healthz", tmp)
        servers.append(gateway)
        arms = [minimal, gateway]
        audio_s = args.sessions * args.appends * 0.1
        results: dict[str, list[tuple[float, float]]] = {a.name: [] for a in arms}
        asyncio.run(_round(gateway.url.replace("http", "ws") + "/v1/realtime?model=bench", 2, 10))  # warm
        asyncio.run(_round(minimal.url.replace("http", "ws") + "/v1/realtime?model=bench", 2, 10))
        for r in range(args.rounds):
            for arm in arms[r % 2 :] + arms[: r % 2]:
                url = arm.url.replace("http", "ws") + "/v1/realtime?model=bench"
                before = procstat.cpu_seconds(arm.pids())
                wall = asyncio.run(_round(url, args.sessions, args.appends))
                cpu = procstat.cpu_seconds(arm.pids()) - before
                results[arm.name].append((cpu / audio_s * 1e6, args.sessions * args.appends / wall))
                print(f"round {r + 1}/{args.rounds} {arm.name}: {cpu / audio_s * 1e6:.0f} µs CPU an audio second, "
                      f"{args.sessions * args.appends / wall:,.0f} appends/s", flush=True)  # fmt: skip
        print(f"\n{args.sessions} sessions at once, {args.appends} appends of 0.1 s each, medians of {args.rounds}:\n")
        print("| relay | CPU µs an audio second | appends a second | x minimal (CPU) |")
        print("|---|---:|---:|---:|")
        ref = statistics.median(c for c, _ in results[minimal.name])
        for arm in arms:
            cpu = statistics.median(c for c, _ in results[arm.name])
            rate = statistics.median(a for _, a in results[arm.name])
            ratio = f"{cpu / ref:.2f}" if ref else "-"  # a run too short for /proc's ticks
            print(f"| {arm.name} | {cpu:,.0f} | {rate:,.0f} | {ratio} |")
    finally:
        for server in reversed(servers):
            stop(server)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Encoder backends the gateway runs itself (``encoders: {NAME: {kind: local}}``).

Each runs as a child process, ``python -m backends.vision_encoder serve`` on a free loopback port,
so torch lives in that process and never in the gateway's. The supervisor waits for its /health
(a real encode), polls it every few seconds, and restarts the process with backoff when it dies.
The gateway's /readyz is ready only while every local encoder is.

Local encoders are started from the config the gateway started with; a reload that changes them
takes effect at the next start (logged).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass

import aiohttp

from .config import EncoderConfig, GatewayConfig

log = logging.getLogger(__name__)

HEALTH_INTERVAL_S = 5.0
START_TIMEOUT_S = 600.0  # loading a large tower from disk can take minutes
BACKOFF_S = (1.0, 2.0, 5.0, 10.0, 30.0)


def encoder_command(spec: EncoderConfig, port: int, python: str = sys.executable) -> list[str]:
    return [
        python, "-m", "backends.vision_encoder", "serve",
        "--model", spec.model,
        "--host", "127.0.0.1",
        "--port", str(port),
        "--device", spec.device,
        "--max-batch-size", str(spec.max_batch_size),
        "--max-batch-delay-ms", str(spec.max_batch_delay_ms),
        "--timeout-s", str(spec.timeout_s),
        "--parent-pid", str(os.getpid()),
    ]  # fmt: skip


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@dataclass
class LocalEncoder:
    spec: EncoderConfig
    url: str | None = None
    ready: bool = False
    restarts: int = 0
    pid: int | None = None
    last_error: str = ""

    def status(self) -> dict[str, object]:
        return {
            "kind": "local",
            "model": self.spec.model,
            "ready": self.ready,
            "url": self.url,
            "pid": self.pid,
            "restarts": self.restarts,
            "last_error": self.last_error,
        }


class Supervisor:
    def __init__(self, config: GatewayConfig, *, command: Sequence[str] | None = None) -> None:
        self.encoders = {name: LocalEncoder(spec) for name, spec in config.encoders.items() if spec.kind == "local"}
        self._command = command  # tests may run another program in the backend's place
        self._tasks: list[asyncio.Task[None]] = []
        self._session: aiohttp.ClientSession | None = None

    @property
    def ready(self) -> bool:
        return all(e.ready for e in self.encoders.values())

    def url(self, name: str) -> str | None:
        encoder = self.encoders.get(name)
        return encoder.url if encoder is not None and encoder.ready else None

    def check_reload(self, config: GatewayConfig) -> None:
        for name, encoder in self.encoders.items():
            if config.encoders.get(name) != encoder.spec:
                log.warning("local encoder '%s' changed or went away; the change takes effect at the next start", name)

    async def start(self) -> None:
        if not self.encoders:
            return
        self._session = aiohttp.ClientSession()
        for name, encoder in self.encoders.items():
            self._tasks.append(asyncio.create_task(self._supervise(name, encoder), name=f"encoder {name}"))

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self._session is not None:
            await self._session.close()

    async def _supervise(self, name: str, encoder: LocalEncoder) -> None:
        attempt = 0
        while True:
            started = time.monotonic()
            await self._run_once(name, encoder)
            encoder.restarts += 1
            if time.monotonic() - started > 60:
                attempt = 0  # it ran a good while: start the backoff over
            delay = BACKOFF_S[min(attempt, len(BACKOFF_S) - 1)]
            attempt += 1
            log.warning("local encoder '%s' exited (%s); restarting in %.0fs", name, encoder.last_error, delay)
            await asyncio.sleep(delay)

    async def _run_once(self, name: str, encoder: LocalEncoder) -> None:
        port = _free_port()
        argv = [*self._command, "--port", str(port)] if self._command else encoder_command(encoder.spec, port)
        process = await asyncio.create_subprocess_exec(*argv, stdin=asyncio.subprocess.DEVNULL)
        encoder.pid, encoder.url, encoder.ready = process.pid, f"http://127.0.0.1:{port}", False
        log.info("local encoder '%s' (%s) starting, pid %d, port %d", name, encoder.spec.model, process.pid, port)
        watcher = asyncio.create_task(self._watch_health(name, encoder))
        try:
            code = await process.wait()
            encoder.last_error = f"exit code {code}"
        finally:
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watcher
            encoder.ready = False
            if process.returncode is None:  # cancelled: the gateway is stopping
                await _stop(process)

    async def _watch_health(self, name: str, encoder: LocalEncoder) -> None:
        assert self._session is not None
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            healthy, detail = await self._health(encoder)
            if healthy != encoder.ready:
                log.info("local encoder '%s' %s: %s", name, "ready" if healthy else "not ready", detail)
            encoder.ready = healthy
            encoder.last_error = "" if healthy else detail
            if not healthy and not encoder.restarts and time.monotonic() > deadline and encoder.pid:
                log.error("local encoder '%s' did not become healthy in %.0fs", name, START_TIMEOUT_S)
            await asyncio.sleep(HEALTH_INTERVAL_S if encoder.ready else 0.25)

    async def _health(self, encoder: LocalEncoder) -> tuple[bool, str]:
        assert self._session is not None
        try:
            async with self._session.get(
                f"{encoder.url}/health", timeout=aiohttp.ClientTimeout(total=max(encoder.spec.timeout_s, 5.0))
            ) as resp:
                return resp.status == 200, f"health {resp.status}"
        except (aiohttp.ClientError, TimeoutError) as exc:
            return False, type(exc).__name__


async def _stop(process: asyncio.subprocess.Process) -> None:
    with contextlib.suppress(ProcessLookupError):
        process.terminate()
    try:
        await asyncio.wait_for(process.wait(), timeout=10)
    except TimeoutError:
        with contextlib.suppress(ProcessLookupError):
            process.kill()
        await process.wait()

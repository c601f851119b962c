"""Encoder backends the gateway runs itself (``encoders: {NAME: {kind: local}}``).

Each runs as a child process, ``python -m backends.vision_encoder serve`` on a free loopback port,
so torch lives in that process and never in the gateway's. The supervisor waits for its /health
(a real encode), polls it every few seconds, and restarts the process with backoff when it dies.
The gateway's /readyz is ready only while every local encoder is.

A reload starts the local encoders it adds, stops those it removes, and restarts those it
changes. A backend that stops answering its health check (three checks in a row once it was
ready, or no answer within ``Timings.start_timeout_s`` of starting) is killed and started again.

Under ``serve --workers N`` the master alone supervises, and publishes :meth:`Supervisor.snapshot`
to a file that each worker's :class:`SupervisorView` follows: the encoders start once, not N times.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import socket
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from ..config import EncoderConfig, GatewayConfig

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Timings:
    """How the supervisor watches its backends (tests shorten them)."""

    health_interval_s: float = 5.0
    health_timeout_s: float = 30.0  # a health check includes a real encode
    unhealthy_checks: int = 3  # failed checks in a row before a backend that was ready is restarted
    start_timeout_s: float = 600.0  # loading a large tower from disk can take minutes
    backoff_s: tuple[float, ...] = (1.0, 2.0, 5.0, 10.0, 30.0)


DEFAULT_TIMINGS = Timings()


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


def _local_specs(config: GatewayConfig) -> dict[str, EncoderConfig]:
    return {name: spec for name, spec in config.encoders.items() if spec.kind == "local"}


def _fingerprint(spec: EncoderConfig) -> str:
    """Tells whether a published encoder runs the spec a worker's config asks for (a reload may change it)."""
    return hashlib.sha256(repr(spec).encode()).hexdigest()[:16]


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
    def __init__(
        self, config: GatewayConfig, *, command: Sequence[str] | None = None, timings: Timings = DEFAULT_TIMINGS
    ) -> None:
        self._specs = _local_specs(config)
        self._timings = timings
        self.encoders: dict[str, LocalEncoder] = {}
        self._command = command  # tests may run another program in the backend's place
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._retired: set[asyncio.Task[None]] = set()
        self._session: aiohttp.ClientSession | None = None

    def snapshot(self) -> dict[str, dict[str, Any]]:
        """Each local encoder's state, as :class:`SupervisorView` reads it."""
        return {name: {**e.status(), "fingerprint": _fingerprint(e.spec)} for name, e in sorted(self.encoders.items())}

    @property
    def ready(self) -> bool:
        return all(self.encoders.get(name, LocalEncoder(spec)).ready for name, spec in self._specs.items())

    def url(self, name: str) -> str | None:
        encoder = self.encoders.get(name)
        return encoder.url if encoder is not None and encoder.ready else None

    async def start(self) -> None:
        self._session = aiohttp.ClientSession()
        for name, spec in self._specs.items():
            self._launch(name, spec)

    def update(self, config: GatewayConfig) -> None:
        """A reload: start what it adds, stop what it removes, restart what it changes."""
        new = _local_specs(config)
        for name in [n for n in self._specs if new.get(n) != self._specs[n]]:
            log.info("local encoder '%s' %s by a reload", name, "changed" if name in new else "removed")
            self._retire(name)
        for name, spec in new.items():
            if name not in self._tasks and self._session is not None:
                self._launch(name, spec)
        self._specs = new

    async def close(self) -> None:
        for name in list(self._tasks):
            self._retire(name)
        for task in list(self._retired):
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self._session is not None:
            await self._session.close()

    def _launch(self, name: str, spec: EncoderConfig) -> None:
        encoder = self.encoders[name] = LocalEncoder(spec)
        self._tasks[name] = asyncio.create_task(self._supervise(name, encoder), name=f"encoder {name}")

    def _retire(self, name: str) -> None:
        task = self._tasks.pop(name)
        self.encoders.pop(name, None)
        task.cancel()  # its process is stopped as the task unwinds
        self._retired.add(task)
        task.add_done_callback(self._retired.discard)

    async def _supervise(self, name: str, encoder: LocalEncoder) -> None:
        attempt = 0
        while True:
            started = time.monotonic()
            await self._run_once(name, encoder)
            encoder.restarts += 1
            if time.monotonic() - started > 60:
                attempt = 0  # it ran a good while: start the backoff over
            backoff = self._timings.backoff_s
            delay = backoff[min(attempt, len(backoff) - 1)]
            attempt += 1
            log.warning("local encoder '%s' exited (%s); restarting in %.0fs", name, encoder.last_error, delay)
            await asyncio.sleep(delay)

    async def _run_once(self, name: str, encoder: LocalEncoder) -> None:
        port = encoder.spec.port or _free_port()  # encoders.NAME.port, else any free one
        argv = [*self._command, "--port", str(port)] if self._command else encoder_command(encoder.spec, port)
        process = await asyncio.create_subprocess_exec(*argv, stdin=asyncio.subprocess.DEVNULL)
        encoder.pid, encoder.url, encoder.ready = process.pid, f"http://127.0.0.1:{port}", False
        log.info("local encoder '%s' (%s) starting, pid %d, port %d", name, encoder.spec.model, process.pid, port)
        watcher = asyncio.create_task(self._watch_health(name, encoder, process))
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

    async def _watch_health(self, name: str, encoder: LocalEncoder, process: asyncio.subprocess.Process) -> None:
        """Track readiness; kill a backend that hangs (the supervise loop starts it again)."""
        timings = self._timings
        deadline = time.monotonic() + timings.start_timeout_s
        was_ready, failures = False, 0
        while True:
            healthy, detail = await self._health(encoder)
            if healthy != encoder.ready:
                log.info("local encoder '%s' %s: %s", name, "ready" if healthy else "not ready", detail)
            encoder.ready = healthy
            encoder.last_error = "" if healthy else detail
            was_ready = was_ready or healthy
            failures = 0 if healthy else failures + 1
            if (was_ready and failures >= timings.unhealthy_checks) or (not was_ready and time.monotonic() > deadline):
                log.error("local encoder '%s' is not answering its health check (%s); restarting it", name, detail)
                with contextlib.suppress(ProcessLookupError):
                    process.kill()
                return
            await asyncio.sleep(timings.health_interval_s if encoder.ready else 0.25)

    async def _health(self, encoder: LocalEncoder) -> tuple[bool, str]:
        assert self._session is not None
        try:
            async with self._session.get(
                f"{encoder.url}/health", timeout=aiohttp.ClientTimeout(total=self._timings.health_timeout_s)
            ) as resp:
                return resp.status == 200, f"health {resp.status}"
        except (aiohttp.ClientError, TimeoutError) as exc:
            return False, type(exc).__name__


class SupervisorView(Supervisor):
    """A worker's view of the master's supervisor (``serve --workers N``): it starts no process, and
    follows the snapshot the master writes to ``status`` (replaced atomically) every ``interval_s``.
    An encoder counts once the snapshot shows it running the spec of this worker's own config."""

    def __init__(self, config: GatewayConfig, status: Path, *, interval_s: float = 0.2) -> None:
        super().__init__(config)
        self._status, self._interval_s = status, interval_s
        self._published: dict[str, Any] = {}
        self._signature: tuple[int, int, int] | None = None
        self._follower: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self._read()
        self._follower = asyncio.create_task(self._follow(), name="local encoders' status")

    def update(self, config: GatewayConfig) -> None:
        self._specs = _local_specs(config)
        self._refresh()

    async def close(self) -> None:
        if self._follower is not None:
            self._follower.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._follower

    async def _follow(self) -> None:
        while True:
            await asyncio.sleep(self._interval_s)
            self._read()

    def _read(self) -> None:
        try:
            st = os.stat(self._status)
            signature = (st.st_mtime_ns, st.st_size, st.st_ino)
            if signature == self._signature:
                return
            published = orjson.loads(self._status.read_bytes())
        except (OSError, orjson.JSONDecodeError) as exc:
            if self._signature is not None or self._published:
                log.warning("cannot read the local encoders' status from %s: %s", self._status, exc)
            self._signature, self._published = None, {}
        else:
            self._signature, self._published = signature, published if isinstance(published, dict) else {}
        self._refresh()

    def _refresh(self) -> None:
        encoders: dict[str, LocalEncoder] = {}
        for name, spec in self._specs.items():
            state = self._published.get(name)
            if isinstance(state, dict) and state.get("fingerprint") == _fingerprint(spec):
                encoders[name] = LocalEncoder(
                    spec,
                    url=state.get("url"),
                    ready=state.get("ready") is True,
                    restarts=int(state.get("restarts", 0)),
                    pid=state.get("pid"),
                    last_error=str(state.get("last_error", "")),
                )
            else:  # not started yet, or still running a spec this worker's config no longer has
                encoders[name] = LocalEncoder(spec, last_error="not started by the master yet")
        self.encoders = encoders


async def _stop(process: asyncio.subprocess.Process) -> None:
    with contextlib.suppress(ProcessLookupError):
        process.terminate()
    try:
        await asyncio.wait_for(process.wait(), timeout=10)
    except TimeoutError:
        with contextlib.suppress(ProcessLookupError):
            process.kill()
        await process.wait()

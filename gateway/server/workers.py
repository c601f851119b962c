"""``modality-gateway serve --workers N``: N gateway processes on one port.

The serve process becomes a master that serves no request itself::

    master    loads routing.yaml (exit 2 when invalid) and holds the port; runs the local encoders,
              once; starts N workers and starts again, with backoff, one that dies; passes reloads
              and stop signals on to them; on SIGTERM waits for every worker's drain, then stops
              the encoders and exits 0
    worker    a whole gateway (``serve --worker I``, internal), listening on the same host:port
              with SO_REUSEPORT: the kernel spreads new connections over the workers

They share a private run directory, removed at exit:

    metrics/        prometheus_client's multiprocess files (PROMETHEUS_MULTIPROC_DIR): the worker
                    answering a scrape sums every worker's (gateway.meters.WorkersCollector)
    encoders.json   the local encoders' state, replaced atomically by the master, followed by each
                    worker (gateway.encode.supervisor.SupervisorView): its /readyz and where it sends images

and a pipe on which each worker says ``up I`` once it can take SIGHUP, and ``reload I`` after a
``POST /admin/reload`` it answered, for the master to reload the others. SIGHUP to the master
reloads every worker (and the master's own table, for the local encoders it adds or removes).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import logging
import os
import shutil
import signal
import sys
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path

import orjson
from aiohttp import web
from prometheus_client import CollectorRegistry
from prometheus_client.multiprocess import mark_process_dead

from ..config import GatewayConfig, load_config, parse_config
from ..encode.supervisor import Supervisor, SupervisorView
from ..errors import ConfigError
from ..metrics import GatewayMetrics
from .app import create_app
from .lifecycle import STOP_SIGNALS, CannotListen, reload_on_sighup, reload_quietly
from .state import SERVICES_KEY
from .store import ConfigStore

log = logging.getLogger(__name__)

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
METRICS_DIR = "metrics"
ENCODERS_FILE = "encoders.json"
GOOD_CONFIG = "routing.yaml"  # the last routing.yaml the master loaded: where a new worker starts
BACKOFF_S = (0.5, 1.0, 2.0, 5.0, 10.0, 30.0)  # before starting a dead worker again, by deaths in a row
STEADY_S = 60.0  # a worker that ran this long starts the backoff over
KILL_MARGIN_S = 10.0  # past drain_grace_s + drain_timeout_s after the stop signal, a worker is killed
PUBLISH_S = 0.1  # how often the master compares the encoders' state with what it published


class Master:
    """Runs N workers of one gateway (see the module docstring)."""

    def __init__(
        self,
        config: GatewayConfig,
        *,
        config_path: str,
        host: str,
        port: int,
        workers: int,
        log_level: str = "info",
    ) -> None:
        self._config, self._config_path = config, config_path
        self._host, self._port, self._workers = host, port, workers
        self._log_level, self._backoff_s = log_level, BACKOFF_S
        self._store = ConfigStore(config, metrics=GatewayMetrics(CollectorRegistry()), path=config_path)
        self._supervisor = Supervisor(config)
        self._processes: dict[int, asyncio.subprocess.Process] = {}
        self._up: set[int] = set()  # workers that said they can take SIGHUP
        self._missed_reload: set[int] = set()  # workers that were starting when a reload came
        self._stopping = asyncio.Event()
        self._stop_signal = signal.SIGTERM  # the last one passed on (to a worker still starting)
        self._stop_signals: set[signal.Signals] = set()  # every one passed on
        self._kill_timer: asyncio.TimerHandle | None = None
        self._control = b""
        self._tasks: set[asyncio.Task[None]] = set()

    async def run(self) -> int:
        held = await self._hold_ports()  # or CannotListen, said by the CLI
        log.info(
            "serving %d models from %s on http://%s:%d with %d workers",
            len(self._config.models), self._config_path, self._host, self._port, self._workers,
        )  # fmt: skip
        run_dir = Path(tempfile.mkdtemp(prefix="modality-gateway-"))
        read_fd, write_fd = os.pipe()
        try:
            (run_dir / METRICS_DIR).mkdir()
            return await self._run(run_dir, read_fd, write_fd)
        finally:
            for server in held:
                server.close()
            os.close(read_fd)
            os.close(write_fd)
            shutil.rmtree(run_dir, ignore_errors=True)

    async def _hold_ports(self) -> list[asyncio.Server]:
        """Bind host:port (and server.admin_listen) with SO_REUSEPORT without listening: a port in
        use fails here, once, and no other program can take the port while workers restart."""
        loop = asyncio.get_running_loop()
        try:
            main = await loop.create_server(
                asyncio.Protocol, self._host, self._port, reuse_port=True, start_serving=False
            )
        except OSError as exc:
            raise CannotListen((self._host, self._port), exc) from None
        held = [main]
        if self._port == 0:
            self._port = main.sockets[0].getsockname()[1]
        if (admin := self._config.server.admin_address) is not None:
            try:
                held.append(await loop.create_server(asyncio.Protocol, *admin, reuse_port=True, start_serving=False))
            except OSError as exc:
                main.close()
                raise CannotListen(admin, exc, admin=True) from None
        return held

    async def _run(self, run_dir: Path, read_fd: int, write_fd: int) -> int:
        loop = asyncio.get_running_loop()
        self._store.subscribe(self._supervisor.update)
        self._store.subscribe(functools.partial(_keep_good, self._config_path, run_dir / GOOD_CONFIG))
        _keep_good(self._config_path, run_dir / GOOD_CONFIG, self._config)
        await self._supervisor.start()
        status = run_dir / ENCODERS_FILE
        published = _publish(self._supervisor, status, b"")  # before any worker reads it
        background = [
            asyncio.create_task(self._publish_changes(status, published), name="encoders' status"),
            asyncio.create_task(self._store.watch(), name="routing.yaml watcher"),
        ]
        os.set_blocking(read_fd, False)
        loop.add_reader(read_fd, self._read_control, read_fd)
        loop.add_signal_handler(signal.SIGHUP, self._reload, None)
        for sig in STOP_SIGNALS:
            loop.add_signal_handler(sig, self._stop, sig)
        try:
            log.info("starting %d workers on http://%s:%d", self._workers, self._host, self._port)
            keepers = [asyncio.create_task(self._keep(i, run_dir, write_fd)) for i in range(self._workers)]
            codes = await asyncio.gather(*keepers)
            log.info("every worker stopped (exit codes %s); stopping the local encoders", codes)
        finally:
            loop.remove_reader(read_fd)
            for sig in (signal.SIGHUP, *STOP_SIGNALS):
                loop.remove_signal_handler(sig)
            if self._kill_timer is not None:
                self._kill_timer.cancel()
            try:
                for task in background:
                    task.cancel()
                await asyncio.gather(*background, return_exceptions=True)  # stopped, whatever ended them
            finally:
                await self._supervisor.close()
        log.info("stopped")
        return 0 if all(code == 0 for code in codes) else 1

    async def _keep(self, index: int, run_dir: Path, control_fd: int) -> int:
        """Run worker ``index`` until the master stops; start it again when it dies."""
        loop = asyncio.get_running_loop()
        deaths = 0
        while True:
            started = loop.time()
            try:
                process = await self._spawn(index, run_dir, control_fd)
            except OSError as exc:  # no fork now (EAGAIN, ENOMEM: likely just after an OOM kill)
                log.error("worker %d could not be started: %s", index, exc)
                pid, code = None, -1
            else:
                pid = process.pid
                code = await process.wait()
                del self._processes[index]
                self._up.discard(index)
                # its live gauges leave the sums; its counters stay in them
                mark_process_dead(pid, str(run_dir / METRICS_DIR))  # type: ignore[no-untyped-call]
            if self._stopping.is_set():
                log.info("worker %d (pid %s) exited with code %d", index, pid, code)
                # killed by a stop signal before it could take it (still starting): no failure
                return 0 if -code in self._stop_signals else code
            deaths = 0 if loop.time() - started > STEADY_S else deaths + 1
            delay = self._backoff_s[min(deaths - 1, len(self._backoff_s) - 1)] if deaths else 0.0
            log.error("worker %d (pid %s) died (exit code %d); starting it again in %gs", index, pid, code, delay)
            if code == 2:
                log.error(
                    "exit code 2: routing.yaml (%s) is invalid now; fix it for worker %d to start",
                    self._config_path,
                    index,
                )
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(delay):
                    await self._stopping.wait()
            if self._stopping.is_set():
                return 0

    async def _spawn(self, index: int, run_dir: Path, control_fd: int) -> asyncio.subprocess.Process:
        argv = [
            sys.executable, "-m", "gateway", "serve",
            "--config", self._config_path,
            "--host", self._host,
            "--port", str(self._port),
            "--log-level", self._log_level,
            "--worker", str(index),
            "--run-dir", str(run_dir),
            "--control-fd", str(control_fd),
            "--master-pid", str(os.getpid()),
        ]  # fmt: skip
        process = await asyncio.create_subprocess_exec(
            *argv,
            stdin=asyncio.subprocess.DEVNULL,
            env={**os.environ, MULTIPROC_ENV: str(run_dir / METRICS_DIR)},  # before it imports prometheus_client
            pass_fds=(control_fd,),
            start_new_session=True,  # a terminal's Ctrl-C reaches the master alone, which passes it on once
        )
        self._processes[index] = process
        log.info("worker %d started, pid %d", index, process.pid)
        if self._stopping.is_set():  # the stop signal came while it was being started
            _send(process, self._stop_signal)
        return process

    def _stop(self, sig: signal.Signals) -> None:
        if not self._stopping.is_set():
            log.info("%s: passed on to every worker; each drains, then the local encoders stop", sig.name)
            server = self._config.server
            # a worker stuck past its whole drain (a hung cleanup) must not hold the master forever
            limit = server.drain_grace_s + server.drain_timeout_s + KILL_MARGIN_S
            self._kill_timer = asyncio.get_running_loop().call_later(limit, self._kill_remaining, limit)
        self._stopping.set()
        self._stop_signal = sig
        self._stop_signals.add(sig)
        for process in self._processes.values():
            _send(process, sig)  # a second signal cuts the workers' grace period short, as in one process

    def _kill_remaining(self, limit: float) -> None:
        for index, process in self._processes.items():
            log.error(
                "worker %d (pid %d) still running %gs after the stop signal; killing it", index, process.pid, limit
            )
            _send(process, signal.SIGKILL)

    def _reload(self, origin: int | None) -> None:
        """SIGHUP (``origin`` None) or a worker's ``POST /admin/reload``: every other worker reloads,
        and the master, for its local encoders. Not once stopping: the workers are draining."""
        if self._stopping.is_set():
            log.info("reload ignored: stopping")
            return
        for index, process in self._processes.items():
            if index == origin:
                continue
            if index in self._up:
                _send(process, signal.SIGHUP)
            else:  # not ready for SIGHUP yet (it would die of it): when it says it is
                self._missed_reload.add(index)
        task = asyncio.create_task(reload_quietly(self._store.reload()))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _read_control(self, fd: int) -> None:
        try:
            self._control += os.read(fd, 4096)
        except BlockingIOError:
            return
        *lines, self._control = self._control.split(b"\n")
        for line in lines:
            what, _, index = line.decode(errors="replace").partition(" ")
            if not index.isdigit():
                log.warning("ignored %r on the workers' control pipe", line)
            elif what == "up":
                self._came_up(int(index))
            elif what == "reload":
                log.info("worker %s reloaded by POST /admin/reload; reloading the others", index)
                self._reload(int(index))

    def _came_up(self, index: int) -> None:
        self._up.add(index)
        if index in self._missed_reload and index in self._processes:
            self._missed_reload.discard(index)
            _send(self._processes[index], signal.SIGHUP)

    async def _publish_changes(self, status: Path, published: bytes) -> None:
        while True:
            await asyncio.sleep(PUBLISH_S)
            try:
                # written again when it went missing too (a /tmp cleaner): workers read it at start
                published = _publish(self._supervisor, status, published if status.exists() else b"")
            except OSError as exc:  # a full disk: workers keep the last state; try again next time
                log.error("cannot write %s for the workers: %s", status, exc)


def _publish(supervisor: Supervisor, status: Path, published: bytes) -> bytes:
    """Write the supervisor's snapshot when it changed: a new file renamed over the old one, so a
    worker reads the old state or the new, never half of one."""
    data = orjson.dumps(supervisor.snapshot(), option=orjson.OPT_SORT_KEYS)
    if data != published:
        tmp = status.with_suffix(".tmp")
        tmp.write_bytes(data)
        os.replace(tmp, status)
    return data


def _keep_good(path: str, copy: Path, config: GatewayConfig) -> None:
    """Keep the text ``config`` was loaded from as ``copy``: a worker started later (one that died)
    starts from it, as its siblings run, even if the file was edited into an invalid one since
    (it would refuse to start) or into a valid one the others have not loaded yet. Nothing is
    written if the file changed again since ``config`` was read from it (the copy stays as it was)."""
    try:
        text = Path(path).read_bytes()
        if hashlib.sha256(text).hexdigest() != config.sha256:
            return
        tmp = copy.with_suffix(".tmp")
        tmp.write_bytes(text)
        os.replace(tmp, copy)
    except OSError as exc:
        log.error("cannot keep a copy of %s for new workers: %s", path, exc)


def worker_config(run_dir: str, path: str) -> GatewayConfig:
    """A new worker's config: routing.yaml as it is now when it is valid (its siblings load it too);
    when it is not (an edit being fixed), the one the master last loaded, which its siblings still
    run, read as ``path`` (the file it reloads from, which errors name). ConfigError when neither
    is there."""
    try:
        return load_config(path, here=True)
    except ConfigError as invalid:
        try:
            text = (Path(run_dir) / GOOD_CONFIG).read_text(encoding="utf-8")
            config = parse_config(text, filename=path, here=True)
        except (OSError, UnicodeDecodeError, ConfigError):
            raise invalid from None
        log.warning("%s is invalid now; starting from the routing.yaml the other workers run:\n%s", path, invalid)
        return config


def _send(process: asyncio.subprocess.Process, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):
        process.send_signal(sig)


def worker_app(
    config: GatewayConfig, *, config_path: str, index: int, run_dir: str, control_fd: int
) -> web.Application:
    """Worker ``index``'s gateway: the master's local encoders, metrics summed over every worker."""
    metrics_dir = os.environ.get(MULTIPROC_ENV)
    if metrics_dir != str(Path(run_dir) / METRICS_DIR):
        raise RuntimeError(f"a worker needs {MULTIPROC_ENV} set by its master (serve --workers N)")
    supervisor = SupervisorView(config, Path(run_dir) / ENCODERS_FILE)
    app = create_app(config, config_path=config_path, supervisor=supervisor, multiprocess_dir=metrics_dir)
    lifecycle = app[SERVICES_KEY].lifecycle
    lifecycle.worker = index
    lifecycle.reload_others = functools.partial(_tell_master, control_fd, f"reload {index}")
    app.cleanup_ctx.append(reload_on_sighup)
    app.cleanup_ctx.append(functools.partial(_say_up, control_fd, index))  # after the SIGHUP handler
    return app


async def _say_up(control_fd: int, index: int, app: web.Application) -> AsyncIterator[None]:
    _tell_master(control_fd, f"up {index}")
    yield


def _tell_master(control_fd: int, message: str) -> None:
    try:
        os.write(control_fd, f"{message}\n".encode())  # one short write: atomic on a pipe
    except OSError as exc:
        log.error("cannot reach the master: %s", exc)

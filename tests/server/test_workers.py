"""`modality-gateway serve --workers N`: real processes sharing one port, their metrics summed,
reloads and stop signals reaching every worker, local encoders started once."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.parser import text_string_to_metric_families

from gateway.config import parse_config
from gateway.encode.supervisor import LocalEncoder, Supervisor, SupervisorView
from gateway.server.cli import main
from tests.conftest import Upstream, free_port, routing
from tests.server.test_serve import wait_healthy

TOKEN = {"Authorization": "Bearer s3cret"}
TIMEOUT = aiohttp.ClientTimeout(total=10)
BODY = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
SERVER = "reload_interval_s: 0, access_log: false, drain_grace_s: 0.2"

# A local encoder backend without torch: it notes its pid and answers /health.
STUB_ENCODER = """
import os, sys
from aiohttp import web
port = int(sys.argv[sys.argv.index('--port') + 1])
with open(sys.argv[1], 'a') as f:
    f.write(f'{os.getpid()}\\n')
app = web.Application()
app.router.add_get('/health', lambda request: web.json_response({'status': 'ok'}))
web.run_app(app, host='127.0.0.1', port=port, print=None)
"""
# `serve` with the local encoder backend's command replaced by the stub's (workers start none)
SERVE_WITH_STUB = """
import sys
from gateway.encode import supervisor
from gateway.server import cli
stub, started = sys.argv.pop(1), sys.argv.pop(1)
supervisor.encoder_command = lambda spec, port: [sys.executable, stub, started, '--port', str(port)]
sys.exit(cli.main(sys.argv[1:]))
"""


@dataclass
class Served:
    """`serve --workers N` running, its output (and its workers') read as it comes."""

    process: asyncio.subprocess.Process
    lines: list[str] = field(default_factory=list)
    reader: asyncio.Task[None] | None = None

    def __post_init__(self) -> None:
        self.reader = asyncio.create_task(self._read())

    async def _read(self) -> None:
        assert self.process.stdout is not None
        async for line in self.process.stdout:
            self.lines.append(line.decode())

    @property
    def output(self) -> str:
        return "".join(self.lines)


async def start(
    config: Path, port: int, tmp_path: Path, *, workers: int = 2, prefix: tuple[str, ...] = ("-m", "gateway")
) -> Served:
    """`serve --workers N`, its run directory under ``tmp_path``."""
    env = {**os.environ, "GATEWAY_ADMIN_TOKEN": "s3cret", "TMPDIR": str(tmp_path)}
    process = await asyncio.create_subprocess_exec(
        sys.executable, *prefix, "serve", "--config", str(config), "--port", str(port), "--workers", str(workers),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT, env=env,
    )  # fmt: skip
    return Served(process)


async def start_text_model(upstream: Upstream, tmp_path: Path) -> tuple[Path, str, Served]:
    """Two workers of a one-model config (text, to ``upstream``): its file, the URL, the master."""
    config = tmp_path / "routing.yaml"
    config.write_text(routing(f"  - {{name: m, upstreams: [{upstream.url}], accepts: [text]}}", server=f"{{{SERVER}}}"))
    port = free_port()
    return config, f"http://127.0.0.1:{port}", await start(config, port, tmp_path)


async def readyz(url: str) -> tuple[int, dict[str, Any]]:
    """The admin's /readyz report, on a new connection (which the kernel gives to any worker)."""
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True), timeout=TIMEOUT) as session:
        async with session.get(f"{url}/readyz", headers=TOKEN) as resp:
            return resp.status, await resp.json()


async def each_worker(url: str, n: int = 2) -> dict[int, dict[str, Any]]:
    """Every worker's /readyz report, by its index: new connections until each has answered."""
    seen: dict[int, dict[str, Any]] = {}
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 60  # bounded; a worker may still be starting (a busy machine: slowly)
    while loop.time() < deadline:
        try:
            _, report = await readyz(url)
        except (aiohttp.ClientConnectionError, OSError):  # a worker killed, or not yet listening
            await asyncio.sleep(0.05)
            continue
        seen[report["worker"]["index"]] = report
        if len(seen) == n:
            return seen
    raise AssertionError(f"only workers {sorted(seen)} answered")


async def eventually(predicate: Callable[[], Awaitable[bool]], seconds: float = 60) -> None:
    """``predicate`` true within ``seconds``; a connection refused or reset meanwhile is a "not
    yet" (a killed worker's listening socket resets what the kernel had queued on it)."""
    for _ in range(int(seconds / 0.05)):  # bounded
        try:
            if await predicate():
                return
        except (aiohttp.ClientConnectionError, OSError):
            pass
        await asyncio.sleep(0.05)
    raise AssertionError("condition not met in time")


async def scrape(url: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
        async with session.get(f"{url}/metrics") as resp:
            text = await resp.text()
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(samples: dict[tuple[str, frozenset[tuple[str, str]]], float], name: str, **labels: str) -> float:
    return sum(v for (n, ls), v in samples.items() if n == name and set(labels.items()) <= ls)


def run_dir(tmp_path: Path) -> Path:
    (found,) = tmp_path.glob("modality-gateway-*")
    return found


def served_by(metrics_dir: Path, pid: int) -> float:
    """gateway_requests_total in one worker's own file."""
    families = MultiProcessCollector.merge([str(metrics_dir / f"counter_{pid}.db")])  # type: ignore[no-untyped-call]
    return sum(s.value for f in families if f.name == "gateway_requests" for s in f.samples)


async def stop(served: Served, tmp_path: Path) -> str:
    """Kill the master and its workers if they still run; what they printed (shown if the test fails)."""
    for pid in workers_of(tmp_path):
        os.kill(pid, signal.SIGKILL)
    if served.process.returncode is None:
        with contextlib.suppress(ProcessLookupError):
            served.process.kill()
        await served.process.wait()  # returns once every process writing to its stdout has exited
    assert served.reader is not None
    await served.reader
    print(served.output)
    return served.output


def workers_of(tmp_path: Path) -> list[int]:
    """A test's workers still running (their command line names its run directory)."""
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        with contextlib.suppress(OSError):
            if f"--run-dir\0{tmp_path}/".encode() in cmdline.read_bytes():
                found.append(int(cmdline.parent.name))
    return found


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


async def test_two_workers_share_the_port_sum_their_metrics_and_reload_and_stop_together(
    upstream: Upstream, tmp_path: Path
) -> None:
    port, admin = free_port(), free_port()
    config = tmp_path / "routing.yaml"
    model = f"  - {{name: m, upstreams: [{upstream.url}], accepts: [text]}}"
    server = f"{{{SERVER}, admin_listen: '127.0.0.1:{admin}'}}"
    config.write_text(routing(model, server=server))
    url, side = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{admin}"
    served = await start(config, port, tmp_path)
    process = served.process
    pids: list[int] = []
    try:
        await wait_healthy(url, process)
        workers = await each_worker(url)
        pids = [workers[i]["worker"]["pid"] for i in (0, 1)]
        assert len(set(pids)) == 2 and process.pid not in pids

        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True), timeout=TIMEOUT) as session:
            for _ in range(30):  # a new connection each: spread over both workers
                async with session.post(f"{url}/v1/chat/completions", json=BODY) as resp:
                    assert resp.status == 200
        metrics_dir = run_dir(tmp_path) / "metrics"
        assert all(served_by(metrics_dir, pid) > 0 for pid in pids)  # each served some...
        samples = await scrape(side)  # ...and one scrape, on the admin port, shows them all
        assert value(samples, "gateway_requests_total", model="m", code="200") == 30
        assert value(samples, "gateway_requests_in_flight") == 1  # the scrape itself
        old_sha = {dict(ls)["sha256"] for (n, ls) in samples if n == "gateway_config_info"}

        # SIGHUP to the master: both workers reload
        config.write_text(routing(model, model.replace("name: m", "name: n"), server=server))
        process.send_signal(signal.SIGHUP)

        async def reloaded(times: int) -> bool:
            return value(await scrape(side), "gateway_config_reloads_total", result="success") == times

        await eventually(lambda: reloaded(2))
        workers = await each_worker(url)
        assert all(w["config_generation"] == 2 and w["models"] == ["m", "n"] for w in workers.values())
        samples = await scrape(side)
        new_sha = {dict(ls)["sha256"] for (n, ls) in samples if n == "gateway_config_info"}
        assert len(new_sha) == 1 and new_sha != old_sha  # the old version is gone from the scrape
        assert value(samples, "gateway_config_generation") == 2

        # POST /admin/reload on one worker: the other reloads too
        async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
            async with session.post(f"{side}/admin/reload", headers=TOKEN) as resp:
                assert resp.status == 200 and (await resp.json())["config_generation"] == 3
        await eventually(lambda: reloaded(4))
        assert {w["config_generation"] for w in (await each_worker(url)).values()} == {3}

        process.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(process.wait(), timeout=60) == 0
        assert all(gone(pid) for pid in pids)
        assert not list(tmp_path.glob("modality-gateway-*"))  # the run directory is removed
    finally:
        output = await stop(served, tmp_path)
    assert "with 2 workers" in output
    assert "worker 1 gateway.server.store: routing.yaml generation 3 in effect" in output
    assert "reloaded by POST /admin/reload; reloading the others" in output
    assert output.count("gateway.server.lifecycle: stopped") == 2 and "master gateway.server.workers: stopped" in output


async def test_a_killed_worker_is_started_again_and_the_local_encoder_runs_once(
    upstream: Upstream, tmp_path: Path
) -> None:
    stub, started = tmp_path / "stub_encoder.py", tmp_path / "encoders_started"
    stub.write_text(STUB_ENCODER)
    config = tmp_path / "routing.yaml"
    config.write_text(
        routing(
            f"  - {{name: m, upstreams: [{upstream.url}], accepts: [text, image], encode: {{image: vision}}}}",
            server=f"{{{SERVER}}}",
            extra="encoders:\n  vision: {kind: local, device: cpu}\n",
        )
    )
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    served = await start(config, port, tmp_path, prefix=("-c", SERVE_WITH_STUB, str(stub), str(started)))
    process = served.process
    pids: list[int] = []
    try:
        await wait_healthy(url, process)

        async def both_ready() -> bool:
            reports = await each_worker(url)
            return all(r["status"] == "ready" for r in reports.values())

        await eventually(both_ready)
        workers = await each_worker(url)
        pids = [workers[i]["worker"]["pid"] for i in (0, 1)]
        (encoder,) = {w["encoders"]["vision"]["pid"] for w in workers.values()}  # the same one in both
        assert started.read_text().split() == [str(encoder)]  # started once, by the master

        metrics_dir = run_dir(tmp_path) / "metrics"
        assert (metrics_dir / f"gauge_livesum_{pids[0]}.db").exists()
        os.kill(pids[0], signal.SIGKILL)

        async def replaced() -> bool:
            status, report = await readyz(url)
            return report["worker"]["index"] == 0 and report["worker"]["pid"] != pids[0] and status == 200

        await eventually(replaced)
        assert not (metrics_dir / f"gauge_livesum_{pids[0]}.db").exists()  # marked dead: out of the live sums
        assert (metrics_dir / f"counter_{pids[0]}.db").exists()  # its counts stay in the sums
        pids.append((await readyz(url))[1]["worker"]["pid"])
        assert started.read_text().split() == [str(encoder)]

        process.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(process.wait(), timeout=60) == 0
        assert gone(encoder) and all(gone(pid) for pid in pids)
    finally:
        output = await stop(served, tmp_path)
    assert f"worker 0 (pid {pids[0]}) died (exit code -9); starting it again" in output


async def test_a_worker_started_while_routing_yaml_is_invalid_runs_what_its_siblings_run(
    upstream: Upstream, tmp_path: Path
) -> None:
    config, url, served = await start_text_model(upstream, tmp_path)
    try:
        await wait_healthy(url, served.process)
        workers = await each_worker(url)
        first = workers[0]["worker"]["pid"]
        config.write_text("version: 1\nmodels: [this is not a model]\n")  # an edit being fixed
        os.kill(first, signal.SIGKILL)

        async def replaced() -> bool:
            status, report = await readyz(url)
            return report["worker"]["index"] == 0 and report["worker"]["pid"] != first and status == 200

        await eventually(replaced)  # it started: from the master's last loaded routing.yaml
        async with aiohttp.ClientSession() as session:
            for _ in range(8):  # over new connections: both workers serve model m
                async with session.post(
                    f"{url}/v1/chat/completions",
                    json={"model": "m", "messages": [{"role": "user", "content": "hi"}]},
                    headers={"Connection": "close"},
                ) as resp:
                    assert resp.status == 200
        served.process.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(served.process.wait(), timeout=60) == 0
    finally:
        output = await stop(served, tmp_path)
    assert "is invalid now; starting from the routing.yaml the other workers run" in output


async def test_a_reload_while_the_workers_start_reaches_them_once_they_can_take_it(
    upstream: Upstream, tmp_path: Path
) -> None:
    _, url, served = await start_text_model(upstream, tmp_path)
    try:

        async def spawned() -> bool:
            return "worker 1 started" in served.output

        await eventually(spawned)
        served.process.send_signal(signal.SIGHUP)  # the workers are still importing: SIGHUP would kill them
        await wait_healthy(url, served.process)

        async def reloaded() -> bool:
            return {w["config_generation"] for w in (await each_worker(url)).values()} == {2}

        await eventually(reloaded)
        served.process.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(served.process.wait(), timeout=60) == 0
    finally:
        output = await stop(served, tmp_path)
    assert "died" not in output


async def test_the_port_in_use_is_refused_once_by_the_master(upstream: Upstream, tmp_path: Path) -> None:
    config = tmp_path / "routing.yaml"
    config.write_text(routing(f"  - {{name: m, upstreams: [{upstream.url}], accepts: [text]}}", server=f"{{{SERVER}}}"))
    port = int(upstream.url.rsplit(":", 1)[1])  # the stand-in listens there, without SO_REUSEPORT
    served = await start(config, port, tmp_path)
    assert await asyncio.wait_for(served.process.wait(), timeout=60) == 1
    output = await stop(served, tmp_path)
    assert f"cannot listen on http://127.0.0.1:{port}: address already in use" in output
    assert "worker 0 started" not in output and "Traceback" not in output


def test_workers_must_be_a_positive_number(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["serve", "--workers", "0"])
    assert exited.value.code == 2
    assert "--workers: must be a whole number of at least 1, not '0'" in capsys.readouterr().err


def test_serve_help_names_workers_and_hides_the_internal_options(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    out = capsys.readouterr().out
    assert "--workers N" in out and "--worker " not in out and "--run-dir" not in out and "--master-pid" not in out


def test_a_worker_refuses_to_start_outside_a_master(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR", raising=False)
    config = tmp_path / "routing.yaml"
    config.write_text("version: 1\nmodels:\n  - {name: m, upstreams: ['http://127.0.0.1:1'], accepts: [text]}\n")
    assert main(["serve", "--config", str(config), "--worker", "0"]) == 2
    assert "--worker is internal to serve --workers N" in capsys.readouterr().err


ENCODER = "encoders:\n  vision: {kind: local, device: cpu}\n"


async def test_a_worker_follows_the_masters_encoders_by_their_spec(tmp_path: Path) -> None:
    model = "  - {name: m, upstreams: ['http://127.0.0.1:1'], accepts: [text, image], encode: {image: vision}}"
    config = parse_config(routing(model, extra=ENCODER))
    master = Supervisor(config)
    status = tmp_path / "encoders.json"
    view = SupervisorView(config, status, interval_s=0.01)
    await view.start()
    try:
        assert not view.ready and view.url("vision") is None
        assert view.encoders["vision"].last_error == "not started by the master yet"

        # the master's state, as its supervise loop sets it, published
        master.encoders["vision"] = LocalEncoder(config.encoders["vision"], "http://127.0.0.1:5", True, 1, 42)
        status.write_bytes(orjson.dumps(master.snapshot()))

        async def ready() -> bool:
            return view.ready

        await eventually(ready)
        assert view.url("vision") == "http://127.0.0.1:5"
        assert view.encoders["vision"].status() == master.encoders["vision"].status()

        # a reload of this worker changes the encoder's spec: not ready until the master runs that one
        view.update(parse_config(routing(model, extra=ENCODER.replace("cpu", "cuda"))))
        assert not view.ready and view.url("vision") is None
        view.update(parse_config(routing(model.replace(", encode: {image: vision}", ""))))
        assert await ready() and view.encoders == {}  # no local encoder left to wait for
    finally:
        await view.close()

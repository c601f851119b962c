"""N gateways x M encoders, for real, on loopback: ``python -m tools.cluster_demo`` (``make cluster-demo``).

Starts 2 gateway processes that read one routing.yaml from a ConfigMap-style directory, 2 vision
encoder backends (``kind: http``, the builtin tower on CPU), a stand-in upstream and, when Debian's
``prometheus`` is installed, one real Prometheus that scrapes both gateways. Then it shows:

1. EPD requests through both gateways are spread over both encoders;
2. one encoder is killed (SIGKILL) with requests in flight while more stream in, and no request
   should fail (each failed one is printed, and the demo exits 1);
3. the ConfigMap is edited as the kubelet does it (a new timestamped directory, then an atomic swap
   of the ``..data`` symlink) and both gateways serve the new model; the time it took is printed;
4. Prometheus' sums over both gateways equal the gateways' own counters.

Everything stops by itself (each wait is bounded) and every process it started is stopped.
``tests/test_cluster.py`` runs the same steps (the functions below) and asserts on their results.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import io
import json
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from importlib.util import find_spec
from pathlib import Path
from types import TracebackType
from typing import Any

import aiohttp
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

from tools.standin import StandIn

ENCODER = "vision"
MODEL = "vl"  # the EPD model of the first config
NEW_MODEL = "vl-next"  # the model the ConfigMap edit adds
START_TIMEOUT_S = 60.0  # torch's import and the towers' first forward pass, on 2 busy cores
REQUEST_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 10.0

ImageFactory = Callable[[int], bytes]  # the i-th image of a run: distinct images, so none is a cache hit


def free_port() -> int:
    """A loopback port free right now (nothing listens on it until someone binds it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def routing_yaml(upstream: str, encoders: Sequence[str], models: Sequence[str]) -> str:
    """One routing.yaml for every gateway: the models all encode images on the ``vision`` encoders."""
    lines = [
        "version: 1",
        # stop at once when told to (no load balancer to warn here)
        "server: {drain_grace_s: 0, drain_timeout_s: 5}",
        "encoders:",
        f"  {ENCODER}: {{kind: http, urls: [{', '.join(encoders)}], timeout_s: {REQUEST_TIMEOUT_S:g}}}",
        "models:",
    ]
    lines += [
        f"  - {{name: {m}, upstreams: [{upstream}], accepts: [text, image], encode: {{image: {ENCODER}}}}}"
        for m in models
    ]
    return "\n".join(lines) + "\n"


def write_configmap(directory: Path, files: Mapping[str, str]) -> float:
    """Write ``files`` into ``directory`` as the kubelet updates a mounted ConfigMap, and return the
    ``time.monotonic()`` of the swap.

    The layout is ``NAME -> ..data/NAME``, ``..data -> ..<timestamp>/``. An update writes a new
    timestamped directory, points ``..data_tmp`` at it and renames that over ``..data`` (one atomic
    step: a reader sees the old files or the new ones, never a mix), then removes the old directory.
    """
    directory.mkdir(parents=True, exist_ok=True)
    data = directory / "..data"
    old = os.readlink(data) if data.is_symlink() else None
    stamp = directory / f"..{time.strftime('%Y_%m_%d_%H_%M_%S')}.{time.monotonic_ns() % 10**9}"
    stamp.mkdir()
    for name, text in files.items():
        (stamp / name).write_text(text)
    tmp = directory / "..data_tmp"
    tmp.symlink_to(stamp.name)
    tmp.rename(data)
    swapped = time.monotonic()
    for name in files:
        if not (directory / name).is_symlink():
            (directory / name).symlink_to(f"..data/{name}")
    if old is not None:
        shutil.rmtree(directory / old)
    return swapped


def _loopback() -> str:
    return f"http://127.0.0.1:{free_port()}"


def _port(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


@dataclass
class Service:
    """A process this module started, listening on ``url``, its output in ``log``."""

    name: str
    url: str
    process: asyncio.subprocess.Process
    log: Path

    def tail(self, lines: int = 15) -> str:
        try:
            text = self.log.read_text(errors="replace").splitlines()[-lines:]
        except OSError:
            return ""
        return "\n".join(f"    {line}" for line in text)


@dataclass
class Reply:
    gateway: int
    status: int
    encoded: str | None  # X-Gateway-Encoded
    code: str | None  # the error's code, when not 200
    content: str  # the stand-in's answer, or the error's message


class Cluster:
    """``gateways`` gateway processes reading one ConfigMap-style directory, ``encoders`` encoder
    backend processes, and (``prometheus=True``) one Prometheus scraping every gateway each
    ``scrape_interval``. The stand-in upstream is the caller's (``upstream``: its URL).

    ``async with Cluster(...) as cluster`` starts them all and waits, bounded, until each answers;
    leaving the block stops them all, also on errors, and kills what does not stop in time.
    """

    def __init__(
        self,
        workdir: Path,
        upstream: str,
        *,
        gateways: int = 2,
        encoders: int = 2,
        prometheus: bool = True,
        scrape_interval: str = "1s",
    ) -> None:
        self.workdir = workdir
        self.upstream = upstream
        self.config_dir = workdir / "config"
        self.config_path = self.config_dir / "routing.yaml"
        self.scrape_interval = scrape_interval
        self.encoders = [_loopback() for _ in range(encoders)]
        self.gateways = [_loopback() for _ in range(gateways)]
        self.prometheus = _loopback() if prometheus else None
        self._services: list[Service] = []
        self.sent: Counter[str] = Counter()  # chat requests sent to each gateway (by its URL) by chat()

    @property
    def services(self) -> list[Service]:
        return list(self._services)

    def service(self, url: str) -> Service:
        return next(s for s in self._services if s.url == url)

    def write_config(self, models: Sequence[str]) -> float:
        """(Re)write routing.yaml the kubelet's way; the ``time.monotonic()`` of the swap."""
        return write_configmap(self.config_dir, {"routing.yaml": routing_yaml(self.upstream, self.encoders, models)})

    async def __aenter__(self) -> Cluster:
        try:
            await self.start()
        except BaseException:
            await self.stop()
            raise
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc is not None:
            print(self.logs(), flush=True)  # what each process said, next to the failure
        await self.stop()

    async def start(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.write_config([MODEL])
        python = sys.executable
        for i, url in enumerate(self.encoders):
            port = str(_port(url))
            await self._spawn(
                f"encoder-{i}", url,
                python, "-m", "backends.vision_encoder", "serve", "--model", "builtin:vit-small",
                "--host", "127.0.0.1", "--port", port, "--device", "cpu", "--log-level", "warning",
                "--parent-pid", str(os.getpid()),  # gone with this process, even when it is killed
            )  # fmt: skip
        for i, url in enumerate(self.gateways):
            port = str(_port(url))
            await self._spawn(
                f"gateway-{i}", url,
                python, "-m", "gateway", "serve", "--config", str(self.config_path), "--port", port,
                "--log-level", "warning",
            )  # fmt: skip
        if self.prometheus is not None:
            targets = ", ".join(f"'{u.removeprefix('http://')}'" for u in self.gateways)
            config = self.workdir / "prometheus.yml"
            config.write_text(
                f"global: {{scrape_interval: {self.scrape_interval}, evaluation_interval: {self.scrape_interval}}}\n"
                "scrape_configs:\n"
                f"  - job_name: gateway\n    static_configs: [{{targets: [{targets}]}}]\n"
            )
            await self._spawn(
                "prometheus", self.prometheus,
                "prometheus", f"--config.file={config}", f"--storage.tsdb.path={self.workdir / 'prometheus-data'}",
                f"--web.listen-address={self.prometheus.removeprefix('http://')}",
            )  # fmt: skip
        checks = [(u, "/health") for u in self.encoders] + [(u, "/readyz") for u in self.gateways]
        if self.prometheus is not None:
            checks.append((self.prometheus, "/-/ready"))
        async with aiohttp.ClientSession() as session:
            await asyncio.gather(*(self._wait_ready(session, url, path) for url, path in checks))

    async def _spawn(self, name: str, url: str, *argv: str) -> None:
        log = self.workdir / f"{name}.log"
        with log.open("wb") as out:  # a file, not a pipe: a pipe nobody reads would block the process
            process = await asyncio.create_subprocess_exec(
                *argv, stdin=asyncio.subprocess.DEVNULL, stdout=out, stderr=asyncio.subprocess.STDOUT
            )
        self._services.append(Service(name, url, process, log))

    async def _wait_ready(self, session: aiohttp.ClientSession, url: str, path: str) -> None:
        service = self.service(url)
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if service.process.returncode is not None:
                raise RuntimeError(f"{service.name} exited with {service.process.returncode}:\n{service.tail()}")
            with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                async with session.get(f"{url}{path}", timeout=aiohttp.ClientTimeout(total=5)) as resp:
                    if resp.status == 200:
                        return
            await asyncio.sleep(0.1)
        raise RuntimeError(f"{service.name} did not answer {path} within {START_TIMEOUT_S:g}s:\n{service.tail()}")

    async def kill(self, url: str) -> None:
        """SIGKILL: no drain, no goodbye; the kernel closes its connections."""
        service = self.service(url)
        service.process.kill()
        await asyncio.wait_for(service.process.wait(), STOP_TIMEOUT_S)

    async def stop(self) -> None:
        """SIGTERM to every process still running, SIGKILL to those still there after STOP_TIMEOUT_S."""
        running = [s.process for s in self._services if s.process.returncode is None]
        for process in running:
            with contextlib.suppress(ProcessLookupError):
                process.send_signal(signal.SIGTERM)
                process.send_signal(signal.SIGCONT)  # one left frozen (SIGSTOP) takes it too
        try:
            await asyncio.wait_for(asyncio.gather(*(p.wait() for p in running)), STOP_TIMEOUT_S)
        except TimeoutError:
            for process in running:
                if process.returncode is None:
                    with contextlib.suppress(ProcessLookupError):
                        process.kill()
            await asyncio.gather(*(p.wait() for p in running))

    def logs(self) -> str:
        return "\n".join(f"--- {s.name} ({s.url}), last lines of {s.log}:\n{s.tail()}" for s in self._services)


# --- talking to it -------------------------------------------------------------------------------


async def chat(
    session: aiohttp.ClientSession, cluster: Cluster, gateway: int, model: str, image: bytes | None
) -> Reply:
    """One chat request through gateway number ``gateway``, with one image part when ``image``."""
    content: list[dict[str, Any]] = [{"type": "text", "text": "what is this?"}]
    if image is not None:
        url = "data:image/png;base64," + base64.b64encode(image).decode()
        content.append({"type": "image_url", "image_url": {"url": url}})
    body = {"model": model, "messages": [{"role": "user", "content": content}]}
    url = cluster.gateways[gateway]
    cluster.sent[url] += 1
    try:
        async with session.post(
            f"{url}/v1/chat/completions", json=body, timeout=aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
        ) as resp:
            text = await resp.text()
            encoded = resp.headers.get("X-Gateway-Encoded")
    except (aiohttp.ClientError, TimeoutError) as exc:
        return Reply(gateway, 0, None, type(exc).__name__, str(exc))
    try:
        payload = json.loads(text)
    except ValueError:
        payload = None
    if not isinstance(payload, dict):
        return Reply(gateway, resp.status, encoded, "not_json", text[:200])
    if resp.status == 200:
        return Reply(gateway, 200, encoded, None, payload["choices"][0]["message"]["content"])
    error = payload.get("error") or {}
    return Reply(gateway, resp.status, encoded, error.get("code"), error.get("message", ""))


async def stream(
    session: aiohttp.ClientSession,
    cluster: Cluster,
    model: str,
    images: ImageFactory,
    count: int,
    *,
    first: int = 0,
    concurrency: int = 4,
) -> list[Reply]:
    """``count`` EPD requests, ``concurrency`` at a time, taking turns over the gateways; image
    ``first + i`` for the i-th."""
    limit = asyncio.Semaphore(concurrency)

    async def one(i: int) -> Reply:
        async with limit:
            return await chat(session, cluster, i % len(cluster.gateways), model, images(first + i))

    return list(await asyncio.gather(*(one(i) for i in range(count))))


async def samples(session: aiohttp.ClientSession, url: str, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    """Every series of the counter or gauge ``name`` in ``url``'s /metrics, by its sorted labels."""
    async with session.get(f"{url}/metrics", timeout=aiohttp.ClientTimeout(total=10)) as resp:
        resp.raise_for_status()
        text = await resp.text()
    return {
        tuple(sorted(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == name
    }


async def total(session: aiohttp.ClientSession, url: str, name: str, **labels: str) -> float:
    """The sum of ``name``'s series in ``url``'s /metrics whose labels include ``labels``."""
    series = await samples(session, url, name)
    return sum(v for key, v in series.items() if all((k, v2) in key for k, v2 in labels.items()))


async def query(session: aiohttp.ClientSession, prometheus: str, promql: str) -> list[dict[str, Any]] | None:
    """An instant query's result vector; None while Prometheus cannot answer."""
    try:
        async with session.get(
            f"{prometheus}/api/v1/query", params={"query": promql}, timeout=aiohttp.ClientTimeout(total=10)
        ) as resp:
            if resp.status != 200:
                return None
            result: list[dict[str, Any]] = (await resp.json())["data"]["result"]
            return result
    except (aiohttp.ClientError, TimeoutError):
        return None


# --- the four steps ------------------------------------------------------------------------------


@dataclass
class Spread:
    replies: list[Reply]
    images_by_encoder: dict[str, float]  # each encoder's own vision_encoder_images_total{result="ok"}


async def spread(session: aiohttp.ClientSession, cluster: Cluster, images: ImageFactory, count: int = 16) -> Spread:
    """``count`` EPD requests through both gateways; how many images each encoder encoded."""
    replies = await stream(session, cluster, MODEL, images, count)
    by_encoder = {
        url: await total(session, url, "vision_encoder_images_total", result="ok") for url in cluster.encoders
    }
    return Spread(replies, by_encoder)


@dataclass
class Kill:
    victim: str
    killed_after: int  # replies received before the victim was frozen (or killed)
    waiting: int  # requests waiting in the victim's sockets when it was killed (0 without /proc/net/tcp)
    replies: list[Reply]
    encoder_outcomes: dict[str, float] = field(default_factory=dict)  # gateway_encoder_requests_total, summed

    @property
    def failed(self) -> list[Reply]:
        return [r for r in self.replies if r.status != 200 or r.encoded != "1"]


async def kill_one_encoder(
    session: aiohttp.ClientSession,
    cluster: Cluster,
    images: ImageFactory,
    count: int = 48,
    *,
    kill_after: int = 12,
    first: int = 1000,
    bound_s: float = 10.0,
) -> Kill:
    """``count`` EPD requests, 4 at a time, the first encoder killed (SIGKILL) with requests in flight.

    After ``kill_after`` replies it is frozen (SIGSTOP: what it was sent from then on waits, unread,
    in its sockets); the requests go on, and as soon as one waits in it (/proc/net/tcp says so;
    within ``bound_s``) it is killed, as an encoder that dies under load. Without /proc/net/tcp (not
    Linux) it is killed after the ``kill_after`` replies, between requests."""
    victim = cluster.encoders[0]
    port = _port(victim)
    replies = await stream(session, cluster, MODEL, images, kill_after, first=first)
    frozen = _tcp_sockets() is not None
    if frozen:  # nothing in flight on it now: each request it is sent from now on waits, visibly
        cluster.service(victim).process.send_signal(signal.SIGSTOP)
    else:
        await cluster.kill(victim)

    async def killer() -> int:
        if not frozen:
            return 0
        deadline = time.monotonic() + bound_s
        while not (waiting := waiting_requests(port)) and time.monotonic() < deadline:
            await asyncio.sleep(0.005)
        await cluster.kill(victim)
        return waiting

    kill = asyncio.create_task(killer())
    try:
        replies += await stream(session, cluster, MODEL, images, count - kill_after, first=first + kill_after)
    finally:
        waiting = await kill
    outcomes: dict[str, float] = {}
    for url in cluster.gateways:
        for key, value in (await samples(session, url, "gateway_encoder_requests_total")).items():
            outcome = dict(key)["outcome"]
            outcomes[outcome] = outcomes.get(outcome, 0.0) + value
    return Kill(victim, kill_after, waiting, replies, {k: v for k, v in outcomes.items() if v})


def _tcp_sockets() -> list[tuple[int, int, int, int]] | None:
    """(local port, remote port, state, bytes received and not yet read) of every IPv4 TCP socket
    on this machine, from /proc/net/tcp; None where there is no such file (not Linux)."""
    try:
        lines = Path("/proc/net/tcp").read_text().splitlines()[1:]
    except OSError:
        return None
    sockets = []
    for line in lines:
        fields = line.split()
        local, remote, state, queues = fields[1], fields[2], fields[3], fields[4]
        sockets.append(
            (int(local.rsplit(":", 1)[1], 16), int(remote.rsplit(":", 1)[1], 16), int(state, 16),
             int(queues.split(":")[1], 16))
        )  # fmt: skip
    return sockets


ESTABLISHED, CLOSE_WAIT = 0x01, 0x08


def waiting_requests(port: int) -> int:
    """Connections to the server on ``port`` that hold bytes it has not read: requests waiting in a
    process that does not run (0 without /proc/net/tcp)."""
    return sum(1 for lp, _, st, unread in _tcp_sockets() or [] if lp == port and st == ESTABLISHED and unread)


def half_closed(port: int) -> int:
    """Clients' connections to ``port`` that its server closed and the client has not closed yet
    (CLOSE_WAIT): a dead server's kept-alive connections that a gateway has not yet seen close."""
    return sum(1 for _, rp, st, _ in _tcp_sockets() or [] if rp == port and st == CLOSE_WAIT)


async def settled(url: str, bound_s: float = 5.0) -> None:
    """Wait (bounded) until no client holds a half-closed connection to a dead server at ``url``:
    every gateway has seen its kept-alive connections to it close, and will connect anew (and be
    refused) rather than send a request down one of them. Returns at once without /proc/net/tcp."""
    port = _port(url)
    deadline = time.monotonic() + bound_s
    while half_closed(port) and time.monotonic() < deadline:
        await asyncio.sleep(0.005)


@dataclass
class Swap:
    seconds: dict[str, float]  # per gateway: from the swap of ..data to its first 200 for NEW_MODEL
    probes: int  # requests sent meanwhile (404 model_not_found until the reload)
    replies: list[Reply]  # then one EPD request for NEW_MODEL per gateway


async def edit_config(
    session: aiohttp.ClientSession, cluster: Cluster, images: ImageFactory, *, bound_s: float = 10.0
) -> Swap:
    """Swap the ConfigMap to one that adds NEW_MODEL; time each gateway until it serves it."""
    probes = 0

    async def until_live(gateway: int, swapped: float) -> float:
        nonlocal probes
        while (elapsed := time.monotonic() - swapped) < bound_s:
            probes += 1
            reply = await chat(session, cluster, gateway, NEW_MODEL, None)
            if reply.status == 200:
                return time.monotonic() - swapped
            if reply.code != "model_not_found":
                raise AssertionError(f"gateway {gateway} answered {reply} while reloading")
            await asyncio.sleep(0.01)
        raise AssertionError(f"gateway {gateway} did not serve {NEW_MODEL} within {elapsed:.1f}s of the edit")

    swapped = cluster.write_config([MODEL, NEW_MODEL])
    times = await asyncio.gather(*(until_live(i, swapped) for i in range(len(cluster.gateways))))
    replies = [await chat(session, cluster, i, NEW_MODEL, images(2000 + i)) for i in range(len(cluster.gateways))]
    return Swap(dict(zip(cluster.gateways, times, strict=True)), probes, replies)


@dataclass
class Scrape:
    own: dict[str, dict[tuple[tuple[str, str], ...], float]]  # each gateway's gateway_requests_total
    summed: dict[tuple[tuple[str, str], ...], float]  # sum by (model, code, key, api) over the gateways, by Prometheus
    by_instance: dict[tuple[str, tuple[tuple[str, str], ...]], float]  # Prometheus, per instance and series

    @property
    def expected_sums(self) -> dict[tuple[tuple[str, str], ...], float]:
        sums: dict[tuple[tuple[str, str], ...], float] = {}
        for series in self.own.values():
            for key, value in series.items():
                sums[key] = sums.get(key, 0.0) + value
        return sums


async def scrape(session: aiohttp.ClientSession, cluster: Cluster, *, bound_s: float = 20.0) -> Scrape:
    """Once traffic has stopped: each gateway's own gateway_requests_total (read once it counts
    every request ``cluster.sent`` it: nothing more will change), then Prometheus' sums over them,
    once a scrape after the last request has landed (polled, within ``bound_s``)."""
    assert cluster.prometheus is not None
    name = "gateway_requests_total"
    deadline = time.monotonic() + bound_s
    own = {}
    for url in cluster.gateways:
        series = await samples(session, url, name)
        while sum(series.values()) < cluster.sent[url] and time.monotonic() < deadline:  # past it: a test shows it
            await asyncio.sleep(0.01)
            series = await samples(session, url, name)
        own[url] = {k: v for k, v in series.items() if v}
    scrape = Scrape(own, {}, {})
    labels = ("model", "code", "key", "api")
    while time.monotonic() < deadline:
        summed = await query(session, cluster.prometheus, f"sum by ({', '.join(labels)}) ({name})")
        per = await query(session, cluster.prometheus, f"sum by (instance, {', '.join(labels)}) ({name})")
        if summed is not None and per is not None:
            scrape.summed = {
                tuple(sorted((k, r["metric"].get(k, "")) for k in labels)): float(r["value"][1])
                for r in summed
                if float(r["value"][1])
            }
            scrape.by_instance = {
                (
                    "http://" + r["metric"]["instance"],
                    tuple(sorted((k, r["metric"].get(k, "")) for k in labels)),
                ): float(r["value"][1])
                for r in per
                if float(r["value"][1])
            }
            if scrape.summed == scrape.expected_sums:
                break
        await asyncio.sleep(0.2)
    return scrape


# --- the demonstration ---------------------------------------------------------------------------


def pillow_png(i: int) -> bytes:
    """The i-th image of the demo: a 64x48 PNG of its own color."""
    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (64, 48), (i % 256, (i // 256) % 256, 90)).save(buffer, "PNG")
    return buffer.getvalue()


def _statuses(replies: Sequence[Reply]) -> str:
    counts = Counter(f"{r.status}{' ' + r.code if r.code else ''}" for r in replies)
    return ", ".join(f"{n} x {status}" for status, n in sorted(counts.items()))


async def demo(workdir: Path) -> int:
    """Run the four steps, printing what happened; 0 when each went as it should."""
    problems: list[str] = []
    standin = StandIn("standin")
    runner = web.AppRunner(standin.app(), access_log=None)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    with_prometheus = shutil.which("prometheus") is not None
    started = time.monotonic()
    try:
        print(
            f"starting 2 encoders, 2 gateways{', Prometheus' if with_prometheus else ''} in {workdir} ...", flush=True
        )
        cluster = Cluster(workdir, f"http://127.0.0.1:{port}", prometheus=with_prometheus)
        async with cluster, aiohttp.ClientSession() as session:
            print(f"  up in {time.monotonic() - started:.1f}s")
            print(f"  stand-in upstream  http://127.0.0.1:{port}")
            for s in cluster.services:
                print(f"  {s.name:<18} {s.url}  (pid {s.process.pid}, log {s.log.name})")
            links = sorted(
                p.name + (f" -> {os.readlink(p)}" if p.is_symlink() else "/") for p in cluster.config_dir.iterdir()
            )
            print(f"  config: {cluster.config_dir}: {', '.join(links)}")

            print("\n1. 16 EPD requests, 4 at a time, taking turns over both gateways")
            result = await spread(session, cluster, pillow_png)
            print(f"   replies: {_statuses(result.replies)}")
            for url, n in result.images_by_encoder.items():
                print(f"   {cluster.service(url).name} ({url}) encoded {n:g} images")
            if not all(result.images_by_encoder.values()) or _statuses(result.replies) != "16 x 200":
                problems.append("step 1: the images were not spread over both encoders, or a request failed")

            print("\n2. 48 EPD requests, 4 at a time; after the 12th reply encoder-0 is frozen (SIGSTOP) until")
            print("   a request waits in it, then killed (SIGKILL): it dies with work in flight, as under load")
            kill = await kill_one_encoder(session, cluster, pillow_png)
            print(f"   killed with {kill.waiting} request(s) waiting in it")
            print(
                f"   replies: {_statuses(kill.replies)}; failed (not 200 with X-Gateway-Encoded: 1): {len(kill.failed)}"
            )
            for r in kill.failed[:5]:
                print(f"     gateway-{r.gateway}: {r.status} {r.code}: {r.content[:160]}")
            print(f"   gateway_encoder_requests_total over both gateways, by outcome: {kill.encoder_outcomes}")
            if kill.failed:
                problems.append(f"step 2: {len(kill.failed)} of {len(kill.replies)} requests failed around the kill")

            print(f"\n3. ConfigMap edit: a new ..<timestamp>/ directory, then ..data swapped to it (adds {NEW_MODEL})")
            swap = await edit_config(session, cluster, pillow_png)
            for url, seconds in swap.seconds.items():
                print(f"   {cluster.service(url).name} served {NEW_MODEL} {seconds * 1000:.0f} ms after the swap")
            print(f"   ({swap.probes} probe requests meanwhile; then one EPD request each: {_statuses(swap.replies)})")
            print("   reload poll interval: 0.5 s (server.reload_interval_s); docs/reliability.md has the benchmark")

            if cluster.prometheus is None:
                print("\n4. skipped: no `prometheus` binary (Debian's prometheus package: make test-deps)")
            else:
                print(f"\n4. one Prometheus ({cluster.prometheus}) scrapes both gateways every 1 s")
                scraped = await scrape(session, cluster)
                width = max((len(_label(k)) for k in scraped.expected_sums), default=10)
                print(
                    f"   {'gateway_requests_total':<{width}}  "
                    + "  ".join(f"{cluster.service(u).name:>9}" for u in cluster.gateways)
                    + "  Prometheus sum"
                )
                for key in sorted(scraped.expected_sums):
                    own = "  ".join(f"{scraped.own[u].get(key, 0):>9g}" for u in cluster.gateways)
                    print(f"   {_label(key):<{width}}  {own}  {scraped.summed.get(key, float('nan')):>14g}")
                if scraped.summed != scraped.expected_sums:
                    problems.append("step 4: Prometheus' sums differ from the gateways' own counters")
                else:
                    print("   equal, series by series")
    finally:
        await runner.cleanup()
    print(f"\nstopped everything; {time.monotonic() - started:.1f}s in all")
    for problem in problems:
        print(f"PROBLEM: {problem}")
    return 1 if problems else 0


def _label(key: tuple[tuple[str, str], ...]) -> str:
    return "{" + ",".join(f'{k}="{v}"' for k, v in key) + "}"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.cluster_demo", description=__doc__.split("\n\n")[0])
    parser.add_argument("--keep", action="store_true", help="keep the working directory (logs, config, TSDB)")
    parser.add_argument("--timeout-s", type=float, default=180.0, help="give up after this long (default: %(default)g)")
    args = parser.parse_args(argv)
    for module in ("torch", "PIL"):
        if find_spec(module) is None:
            print(f"needs the encoder extra ({module}): pip install -e '.[encoder]'", file=sys.stderr)
            return 2
    workdir = Path(tempfile.mkdtemp(prefix="cluster-demo-"))
    try:
        return asyncio.run(asyncio.wait_for(demo(workdir), args.timeout_s))
    except TimeoutError:
        print(f"gave up after {args.timeout_s:g}s", file=sys.stderr)
        return 1
    finally:
        if args.keep:
            print(f"kept {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())

"""The gateway hop, side by side: straight to the upstream, through the least an aiohttp proxy can do,
and through the gateway, for each kind of request the gateway sees (``make bench``).

    .venv/bin/python -m bench.hop [--quick] [--rounds 3] [--duration 3] [--scenarios text reject ...]
        [--gateway-workers N] [--plot docs/bench-hop.png] [--json out.json] [--profile] [--profile-raw F]
        [--baseline /tmp/wt-before]

It starts, as separate processes on free loopback ports, the stand-in upstream (``tools.standin``),
the minimal proxy (``bench.minimal_proxy``) and the gateway (``modality-gateway serve`` on a
generated routing.yaml; a second one with the access log on, a third with a local encoder for EPD),
then drives each with wrk (``bench.wrk``): every scenario runs its paths in turn, round after round
(the order rotating), and reports medians of the rounds: req/s, p50 and p99, the CPU time the
proxy process spent per request and its peak RSS (``bench.procstat``), and req/s as a ratio of the
reference path's in the same round. Bounded: every run stops after ``--duration`` seconds; the
default takes about 7 minutes, ``--quick`` under a minute.

``--baseline DIR`` also starts the gateway of another checkout (a ``git worktree`` of the commit
before a change) on the same config, as more paths of the text and image scenarios: before and
after measured side by side, in the same rounds, instead of in two runs the machine's drift
tells apart.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import datetime
import hashlib
import json
import math
import os
import platform
import random
import re
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import zlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import orjson

from bench import procstat, report, wrk
from bench.common import free_port
from bench.report import Run, Series, Summary
from tools.redis_server import RedisServer

# Text first, large bodies last: a process keeps some memory it grew for 2 MiB bodies, which would
# show in the peak RSS of the runs after.
SCENARIOS = ("text", "reject", "stream-20", "stream-500", "sweep", "image-100k", "image-2m", "epd", "apis", "tenants")
QUICK_SCENARIOS = ("text", "reject", "stream-20", "sweep", "image-100k")
SWEEP = (1, 4, 16, 32, 64)
QUICK_SWEEP = (1, 32)
CONNECTIONS = 32
EPD_CONNECTIONS = 8
PROMPT = "Describe the picture in one sentence."
DIRECT, MINIMAL, GATEWAY, GATEWAY_LOG = "direct", "minimal proxy", "gateway", "gateway, access log on"
GATEWAY_UNCOUNTED = "gateway, images not counted"  # a model with no visual_tokens: what counting costs
FLOOR = "aiohttp server, fixed 400"  # bench.floor: the least an aiohttp server does to answer
# bench.client_floor: aiohttp's server and the gateway's client, nothing else (the gateway's own work: the rest)
CLIENT_FLOOR = "aiohttp server + the gateway's client"
FORWARDED, REJECTED = "gateway, forwarded (text)", "gateway, rejected (400)"
# The tenants scenario: a key's limits in this process or shared in Redis, and traces sent (issue 24)
GATEWAY_KEYS, GATEWAY_REDIS = "gateway, key limits per process", "gateway, key limits in Redis"
GATEWAY_TRACED, GATEWAY_SAMPLED = "gateway, traced (every request)", "gateway, traced (10% sampled)"
GATEWAY_UNSAMPLED = "gateway, traced (none sampled)"  # what a request not sampled costs: sample_ratio 0
TRACED = (GATEWAY_TRACED, GATEWAY_SAMPLED, GATEWAY_UNSAMPLED)
BENCH_KEY = "sk-bench-0123456789"  # a key of the bench's own gateways, on loopback only
ROOT = Path(__file__).resolve().parent.parent


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# --- request bodies -------------------------------------------------------------------------------


def chat_body(model: str, *, image_url: str | None = None, stream_chunks: int | None = None) -> bytes:
    content: list[dict[str, object]] = [{"type": "text", "text": PROMPT}]
    if image_url is not None:
        content.append({"type": "image_url", "image_url": {"url": image_url}})
    body: dict[str, object] = {"model": model, "max_tokens": 16, "messages": [{"role": "user", "content": content}]}
    if stream_chunks is not None:  # the stand-in then streams exactly this many content chunks
        body.update(stream=True, max_tokens=stream_chunks, ignore_eos=True)
    return orjson.dumps(body)


def responses_body(model: str) -> bytes:
    """The text chat request as the Responses API sends it."""
    content = [{"type": "input_text", "text": PROMPT}]
    return orjson.dumps({"model": model, "max_output_tokens": 16, "input": [{"role": "user", "content": content}]})


def messages_body(model: str) -> bytes:
    """The text chat request as Anthropic's Messages API sends it."""
    content = [{"type": "text", "text": PROMPT}]
    return orjson.dumps({"model": model, "max_tokens": 16, "messages": [{"role": "user", "content": content}]})


def image_body(model: str, size: int, *, seed: int = 0) -> bytes:
    """A chat request of ``size`` bytes, nearly all of it one ``data:image/png;base64,`` URL: a valid
    PNG of random pixels (square, as large as fits), padded to the size by a ``tEXt`` comment."""
    bare = len(chat_body(model, image_url="data:image/png;base64,"))
    room = (size - bare) // 4 * 3
    png = noise_png(math.isqrt((room - 256) // 3), math.isqrt((room - 256) // 3), seed)
    comment = b"Comment\x00" + b" " * (room - len(png) - 12 - 8)
    text = struct.pack(">I", len(comment)) + b"tEXt" + comment + struct.pack(">I", zlib.crc32(b"tEXt" + comment))
    png = png[:-12] + text + png[-12:]
    return chat_body(model, image_url="data:image/png;base64," + base64.b64encode(png).decode())


def noise_png(width: int, height: int, seed: int) -> bytes:
    """A valid RGB PNG of random pixels: each seed a distinct image (an encoder cache miss)."""
    rng = random.Random(seed)
    rows = b"".join(b"\x00" + rng.randbytes(width * 3) for _ in range(height))

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(rows, 1)) + chunk(b"IEND", b"")


def png_body(model: str, seed: int) -> bytes:
    return chat_body(model, image_url="data:image/png;base64," + base64.b64encode(noise_png(224, 224, seed)).decode())


# --- the processes --------------------------------------------------------------------------------


@dataclass
class Server:
    name: str
    process: subprocess.Popen[bytes]
    url: str
    log: Path

    def pids(self) -> list[int]:
        """The server and its workers; a local encoder it supervises is counted apart (``encoder_pids``)."""
        return [self.process.pid, *(p for p in procstat.descendants(self.process.pid) if not _is_encoder(p))]

    def encoder_pids(self) -> list[int]:
        return [p for p in procstat.descendants(self.process.pid) if _is_encoder(p)]


def _is_encoder(pid: int) -> bool:
    try:
        return b"vision_encoder" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def start_server(
    name: str, argv: Sequence[str], url: str, ready: str, tmp: Path, *, timeout_s: float = 120, cwd: Path = ROOT
) -> Server:
    """Start ``argv`` in ``cwd`` (its modules first on the path) and wait (bounded) until ``url +
    ready`` answers 200."""
    log_path = tmp / f"{name.replace(' ', '-').replace(',', '').replace('@', '')}.log"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(cwd), os.environ.get("PYTHONPATH")) if p)}
    with log_path.open("wb") as out:
        process = subprocess.Popen(
            argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=cwd, env=env
        )
    server = Server(name, process, url, log_path)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            break
        with contextlib.suppress(OSError, urllib.error.URLError):
            with urllib.request.urlopen(url + ready, timeout=2) as response:
                if response.status == 200:
                    return server
        time.sleep(0.1)
    stop(server)
    raise RuntimeError(f"{name} did not come up ({' '.join(argv)}):\n{log_path.read_text()[-3000:]}")


def start_standin(name: str, tmp: Path) -> Server:
    """The stand-in engine (tools.standin, keeping nothing it receives) on a free port."""
    port = free_port()
    argv = [sys.executable, "-m", "tools.standin", "--port", str(port), "--name", "bench", "--no-record"]
    return start_server(name, argv, f"http://127.0.0.1:{port}", "/health", tmp)


def stop(server: Server) -> None:
    server.process.terminate()
    try:
        server.process.wait(timeout=20)
    except subprocess.TimeoutExpired:
        server.process.kill()
        server.process.wait()


def tenants_config(variant: str, *, redis: str | None = None, collector: str | None = None) -> tuple[str, str]:
    """The server keys and the auth section of a tenants-scenario gateway: its key limited (rates
    far above what a run sends: the checks run, none refuses), in this process or in Redis, or
    its requests traced to the bench's collector."""
    server, auth = "", ""
    if variant in (GATEWAY_KEYS, GATEWAY_REDIS):
        digest = hashlib.sha256(BENCH_KEY.encode()).hexdigest()
        auth = (
            "auth:\n  keys:\n"
            f"    - {{name: bench, key_sha256: {digest}, rate_limit: {{requests_per_minute: 1000000000, "
            "burst: 1000000, tokens_per_minute: 1000000000000, tokens_per_day: 1000000000000}}\n"
        )
        if variant == GATEWAY_REDIS:
            server = f", limits_store: {{url: '{redis}', timeout_ms: 50}}"
    elif variant in TRACED:
        ratio = {GATEWAY_TRACED: 1.0, GATEWAY_SAMPLED: 0.1, GATEWAY_UNSAMPLED: 0.0}[variant]
        server = f", tracing: {{otlp_endpoint: '{collector}', sample_ratio: {ratio}}}"
    return server, auth


def gateway_config(
    port: int,
    upstream: str,
    *,
    access_log: bool,
    epd: bool,
    extra: tuple[str, str] = ("", ""),
) -> str:
    encoders = (
        "encoders:\n  vision: {kind: local, model: 'builtin:vit-small', device: cpu, max_batch_size: 32}\n"
        if epd
        else ""
    )
    epd_model = f"  - {{name: bench-epd, upstreams: [{upstream}], accepts: [text, image], encode: {{image: vision}}}}\n"
    return (
        "version: 1\n"
        f"server: {{host: 127.0.0.1, port: {port}, max_body_bytes: 67108864, reload_interval_s: 0, "
        "drain_grace_s: 0, drain_timeout_s: 2, "
        f"access_log: {str(access_log).lower()}{extra[0]}}}\n"
        f"{extra[1]}"
        f"{encoders}"
        "models:\n"
        f"  - {{name: bench, upstreams: [{upstream}], accepts: [text, image], visual_tokens: {{preset: qwen2.5-vl}}, "
        "limits: {visual_tokens: 16384, image_pixels: 12845056}}  # images counted, as a production table does\n"
        f"  - {{name: bench-plain, upstreams: [{upstream}], accepts: [text, image]}}  # images not counted\n"
        f"  - {{name: bench-text, upstreams: [{upstream}], accepts: [text]}}  # images: 400 at admission\n"
        f"{epd_model if epd else ''}"
    )


def gateway_base() -> list[str]:
    script = Path(sys.executable).parent / "modality-gateway"
    return [str(script)] if script.exists() else [sys.executable, "-m", "gateway"]


def gateway_command(config: Path, workers: int) -> list[str]:
    command = [*gateway_base(), "serve", "--config", str(config), "--log-level", "info"]
    return [*command, "--workers", str(workers)] if workers > 1 else command


def check_workers_option() -> None:
    serve_help = subprocess.run([*gateway_base(), "serve", "--help"], capture_output=True, text=True, timeout=60)
    if "--workers" not in serve_help.stdout:
        raise SystemExit("--gateway-workers: this gateway's `serve` has no --workers option yet")


class Stack:
    """The servers of a run, started on demand, all stopped on exit; ``baseline``: another
    checkout whose gateway runs beside this one's (``--baseline``)."""

    def __init__(self, tmp: Path, workers: int, baseline: Path | None = None) -> None:
        self.tmp, self.workers, self.baseline = tmp, workers, baseline
        self._servers: dict[str, Server] = {}
        self.baseline_name = f"gateway @{_short_commit(baseline)}" if baseline is not None else ""

    def __enter__(self) -> Stack:
        return self

    def __exit__(self, *exc: object) -> None:
        for server in self._servers.values():
            server.process.terminate()
        for server in self._servers.values():
            stop(server)

    def get(self, name: str) -> Server:
        if name not in self._servers:
            self._servers[name] = self._start(name)
        return self._servers[name]

    def restart(self, name: str) -> Server:
        """The server of this name stopped and started again: a new process (on a new port)."""
        if name in self._servers:
            stop(self._servers.pop(name))
        return self.get(name)

    def _start(self, name: str) -> Server:
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        log(f"starting {name} on {url}")
        if name == "upstream":
            argv = [sys.executable, "-m", "tools.standin", "--port", str(port), "--name", "bench", "--no-record"]
            return start_server("stand-in upstream", argv, url, "/health", self.tmp)
        if name == "redis":  # tools.redis_server's: its output read until it is ready, then left to it
            store = RedisServer(self.tmp)
            return Server(name, store.process, store.url, self.tmp / "redis.log")  # type: ignore[arg-type]
        if name == "collector":
            argv = [sys.executable, "-m", "bench.otlp_sink", "--port", str(port)]
            return start_server("trace collector", argv, url, "/health", self.tmp)
        if name in (MINIMAL, FLOOR, CLIENT_FLOOR):
            module = {MINIMAL: "bench.minimal_proxy", FLOOR: "bench.floor", CLIENT_FLOOR: "bench.client_floor"}[name]
            argv = [sys.executable, "-m", module, "--port", str(port), "--upstream", self.upstream]
            return start_server(name, argv, url, "/health", self.tmp)
        epd = name == "gateway, EPD"
        config = self.tmp / f"routing-{port}.yaml"
        extra = ("", "")
        if name in (GATEWAY_KEYS, GATEWAY_REDIS, *TRACED):
            store_url = self.get("redis").url if name == GATEWAY_REDIS else None
            collector = self.get("collector").url if name in TRACED else None
            extra = tenants_config(name, redis=store_url, collector=collector)
        config.write_text(gateway_config(port, self.upstream, access_log=name == GATEWAY_LOG, epd=epd, extra=extra))
        if name == self.baseline_name and self.baseline is not None:  # the other checkout's, on its own modules
            argv = [sys.executable, "-m", "gateway", "serve", "--config", str(config), "--log-level", "info"]
            return start_server(name, argv, url, "/healthz", self.tmp, cwd=self.baseline)
        return start_server(
            name, gateway_command(config, self.workers), url, "/readyz" if epd else "/healthz", self.tmp
        )

    @property
    def upstream(self) -> str:
        return self.get("upstream").url


def _short_commit(folder: Path) -> str:
    found = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=folder,
                           check=False).stdout.strip()  # fmt: skip
    return found or folder.name


# --- scenarios ------------------------------------------------------------------------------------


@dataclass
class Arm:
    path: str
    target: Server
    measured: Server | None  # whose CPU and RSS are reported; None: the upstream itself (direct)
    script: Callable[[], Path]
    expect_ok: bool = True  # False: every answer is a 4xx
    counters: Callable[[], dict[str, float]] | None = None
    route: str = "/v1/chat/completions"  # the API it posts to
    warm_with: Callable[[], Path] | None = None  # what warms its server first (None: the plain text request)


@dataclass
class Plan:
    scenario: str
    connections: int
    arms: list[Arm]
    reference: str
    direct: str | None = DIRECT
    warmup: list[Arm] = field(default_factory=list)
    # each round's arms on fresh processes (None: the same ones throughout): a process's own speed,
    # which its memory's layout sets, differs from another's of the same code by up to ~3%, as
    # much as the features a plan weighs; the median of rounds over fresh ones is the code's
    fresh: Callable[[], list[Arm]] | None = None


class Scripts:
    """Request bodies and wrk scripts, written once to the run's folder."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self._made: dict[str, Path] = {}
        self._seed = 1000

    def static(
        self, key: str, bodies: Callable[[], Sequence[bytes]], headers: Mapping[str, str] | None = None
    ) -> Callable[[], Path]:
        def make() -> Path:
            if key not in self._made:
                self._made[key] = self._write(key, bodies(), headers or {})
            return self._made[key]

        return make

    def fresh(self, key: str, count: int, body: Callable[[int], bytes]) -> Callable[[], Path]:
        """A script of ``count`` bodies never sent before (new seeds at each call)."""

        def make() -> Path:
            self._seed += count
            return self._write(f"{key}-{self._seed}", [body(self._seed + i) for i in range(count)], {})

        return make

    def _write(self, key: str, bodies: Sequence[bytes], headers: Mapping[str, str]) -> Path:
        folder = self.tmp / "bodies" / key
        folder.mkdir(parents=True, exist_ok=True)
        paths = []
        for i, data in enumerate(bodies):
            paths.append(folder / f"{i}.json")
            paths[-1].write_bytes(data)
        script = folder / "post.lua"
        script.write_text(wrk.lua_script(paths, {"Content-Type": "application/json", **headers}))
        return script


def _three(
    scenario: str, connections: int, stack: Stack, script: Callable[[], Path], route: str = "/v1/chat/completions"
) -> Plan:
    up, minimal, gw = stack.get("upstream"), stack.get(MINIMAL), stack.get(GATEWAY)
    arms = [Arm(DIRECT, up, None, script, route=route), Arm(MINIMAL, minimal, minimal, script, route=route),
            Arm(GATEWAY, gw, gw, script, route=route)]  # fmt: skip
    return Plan(scenario, connections, arms, reference=MINIMAL)


def plans(name: str, stack: Stack, scripts: Scripts, *, duration: int, sweep: Sequence[int]) -> list[Plan]:
    text = scripts.static("text", lambda: [chat_body("bench")])
    if name == "text":
        plan = _three("text chat", CONNECTIONS, stack, text)
        gw_log = stack.get(GATEWAY_LOG)
        plan.arms.append(Arm(GATEWAY_LOG, gw_log, gw_log, text))
        floor = stack.get(CLIENT_FLOOR)
        plan.arms.append(Arm(CLIENT_FLOOR, floor, floor, text))
        if stack.baseline is not None:
            before = stack.get(stack.baseline_name)
            plan.arms.append(Arm(stack.baseline_name, before, before, text))
        return [plan]
    if name in ("image-100k", "image-2m"):
        size, label = (100 * 1024, "100 KiB") if name == "image-100k" else (2 * 1024 * 1024, "2 MiB")
        body = scripts.static(name, lambda: [image_body("bench", size)])
        plain = scripts.static(name + "-plain", lambda: [image_body("bench-plain", size)])
        plan = _three(f"image, {label} body", CONNECTIONS, stack, body)  # its visual tokens counted
        gw = stack.get(GATEWAY)
        plan.arms.append(Arm(GATEWAY_UNCOUNTED, gw, gw, plain))  # the same, to a model with no visual_tokens
        if stack.baseline is not None:
            before = stack.get(stack.baseline_name)
            plan.arms.append(Arm(stack.baseline_name, before, before, body))
            plan.arms.append(Arm(f"{stack.baseline_name}, images not counted", before, before, plain))
        return [plan]
    if name == "reject":
        gw = stack.get(GATEWAY)
        tiny = "data:image/png;base64," + base64.b64encode(noise_png(1, 1, 0)).decode()
        rejected = scripts.static("reject", lambda: [chat_body("bench-text", image_url=tiny)])
        floor = stack.get(FLOOR)
        arms = [
            Arm(FORWARDED, gw, gw, text),
            Arm(REJECTED, gw, gw, rejected, False),
            Arm(FLOOR, floor, floor, rejected, False),
        ]
        return [Plan("rejection", CONNECTIONS, arms, reference=FORWARDED, direct=None)]
    if name.startswith("stream-"):
        chunks = int(name.split("-")[1])
        body = scripts.static(name, lambda: [chat_body("bench", stream_chunks=chunks)])
        return [_three(f"stream, {chunks} chunks", c, stack, body) for c in (1, CONNECTIONS)]
    if name == "epd":
        return [_epd_plan(stack, scripts, duration)]
    if name == "apis":  # the other doors, side by side with chat: the same text, the same reply
        responses = scripts.static("responses", lambda: [responses_body("bench")])
        messages = scripts.static("messages", lambda: [messages_body("bench")])
        return [
            _three("text, chat API", CONNECTIONS, stack, text),
            _three("text, Responses API", CONNECTIONS, stack, responses, "/v1/responses"),
            _three("text, Messages API", CONNECTIONS, stack, messages, "/v1/messages"),
        ]
    if name == "sweep":
        return [_three("sweep: text chat", c, stack, text) for c in sweep]
    if name == "tenants":
        return [_tenants_plan(stack, scripts)]
    raise ValueError(name)


def _tenants_plan(stack: Stack, scripts: Scripts) -> Plan:
    """Text chat through the gateway as it is, with a key's limits (in the process, then shared in
    Redis: the store's commands a request counted), and with traces sent (the spans counted)."""
    text = scripts.static("text", lambda: [chat_body("bench")])
    keyed = scripts.static("text-keyed", lambda: [chat_body("bench")], {"Authorization": f"Bearer {BENCH_KEY}"})
    redis = stack.get("redis")
    collector = stack.get("collector")

    def commands() -> dict[str, float]:
        return {"limits scripts": float(_scripts_run(redis.url))}

    def spans() -> dict[str, float]:
        with urllib.request.urlopen(collector.url + "/count", timeout=10) as response:
            return {"spans received": float(orjson.loads(response.read())["spans"])}

    variants = (
        (GATEWAY, text, None),
        (GATEWAY_KEYS, keyed, None),
        (GATEWAY_REDIS, keyed, commands),
        (GATEWAY_TRACED, text, spans),
        (GATEWAY_SAMPLED, text, spans),
        (GATEWAY_UNSAMPLED, text, spans),
    )

    def arms(start: Callable[[str], Server]) -> list[Arm]:
        return [Arm(name, server, server, script, counters=counters, warm_with=script)
                for name, script, counters in variants for server in (start(name),)]  # fmt: skip

    # fresh gateways each round: the features weighed here cost a few µs of ~100, within what one
    # process differs from another of the same code
    return Plan("tenants: text chat", CONNECTIONS, arms(stack.get), reference=GATEWAY, direct=None,
                fresh=lambda: arms(stack.restart))  # fmt: skip


def _scripts_run(url: str) -> int:
    """The limits scripts the store has run since it started (INFO commandstats: EVALSHA's
    calls), over RESP on a plain socket: the reply is one bulk string, ``$LEN\\r\\n...\\r\\n``."""
    host, port = url.removeprefix("redis://").split("/")[0].split(":")
    with socket.create_connection((host, int(port)), timeout=10) as conn:
        conn.sendall(b"*2\r\n$4\r\nINFO\r\n$12\r\ncommandstats\r\n")
        data = b""
        while b"\r\n" not in data or len(data) < data.index(b"\r\n") + 4 + int(data[1 : data.index(b"\r\n")]):
            data += conn.recv(65536)
    found = re.search(rb"cmdstat_evalsha:calls=(\d+)", data)
    return int(found.group(1)) if found else 0


def _epd_plan(stack: Stack, scripts: Scripts, duration: int) -> Plan:
    """The gateway encoding images with its local builtin:vit-small encoder (CPU), against the same
    gateway forwarding the same images as they are; the minimal proxy has no equivalent."""
    gw = stack.get("gateway, EPD")
    seen = scripts.static("epd-seen", lambda: [png_body("bench-epd", seed) for seed in range(8)])
    forwarded = scripts.static("epd-forwarded", lambda: [png_body("bench", seed) for seed in range(8)])
    # More distinct images than the CPU encoder gets through in a run (~20/s), so none repeats.
    fresh = scripts.fresh("epd-fresh", 16 + 30 * duration, lambda seed: png_body("bench-epd", seed))

    def counters() -> dict[str, float]:
        outcomes = _encoder_outcomes(gw.url)
        return {
            "images encoded": outcomes.get("ok", 0.0),
            "encoder cache hits": outcomes.get("cached", 0.0),
            "encoder CPU s": procstat.cpu_seconds(gw.encoder_pids()),
        }

    arms = [
        Arm("gateway, images forwarded", gw, gw, forwarded, counters=counters),
        Arm("gateway, EPD, new images", gw, gw, fresh, counters=counters),
        Arm("gateway, EPD, cached images", gw, gw, seen, counters=counters),
    ]
    warmup = [Arm("warm-up: encode the cached set", gw, gw, seen)]
    return Plan("EPD, 224x224 PNG", EPD_CONNECTIONS, arms, reference=arms[0].path, direct=None, warmup=warmup)


_OUTCOME = re.compile(r'^gateway_encoder_requests_total\{[^}]*outcome="(\w+)"[^}]*\} ([0-9.e+]+)$', re.MULTILINE)


def _encoder_outcomes(url: str) -> dict[str, float]:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as response:
        text = response.read().decode()
    totals: dict[str, float] = {}
    for outcome, value in _OUTCOME.findall(text):
        totals[outcome] = totals.get(outcome, 0.0) + float(value)
    return totals


# --- running --------------------------------------------------------------------------------------


def measure(arm: Arm, connections: int, duration: int) -> Run:
    pids = arm.measured.pids() if arm.measured else []
    before = arm.counters() if arm.counters else {}
    script = arm.script()
    with procstat.measure(pids) as usage:
        result = wrk.run(arm.target.url + arm.route, script, connections=connections, duration_s=duration)
    after = arm.counters() if arm.counters else {}
    counters = {k: after[k] - before.get(k, 0.0) for k in after}
    wanted = 0 if arm.expect_ok else result.requests
    if result.non_2xx != wanted or result.socket_errors:
        log(
            f"  ! {arm.path}: {result.non_2xx} of {result.requests} answers non-2xx, "
            f"{result.socket_errors} socket errors"
        )
    return Run(result, usage.cpu_s, usage.peak_rss, counters)


def run_plan(plan: Plan, *, rounds: int, duration: int, warm: Callable[[Arm], None]) -> list[Series]:
    series = [
        Series(plan.scenario, plan.connections, a.path, a.measured.name if a.measured else "-") for a in plan.arms
    ]
    for arm in plan.arms:
        warm(arm)
    for arm in plan.warmup:
        measure(arm, plan.connections, max(2, duration))
    for r in range(rounds):
        if plan.fresh is not None and r:
            plan.arms = plan.fresh()
            for arm in plan.arms:
                warm(arm)
        shift = r % len(plan.arms)  # a different path goes first each round
        for i in [*range(shift, len(plan.arms)), *range(shift)]:
            run = measure(plan.arms[i], plan.connections, duration)
            series[i].runs.append(run)
            log(
                f"[{plan.scenario}, c={plan.connections}] round {r + 1}/{rounds} {plan.arms[i].path}: "
                f"{run.result.rps:,.0f} req/s, p50 {run.result.p50_ms:.2f} ms, p99 {run.result.p99_ms:.2f} ms"
            )
    return series


def warmer(scripts: Scripts, seconds: int) -> Callable[[Arm], None]:
    """Text through each arm's server for ``seconds`` before its first measured run (or the arm's
    ``warm_with``: a key's requests, which plain text would not warm): connection pools, caches
    and lazy imports warm."""
    warmed: set[int] = set()
    text = scripts.static("text", lambda: [chat_body("bench")])

    def warm(arm: Arm) -> None:
        server = arm.target
        if seconds and server.process.pid not in warmed:  # (a server started again is warmed again)
            warmed.add(server.process.pid)
            if arm.warm_with is not None:
                wrk.run(server.url + arm.route, arm.warm_with(), connections=8, duration_s=seconds)
            else:
                wrk.run(server.url + "/v1/chat/completions", text(), connections=8, duration_s=seconds)

    return warm


# --- what it reports ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Goal:
    what: str
    target: str
    measured: float
    met: bool


def goals(rows: Sequence[Summary]) -> list[Goal]:
    """The issues' targets, checked against the gateway's rows (the sweep's too: c=1)."""
    out = []
    proxy_added = {r.connections: r.added_p50_ms for r in rows if r.scenario.startswith("sweep") and r.path == MINIMAL}
    for r in rows:
        if r.scenario.startswith("sweep") and r.path == GATEWAY and r.connections == 1:
            added, least = r.added_p50_ms, proxy_added.get(1)
            if added is not None and least is not None:  # issue 42: no more than the minimal proxy adds
                out.append(Goal("text chat, c=1, added p50 ms", f"≤ {least:.2f} (the proxy's)", added, added <= least))
            continue
        if r.scenario.startswith("tenants") and r.ratio is not None and r.path in (GATEWAY_KEYS, GATEWAY_REDIS):
            out.append(Goal(f"{r.path}, x the plain gateway", "≥ 0.90", r.ratio, r.ratio >= 0.9))  # issue 42
        if r.scenario.startswith("tenants") and r.ratio is not None and r.path == GATEWAY_SAMPLED:
            out.append(Goal(f"{r.path}, x the plain gateway", "≥ 0.90", r.ratio, r.ratio >= 0.9))
        if r.path == GATEWAY and r.ratio is not None:
            if r.scenario == "text chat":  # issue 42: a tenth more than the least an aiohttp proxy does
                out.append(Goal("text chat, c=32, x minimal proxy", "≥ 1.10", r.ratio, r.ratio >= 1.10))
            elif r.scenario.startswith("image"):
                out.append(Goal(f"{r.scenario}, x minimal proxy", "≥ 0.85", r.ratio, r.ratio >= 0.85))
                if r.scenario == "image, 100 KiB body":  # issue 23: with its visual tokens counted
                    out.append(Goal(f"{r.scenario}, counted, x minimal proxy", "≥ 0.95", r.ratio, r.ratio >= 0.95))
            elif r.scenario.startswith("stream") and r.connections > 1:
                out.append(Goal(f"{r.scenario}, c={r.connections}, x minimal proxy", "≥ 0.90", r.ratio, r.ratio >= 0.9))
        if r.path == GATEWAY and r.scenario.startswith("stream") and r.connections == 1 and r.added_p50_ms is not None:
            added = r.added_p50_ms
            out.append(Goal(f"{r.scenario}, c=1, added p50 ms", "≤ 0.30", added, added <= 0.3))
        if r.path == REJECTED and r.ratio is not None:
            out.append(Goal("rejections, x forwarded through the gateway", "≥ 3", r.ratio, r.ratio >= 3))
    return out


def notes(rows: Sequence[Summary]) -> list[str]:
    out = []
    by_path = {r.path: r for r in rows}
    if REJECTED in by_path and FLOOR in by_path and FORWARDED in by_path:
        rejected, floor, forwarded = by_path[REJECTED], by_path[FLOOR], by_path[FORWARDED]
        out.append(
            f"rejection: the gateway spends {rejected.cpu_us:.0f} µs CPU a rejected request, {forwarded.cpu_us:.0f} a "
            f"forwarded one; an aiohttp server answering a fixed 400 (the floor) {floor.cpu_us:.0f}, and answers "
            f"{floor.rps / forwarded.rps if forwarded.rps else float('nan'):.2f}x the forwarded throughput"
        )
    for r in rows:
        if (r.non_2xx and r.path not in (REJECTED, FLOOR)) or r.socket_errors:
            out.append(f"{r.scenario}, {r.path}: {r.non_2xx} non-2xx answers, {r.socket_errors} socket errors")
        if r.counters.get("limits scripts") and r.requests:  # the store's work: scripts a request, a second
            scripts = r.counters["limits scripts"]
            out.append(
                f"{r.path}: {scripts:.0f} limits scripts over {r.requests} requests ({scripts / r.requests:.4f} a "
                f"request, {scripts / r.requests * r.rps:.0f} a second)"
            )
        if r.counters.get("images encoded") or r.counters.get("encoder cache hits"):
            encoded, hits = r.counters["images encoded"], r.counters["encoder cache hits"]
            cpu_ms = r.counters["encoder CPU s"] / r.requests * 1000 if r.requests else float("nan")
            out.append(
                f"{r.path}: {encoded:.0f} images encoded, {hits:.0f} encoder cache hits over {r.requests} requests; "
                f"the encoder process spent {cpu_ms:.1f} ms CPU a request"
            )
    return out


def machine() -> dict[str, object]:
    cpu = next((line.split(":", 1)[1].strip() for line in _lines("/proc/cpuinfo") if line.startswith("model name")), "")
    mem = next((line.split()[1] for line in _lines("/proc/meminfo") if line.startswith("MemTotal")), "0")
    version = subprocess.run([wrk.wrk_path(), "-v"], capture_output=True, text=True, check=False).stdout.split(" [")[0]
    commit = subprocess.run(["git", "describe", "--always", "--dirty"], capture_output=True, text=True, cwd=ROOT,
                            check=False).stdout.strip()  # fmt: skip
    return {
        "date": datetime.date.today().isoformat(),
        "cores": os.cpu_count(),
        "cpu": cpu,
        "memory_gib": round(int(mem) / (1 << 20)),
        "load_average_at_start": os.getloadavg()[0],
        "python": platform.python_version(),
        "wrk": version.strip(),
        "commit": commit,
    }


def _lines(path: str) -> list[str]:
    try:
        return Path(path).read_text().splitlines()
    except OSError:
        return []


# what --profile may run: label, and the requests
PROFILED: dict[str, tuple[str, Callable[[], list[bytes]]]] = {
    "text": ("text chat", lambda: [chat_body("bench")]),
    "image-100k": ("a 100 KiB image request", lambda: [image_body("bench", 100 * 1024)]),
    "image-100k-plain": ("a 100 KiB image request, not counted", lambda: [image_body("bench-plain", 100 * 1024)]),
}


def profile_gateway(
    stack: Stack, scripts: Scripts, seconds: int, workers: int, kind: str = "text", raw: Path | None = None
) -> tuple[dict[str, object], str]:
    """py-spy on the gateway (its workers too) during a run of ``kind`` (text, image-100k) at c=32:
    where its CPU goes. Returns the numbers and their tables; ``raw``: py-spy's own output kept
    there (one line a stack, for a comparison of two profiles line by line)."""
    gw = stack.get(GATEWAY)
    out = stack.tmp / "profile.txt"
    spy = [str(Path(sys.executable).parent / "py-spy"), "record", "--pid", str(gw.process.pid), "--rate", "200",
           "--duration", str(seconds), "--format", "raw", "--output", str(out)]  # fmt: skip
    if workers > 1:
        spy.append("--subprocesses")
    log(f"profiling: {' '.join(spy)}")
    with subprocess.Popen(spy, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE) as recorder:
        time.sleep(1)  # attached before the load starts
        label, bodies = PROFILED[kind]
        script = scripts.static(kind, bodies)()
        wrk.run(gw.url + "/v1/chat/completions", script, connections=CONNECTIONS, duration_s=seconds)
        _, err = recorder.communicate(timeout=seconds + 60)
    if not out.exists():
        return {"error": err.decode(errors="replace")[-2000:]}, "Profile failed: " + err.decode(errors="replace")
    profile = report.summarize_profile(out.read_text())
    if raw is not None:
        shutil.copy(out, raw)
    data = {"command": " ".join(spy), **asdict(profile)}
    text = (
        f"Profile of the gateway, {label} at c={CONNECTIONS} ({profile.samples} samples at 200 Hz, idle time "
        f"left out; sampling pauses the gateway, so it serves less meanwhile). Own time by package:\n\n"
        f"{report.area_table(profile.areas)}\n\nTop functions by own time:\n\n{report.profile_table(profile.own)}"
        f"\n\nby time on the stack (own + callees):\n\n{report.profile_table(profile.total)}"
    )
    return data, text


@dataclass
class Results:
    machine: dict[str, object]
    settings: dict[str, object]
    rows: list[Summary] = field(default_factory=list)
    sweep: list[Summary] = field(default_factory=list)
    profile: dict[str, object] | None = None
    profile_text: str = ""

    def render(self) -> str:
        parts = [f"Machine: {json.dumps(self.machine)}", f"Settings: {json.dumps(self.settings)}"]
        parts += [report.markdown_table(rows) for rows in (self.rows, self.sweep) if rows]
        checked = goals([*self.rows, *self.sweep])
        if checked:
            lines = ["| goal | target | measured | met |", "|---|---|---:|---|"]
            lines += [f"| {g.what} | {g.target} | {g.measured:.2f} | {'yes' if g.met else 'no'} |" for g in checked]
            parts.append("\n".join(lines))
        found = notes([*self.rows, *self.sweep])
        if found:
            parts.append("\n".join(f"- {note}" for note in found))
        if self.profile_text:
            parts.append(self.profile_text)
        return "\n\n".join(parts) + "\n"

    def to_json(self) -> str:
        data = {
            "machine": self.machine,
            "settings": self.settings,
            "rows": [asdict(r) for r in self.rows],
            "sweep": [asdict(r) for r in self.sweep],
            "goals": [asdict(g) for g in goals([*self.rows, *self.sweep])],
            "profile": self.profile,
        }
        return json.dumps(data, indent=1) + "\n"


def run_all(args: argparse.Namespace) -> Results:
    rounds = args.rounds or (1 if args.quick else 3)
    duration = args.duration or (1 if args.quick else 3)
    names = args.scenarios or (QUICK_SCENARIOS if args.quick else SCENARIOS)
    settings = {"rounds": rounds, "duration_s": duration, "gateway_workers": args.gateway_workers, "scenarios": names}
    results = Results(machine(), settings)
    started = time.monotonic()
    with (
        tempfile.TemporaryDirectory(prefix="bench-hop-") as folder,
        Stack(Path(folder), args.gateway_workers, args.baseline) as stack,
    ):
        scripts = Scripts(Path(folder))
        warm = warmer(scripts, args.warmup)
        for name in names:
            sweep = QUICK_SWEEP if args.quick else SWEEP
            for plan in plans(name, stack, scripts, duration=duration, sweep=sweep):
                series = run_plan(plan, rounds=rounds, duration=duration, warm=warm)
                summaries = report.summarize(series, reference=plan.reference, direct=plan.direct)
                (results.sweep if name == "sweep" else results.rows).extend(summaries)
        if args.profile:
            results.profile, results.profile_text = profile_gateway(
                stack, scripts, max(5, duration), args.gateway_workers, args.profile, args.profile_raw
            )
    results.machine["load_average_at_end"] = os.getloadavg()[0]
    results.machine["seconds"] = round(time.monotonic() - started)
    return results


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="1 round of 1 s runs, fewer scenarios: under a minute")
    parser.add_argument("--rounds", type=int, help="rounds of every scenario (default 3; --quick 1)")
    parser.add_argument("--duration", type=int, help="seconds a run, whole (default 3; --quick 1)")
    parser.add_argument("--warmup", type=int, default=1, help="seconds of text through each server first (0: none)")
    parser.add_argument("--scenarios", nargs="+", choices=SCENARIOS, help="default: all (--quick: some)")
    parser.add_argument("--gateway-workers", type=int, default=1, help="`serve --workers N` (default 1)")
    parser.add_argument("--plot", type=Path, help="PNG of the sweep: throughput and p99 against concurrency")
    parser.add_argument("--json", type=Path, help="write every number here too")
    parser.add_argument(
        "--profile", nargs="?", const="text", choices=sorted(PROFILED), help="py-spy the gateway (default: text)"
    )
    parser.add_argument("--profile-raw", type=Path, help="with --profile: keep py-spy's raw stacks in this file")
    parser.add_argument(
        "--baseline", type=Path, help="another checkout (a worktree of the commit before): its gateway runs beside"
    )
    args = parser.parse_args(argv)
    if args.baseline is not None and not (args.baseline / "gateway" / "__main__.py").exists():
        raise SystemExit(f"--baseline {args.baseline}: no gateway/ checkout there")
    if args.gateway_workers > 1:
        check_workers_option()
    results = run_all(args)
    print(results.render(), end="")
    if args.plot and results.sweep:
        m = results.machine
        title = f"text chat through each path, wrk -t1, {m['cores']} cores ({m['cpu']}), {m['date']}"
        report.plot_sweep(results.sweep, args.plot, title=title)
        log(f"wrote {args.plot}")
    if args.json:
        args.json.write_text(results.to_json())
        log(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

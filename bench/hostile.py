"""How the gateway copes with hostile requests (issue 6, "Hardening"): the before/after figures of
docs/security.md.

Every scenario gets a fresh gateway process (so its peak RSS is its own) in front of one stand-in
upstream + encoder process that counts what it receives. While the hostile request is in flight,
another connection polls GET /healthz every 10 ms; the slowest answer is the event-loop stall.
Everything runs on 127.0.0.1, every client call has a timeout, and every process is stopped at the
end, errors included.

    .venv/bin/python -m bench.hostile [--only NAME ...] [--json OUT] [--rev REV] [--server KEY=VALUE ...]

``--rev HEAD`` runs the gateway as committed (extracted with ``git archive``) instead of the
working tree: the "before" of uncommitted fixes. ``--server`` adds keys to routing.yaml's server
section (for limits a newer gateway knows, e.g. ``client_body_timeout_s=10``).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import functools
import gzip
import hashlib
import io
import itertools
import json
import os
import socket
import subprocess
import sys
import tarfile
import tempfile
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import orjson
from aiohttp import web

from bench.common import free_port
from tools.redis_server import RedisServer

REPO = Path(__file__).resolve().parents[1]
MAX_BODY_BYTES = 33_554_432
PNG_1X1 = (
    "data:image/png;base64,"
    "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNkYPhfDwAChwGA60e6kgAAAABJRU5ErkJggg=="
)
EMBEDS = base64.b64encode(bytes(range(256)) * 48).decode()  # 16 KB, what the encoder stand-in returns
# Per streamed answer, ~1 KB each: more than the kernel buffers of the two hops hold (several MB),
# and bounded even if nothing applies backpressure (50 streams: 1.6 GB at most)
STREAM_CHUNKS = 30_000
STREAM_SECONDS = 30.0
SCENARIO_LIMIT_S = 60.0
PROBE_INTERVAL_S = 0.01
PROBE_TAIL_S = 0.3  # keep probing after the answer: freeing a huge request can stall the loop too
BIGINT = b"123456789012345678901234567890"


# --- the stand-in upstream and encoder (a subprocess: `--fakes PORT`) -------------------------


@dataclass
class Fakes:
    """An OpenAI-compatible upstream and a /v1/encode backend on one port, counting what they get."""

    stats: Counter[str] = field(default_factory=Counter)
    last_body: bytes = b""

    def app(self) -> web.Application:
        app = web.Application(client_max_size=1 << 30)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_post("/v1/encode", self._encode)
        app.router.add_get("/health", self._health)
        app.router.add_get("/_stats", self._stats)
        app.router.add_get("/_last", self._last)
        app.router.add_post("/_reset", self._reset)
        return app

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        self.stats["chat_requests"] += 1
        self.stats["chat_bytes"] += len(body)
        self.last_body = body
        try:
            payload = orjson.loads(body)
        except orjson.JSONDecodeError:
            payload = {}
        model = payload.get("model") if isinstance(payload, dict) else None
        if isinstance(payload, dict) and payload.get("stream"):
            return await self._stream(request, model)
        reply = {
            "id": "chatcmpl-hostile",
            "object": "chat.completion",
            "created": 1_700_000_000,
            "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
        }
        return web.Response(body=orjson.dumps(reply), content_type="application/json")

    async def _stream(self, request: web.Request, model: object) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        sock = request.transport.get_extra_info("socket") if request.transport else None
        if sock is not None:  # a reader that stops shows here at once, not after megabytes of kernel buffer
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        await response.prepare(request)
        delta = {"index": 0, "delta": {"content": "x" * 1000}, "finish_reason": None}
        event = {"id": "chatcmpl-hostile", "object": "chat.completion.chunk", "model": model, "choices": [delta]}
        chunk = b"data: " + orjson.dumps(event) + b"\n\n"
        self.stats["open_streams"] += 1
        try:
            async with asyncio.timeout(STREAM_SECONDS):
                for _ in range(STREAM_CHUNKS):
                    await response.write(chunk)  # waits while the gateway does not read
                    self.stats["streamed_bytes"] += len(chunk)
                await response.write(b"data: [DONE]\n\n")
            self.stats["finished_streams"] += 1
        except (ConnectionError, TimeoutError):
            pass
        finally:
            self.stats["open_streams"] -= 1
        return response

    async def _encode(self, request: web.Request) -> web.Response:
        body = await request.read()
        self.stats["encode_requests"] += 1
        self.stats["encode_bytes"] += len(body)
        return web.json_response({"image_embeds": EMBEDS})

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def _stats(self, request: web.Request) -> web.Response:
        return web.json_response(dict(self.stats))

    async def _last(self, request: web.Request) -> web.Response:
        return web.Response(body=self.last_body)

    async def _reset(self, request: web.Request) -> web.Response:
        open_streams = self.stats["open_streams"]  # streams of a stopped gateway may still be closing
        self.stats.clear()
        self.stats["open_streams"] = open_streams
        self.last_body = b""
        return web.Response(text="ok")


# --- processes -------------------------------------------------------------------------------


API_KEY = "sk-hostile-bench"  # the key of the scenarios that run with auth on
LIMITED_KEY = "sk-hostile-limited"  # a second key; with a store, of 600 requests a minute (burst 10) shared in Redis
LIMITED_RPM, LIMITED_BURST = 600, 10
ADMIN_TOKEN = "hostile-admin-token"


def routing_yaml(gateway_port: int, fakes: str, server_extra: list[str], *, auth: bool = False, store: str = "") -> str:
    """The scenarios' table; ``store``: a redis URL the keys' limits are shared through (and auth on)."""
    if store:
        server_extra = [*server_extra, f"limits_store={{url: '{store}', timeout_ms: 50, on_failure: open}}"]
        auth = True
    extra = "".join(f", {item.replace('=', ': ', 1)}" for item in server_extra)
    keys = f"auth:\n  keys:\n    - {{name: bench, key_sha256: {hashlib.sha256(API_KEY.encode()).hexdigest()}}}\n"
    limit = f", rate_limit: {{requests_per_minute: {LIMITED_RPM}, burst: {LIMITED_BURST}}}" if store else ""
    keys += f"    - {{name: limited, key_sha256: {hashlib.sha256(LIMITED_KEY.encode()).hexdigest()}{limit}}}\n"
    return f"""version: 1
server: {{port: {gateway_port}, max_body_bytes: {MAX_BODY_BYTES}, reload_interval_s: 0{extra}}}
{keys if auth else ""}encoders:
  enc: {{kind: http, urls: [{fakes}]}}
models:
  - {{name: chat, upstreams: [{fakes}], upstream_model: org/Chat, accepts: [text, image]}}
  - name: epd
    upstreams: [{fakes}]
    upstream_model: org/Epd
    accepts: [text, image]
    encode: {{image: enc}}
    on_encoder_error: passthrough
  - name: counted                   # images counted and held to a pixel limit (Qwen2.5-VL's count)
    upstreams: [{fakes}]
    accepts: [text, image]
    visual_tokens: {{preset: qwen2.5-vl}}
    limits: {{image_pixels: 4000000}}
  - name: doc                       # PDFs as their text and page images
    upstreams: [{fakes}]
    accepts: [text, image]
    on_unsupported: {{file: {{extract: {{page_images: true, dpi: 100}}}}}}
  - name: vid                       # the shipped routing.yaml's video policy
    upstreams: [{fakes}]
    accepts: [text, image]
    on_unsupported: {{video: {{frames: 8}}}}
"""


async def _start(args: list[str], cwd: Path, log: Path, *, workdir: Path | None = None) -> asyncio.subprocess.Process:
    """``args`` run with ``cwd``'s code (PYTHONPATH), in ``workdir`` (default ``cwd``)."""
    env = {**os.environ, "PYTHONPATH": str(cwd), "GATEWAY_ADMIN_TOKEN": ADMIN_TOKEN}
    cwd = workdir or cwd
    with log.open("wb") as out:
        return await asyncio.create_subprocess_exec(
            sys.executable, *args, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT
        )


async def _stop(proc: asyncio.subprocess.Process) -> None:
    if proc.returncode is None:
        proc.terminate()
        try:
            await asyncio.wait_for(proc.wait(), 5)
        except TimeoutError:
            proc.kill()
            await proc.wait()


async def _wait_ready(proc: asyncio.subprocess.Process, url: str, log: Path, *, limit_s: float = 20.0) -> None:
    deadline = time.monotonic() + limit_s
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as session:
        while time.monotonic() < deadline:
            if proc.returncode is not None:
                raise RuntimeError(f"{url} exited with {proc.returncode}:\n{log.read_text()[-2000:]}")
            with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                async with session.get(url) as resp:
                    if resp.status < 500:
                        return
            await asyncio.sleep(0.05)
    raise RuntimeError(f"{url} did not come up in {limit_s:g} s:\n{log.read_text()[-2000:]}")


@contextlib.asynccontextmanager
async def running(
    args: list[str], cwd: Path, log: Path, ready_url: str, *, workdir: Path | None = None
) -> AsyncIterator[asyncio.subprocess.Process]:
    proc = await _start(args, cwd, log, workdir=workdir)
    try:
        await _wait_ready(proc, ready_url, log)
        yield proc
    finally:
        await _stop(proc)


def cpu_seconds(pid: int) -> float:
    """The CPU time a process has used (user + system)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def settled_cpu_seconds(pid: int, *, limit_s: float = 300.0) -> float:
    """The process's CPU time once it has stopped using any (work that goes on after the
    answers, like a decode nobody waits for), polled every second, at most ``limit_s``."""
    last = cpu_seconds(pid)
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        await asyncio.sleep(1.0)
        now = cpu_seconds(pid)
        if now - last < 0.05:
            return now
        last = now
    return last


def memory_kb(pid: int) -> dict[str, int]:
    """VmRSS and VmHWM of a process, in kB."""
    values = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, rest = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            values[key] = int(rest.split()[0])
    return values


def reset_peak(pid: int) -> bool:
    """Make VmHWM start again from VmRSS (Linux >= 4.0), so the next peak is this scenario's own."""
    try:
        Path(f"/proc/{pid}/clear_refs").write_text("5")
    except OSError:
        return False
    return True


def source_tree(rev: str, into: Path) -> Path:
    """The repository at ``rev``, extracted (git archive) under ``into``."""
    archive = subprocess.run(["git", "-C", str(REPO), "archive", "--format=tar", rev], capture_output=True, check=True)
    with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
        tar.extractall(into, filter="data")
    return into


# --- measuring -------------------------------------------------------------------------------


class HealthProbe:
    """Polls /healthz on its own connection; ``worst`` is the slowest answer (or wait) seen."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.worst = 0.0
        self.polls = 0
        self.failures = 0
        self._since: float | None = None
        self._ready = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> HealthProbe:
        self._task = asyncio.create_task(self._poll())
        await asyncio.wait_for(self._ready.wait(), 5)  # the connection is open before the attack starts
        self.worst = 0.0
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._since is not None:  # a poll still waiting has waited this long
            self.worst = max(self.worst, time.perf_counter() - self._since)
        assert self._task is not None
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task

    async def _poll(self) -> None:
        connector = aiohttp.TCPConnector(limit=1)
        async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=60)) as session:
            while True:
                self._since = time.perf_counter()
                try:
                    async with session.get(self.url) as resp:
                        await resp.read()
                        ok = resp.status == 200
                except (aiohttp.ClientError, TimeoutError):
                    ok = False
                self.worst = max(self.worst, time.perf_counter() - self._since)
                self._since = None
                self.polls += 1
                self.failures += not ok
                self._ready.set()
                await asyncio.sleep(PROBE_INTERVAL_S)


@dataclass
class Answer:
    status: int | None  # None: no status line came
    seconds: float | None  # to the status line, or to the close
    body: bytes = b""
    note: str = ""
    head: bytes = b""  # the response's header lines


def request_head(port: int, length: int, *, target: str = "/v1/chat/completions", extra: tuple[str, ...] = ()) -> bytes:
    lines = [
        f"POST {target} HTTP/1.1",
        f"Host: 127.0.0.1:{port}",
        "Content-Type: application/json",
        f"Content-Length: {length}",
        "Connection: close",
        *extra,
    ]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


async def _send(writer: asyncio.StreamWriter, head: bytes, body: bytes, pace_s: float | None) -> None:
    with contextlib.suppress(ConnectionError):
        writer.write(head)
        if pace_s is None:
            writer.write(body)
            await writer.drain()
            return
        for i in range(len(body)):
            writer.write(body[i : i + 1])
            await writer.drain()
            await asyncio.sleep(pace_s)


async def exchange(
    port: int, head: bytes, body: bytes = b"", *, timeout_s: float = 30.0, pace_s: float | None = None
) -> Answer:
    """Send a raw request (optionally one byte every ``pace_s``) and read the answer to the close."""
    reader, writer = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port), 5)
    started = time.perf_counter()
    sender = asyncio.create_task(_send(writer, head, body, pace_s))
    status: int | None = None
    seconds: float | None = None
    try:
        async with asyncio.timeout(timeout_s):
            line = await reader.readline()
            seconds = time.perf_counter() - started
            if not line:
                return Answer(None, seconds, note=f"closed without an answer at {seconds:.1f} s")
            status = _status(line)
            rest = await _read_to_close(reader)
        closed = time.perf_counter() - started
        lingered = f"connection closed at {closed:.1f} s" if closed - seconds > 1 else ""  # long after the answer
        head, _, answer = rest.partition(b"\r\n\r\n")
        return Answer(status, seconds, answer, lingered, head)
    except TimeoutError:
        if status is not None:
            return Answer(status, seconds, note=f"answered, connection still open at {timeout_s:g} s")
        return Answer(None, None, note=f"no answer, still open at {timeout_s:g} s")
    except ConnectionError as exc:
        seconds = time.perf_counter() - started
        return Answer(None, seconds, note=f"{type(exc).__name__} at {seconds:.1f} s")
    finally:
        sender.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await sender
        writer.close()


async def _read_to_close(reader: asyncio.StreamReader, cap: int = 1 << 20) -> bytes:
    data = bytearray()
    while len(data) < cap and (chunk := await reader.read(65536)):
        data += chunk
    return bytes(data)


def _status(line: bytes) -> int | None:
    parts = line.split()
    return int(parts[1]) if len(parts) > 1 and parts[1].isdigit() else None


def error_code(body: bytes) -> str:
    """``code: message`` of the gateway's error JSON, shortened; '' when the body is not one."""
    try:
        error = orjson.loads(body)["error"]
    except (orjson.JSONDecodeError, KeyError, TypeError):
        return ""
    message = str(error.get("message", ""))
    return f"{error.get('code')}: {message[:80]}{'...' if len(message) > 80 else ''}"


@dataclass
class Row:
    scenario: str
    status: str
    answer_s: float | None
    max_healthz_ms: float | None
    peak_rss_growth_mb: float | None
    upstream_bytes: int | None
    notes: str


@dataclass
class Lab:
    """What a scenario works with: the gateway under attack and the counting stand-ins."""

    port: int
    pid: int
    fakes: str
    session: aiohttp.ClientSession
    trickle_s: float
    workdir: Path  # the gateway's working directory
    stall_s: float | None = None
    peak_growth_kb: int | None = None

    @contextlib.asynccontextmanager
    async def hostile(self) -> AsyncIterator[None]:
        """Measure what happens inside: the worst /healthz wait and the peak RSS growth."""
        rss_before = memory_kb(self.pid)["VmRSS"]
        exact = reset_peak(self.pid)
        baseline = rss_before if exact else memory_kb(self.pid)["VmHWM"]
        probe = HealthProbe(f"http://127.0.0.1:{self.port}/healthz")
        async with probe:
            try:
                yield
            finally:
                await asyncio.sleep(PROBE_TAIL_S)
                self.stall_s = probe.worst
                with contextlib.suppress(OSError):
                    self.peak_growth_kb = memory_kb(self.pid)["VmHWM"] - baseline

    async def stats(self) -> dict[str, int]:
        async with self.session.get(f"{self.fakes}/_stats") as resp:
            stats: dict[str, int] = await resp.json()
            return stats

    async def last_body(self) -> bytes:
        async with self.session.get(f"{self.fakes}/_last") as resp:
            return await resp.read()

    async def post(self, body: bytes, *, extra: tuple[str, ...] = (), target: str = "/v1/chat/completions") -> Answer:
        async with self.hostile():
            return await exchange(self.port, request_head(self.port, len(body), target=target, extra=extra), body)


@dataclass
class Outcome:
    status: str
    seconds: float | None
    notes: str = ""


def outcome(answer: Answer, *notes: str) -> Outcome:
    said = [answer.note, error_code(answer.body), *notes]
    return Outcome(str(answer.status or "-"), answer.seconds, "; ".join(n for n in said if n))


def chat(model: str, content: object, **extra: object) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": content}], **extra}


def image_body(url: str) -> bytes:
    return orjson.dumps(chat("epd", [{"type": "image_url", "image_url": {"url": url}}]))


# --- scenarios -------------------------------------------------------------------------------


async def amplification(lab: Lab) -> Outcome:
    part = {"type": "image_url", "image_url": {"url": PNG_1X1}}
    body = orjson.dumps(chat("epd", [part] * 2500))
    answer = await lab.post(body)
    stats = await lab.stats()
    return outcome(
        answer,
        f"2,500 parts, {len(body) / 1e3:.0f} KB in",
        f"encoder calls {stats.get('encode_requests', 0)}",
        f"upstream/in = {stats.get('chat_bytes', 0) / len(body):.0f}x",
    )


async def part_count(lab: Lab) -> Outcome:
    head = b'{"model":"chat","messages":[{"role":"user","content":['
    body = head + b'"",' * 10_000_000 + b'{"type":"bogus"}]}]}'
    return outcome(await lab.post(body), f"10M empty strings, {len(body) / 1e6:.1f} MB")


async def percent_data_url(lab: Lab) -> Outcome:
    body = image_body("data:image/png," + "%41" * 10_000_000)
    answer = await lab.post(body)
    stats = await lab.stats()
    return outcome(answer, f"{len(body) / 1e6:.1f} MB", f"encoder got {stats.get('encode_bytes', 0) / 1e6:.1f} MB")


def _spaced(data: bytes, every: int) -> bytes:
    """``data`` with a space after every ``every`` bytes (len(data) must be a multiple of ``every``)."""
    n = len(data) // every
    out = bytearray(n * (every + 1))
    for k in range(every):
        out[k :: every + 1] = data[k::every]
    out[every :: every + 1] = b" " * n
    return bytes(out)


async def _base64_spaces(lab: Lab, image_bytes: int, every: int) -> Outcome:
    encoded = base64.b64encode(os.urandom(image_bytes))
    body = image_body("data:image/png;base64," + _spaced(encoded, every).decode())
    answer = await lab.post(body)
    stats = await lab.stats()
    return outcome(
        answer,
        f"{len(encoded) / 1e6:.1f} MB base64, space every {every} char(s), {len(body) / 1e6:.1f} MB body",
        f"encoder got {stats.get('encode_bytes', 0) / 1e6:.1f} MB",
    )


async def base64_spaces(lab: Lab) -> Outcome:
    return await _base64_spaces(lab, 11_000_000, 1)


async def base64_spaces_4(lab: Lab) -> Outcome:
    return await _base64_spaces(lab, 16_500_000, 4)


async def _reader_that_never_reads(port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # so the gateway's writes back up early
    sock.setblocking(False)
    try:
        await asyncio.wait_for(asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", port)), 5)
    except BaseException:
        sock.close()
        raise
    return await asyncio.open_connection(sock=sock, limit=4096)


async def slow_reader(lab: Lab, clients: int = 50, hold_s: float = 5.0) -> Outcome:
    body = orjson.dumps(chat("chat", "tell me a long story", stream=True))
    head = request_head(lab.port, len(body))
    writers: list[asyncio.StreamWriter] = []
    async with lab.hostile():
        started = time.perf_counter()
        try:
            pairs = [await _reader_that_never_reads(lab.port) for _ in range(clients)]
            writers = [w for _, w in pairs]
            for w in writers:
                w.write(head + body)

            async def status_line(reader: asyncio.StreamReader) -> tuple[int | None, float]:
                with contextlib.suppress(TimeoutError, ConnectionError):
                    line = await asyncio.wait_for(reader.readline(), hold_s)
                    return _status(line), time.perf_counter() - started
                return None, time.perf_counter() - started

            answers = await asyncio.gather(*(status_line(r) for r, _ in pairs))
            await asyncio.sleep(max(0.0, started + hold_s - time.perf_counter()))
            held = await lab.stats()
        finally:
            for w in writers:
                w.close()
        await asyncio.sleep(1.0)
        after = await lab.stats()
    statuses = Counter(str(s or "-") for s, _ in answers)
    return Outcome(
        ", ".join(f"{s} x{n}" for s, n in statuses.most_common()),
        max(t for _, t in answers),
        f"{clients} clients that never read: upstream streams open at {hold_s:g} s: "
        f"{held.get('open_streams', 0)}/{held.get('chat_requests', 0)} ({held.get('finished_streams', 0)} finished), "
        f"1 s after the clients closed: {after.get('open_streams', 0)}; the upstream wrote "
        f"{held.get('streamed_bytes', 0) / 1e6:.0f} MB by {hold_s:g} s (answer s: the slowest status line)",
    )


async def body_trickle(lab: Lab) -> Outcome:
    body = orjson.dumps(chat("chat", "x" * 1000))[:1000]
    head = request_head(lab.port, 1000)
    async with lab.hostile():
        answer = await exchange(lab.port, head, body, timeout_s=lab.trickle_s, pace_s=1.0)
    return outcome(answer, "Content-Length 1000, 1 byte/s")


async def corrupt_gzip(lab: Lab) -> Outcome:
    return outcome(await lab.post(b"this is not gzip at all" * 10, extra=("Content-Encoding: gzip",)))


async def absolute_form(lab: Lab) -> Outcome:
    body = orjson.dumps(chat("chat", "hi"))
    answer = await lab.post(body, target="http://x/v1/chat/completions")
    stats = await lab.stats()
    return outcome(answer, f"upstream requests {stats.get('chat_requests', 0)}")


async def expect_100(lab: Lab) -> Outcome:
    length = MAX_BODY_BYTES + (8 << 20)
    head = request_head(lab.port, length, extra=("Expect: 100-continue",))
    async with lab.hostile():
        reader, writer = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", lab.port), 5)
        started = time.perf_counter()
        try:
            writer.write(head)
            first = await asyncio.wait_for(reader.readline(), 5)
            seconds = time.perf_counter() - started
            status = _status(first)
            then = ""
            if status == 100:  # a client would now send 40 MiB; what comes without it?
                await asyncio.wait_for(reader.readline(), 2)  # the blank line after the interim answer
                try:
                    final = await asyncio.wait_for(reader.readline(), 2)
                    then = f"then {_status(final)} without a body byte sent"
                except TimeoutError:
                    then = "then nothing in 2 s: the gateway waits for the body"
        except (TimeoutError, ConnectionError) as exc:
            return Outcome("-", None, f"no first answer: {type(exc).__name__}")
        finally:
            writer.close()
    notes = f"Content-Length {length:,} > max_body_bytes; first answer {status}"
    return Outcome(str(status), seconds, f"{notes}; {then}" if then else notes)


async def bigint(lab: Lab) -> Outcome:
    body = b'{"model":"chat","seed":' + BIGINT + b',"messages":[{"role":"user","content":"hi"}]}'
    answer = await lab.post(body)
    received = await lab.last_body()
    if not received:
        return outcome(answer, "nothing reached the upstream")
    seed = json.loads(received).get("seed")  # the stdlib keeps big integers exact
    exact = BIGINT in received
    return outcome(answer, f"upstream got seed={seed!r}", "exact" if exact else "NOT exact")


async def deep_nesting(lab: Lab) -> Outcome:
    body = orjson.dumps(chat("chat", "hi"))[:-1] + b',"extra":' + b"[" * 300 + b"]" * 300 + b"}"
    answer = await lab.post(body)
    stats = await lab.stats()
    return outcome(answer, "300 levels", f"upstream requests {stats.get('chat_requests', 0)}")


# --- media (issue 20) -------------------------------------------------------------------------


def video_body(data: bytes, model: str = "vid") -> bytes:
    part = {"type": "video_url", "video_url": {"url": "data:video/mp4;base64," + base64.b64encode(data).decode()}}
    return orjson.dumps(chat(model, [{"type": "text", "text": "what happens?"}, part]))


async def ffconcat_file_read(lab: Lab) -> Outcome:
    """An ffconcat playlist sent as a video, naming a file in the gateway's working directory."""
    from bench import hostile_media

    (lab.workdir / "secret.mp4").write_bytes(hostile_media.heavy_clip(seconds=2, size=(64, 48)))
    answer = await lab.post(video_body(hostile_media.playlist("secret.mp4")))
    stats = await lab.stats()
    frames = (await lab.last_body()).count(b'"image_url"') if stats.get("chat_requests") else 0
    read = f"secret.mp4 read: {frames} of its frames reached the model" if frames else "no file read"
    return outcome(answer, read)


async def metrics_flood(lab: Lab, connections: int = 16, seconds: float = 4.0) -> Outcome:
    """Keyed chat latency, quiet and while ``connections`` connections (wrk) scrape /metrics
    without any credential, auth on, no admin_listen."""
    quiet = await _chat_latencies(lab, seconds / 2)
    url = f"http://127.0.0.1:{lab.port}/metrics"
    wrk = await asyncio.create_subprocess_exec(
        "wrk", "-t1", f"-c{connections}", f"-d{seconds + 1:g}s", url,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
    )  # fmt: skip
    try:
        await asyncio.sleep(0.5)  # the flood under way
        loaded = await _chat_latencies(lab, seconds)
        report = (await asyncio.wait_for(wrk.communicate(), seconds + 10))[0].decode()
    finally:
        if wrk.returncode is None:
            wrk.kill()
            await wrk.wait()
    scrapes = _wrk_number(report, r"(\d+) requests in")
    refused = _wrk_number(report, r"Non-2xx or 3xx responses: (\d+)")
    status = "401" if scrapes and refused == scrapes else "200" if not refused else "mixed"
    return Outcome(
        status,
        _percentile(loaded, 0.99),
        f"keyed chat p99 {_percentile(quiet, 0.99) * 1000:.1f} ms quiet, {_percentile(loaded, 0.99) * 1000:.1f} ms "
        f"while {connections} connections scrape /metrics with no token ({scrapes:,} scrapes, {refused:,} refused)",
    )


async def _chat_latencies(lab: Lab, seconds: float) -> list[float]:
    body = orjson.dumps(chat("chat", "hi"))
    headers = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}
    latencies: list[float] = []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        started = time.perf_counter()
        async with lab.session.post(
            f"http://127.0.0.1:{lab.port}/v1/chat/completions", data=body, headers=headers
        ) as r:
            await r.read()
            if r.status != 200:
                raise RuntimeError(f"keyed chat answered {r.status}")
        latencies.append(time.perf_counter() - started)
    return latencies


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else 0.0


def _wrk_number(report: str, pattern: str) -> int:
    import re

    found = re.search(pattern, report)
    return int(found.group(1)) if found else 0


async def decode_bomb(lab: Lab, bombs: int = 2) -> Outcome:
    """Two 66 KB 4K bombs (one keyframe, 1,300 frames after it) at once; a valid 2 s clip a
    second later; the gateway's CPU seconds until it is idle again."""
    from bench import hostile_media

    bomb = hostile_media.decode_bomb()
    clip = hostile_media.heavy_clip(seconds=2, size=(320, 240))
    head = functools.partial(request_head, lab.port)
    before = cpu_seconds(lab.pid)
    async with lab.hostile():
        sent = [video_body(hostile_media.distinct(bomb, i)) for i in range(bombs)]  # no single flight
        tasks = [asyncio.create_task(exchange(lab.port, head(len(b)), b, timeout_s=240)) for b in sent]
        await asyncio.sleep(1.0)
        body = video_body(clip)
        valid = await exchange(lab.port, head(len(body)), body, timeout_s=240)
        answers = await asyncio.gather(*tasks)
    cpu = await settled_cpu_seconds(lab.pid) - before
    statuses = Counter(f"{a.status} {error_code(a.body).split(':')[0] or 'ok'}".strip() for a in answers)
    return Outcome(
        ", ".join(f"{k} x{n}" for k, n in statuses.items()),
        max((a.seconds or 0) for a in answers),
        f"{len(bomb) / 1e3:.0f} KB each; a valid 2 s clip during them: {valid.status} "
        f"{error_code(valid.body) or ''} in {valid.seconds or 0:.1f} s; the gateway's CPU until idle: {cpu:.1f} s",
    )


async def video_load(lab: Lab, clips: int = 120) -> Outcome:
    """``clips`` distinct valid 30 s 720p clips at once (each ~0.5 s to sample on this machine):
    more work than two decoding threads do in 30 s."""
    from bench import hostile_media

    clip = hostile_media.heavy_clip()
    bodies = [video_body(hostile_media.distinct(clip, i)) for i in range(clips)]
    async with lab.hostile():
        answers = await asyncio.gather(
            *(exchange(lab.port, request_head(lab.port, len(b)), b, timeout_s=240) for b in bodies)
        )
    said = Counter(f"{a.status} {error_code(a.body).split(':')[0] or 'ok'}" for a in answers)
    retry_after = sum(1 for a in answers if a.status == 503 and b"Retry-After" in a.head)
    return Outcome(
        ", ".join(f"{k} x{n}" for k, n in sorted(said.items())),
        max((a.seconds or 0) for a in answers),
        f"{clips} distinct {len(clip) / 1e6:.1f} MB 30 s 720p clips at once; 503s with Retry-After: {retry_after}",
    )


def _cores() -> int:
    return len(os.sched_getaffinity(0))


async def limits_stall(lab: Lab, seconds: float = 10.0, stallers: int = 2, hogs_n: int = 2) -> Outcome:
    """Issue 40, finding 2: a key of 600 requests a minute (shared in Redis, timeout_ms 50) asks
    as fast as 4 connections can for ``seconds``, while ``stallers`` connections of another key
    send 7 KB gzipped bodies of 130,000 small objects (each holds the gateway's loop tens of ms)
    and ``hogs_n`` processes spin on the gateway's CPU core (a busy machine; the store has
    the other core, as it would have a machine of its own). Served against what the limit
    allows (its burst and 10 a second)."""
    stall = gzip.compress(b'{"model": "chat", "messages": [{"role": "user", "content": "hi"}], "x": [' +
                          b",".join([b"{}"] * 130_000) + b"]}")  # fmt: skip
    loud = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json", "Content-Encoding": "gzip"}
    quiet = {"Authorization": f"Bearer {LIMITED_KEY}", "Content-Type": "application/json"}
    body = orjson.dumps(chat("chat", "hi"))
    url = f"http://127.0.0.1:{lab.port}/v1/chat/completions"
    end = time.monotonic() + seconds
    statuses: Counter[int] = Counter()
    stalls = 0

    async def staller() -> None:
        nonlocal stalls
        while time.monotonic() < end:
            async with lab.session.post(url, data=stall, headers=loud) as r:
                await r.read()
            stalls += 1

    async def asker() -> None:
        while time.monotonic() < end:
            async with lab.session.post(url, data=body, headers=quiet) as r:
                await r.read()
                statuses[r.status] += 1

    hog = [sys.executable, "-c", f"import time\nend = time.monotonic() + {seconds}\nwhile time.monotonic() < end: pass"]
    hogs = [await asyncio.create_subprocess_exec(*hog) for _ in range(hogs_n)]
    for pid in (lab.pid, *(h.pid for h in hogs)) if _cores() > 1 else ():  # the gateway's core busy; the store's not
        os.sched_setaffinity(pid, {0})
    started = time.monotonic()
    try:
        async with lab.hostile():
            await asyncio.gather(*(staller() for _ in range(stallers)), *(asker() for _ in range(4)))
    finally:
        for h in hogs:
            with contextlib.suppress(ProcessLookupError):
                h.kill()
            await h.wait()
    elapsed = time.monotonic() - started
    allowed = LIMITED_BURST + LIMITED_RPM / 60 * elapsed
    served = statuses[200]
    metrics = f"http://127.0.0.1:{lab.port}/metrics"
    async with lab.session.get(metrics, headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}) as r:
        text = await r.text()
    errors = sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                 if line.startswith("gateway_limits_store_errors_total{"))  # fmt: skip
    return Outcome(
        ", ".join(f"{k} x{n}" for k, n in sorted(statuses.items())),
        elapsed,
        f"served {served} of {sum(statuses.values()):,} where the key's limit allows {allowed:.0f} "
        f"({served / allowed:.2f}x), while {stalls} stalling bodies were sent; store calls failed: {errors:.0f}",
    )


async def pdf_tenants(lab: Lab, seconds: float = 20.0, connections: int = 10) -> Outcome:
    """Issue 40, finding 3: one key keeps ``connections`` connections of slow 10 KB PDFs (20
    pages whose boxes say 55 inches: each page rendered at 4096x4096; each PDF distinct) in
    flight for ``seconds``; another key sends a one-page PDF at a time. That key's waits, and
    what the slow ones got."""
    from tools import pdfs

    made = itertools.count()

    def slow() -> bytes:  # each one distinct: none read once for all from the conversions cache
        return pdfs.text_pdf([f"slow {next(made)} " * 40] * 20).replace(b"[0 0 612 792]", b"[0 0 4000 4000]")

    def quick() -> bytes:
        return pdfs.text_pdf([f"quick {next(made)}"])

    def body(pdf: bytes) -> bytes:
        part = {"type": "file", "file": {"filename": "a.pdf", "file_data":
                f"data:application/pdf;base64,{base64.b64encode(pdf).decode()}"}}  # fmt: skip
        return orjson.dumps(chat("doc", [{"type": "text", "text": "read"}, part]))

    url = f"http://127.0.0.1:{lab.port}/v1/chat/completions"
    loud = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}
    quiet = {"Authorization": f"Bearer {LIMITED_KEY}", "Content-Type": "application/json"}
    end = time.monotonic() + seconds
    theirs: Counter[int] = Counter()
    waits: list[float] = []
    timeout = aiohttp.ClientTimeout(total=120)

    async def loud_one() -> None:
        while time.monotonic() < end:
            async with lab.session.post(url, data=body(slow()), headers=loud, timeout=timeout) as r:
                await r.read()
                theirs[r.status] += 1

    async def quiet_one() -> None:
        await asyncio.sleep(1.0)  # the slow ones queued first
        while time.monotonic() < end:
            started = time.monotonic()
            async with lab.session.post(url, data=body(quick()), headers=quiet, timeout=timeout) as r:
                await r.read()
                if r.status != 200:
                    raise RuntimeError(f"the quiet key's PDF answered {r.status}")
            waits.append(time.monotonic() - started)

    async with lab.hostile():
        await asyncio.gather(*(loud_one() for _ in range(connections)), quiet_one())
    return Outcome(
        f"quiet 200 x{len(waits)}",
        _percentile(waits, 0.5),
        f"the quiet key's one-page PDF: p50 {_percentile(waits, 0.5):.2f} s, max {max(waits, default=0):.2f} s; "
        f"the loud key's slow PDFs: {', '.join(f'{k} x{n}' for k, n in sorted(theirs.items()))}",
    )


def _lying_gif() -> bytes:
    """A GIF whose logical screen says 16x16 around a first frame of 12000x12000 (35 bytes):
    Pillow, and so the engines, open it at 12000x12000."""
    import struct

    head = b"GIF89a" + struct.pack("<HH", 16, 16) + bytes([0x80, 0, 0]) + bytes(6)
    return head + b"," + struct.pack("<HHHH", 0, 0, 12000, 12000) + b"\x00\x02\x02\x44\x01\x00;"


def _tiff(side: int) -> bytes:
    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", (side, side), (40, 90, 200)).save(out, "TIFF", compression="tiff_deflate")
    return out.getvalue()


async def image_sizes(lab: Lab) -> Outcome:
    """Issue 40, finding 1: eight lying GIFs in one request to a model of image_pixels 4,000,000
    (the engine would decode 1.2 Gpx); then a 1000x1000 TIFF and a 3000x3000 one (formats the
    engines open, which the header reader does not know)."""

    def images(*urls: str) -> bytes:
        return orjson.dumps(chat("counted", [{"type": "image_url", "image_url": {"url": u}} for u in urls]))

    gif = "data:image/gif;base64," + base64.b64encode(_lying_gif()).decode()
    gifs = await lab.post(images(*[gif] * 8))
    sent_before = (await lab.stats()).get("chat_requests", 0)
    said = []
    for side in (1000, 3000):
        tiff = "data:image/tiff;base64," + base64.b64encode(_tiff(side)).decode()
        answer = await lab.post(images(tiff))
        said.append(f"a {side}x{side} TIFF: {answer.status} {error_code(answer.body).split(':')[0] or 'served'}")
    return outcome(gifs, f"eight lying GIFs ({8 * len(_lying_gif())} bytes of images)",
                   f"requests upstream after them: {sent_before}", *said)  # fmt: skip


AUTH_SCENARIOS = frozenset({"metrics-flood", "pdf-tenants"})
STORE_SCENARIOS = frozenset({"limits-stall"})  # with a redis-server (Debian's), the keys' limits shared there
LIMITS_S = {"decode-bomb": 400.0, "video-load": 300.0, "pdf-tenants": 200.0}  # the rest: SCENARIO_LIMIT_S

SCENARIOS: dict[str, Callable[[Lab], Awaitable[Outcome]]] = {
    "amplification": amplification,
    "part-count": part_count,
    "percent-data-url": percent_data_url,
    "base64-spaces": base64_spaces,
    "base64-spaces-4": base64_spaces_4,
    "slow-reader": slow_reader,
    "body-trickle": body_trickle,
    "corrupt-gzip": corrupt_gzip,
    "absolute-form": absolute_form,
    "expect-100": expect_100,
    "bigint": bigint,
    "deep-nesting": deep_nesting,
    "ffconcat-file-read": ffconcat_file_read,
    "metrics-flood": metrics_flood,
    "decode-bomb": decode_bomb,
    "video-load": video_load,
    "limits-stall": limits_stall,
    "pdf-tenants": pdf_tenants,
    "image-sizes": image_sizes,
}


# --- running ---------------------------------------------------------------------------------


async def run_scenario(name: str, tree: Path, tmp: Path, fakes: str, args: argparse.Namespace) -> Row:
    port = free_port()
    config = tmp / f"routing-{name}.yaml"
    store = RedisServer(tmp) if name in STORE_SCENARIOS else None
    if store is not None and _cores() > 1:  # the store on a core of its own, as on a machine of its own
        os.sched_setaffinity(store.process.pid, {1})
    try:
        config.write_text(
            routing_yaml(port, fakes, args.server, auth=name in AUTH_SCENARIOS, store=store.url if store else "")
        )
        return await _run_scenario(name, tree, tmp, fakes, args, port)
    finally:
        if store is not None:
            store.kill()


async def _run_scenario(name: str, tree: Path, tmp: Path, fakes: str, args: argparse.Namespace, port: int) -> Row:
    config = tmp / f"routing-{name}.yaml"
    log = tmp / f"gateway-{name}.log"
    workdir = tmp / f"work-{name}"
    workdir.mkdir()
    command = ["-m", "gateway", "serve", "--config", str(config), "--port", str(port), "--log-level", "warning"]
    limit_s = LIMITS_S.get(name, SCENARIO_LIMIT_S)
    async with (
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session,
        running(command, tree, log, f"http://127.0.0.1:{port}/healthz", workdir=workdir) as proc,
    ):
        async with session.post(f"{fakes}/_reset") as resp:
            resp.raise_for_status()
        lab = Lab(port, proc.pid, fakes, session, args.trickle_s, workdir)
        try:
            async with asyncio.timeout(limit_s):
                result = await SCENARIOS[name](lab)
        except TimeoutError:
            result = Outcome("-", None, f"scenario did not finish in {limit_s:g} s")
        if proc.returncode is not None:
            result.notes += f"; GATEWAY EXITED ({proc.returncode}): {log.read_text()[-300:]!r}"
        upstream = (await lab.stats()).get("chat_bytes", 0)
    return Row(
        name,
        result.status,
        None if result.seconds is None else round(result.seconds, 3),
        None if lab.stall_s is None else round(lab.stall_s * 1000, 1),
        None if lab.peak_growth_kb is None else round(lab.peak_growth_kb / 1024, 1),
        upstream,
        result.notes,
    )


def print_table(rows: list[Row]) -> None:
    print("| scenario | status | answer s | max /healthz ms | peak RSS +MB | upstream bytes | notes |")
    print("|---|---|---:|---:|---:|---:|---|")
    for r in rows:
        cells = [
            r.scenario,
            r.status,
            "-" if r.answer_s is None else f"{r.answer_s:.2f}",
            "-" if r.max_healthz_ms is None else f"{r.max_healthz_ms:,.0f}",
            "-" if r.peak_rss_growth_mb is None else f"{r.peak_rss_growth_mb:,.1f}",
            "-" if r.upstream_bytes is None else f"{r.upstream_bytes:,}",
            r.notes.replace("|", "/"),
        ]
        print("| " + " | ".join(cells) + " |", flush=True)


async def main(args: argparse.Namespace) -> None:
    names = args.only or list(SCENARIOS)
    with tempfile.TemporaryDirectory(prefix="hostile-") as tmp_name:
        tmp = Path(tmp_name)
        tree = source_tree(args.rev, tmp / "src") if args.rev else REPO
        fakes_port = free_port()
        fakes = f"http://127.0.0.1:{fakes_port}"
        fakes_command = ["-m", "bench.hostile", "--fakes", str(fakes_port)]
        rows: list[Row] = []
        started = time.monotonic()
        async with running(fakes_command, REPO, tmp / "fakes.log", f"{fakes}/health"):
            for name in names:
                try:
                    rows.append(await run_scenario(name, tree, tmp, fakes, args))
                except RuntimeError as exc:  # the gateway did not start (e.g. it refused the config)
                    rows.append(Row(name, "-", None, None, None, None, f"not measured: {exc}"))
                print(f"  {name}: done", file=sys.stderr, flush=True)
    print(f"\ngateway: {args.rev or 'working tree'}; {time.monotonic() - started:.0f} s in all\n")
    print_table(rows)
    if args.json:
        meta = {"gateway": args.rev or "working tree", "server_extra": args.server, "python": sys.version.split()[0]}
        Path(args.json).write_bytes(
            orjson.dumps({"meta": meta, "rows": [asdict(r) for r in rows]}, option=orjson.OPT_INDENT_2)
        )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", action="append", choices=list(SCENARIOS), metavar="NAME",
                        help=f"run only this scenario (repeatable): {', '.join(SCENARIOS)}")  # fmt: skip
    parser.add_argument("--json", metavar="OUT", help="also write the rows as JSON")
    parser.add_argument("--rev", help="run the gateway as committed at this git revision (default: working tree)")
    parser.add_argument("--server", action="append", default=[], metavar="KEY=VALUE",
                        help="an extra routing.yaml server key (repeatable)")  # fmt: skip
    parser.add_argument("--trickle-s", type=float, default=20.0, help="how long body-trickle waits (default 20)")
    parser.add_argument("--fakes", type=int, help=argparse.SUPPRESS)  # internal: serve the stand-ins on this port
    return parser.parse_args(argv)


if __name__ == "__main__":
    arguments = parse_args()
    if arguments.fakes is not None:
        web.run_app(Fakes().app(), host="127.0.0.1", port=arguments.fakes, print=None, access_log=None)
    else:
        asyncio.run(main(arguments))

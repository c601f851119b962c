"""gateway/server/access_log.py: one cheap line a request, written in batches, never forgeable."""

from __future__ import annotations

import asyncio
import contextlib
import io
import re
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
from aiohttp import web

from gateway.config import GatewayConfig, parse_config
from gateway.server.access_log import WRITE_BYTES, AccessLogWriter, _safe, access_logger
from gateway.server.app import SERVER_OPTIONS, create_app
from tests.conftest import Upstream

LINE = re.compile(
    r'^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z 127\.0\.0\.1 "POST /v1/chat/completions HTTP/1\.1" 200 \d+ '
    r'\d+\.\d{3}s rid=(?P<rid>\S+) model=m route=direct encoded=- "(?P<ua>.*)"$'
)


class Stream(io.BytesIO):
    def __init__(self) -> None:
        super().__init__()
        self.writes = 0
        self.written = asyncio.Event()

    def write(self, data: bytes) -> int:  # type: ignore[override]
        self.writes += 1
        self.written.set()
        return super().write(data)


async def test_lines_are_written_in_batches_after_the_flush_interval() -> None:
    stream = Stream()
    writer = AccessLogWriter(stream, flush_s=0.01)
    for i in range(100):
        writer.write(f"line {i}\n")
    assert stream.writes == 0  # gathered, not yet written
    await asyncio.wait_for(stream.written.wait(), timeout=5)  # written by the flush timer
    assert stream.writes == 1
    assert stream.getvalue().decode().splitlines() == [f"line {i}" for i in range(100)]


async def test_a_full_batch_is_written_at_once_and_flush_writes_the_rest() -> None:
    stream = Stream()
    writer = AccessLogWriter(stream, batch_bytes=100, flush_s=60)
    writer.write("x" * 60 + "\n")
    assert stream.writes == 0
    writer.write("y" * 60 + "\n")  # 122 bytes gathered: over the batch
    assert stream.writes == 1
    writer.write("z\n")
    writer.flush()  # what the server's shutdown does
    assert stream.writes == 2
    assert stream.getvalue().decode().splitlines() == ["x" * 60, "y" * 60, "z"]
    writer.flush()  # nothing left: no empty write
    assert stream.writes == 2


def test_a_line_written_without_an_event_loop_is_written_at_once() -> None:
    stream = Stream()
    AccessLogWriter(stream).write("late\n")
    assert stream.getvalue() == b"late\n"


def test_a_broken_stream_does_not_raise() -> None:
    stream = Stream()
    stream.close()
    AccessLogWriter(stream).write("lost\n")  # no exception: a request must not fail for its log line


def test_client_chosen_values_cannot_forge_a_line() -> None:
    assert _safe("OpenAI/Python 1.40.0") == "OpenAI/Python 1.40.0"
    forged = _safe('x" 200 0 0.1s rid=fake\n2026-01-01T00:00:00.000Z 1.2.3.4 "GET /')
    assert "\n" not in forged and '\\"' in forged and "\\x0a" in forged
    assert _safe("back\\slash") == "back\\\\slash"
    assert len(_safe("a" * 10_000)) < 600


def test_timestamps_are_utc_with_milliseconds() -> None:
    writer = AccessLogWriter(Stream())
    assert writer.timestamp(1_700_000_000.25) == "2023-11-14T22:13:20.250Z"
    assert writer.timestamp(1_700_000_001.999) == "2023-11-14T22:13:21.999Z"


@contextlib.asynccontextmanager
async def served(config: GatewayConfig, writer: AccessLogWriter) -> AsyncIterator[int]:
    """The gateway served as `serve` serves it, with ``writer`` as its access log: its port."""
    runner = web.AppRunner(create_app(config), access_log_class=access_logger(writer), **SERVER_OPTIONS)
    await runner.setup()
    try:
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        yield runner.addresses[0][1]
    finally:
        await runner.cleanup()


async def test_a_served_request_gets_one_line_with_what_the_gateway_decided(upstream: Upstream, tmp_path: Path) -> None:
    config = parse_config(
        f"version: 1\nmodels:\n  - name: m\n    upstreams: [{upstream.url}]\n    accepts: [text]\n",
        filename=str(tmp_path / "routing.yaml"),
    )
    stream = Stream()
    writer = AccessLogWriter(stream, flush_s=60)
    async with served(config, writer) as port, aiohttp.ClientSession() as session:
        for _ in range(3):
            async with session.post(
                f"http://127.0.0.1:{port}/v1/chat/completions",
                json={"model": "m", "messages": [{"role": "user", "content": "hi"}]},
                headers={"User-Agent": 'evil"agent'},
            ) as resp:
                assert resp.status == 200
                rid = resp.headers["X-Request-Id"]
    assert stream.writes == 0  # all three still gathered
    writer.flush()
    lines = stream.getvalue().decode().splitlines()
    assert len(lines) == 3
    match = LINE.match(lines[-1])
    assert match is not None, lines[-1]
    assert match["rid"] == rid
    assert match["ua"] == 'evil\\"agent'


def test_a_batch_is_written_in_pieces_of_whole_lines_that_a_pipe_never_tears() -> None:
    stream = Stream()
    writer = AccessLogWriter(stream, flush_s=60)
    lines = [f"{i:05d} " + "x" * (100 + i % 50) + "\n" for i in range(300)]  # ~40 KB
    for line in lines:
        writer.write(line)
    writer.flush()
    assert stream.getvalue().decode() == "".join(lines)
    assert stream.writes >= 40_000 // WRITE_BYTES
    # every write ended at a line's end and was at most PIPE_BUF: read the pieces back
    pieces = Pieces()
    writer = AccessLogWriter(pieces, flush_s=60)
    for line in lines:
        writer.write(line)
    writer.flush()
    assert all(len(p) <= WRITE_BYTES and p.endswith(b"\n") for p in pieces.pieces)


class Pieces(io.BytesIO):
    def __init__(self) -> None:
        super().__init__()
        self.pieces: list[bytes] = []

    def write(self, data: bytes) -> int:  # type: ignore[override]
        self.pieces.append(bytes(data))
        return len(data)


def test_characters_some_tools_read_as_line_breaks_are_escaped() -> None:
    assert _safe("a\u2028b\u0085c\u202ed") == "a\\u2028b\\x85c\\u202ed"


def test_no_stderr_at_all_drops_the_lines_quietly(monkeypatch) -> None:
    monkeypatch.setattr("sys.stderr", None)
    writer = AccessLogWriter()
    writer.write("nowhere\n")  # no loop: flushed at once, to nothing


async def test_query_values_never_reach_the_log(upstream: Upstream, tmp_path: Path) -> None:
    """A key sent as ``?api_key=...`` was written in clear: the query is REDACTED, names too (a
    bare ``?sk-...`` is a name), and the gateway's API takes none."""
    config = parse_config(f"version: 1\nmodels:\n  - {{name: m, upstreams: [{upstream.url}], accepts: [text]}}\n")
    stream = Stream()
    writer = AccessLogWriter(stream, flush_s=60)
    async with served(config, writer) as port, aiohttp.ClientSession() as session:
        url = f"http://127.0.0.1:{port}/v1/models?api_key=sk-in-the-query&sk-bare&token=tok-zyx%20wvu"
        async with session.get(url) as resp:
            assert resp.status == 200
    writer.flush()
    (line,) = stream.getvalue().decode().splitlines()
    assert '"GET /v1/models?REDACTED HTTP/1.1" 200' in line
    assert "sk-" not in line and "zyx" not in line and "wvu" not in line  # letters no request id holds

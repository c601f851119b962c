"""Reader processes for documents: PDFium runs in them, never in the gateway (gateway.media.pdf).

:class:`Readers` keeps the idle reader processes of the gateway process and lends one to each
job; a job runs on one of the media decoding threads (gateway.media.decoders: a bounded queue,
two at once), which waits for the answer while the event loop serves. A reader that takes longer
than the job's time, or whose request left, is killed; one that died (PDFium aborts when its
address space, 1 GiB, runs out) is reported, and the next job starts a fresh one. A reader is
used for :data:`JOBS` documents, then replaced. The first document after a start waits ~0.2 s
for its reader to start.
"""

from __future__ import annotations

import os
import selectors
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import orjson

from ..errors import DecodersBusyError

JOBS = 256  # documents a reader reads before it is replaced
_ROOT = str(Path(__file__).resolve().parents[2])  # where the gateway package is, for the reader's import


class ReaderFailed(Exception):
    """The document could not be read: why, in words for the client."""


class ReaderStopped(Exception):
    """Nobody waits for the reading any more (the request left, the gateway stops)."""


class Readers:
    """The idle reader processes, lent one a job (see the module docstring)."""

    def __init__(self) -> None:
        self._idle: list[tuple[subprocess.Popen[bytes], int]] = []  # each with the jobs it has done
        self._lock = threading.Lock()
        self._closed = False

    def read(self, job: dict[str, Any], data: bytes, *, timeout_s: float, stop: threading.Event) -> Any:
        """The reader's answer to ``job`` for ``data`` (on a decoding thread), or ReaderFailed.
        A reader used before that ends before it answers is tried once more with a fresh one (it
        may have died between two jobs: not this document's fault)."""
        deadline = time.monotonic() + timeout_s
        limit = _longest(job)
        while True:
            process, done = self._lend()
            try:
                return self._job(process, done, (job, data), (deadline, limit, timeout_s), stop)
            except _Ended as ended:
                if done == 0:
                    raise ReaderFailed(str(ended)) from None

    def _job(
        self,
        process: subprocess.Popen[bytes],
        done: int,
        work: tuple[dict[str, Any], bytes],
        bounds: tuple[float, int, float],
        stop: threading.Event,
    ) -> Any:
        job, data = work
        try:
            header = orjson.dumps(job)
            _send(process, (len(header).to_bytes(4, "big") + header + len(data).to_bytes(4, "big"), data), bounds, stop)
            answer = _answer(process, bounds, stop)
        except OSError:  # it died as the document came
            _kill(process)
            raise _Ended(_died(process)) from None
        except BaseException:
            _kill(process)
            raise
        if not isinstance(answer, dict) or not ("pages" in answer or "error" in answer):
            _kill(process)
            raise ReaderFailed("its reader answered something else than an answer")
        if answer.get("last"):  # it ends itself after this answer (out of memory)
            _kill(process)
        else:
            self._give_back(process, done + 1)
        return answer

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for process, _ in idle:
            _kill(process)

    def _lend(self) -> tuple[subprocess.Popen[bytes], int]:
        with self._lock:
            while self._idle:
                process, done = self._idle.pop()
                if process.poll() is None:
                    return process, done
                _kill(process)  # died while idle: its pipes closed now
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (_ROOT, os.environ.get("PYTHONPATH")) if p)}
        command = [sys.executable, "-m", "gateway.media.pdf"]
        try:
            process = subprocess.Popen(
                command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env
            )
        except OSError as exc:  # out of processes or descriptors: the gateway's saturation, not the file's
            raise DecodersBusyError(f"The gateway could not start a document reader ({exc}); retry shortly") from None
        assert process.stdin is not None
        os.set_blocking(process.stdin.fileno(), False)  # written as it drains, within the job's time (_send)
        return process, 0

    def _give_back(self, process: subprocess.Popen[bytes], done: int) -> None:
        with self._lock:
            if not self._closed and done < JOBS and process.poll() is None:
                self._idle.append((process, done))
                return
        _kill(process)


def _longest(job: dict[str, Any]) -> int:
    """The longest answer to ``job``: its text, escaped, and its page images in base64."""
    render = job.get("render") or {}
    images = render.get("max_total_bytes", 0) // 3 * 4 + 64 * int(job.get("max_pages", 0)) if render else 0
    return 6 * int(job.get("max_chars", 1 << 20)) + images + (1 << 20)


class _Ended(Exception):
    """The reader ended before it answered."""


def _send(
    process: subprocess.Popen[bytes],
    buffers: tuple[bytes, ...],
    bounds: tuple[float, int, float],
    stop: threading.Event,
) -> None:
    """The job written to the reader as its pipe drains, within the deadline; 50 ms at most
    between looks at ``stop`` (a reader that stopped reading does not hold the thread)."""
    deadline, _, timeout_s = bounds
    assert process.stdin is not None
    fd = process.stdin.fileno()
    with selectors.DefaultSelector() as selector:
        selector.register(fd, selectors.EVENT_WRITE)
        for buffer in buffers:
            view = memoryview(buffer)
            while view:
                _check(deadline, timeout_s, stop)
                if not selector.select(min(deadline - time.monotonic(), 0.05)):
                    continue
                try:
                    view = view[os.write(fd, view[: 1 << 20]) :]
                except BlockingIOError:  # pragma: no cover - the selector said it had room
                    continue


def _check(deadline: float, timeout_s: float, stop: threading.Event) -> None:
    if stop.is_set():
        raise ReaderStopped
    if deadline - time.monotonic() <= 0:
        raise ReaderFailed(f"reading it took over {timeout_s:g}s (extract.timeout_s)")


def _answer(process: subprocess.Popen[bytes], bounds: tuple[float, int, float], stop: threading.Event) -> Any:
    """The answer frame, read as it comes, within the deadline and the longest answer; 50 ms at
    most between looks at ``stop``."""
    deadline, limit, timeout_s = bounds
    assert process.stdout is not None
    fd = process.stdout.fileno()
    got = bytearray()
    want = 4
    with selectors.DefaultSelector() as selector:
        selector.register(fd, selectors.EVENT_READ)
        while len(got) < want:
            _check(deadline, timeout_s, stop)
            if not selector.select(min(deadline - time.monotonic(), 0.05)):
                continue
            chunk = os.read(fd, min(want - len(got), 1 << 20))
            if not chunk:
                raise _Ended(_died(process))
            got += chunk
            if want == 4 and len(got) >= 4:
                want = 4 + int.from_bytes(got[:4], "big")
                if want > limit:
                    raise ReaderFailed("its reader's answer passed the longest an answer may be")
    try:
        return orjson.loads(bytes(got[4:want]))
    except orjson.JSONDecodeError:
        raise ReaderFailed("its reader's answer was not JSON") from None


def _died(process: subprocess.Popen[bytes]) -> str:
    try:
        code = process.wait(timeout=1.0)
    except subprocess.TimeoutExpired:
        code = None
    if code is not None and code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:  # a real-time signal: no name
            name = f"signal {-code}"
        return f"its reader ended on {name}: out of its memory (1 GiB), or a malformed file"
    return "its reader ended before it answered"


def _kill(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        process.kill()
    try:
        process.wait(timeout=2.0)
    except subprocess.TimeoutExpired:  # pragma: no cover - a killed process is reaped at once
        pass
    for pipe in (process.stdin, process.stdout):
        if pipe is not None:
            pipe.close()

"""Debian's redis-server on a free loopback port, for the tests and benchmarks of the shared key
limits (gateway/admission/shared.py): no persistence, its files under a directory of the caller's,
ready once it says it accepts connections."""

from __future__ import annotations

import socket
import subprocess
from pathlib import Path


class RedisServer:
    """One redis-server, started ready; :meth:`kill` stops it (tests kill it mid-way)."""

    def __init__(self, where: Path) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port: int = s.getsockname()[1]
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.process = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", str(where)],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip
        assert self.process.stdout is not None
        for line in self.process.stdout:  # it says when it listens (bounded by its start, or its exit)
            if "Ready to accept connections" in line:
                return
        raise RuntimeError("redis-server exited before it was ready")

    @property
    def alive(self) -> bool:
        return self.process.poll() is None

    def kill(self) -> None:
        if self.alive:
            self.process.kill()
        self.process.wait(timeout=10)
        assert self.process.stdout is not None
        self.process.stdout.close()

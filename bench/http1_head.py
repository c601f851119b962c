"""A reply head that arrives a byte a read: what the upstream client's parser costs for it, the
hand parser of an earlier commit beside llhttp's (issue 21). One process, CPU time, medians.

    .venv/bin/python -m bench.http1_head [--rev 4c11cc8] [--kib 64] [--repeats 5]

``--rev`` loads that commit's ``gateway/http1.py`` (``git show``) as the "before".
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType
from typing import Any

REPO = Path(__file__).resolve().parents[1]


class _Sink(asyncio.Transport):
    def write(self, data: Any) -> None:
        pass

    def close(self) -> None:
        pass

    def abort(self) -> None:
        pass


def _module(rev: str) -> ModuleType:
    source = subprocess.run(
        ["git", "-C", str(REPO), "show", f"{rev}:gateway/http1.py"], capture_output=True, check=True, text=True
    ).stdout
    path = Path(tempfile.mkdtemp()) / "http1_before.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("http1_before", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


async def _once(http1: ModuleType, head: bytes) -> float:
    client = http1.Http1Client()
    conn = http1._Connection(client.origin("http://127.0.0.1:9"))
    conn.connection_made(_Sink())
    waiting = asyncio.ensure_future(conn.exchange(b"POST / HTTP/1.1\r\n\r\n", b"", None, None))
    started = time.process_time()
    for i in range(len(head)):
        conn.data_received(head[i : i + 1])
    spent = time.process_time() - started
    reply = await waiting
    assert await reply.read() == b"ok"
    return spent


async def main(args: argparse.Namespace) -> None:
    from gateway.upstream import http1

    size = args.kib * 1024 - 100
    head = b"HTTP/1.1 200 OK\r\nX-Big: " + b"a" * size + b"\r\nContent-Length: 2\r\n\r\nok"
    parsers = {"llhttp (working tree)": http1}
    if args.rev:
        parsers = {f"hand parser ({args.rev})": _module(args.rev), **parsers}
    print(f"a {len(head) / 1024:.0f} KiB reply head, one byte a read; CPU seconds, median of {args.repeats}")
    for name, module in parsers.items():
        times = [await _once(module, head) for _ in range(args.repeats)]
        print(f"  {name}: {statistics.median(times):.3f} s")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--rev", default="4c11cc8", help="the commit whose gateway/http1.py is the before ('' for none)"
    )
    parser.add_argument("--kib", type=int, default=63)
    parser.add_argument("--repeats", type=int, default=5)
    asyncio.run(main(parser.parse_args()))
    sys.exit(0)

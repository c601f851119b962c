"""How much of a proxy hop is aiohttp's client: the minimal proxy with a bare HTTP/1.1 client.

``bench/minimal_proxy.py`` forwards with aiohttp's ``ClientSession``; this one writes the request
line, a few headers and the body to a pooled keep-alive connection itself and reads the reply's
head and ``Content-Length`` body with asyncio streams (no chunked replies: text requests only).
The server side is the same aiohttp server. Side by side with the minimal proxy, the difference
is what a leaner upstream client could save the gateway (docs/benchmarks.md, "What is left"):

    .venv/bin/python -m bench.raw_client_proxy --port 18082 --upstream http://127.0.0.1:18000

A measurement tool, not a client: no timeouts, retries, chunked bodies or error handling.
"""

from __future__ import annotations

import asyncio
from urllib.parse import urlsplit

from aiohttp import web

from bench import minimal_proxy


class Pool:
    def __init__(self, upstream: str) -> None:
        parts = urlsplit(upstream)
        self.host, self.port = parts.hostname or "127.0.0.1", parts.port or 80
        self.idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []

    async def post(self, path: str, body: bytes, content_type: str) -> tuple[int, str, bytes]:
        if self.idle:
            reader, writer = self.idle.pop()
        else:
            reader, writer = await asyncio.open_connection(self.host, self.port)
        writer.write(
            f"POST {path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\nContent-Type: {content_type}\r\n"
            f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        head = await reader.readuntil(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        status = int(lines[0].split(" ", 2)[1])
        length, reply_type = 0, "application/json"
        for line in lines[1:]:
            name, _, value = line.partition(":")
            lowered = name.lower()
            if lowered == "content-length":
                length = int(value)
            elif lowered == "content-type":
                reply_type = value.strip()
        data = await reader.readexactly(length)
        self.idle.append((reader, writer))
        return status, reply_type, data


POOL = web.AppKey("pool", Pool)


def make_app(upstream: str) -> web.Application:
    app = web.Application(client_max_size=1 << 30)
    app[POOL] = Pool(upstream)

    async def proxy(request: web.Request) -> web.Response:
        body = await request.read()
        content_type = request.headers.get("Content-Type", "application/json")
        status, reply_type, data = await request.app[POOL].post(request.rel_url.raw_path_qs, body, content_type)
        return web.Response(status=status, body=data, headers={"Content-Type": reply_type})

    app.router.add_route("*", "/{tail:.*}", proxy)
    return app


def main() -> None:
    minimal_proxy.serve(make_app, __doc__)


if __name__ == "__main__":
    main()

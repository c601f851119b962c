"""The floor of the gateway's own hop: aiohttp's server and the gateway's upstream client
(gateway/upstream/http1), and nothing else: the body read, POSTed to the one upstream on a kept-alive
connection, the reply read and answered with its status and content type. Beside the minimal
proxy (aiohttp's server and aiohttp's client) and the gateway in bench.hop's text scenario, the
difference from the gateway is what the gateway's own work costs a request (admission, metrics,
the relay's headers, retries and balancing), and the difference from the minimal proxy what its
client saves.

    .venv/bin/python -m bench.client_floor --port 18083 --upstream http://127.0.0.1:18000

A measurement tool: no retries, no streaming, no error handling beyond what the client raises.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from aiohttp import web

from bench.minimal_proxy import serve
from gateway.upstream.http1.client import Http1Client, Waits

CLIENT = web.AppKey("client", Http1Client)
WAITS = Waits(10.0, 60.0, 60.0)  # connect, first byte, each read after


def make_app(upstream: str) -> web.Application:
    app = web.Application(client_max_size=1 << 30)

    async def client_ctx(app: web.Application) -> AsyncIterator[None]:
        app[CLIENT] = Http1Client()
        yield
        await app[CLIENT].close()

    async def health(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def proxy(request: web.Request) -> web.Response:
        body = await request.read()
        headers = {"Content-Type": request.headers.get("Content-Type", "application/json")}
        reply = await request.app[CLIENT].post(upstream, request.rel_url.raw_path_qs, headers, body, WAITS)
        async with reply:
            data = await reply.read()
        return web.Response(
            body=data, status=reply.status, headers={"Content-Type": reply.headers.get("Content-Type", "")}
        )

    app.cleanup_ctx.append(client_ctx)
    app.router.add_get("/health", health)
    app.router.add_post("/{tail:.*}", proxy)
    return app


def main() -> None:
    serve(make_app, __doc__)


if __name__ == "__main__":
    main()

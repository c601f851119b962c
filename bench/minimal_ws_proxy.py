"""The least an aiohttp WebSocket relay can do: the reference of ``bench.realtime``.

``GET /v1/realtime``: the client's upgrade answered, a WebSocket opened to the upstream's
``/v1/realtime``, and each text frame passed on as it comes, both ways, until either side closes;
nothing else (no admission, no checks, no metrics, no logs).

    .venv/bin/python -m bench.minimal_ws_proxy --port 18082 --upstream http://127.0.0.1:18000
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import aiohttp
from aiohttp import WSMsgType, web

from .minimal_proxy import serve

SESSION = web.AppKey("session", aiohttp.ClientSession)


def make_app(upstream: str) -> web.Application:
    app = web.Application()
    target = upstream.replace("http", "ws", 1) + "/v1/realtime"

    async def session_ctx(app: web.Application) -> AsyncIterator[None]:
        app[SESSION] = aiohttp.ClientSession()
        yield
        await app[SESSION].close()

    async def pipe(source: aiohttp.ClientWebSocketResponse | web.WebSocketResponse, sink: object) -> None:
        async for message in source:
            if message.type is WSMsgType.TEXT:
                await sink.send_str(message.data)  # type: ignore[attr-defined]

    async def relay(request: web.Request) -> web.StreamResponse:
        async with request.app[SESSION].ws_connect(target) as engine:
            client = web.WebSocketResponse()
            await client.prepare(request)
            tasks = [asyncio.create_task(pipe(client, engine)), asyncio.create_task(pipe(engine, client))]
            await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            for task in tasks:
                task.cancel()
            await client.close()
            return client

    async def health(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    app.cleanup_ctx.append(session_ctx)
    app.router.add_get("/v1/realtime", relay)
    app.router.add_get("/health", health)
    return app


def main() -> None:
    serve(make_app, __doc__)


if __name__ == "__main__":
    main()

"""The limit of the stack: the least an aiohttp pass-through proxy can do per request, on uvloop.

It forwards the method, path, body and content type to one upstream and relays the status,
content type and body back, streamed; nothing else (no parsing, no metrics, no logs). The
gateway's throughput is quoted as a ratio of this one's, measured side by side.

    .venv/bin/python -m bench.minimal_proxy --port 18081 --upstream http://127.0.0.1:18000
"""

from __future__ import annotations

import argparse
from collections.abc import AsyncIterator, Callable

import aiohttp
from aiohttp import web

SESSION = web.AppKey("session", aiohttp.ClientSession)


def make_app(upstream: str) -> web.Application:
    app = web.Application(client_max_size=1 << 30)

    async def session_ctx(app: web.Application) -> AsyncIterator[None]:
        app[SESSION] = aiohttp.ClientSession(auto_decompress=False, connector=aiohttp.TCPConnector(limit=0))
        yield
        await app[SESSION].close()

    async def proxy(request: web.Request) -> web.StreamResponse:
        body = await request.read()
        session = request.app[SESSION]
        headers = {"Content-Type": request.headers.get("Content-Type", "application/json")}
        async with session.request(
            request.method, upstream + request.rel_url.raw_path_qs, data=body, headers=headers
        ) as up:
            response = web.StreamResponse(
                status=up.status, headers={"Content-Type": up.headers.get("Content-Type", "")}
            )
            await response.prepare(request)
            async for chunk in up.content.iter_any():
                await response.write(chunk)
            await response.write_eof()
            return response

    app.cleanup_ctx.append(session_ctx)
    app.router.add_route("*", "/{tail:.*}", proxy)
    return app


def serve(make: Callable[[str], web.Application], description: str | None) -> None:
    """``--port P --upstream URL``: serve ``make(URL)`` on 127.0.0.1:P, on uvloop where installed."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--upstream", required=True)
    args = parser.parse_args()
    try:
        import uvloop

        loop_factory = uvloop.new_event_loop
    except ImportError:  # pragma: no cover
        loop_factory = None
    web.run_app(make(args.upstream), host="127.0.0.1", port=args.port, access_log=None, print=None,
                loop=loop_factory() if loop_factory else None)  # fmt: skip


def main() -> None:
    serve(make_app, __doc__)


if __name__ == "__main__":
    main()

"""The floor of a rejection: the least an aiohttp server on uvloop can do to answer a POST.

It reads the body and answers a fixed 400 in the OpenAI error shape, without parsing anything:
what the gateway's rejection at admission costs beyond this is the gateway's own work (parsing,
classifying, the error rendered, metrics, the request id). ``bench.hop``'s rejection scenario
runs it side by side with the gateway:

    .venv/bin/python -m bench.floor --port 18083 --upstream unused
"""

from __future__ import annotations

from aiohttp import web

from bench import minimal_proxy

ERROR = (
    b'{"error": {"message": "Model \'bench-text\' does not accept image input", '
    b'"type": "invalid_request_error", "param": "messages[0].content[1]", "code": "unsupported_modality"}}'
)


def make_app(upstream: str) -> web.Application:
    app = web.Application(client_max_size=1 << 30)

    async def reject(request: web.Request) -> web.Response:
        await request.read()
        return web.Response(status=400, body=ERROR, content_type="application/json")

    async def health(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    app.router.add_get("/health", health)
    app.router.add_post("/{tail:.*}", reject)
    return app


def main() -> None:
    minimal_proxy.serve(make_app, __doc__)


if __name__ == "__main__":
    main()

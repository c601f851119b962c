"""A trace collector for benchmarks: takes OTLP/HTTP exports and counts the spans in them.

It answers ``POST /v1/traces`` as a collector does (an empty ``ExportTraceServiceResponse``), so
the gateway's exporter works as it would against a real one, and ``GET /count`` says how many
spans came; nothing is kept. ``GET /health`` answers when it listens.

    .venv/bin/python -m bench.otlp_sink --port 14318
"""

from __future__ import annotations

import argparse

from aiohttp import web

SPANS = web.AppKey("spans", list)


def make_app() -> web.Application:
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
        ExportTraceServiceRequest,
        ExportTraceServiceResponse,
    )

    reply = ExportTraceServiceResponse().SerializeToString()
    app = web.Application(client_max_size=1 << 26)
    app[SPANS] = [0]

    async def export(request: web.Request) -> web.Response:
        message = ExportTraceServiceRequest()
        message.ParseFromString(await request.read())
        app[SPANS][0] += sum(len(s.spans) for r in message.resource_spans for s in r.scope_spans)
        return web.Response(body=reply, content_type="application/x-protobuf")

    async def count(request: web.Request) -> web.Response:
        return web.json_response({"spans": app[SPANS][0]})

    async def health(request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    app.router.add_post("/v1/traces", export)
    app.router.add_get("/count", count)
    app.router.add_get("/health", health)
    return app


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args()
    web.run_app(make_app(), host="127.0.0.1", port=args.port, print=None)


if __name__ == "__main__":
    main()

"""The encoder client (gateway/encode/client.py) before any encoder is asked: a request's images
are fetched at once, and one refused stops the others' fetches at once."""

from __future__ import annotations

import asyncio

import openai
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from tests.conftest import error_body, free_port, routing


async def test_a_refused_image_stops_the_other_fetches_at_once(gateway_factory, upstream) -> None:
    """A fetch that hangs and an image refused at once: the answer came when the slow fetch timed
    out (gather waited for all), the request holding a fetch slot and a media server's connection."""
    arrived, left = asyncio.Event(), asyncio.Event()

    async def slow(request: web.Request) -> web.Response:
        arrived.set()
        try:
            await asyncio.Event().wait()  # never answers
        except asyncio.CancelledError:
            left.set()  # the gateway closed the connection
            raise
        return web.Response()

    async def large(request: web.Request) -> web.Response:
        await arrived.wait()  # refused while the other fetch is under way
        return web.Response(body=b"\x89PNG" + b"\x00" * 4000, content_type="image/png")

    app = web.Application()
    app.router.add_get("/slow.png", slow)
    app.router.add_get("/large.png", large)
    media = TestServer(app, host="127.0.0.1", port=0)
    await media.start_server()
    try:
        gw = await gateway_factory(
            routing(
                f"  - {{name: vl, upstreams: [{upstream.url}], accepts: [text, image], encode: {{image: enc}}}}",
                extra=(
                    "media: {allow_private_networks: true, fetch_timeout_s: 30, max_image_bytes: 1000}\n"
                    f"encoders:\n  enc: {{kind: http, urls: ['http://127.0.0.1:{free_port()}']}}\n"
                ),
            )
        )
        content = [
            {"type": "image_url", "image_url": {"url": str(media.make_url("/slow.png"))}},
            {"type": "image_url", "image_url": {"url": str(media.make_url("/large.png"))}},
        ]
        async with gw.client() as client:
            with pytest.raises(openai.BadRequestError) as caught:
                await asyncio.wait_for(  # far under fetch_timeout_s
                    client.chat.completions.create(model="vl", messages=[{"role": "user", "content": content}]), 10
                )
        assert error_body(caught.value)["param"] == "messages[0].content[1]"
        await asyncio.wait_for(left.wait(), 10)
        assert upstream.received == []
    finally:
        await media.close()

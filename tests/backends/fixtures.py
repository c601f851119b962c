"""Encoder backend fixtures (registered in tests/conftest.py): the builtin tower on CPU, served on 127.0.0.1."""

from __future__ import annotations

import io
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer
from PIL import Image
from prometheus_client import CollectorRegistry

from backends.vision_encoder.server import SERVICE_KEY, build
from tests.images import flat_png  # noqa: F401 - the backend tests' hostile images


def png(color: tuple[int, int, int] = (200, 30, 30), size: tuple[int, int] = (64, 48)) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", size, color).save(buffer, "PNG")
    return buffer.getvalue()


# The bombs of issue 6 (item 7), as flat_png arguments; each is under 1 MB.
RGBA_BOMB = (7071, 7071, bytes((10, 20, 30, 128)))  # 50 MP: decoding it once cost 760 MB
SLIVER = (1, 40_000_000, bytes((10, 20, 30)))  # 40 MP: decoding and resizing it once cost 1.5 GB


@dataclass
class Backend:
    app: web.Application
    server: TestServer
    url: str
    registry: CollectorRegistry

    def sample(self, name: str, **labels: str) -> float:
        return self.registry.get_sample_value(name, labels) or 0.0

    @property
    def service(self):
        return self.app[SERVICE_KEY]


@pytest.fixture
async def backend_factory() -> AsyncIterator[Callable[..., Awaitable[Backend]]]:
    servers: list[TestServer] = []

    async def make(**options: object) -> Backend:
        registry = CollectorRegistry()
        app = build("builtin:vit-small", device="cpu", registry=registry, **options)
        server = TestServer(app, host="127.0.0.1", port=0)
        await server.start_server()
        servers.append(server)
        return Backend(app, server, str(server.make_url("")).rstrip("/"), registry)

    yield make
    for server in servers:
        await server.close()

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


def png(color: tuple[int, int, int] = (200, 30, 30), size: tuple[int, int] = (64, 48)) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", size, color).save(buffer, "PNG")
    return buffer.getvalue()


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
        app = build("builtin:vit-small", device="cpu", registry=registry, **options)  # type: ignore[arg-type]
        server = TestServer(app, host="127.0.0.1", port=0)
        await server.start_server()
        servers.append(server)
        return Backend(app, server, str(server.make_url("")).rstrip("/"), registry)

    yield make
    for server in servers:
        await server.close()

"""Encoder backend fixtures (registered in tests/conftest.py): the builtin tower on CPU, served on 127.0.0.1."""

from __future__ import annotations

import functools
import io
import struct
import zlib
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


@functools.cache
def flat_png(width: int, height: int, pixel: bytes) -> bytes:
    """A PNG of one color (pixel: 1 to 4 bytes, L/LA/RGB/RGBA), compressed a row at a time.

    Hostile images are made this way rather than with Pillow, which would first hold every pixel
    (200 MB for 7071x7071 RGBA) and take seconds to compress them.
    """
    color_type = {1: 0, 2: 4, 3: 2, 4: 6}[len(pixel)]
    row = b"\0" + pixel * width  # filter type 0, then the pixels
    rows_at_once = max(1, (1 << 20) // len(row))
    compressor = zlib.compressobj(1)
    parts = [compressor.compress(row * rows_at_once) for _ in range(height // rows_at_once)]
    parts += [compressor.compress(row * (height % rows_at_once)), compressor.flush()]
    header = struct.pack(">IIBBBBB", width, height, 8, color_type, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", header) + _chunk(b"IDAT", b"".join(parts)) + _chunk(b"IEND", b"")


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


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
        app = build("builtin:vit-small", device="cpu", registry=registry, **options)  # type: ignore[arg-type]
        server = TestServer(app, host="127.0.0.1", port=0)
        await server.start_server()
        servers.append(server)
        return Backend(app, server, str(server.make_url("")).rstrip("/"), registry)

    yield make
    for server in servers:
        await server.close()

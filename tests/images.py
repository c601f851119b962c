"""Images made with the standard library alone, so that gateway tests need neither Pillow nor torch."""

from __future__ import annotations

import base64
import functools
import struct
import zlib
from typing import Any


def png(color: tuple[int, int, int] = (200, 30, 30), size: tuple[int, int] = (64, 48)) -> bytes:
    """A PNG of one RGB color."""
    return flat_png(size[0], size[1], bytes(color))


def data_url(image: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(image).decode()


def image_part(image: bytes) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": data_url(image)}}


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

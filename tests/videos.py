"""Small real videos made with PyAV (a solid shade per second, so that a sampled frame says which
second it came from), for the tests of video served as frames. Callers skip without PyAV."""

from __future__ import annotations

import base64
import io
from typing import Any

import pytest

SHADES = (30, 130, 230)


def video(seconds: int = 3, fps: int = 10, size: tuple[int, int] = (64, 48), codec: str = "mpeg4") -> bytes:
    """``seconds`` seconds at ``fps``, second i a solid shade SHADES[i % 3], in an MP4."""
    av, np = pytest.importorskip("av"), pytest.importorskip("numpy")
    width, height = size
    out = io.BytesIO()
    with av.open(out, "w", format="mp4") as container:
        stream = container.add_stream(codec, rate=fps)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        for i in range(seconds * fps):
            pixels = np.full((height, width, 3), SHADES[(i // fps) % 3], dtype=np.uint8)
            for packet in stream.encode(av.VideoFrame.from_ndarray(pixels, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode(None):
            container.mux(packet)
    return out.getvalue()


def shade(jpeg: bytes) -> int:
    """The mean shade of a JPEG frame."""
    av = pytest.importorskip("av")
    with av.open(io.BytesIO(jpeg), format="mjpeg") as container:
        frame = next(container.decode(video=0))
        return int(frame.to_ndarray(format="rgb24").mean())


def video_part(data: bytes) -> dict[str, Any]:
    return {"type": "video_url", "video_url": {"url": "data:video/mp4;base64," + base64.b64encode(data).decode()}}


def long_gop(frames: int = 240, fps: int = 30, size: tuple[int, int] = (320, 240)) -> bytes:
    """One keyframe and ``frames - 1`` frames after it (H.264, a shade moving on): what makes each
    sample decode from the start again, the decode bomb's shape at a small size."""
    av, np = pytest.importorskip("av"), pytest.importorskip("numpy")
    width, height = size
    out = io.BytesIO()
    with av.open(out, "w", format="mp4") as container:
        options = {"g": str(frames * 2), "keyint_min": str(frames * 2), "sc_threshold": "0", "bf": "0",
                   "preset": "ultrafast"}  # fmt: skip
        stream = container.add_stream("libx264", rate=fps, options=options)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        for i in range(frames):
            pixels = np.full((height, width, 3), i % 256, dtype=np.uint8)
            for packet in stream.encode(av.VideoFrame.from_ndarray(pixels, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode(None):
            container.mux(packet)
    return out.getvalue()


def playlist(*names: str) -> bytes:
    """An ffconcat playlist naming files (relative to the reader's working directory)."""
    return b"ffconcat version 1.0\n" + b"".join(f"file '{name}'\n".encode() for name in names)

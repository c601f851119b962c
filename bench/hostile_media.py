"""Hostile and heavy media for bench.hostile's media scenarios, made with PyAV (the ``video``
extra): the decode bomb, a heavy clip in many distinct copies, and an ffconcat playlist."""

from __future__ import annotations

import io
import struct
from fractions import Fraction


def decode_bomb(frames: int = 1300, size: tuple[int, int] = (3840, 2160)) -> bytes:
    """A 4K H.264 clip of one keyframe and ``frames - 1`` frames that all depend on it, of one
    flat shade: ~66 KB that cost each sample a decode from the start (issue 20's bomb). Two frames
    are encoded; the second (a frame that changes nothing) is written again with later times."""
    import av

    width, height = size
    out = io.BytesIO()
    with av.open(out, "w", format="mp4") as container:
        options = {"g": "100000", "keyint_min": "100000", "sc_threshold": "0", "bf": "0", "preset": "ultrafast",
                   "crf": "51", "repeat-headers": "1"}  # fmt: skip
        stream = container.add_stream("libx264", rate=30, options=options)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        frame = av.VideoFrame(width, height, "yuv420p")
        for plane in frame.planes:
            plane.update(bytes([90]) * plane.buffer_size)
        packets = []
        for i in range(frames):
            frame.pts = i
            packets += stream.encode(frame)
        packets += stream.encode(None)
        for packet in packets:
            container.mux(packet)
    return out.getvalue()


def heavy_clip(seconds: int = 30, fps: int = 30, size: tuple[int, int] = (1280, 720)) -> bytes:
    """A clip that costs real decoding: H.264 with a keyframe every 8 s (libx264's default) of a
    picture that moves every frame."""
    import av
    import numpy as np

    width, height = size
    rng = np.random.default_rng(7)
    texture = rng.integers(0, 256, (height, width * 2), dtype=np.uint8)
    out = io.BytesIO()
    with av.open(out, "w", format="mp4") as container:
        stream = container.add_stream("libx264", rate=fps, options={"preset": "ultrafast", "crf": "28"})
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        stream.codec_context.time_base = Fraction(1, fps)
        for i in range(seconds * fps):
            luma = texture[:, (i * 8) % width : (i * 8) % width + width]
            frame = av.VideoFrame(width, height, "yuv420p")
            frame.planes[0].update(np.ascontiguousarray(luma).tobytes())
            for plane in frame.planes[1:]:
                plane.update(bytes([128]) * plane.buffer_size)
            frame.pts = i
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode(None):
            container.mux(packet)
    return out.getvalue()


def distinct(clip: bytes, n: int) -> bytes:
    """``clip`` with a ``free`` box appended that holds ``n``: the same video, another sha256 (so
    no cache or single flight merges the copies)."""
    payload = f"copy {n}".encode()
    return clip + struct.pack(">I", 8 + len(payload)) + b"free" + payload


def playlist(*names: str) -> bytes:
    """An ffconcat playlist naming files relative to the reader's working directory."""
    return b"ffconcat version 1.0\n" + b"".join(f"file '{name}'\n".encode() for name in names)

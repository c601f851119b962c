"""What sampling a video's frames costs (gateway/media/video.py): time per video and per second of video.

Videos are made here with PyAV (H.264, 30 fps, solid shades changing each second, so that they
compress as real footage with little motion would), at two sizes and three lengths; each is
sampled ``--repeats`` times with 8 frames (the medians are reported), beside decoding every frame
of it once, which is what a decoder without seeking pays:

    .venv/bin/python -m bench.video [--repeats 5]
"""

from __future__ import annotations

import argparse
import hashlib
import io
import statistics
import time

import av
import numpy as np

from gateway.media.conversions import ConversionCache
from gateway.media.video import sample_frames


def make(seconds: int, width: int, height: int, fps: int = 30) -> bytes:
    out = io.BytesIO()
    shades = np.random.default_rng(seconds).integers(0, 255, size=seconds)
    with av.open(out, "w", format="mp4") as container:
        stream = container.add_stream("libx264", rate=fps)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        for i in range(seconds * fps):
            shade = int(shades[i // fps])
            pixels = np.full((height, width, 3), shade, dtype=np.uint8)
            pixels[: height // 4, : (i % fps + 1) * width // fps] = 255 - shade  # a bar that moves
            for packet in stream.encode(av.VideoFrame.from_ndarray(pixels, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode(None):
            container.mux(packet)
    return out.getvalue()


def decode_all(data: bytes) -> int:
    with av.open(io.BytesIO(data), mode="r") as container:
        count = 0
        for _ in container.decode(video=0):
            count += 1
        return count


def timed(fn: object, repeats: int) -> float:
    samples = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()  # type: ignore[operator]
        samples.append(time.perf_counter() - started)
    return statistics.median(samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    print(
        "| video | size | 8 frames sampled (median) | per second of video | every frame decoded | x faster "
        "| a later turn (sha256, cache hit) |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    for width, height in ((640, 360), (1280, 720)):
        for seconds in (10, 30, 60):
            data = make(seconds, width, height)
            sampled = timed(lambda data=data: sample_frames(data, frames=8), args.repeats)
            whole = timed(lambda data=data: decode_all(data), 1)
            # what a later turn that sends the same video pays instead (gateway.media.conversions): its sha256
            # and a lookup in the cache of what was sampled
            cache = ConversionCache(1 << 28)
            key = ("frames", 8, None, 768, True)
            cache.put((*key, hashlib.sha256(data).hexdigest()), sample_frames(data, frames=8), 0)
            hit = timed(
                lambda data=data, cache=cache, key=key: cache.get((*key, hashlib.sha256(data).hexdigest())),
                args.repeats,
            )
            print(
                f"| {seconds} s {width}x{height} H.264 30 fps | {len(data) / 1024:,.0f} KiB "
                f"| {sampled * 1000:.0f} ms | {sampled * 1000 / seconds:.1f} ms | {whole * 1000:.0f} ms "
                f"| {whole / sampled:.1f} | {hit * 1e6:.0f} µs |"
            )


if __name__ == "__main__":
    main()

"""What counting and downscaling images costs (gateway/admission/dimensions.py, visual.py,
gateway/media/downscale.py).

1. **Header read**: µs to size an image from its header, per format, at three sizes (the time
   must not grow with the image), from the bytes and from a data URL (its first KiB decoded);
   beside Pillow's lazy ``Image.open`` on the same bytes.
2. **Admission with counting**: µs ``admit()`` takes for a chat request with one 100 KB image,
   with and without the model's ``visual_tokens:``.
3. **A video read for its tokens** (gateway/media/probe.py): ms to read a clip's container
   (frames, rate, size; no frame decoded) by its length and size, from its bytes; and the base64
   decoding of its data URL before it, which grows with the clip.
4. **Downscale**: ms and peak memory (the growth of VmHWM, each case in a fresh process) per
   12 MP JPEG and per 24 MP PNG brought to 4 MP, and the bytes and tokens saved (Qwen2.5-VL's
   count).

    .venv/bin/python -m bench.visual [--repeats 7]

Medians of ``--repeats`` runs of each. Photos are noise over a gradient: nothing compresses
them better than a camera's would.
"""

from __future__ import annotations

import argparse
import base64
import functools
import io
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import numpy as np
from PIL import Image

from bench import procstat
from gateway.admission.dimensions import data_url_dimensions, read_dimensions
from gateway.admission.plan import admit
from gateway.admission.tokens import count
from gateway.config import parse_config
from gateway.config.types import VISUAL_PRESETS

FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")
SIZES = ((64, 64), (1280, 720), (4000, 3000))


def photo(width: int, height: int, seed: int = 0) -> Image.Image:
    rng = np.random.default_rng(seed)
    gradient = np.linspace(0, 200, width, dtype=np.float32)[None, :, None]
    pixels = np.clip(gradient + rng.normal(0, 25, (height, width, 3)), 0, 255).astype(np.uint8)
    return Image.fromarray(pixels, "RGB")


def encoded(image: Image.Image, fmt: str) -> bytes:
    out = io.BytesIO()
    image.save(out, fmt, **({"quality": 90} if fmt in ("JPEG", "WEBP") else {}))
    return out.getvalue()


def per_call_us(fn: Callable[[], object], repeats: int, *, at_least_s: float = 0.2) -> float:
    """The median over ``repeats`` of µs a call, each run as many calls as fill ``at_least_s``."""
    n, start = 0, time.perf_counter()
    while time.perf_counter() - start < 0.02:
        fn()
        n += 1
    calls = max(1, int(n * at_least_s / 0.02))
    runs = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        runs.append((time.perf_counter() - start) / calls * 1e6)
    return statistics.median(runs)


def headers(repeats: int) -> list[dict[str, Any]]:
    rows = []
    for fmt in FORMATS:
        for width, height in SIZES:
            if fmt == "GIF" and width * height > 2_000_000:
                continue  # GIF is not how anyone sends a 12 MP photo
            data = encoded(photo(width, height), fmt)
            url = f"data:image/{fmt.lower()};base64," + base64.b64encode(data).decode()

            def pillow(data: bytes = data) -> object:
                with Image.open(io.BytesIO(data)) as image:
                    return image.size

            rows.append({
                "format": fmt, "size": f"{width}x{height}", "bytes": len(data),
                "header_us": per_call_us(functools.partial(read_dimensions, data), repeats),
                "data_url_us": per_call_us(functools.partial(data_url_dimensions, url), repeats),
                "pillow_open_us": per_call_us(pillow, repeats),
            })  # fmt: skip
    return rows


TABLE = """version: 1
models:
  - {name: plain, upstreams: ['http://127.0.0.1:1'], accepts: [text, image]}
  - name: counted
    upstreams: ['http://127.0.0.1:1']
    accepts: [text, image]
    visual_tokens: {preset: qwen2.5-vl}
    limits: {visual_tokens: 16384, image_pixels: 12845056}
"""


def admission(repeats: int) -> dict[str, float]:
    config = parse_config(TABLE, filename="bench")
    jpeg = encoded(photo(640, 480), "JPEG")
    url = "data:image/jpeg;base64," + base64.b64encode(jpeg).decode()
    found = {}
    for model in ("plain", "counted"):
        body = {"model": model, "messages": [{"role": "user", "content": [
            {"type": "text", "text": "what is this?"}, {"type": "image_url", "image_url": {"url": url}}]}]}  # fmt: skip
        found[model] = per_call_us(functools.partial(admit, config, body), repeats)
    found["image_bytes"] = len(jpeg)
    return found


def clip(seconds: int, width: int, height: int) -> bytes:
    """An H.264 MP4 of noise frames (10 fps): its bytes as a camera's clip would weigh."""
    import av

    rng = np.random.default_rng(0)
    out = io.BytesIO()
    with av.open(out, "w", format="mp4") as container:
        stream = container.add_stream("libx264", rate=10, options={"preset": "ultrafast"})
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        for _ in range(seconds * 10):
            pixels = rng.integers(0, 255, (height, width, 3), dtype=np.uint8)
            for packet in stream.encode(av.VideoFrame.from_ndarray(pixels, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode(None):
            container.mux(packet)
    return out.getvalue()


VIDEOS = ((2, 320, 240), (10, 320, 240), (10, 1280, 720))


def probes(repeats: int) -> list[dict[str, Any]]:
    from gateway.media.probe import read_video

    rows = []
    for seconds, width, height in VIDEOS:
        data = clip(seconds, width, height)
        url = base64.b64encode(data)
        rows.append({
            "clip": f"{seconds} s {width}x{height}", "bytes": len(data),
            "read_ms": per_call_us(functools.partial(read_video, data), repeats) / 1000,
            "b64_ms": per_call_us(functools.partial(base64.b64decode, url), repeats) / 1000,
        })  # fmt: skip
    return rows


CASES = {"jpeg-12mp": ("JPEG", 4000, 3000), "png-24mp": ("PNG", 6000, 4000)}
TARGET_PIXELS = 4_000_000


def downscale_case(name: str, path: str, repeats: int) -> dict[str, Any]:
    """One case, in this (fresh) process that has read only the image's bytes: the growth of its
    peak RSS is the downscale's."""
    from gateway.admission.tokens import fit
    from gateway.media.downscale import downscale

    _, width, height = CASES[name]
    with open(path, "rb") as file:
        data = file.read()
    pid = [os.getpid()]
    procstat.reset_peak_rss(pid)  # exec keeps the parent's ru_maxrss: VmHWM, reset, is this case's
    before = procstat.peak_rss_bytes(pid)
    spec = VISUAL_PRESETS["qwen2.5-vl"]
    target = fit(spec, width, height, max_pixels=TARGET_PIXELS, max_tokens=None)
    times, made = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        made = downscale(data, target)
        times.append((time.perf_counter() - start) * 1000)
    assert made is not None
    return {
        "case": name, "from": f"{width}x{height}", "to": f"{made.width}x{made.height}",
        "ms": statistics.median(times),
        "peak_rss_mib": (procstat.peak_rss_bytes(pid) - before) / 2**20,
        "bytes_before": len(data), "bytes_after": len(made.data),
        "tokens_before": count(spec, width, height), "tokens_after": count(spec, made.width, made.height),
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--case", nargs=2, help=argparse.SUPPRESS)  # NAME FILE: one downscale case, as a child
    args = parser.parse_args()
    if args.case:
        print(json.dumps(downscale_case(args.case[0], args.case[1], args.repeats)))
        return
    print("| format | size | bytes | header µs | data URL µs | Pillow open µs |\n|---|---|---:|---:|---:|---:|")
    for r in headers(args.repeats):
        print(f"| {r['format']} | {r['size']} | {r['bytes']:,} | {r['header_us']:.2f} | {r['data_url_us']:.2f} | "
              f"{r['pillow_open_us']:.1f} |")  # fmt: skip
    found = admission(args.repeats)
    print(
        f"\nadmit(), chat with one {found['image_bytes']:,}-byte JPEG: {found['plain']:.1f} µs without "
        f"visual_tokens, {found['counted']:.1f} µs with (+{found['counted'] - found['plain']:.1f} µs)"
    )
    print("\n| video | bytes | container read ms | base64 decode ms |\n|---|---:|---:|---:|")
    for r in probes(args.repeats):
        print(f"| {r['clip']} | {r['bytes']:,} | {r['read_ms']:.2f} | {r['b64_ms']:.2f} |")
    print("\n| downscale | from | to | ms | peak RSS MiB | bytes before → after | tokens before → after |")
    print("|---|---|---|---:|---:|---:|---:|")
    for name, (fmt, width, height) in CASES.items():
        with tempfile.NamedTemporaryFile(suffix="." + fmt.lower()) as file:
            file.write(encoded(photo(width, height), fmt))
            file.flush()
            child = subprocess.run(
                [sys.executable, "-m", "bench.visual", "--case", name, file.name, "--repeats", str(args.repeats)],
                capture_output=True, text=True, check=True,
            )  # fmt: skip
        r = json.loads(child.stdout)
        print(f"| {r['case']} | {r['from']} | {r['to']} | {r['ms']:.0f} | {r['peak_rss_mib']:.0f} | "
              f"{r['bytes_before']:,} → {r['bytes_after']:,} | "
              f"{r['tokens_before']:,} → {r['tokens_after']:,} |")  # fmt: skip


if __name__ == "__main__":
    main()

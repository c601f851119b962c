"""What reading a PDF costs: ms a page in a reader process, the reader's memory, a bomb's bound,
page images (ms a page rendered as PNG at each dpi, their bytes), and a later turn's PDF served
from the conversions cache (µs).

    python -m bench.documents [--pages 1 10 50] [--dpi 72 100 150] [--repeats 5]

Each arm through the gateway's own parts (gateway.media.readers on a decoding thread, and
gateway.media.documents with its cache), on PDFs written by tools/pdfs.py (40 lines of text a
page). Medians of ``repeats``. Bounded: it stops by itself, and its readers go with it.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import statistics
import threading
import time
from pathlib import Path

from prometheus_client import CollectorRegistry

from gateway.admission.plan import admit
from gateway.config import parse_config
from gateway.media.conversions import ConversionCache
from gateway.media.decoders import DecoderPool
from gateway.media.documents import Documents
from gateway.media.fetch import MediaFetcher
from gateway.media.readers import ReaderFailed, Readers
from gateway.metrics import GatewayMetrics
from tools import pdfs

CONFIG = """version: 1
models:
  - {name: texty, upstreams: ['http://127.0.0.1:9'], accepts: [text],
     on_unsupported: {file: {extract: {max_pages: 100}}}}
"""
PAGES_CONFIG = """version: 1
models:
  - {name: seer, upstreams: ['http://127.0.0.1:9'], accepts: [text, image],
     on_unsupported: {file: {extract: {max_pages: 100, page_images: true, dpi: 100}}}}
"""
LINE = "The quarterly figures rose by four percent while costs fell in every region we serve."


def document(pages: int) -> bytes:
    return pdfs.text_pdf(["\n".join(f"{i} {LINE}" for i in range(40))] * pages)


def peak_kib(readers: Readers) -> int:
    """The idle reader's peak resident memory (VmHWM), KiB."""
    process, _ = readers._idle[-1]
    for line in Path(f"/proc/{process.pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    return 0


def reads(pages: list[int], repeats: int) -> None:
    readers = Readers()
    stop = threading.Event()
    job = {"max_pages": 1000, "max_chars": 1 << 26}
    started = time.perf_counter()
    readers.read(job, document(1), timeout_s=30, stop=stop)
    print(f"reader start + first 1-page PDF: {(time.perf_counter() - started) * 1e3:.0f} ms")
    print("| pages | ms a PDF | ms a page | reader peak RSS MiB |\n|---:|---:|---:|---:|")
    for n in pages:
        data = document(n)
        times = []
        for _ in range(repeats):
            t = time.perf_counter()
            readers.read(job, data, timeout_s=60, stop=stop)
            times.append(time.perf_counter() - t)
        ms = statistics.median(times) * 1e3
        print(f"| {n} | {ms:.1f} | {ms / n:.2f} | {peak_kib(readers) / 1024:.0f} |")
    t = time.perf_counter()
    try:
        readers.read(job, pdfs.decompression_bomb(), timeout_s=60, stop=stop)
    except ReaderFailed as exc:
        print(
            f"decompression bomb (2 GB of content in 2 MB): refused in {(time.perf_counter() - t) * 1e3:.0f} ms: {exc}"
        )
    t = time.perf_counter()
    answer = readers.read(job | {"max_pages": 20}, pdfs.page_bomb(), timeout_s=60, stop=stop)
    print(f"page-count bomb (100,000 pages): refused in {(time.perf_counter() - t) * 1e3:.0f} ms: {answer['error']}")
    readers.close()


def renders(pages: int, dpis: list[int], repeats: int) -> None:
    """Text and page images of a ``pages``-page PDF, at each dpi, against its text alone."""
    readers = Readers()
    stop = threading.Event()
    data = document(pages)
    text = {"max_pages": 1000, "max_chars": 1 << 26}
    readers.read(text, data, timeout_s=30, stop=stop)  # the reader started
    print(f"| {pages}-page PDF | ms a page | ms a page rendered | PNG KiB a page | size | reader peak RSS MiB |")
    print("|---|---:|---:|---:|---|---:|")
    base = 0.0
    for dpi in [0, *dpis]:
        render = {"dpi": dpi, "max_pixels": 4096 * 4096, "max_bytes": 20 << 20, "max_total_bytes": 64 << 20}
        job = text | {"render": render} if dpi else text
        times, answer = [], {}
        for _ in range(repeats):
            t = time.perf_counter()
            answer = readers.read(job, data, timeout_s=60, stop=stop)
            times.append(time.perf_counter() - t)
        ms = statistics.median(times) * 1e3 / pages
        images = answer.get("images", [])
        png = sum(len(b) for _, _, b in images) * 3 / 4 / 1024 / pages if images else 0
        size = f"{images[0][0]}x{images[0][1]}" if images else "-"
        arm = f"text and images at {dpi} dpi" if dpi else "text only"
        render_ms = f"{ms - base:.2f}" if dpi else "-"
        if not dpi:
            base = ms
        print(f"| {arm} | {ms:.2f} | {render_ms} | {png:.0f} | {size} | {peak_kib(readers) / 1024:.0f} |")
    readers.close()


async def cached(pages: int, repeats: int, table: str = CONFIG) -> None:
    config = parse_config(table)
    metrics = GatewayMetrics(CollectorRegistry())
    decoders = DecoderPool()
    documents = Documents(metrics, MediaFetcher(config.media), decoders, ConversionCache(256 << 20, metrics))
    url = "data:application/pdf;base64," + base64.b64encode(document(pages)).decode()
    part = {"type": "file", "file": {"file_data": url}}
    body = {"model": config.models[0].name, "messages": [{"role": "user", "content": [part]}]}
    plan = admit(config, body)
    t = time.perf_counter()
    await documents.extract(plan, body, max_text_chars=1 << 26, media=config.media)
    first = time.perf_counter() - t
    times = []
    for _ in range(repeats * 20):
        t = time.perf_counter()
        await documents.extract(plan, body, max_text_chars=1 << 26, media=config.media)
        times.append(time.perf_counter() - t)
    size = len(url) / 1024
    what = "text and page images at 100 dpi" if table is PAGES_CONFIG else "text"
    print(
        f"{pages}-page PDF ({size:.0f} KiB as a data URL), its {what}: first turn {first * 1e3:.1f} ms; a later turn "
        f"from the cache {statistics.median(times) * 1e6:.0f} µs (the data URL decoded, its sha256, the lookup)"
    )
    documents.close()
    decoders.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pages", type=int, nargs="+", default=[1, 10, 50])
    parser.add_argument("--dpi", type=int, nargs="+", default=[72, 100, 150])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    reads(args.pages, args.repeats)
    renders(10, args.dpi, args.repeats)
    asyncio.run(cached(20, args.repeats))
    asyncio.run(cached(20, args.repeats, PAGES_CONFIG))


if __name__ == "__main__":
    main()

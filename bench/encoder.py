"""Encoder backend throughput: images/s and latency through the HTTP backend at concurrency 1, 4, 16,
next to the in-process preprocess + forward limit of the same model, measured in the same run.

    .venv/bin/python -m bench.encoder [--images 48] [--repeats 3] [--model builtin:vit-small] [--device cpu]

Bounded: every phase sends a fixed number of images and the whole run stops by itself. All images
are distinct JPEGs (640x480), so nothing is a cache hit except in the cache phase, which sends an
already-encoded set again.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as the backend sets it, before torch loads OpenMP

import argparse
import asyncio
import io
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import aiohttp
import torch
from PIL import Image

from backends.vision_encoder.preprocess import decode_image
from backends.vision_encoder.towers import load_tower, resolve_device
from bench.common import free_port, percentile_ms, wait_up


def make_images(n: int, seed: int) -> list[bytes]:
    """Distinct 640x480 JPEGs with some structure (gradients + noise), about 30-60 KB each."""
    generator = torch.Generator().manual_seed(seed)
    images = []
    for _ in range(n):
        base = torch.linspace(0, 255, 640).repeat(480, 1)
        noise = torch.randint(0, 64, (480, 640, 3), generator=generator).float()
        pixels = (base.unsqueeze(-1) * torch.rand(3, generator=generator) + noise).clamp(0, 255).byte()
        buffer = io.BytesIO()
        Image.fromarray(pixels.numpy()).save(buffer, "JPEG", quality=90)
        images.append(buffer.getvalue())
    return images


def in_process_limit(model: str, device: str, images: list[bytes], batches: tuple[int, ...] = (8, 16, 32)) -> float:
    """The best images/s of decode + prepare + forward in this process: no HTTP, no serialization, no
    cache; preparation of later images overlaps the forward pass (every core), as in the backend."""
    dev, dtype = resolve_device(device)
    tower = load_tower(model, device=dev, dtype=dtype)
    pool = ThreadPoolExecutor(max_workers=os.cpu_count() or 1)

    def prepare(data: bytes):
        return tower.prepare(decode_image(data, max_pixels=50_000_000))

    best = 0.0
    with torch.inference_mode():
        tower.forward([prepare(images[0])])  # warm-up
        for batch in batches:
            started = time.perf_counter()
            futures = [pool.submit(prepare, data) for data in images]
            for i in range(0, len(futures), batch):
                tower.forward([f.result() for f in futures[i : i + batch]])
            best = max(best, len(images) / (time.perf_counter() - started))
    pool.shutdown()
    return best


async def drive(url: str, images: list[bytes], concurrency: int) -> tuple[float, float, float]:
    """(images/s, p50 ms, p99 ms)."""
    latencies: list[float] = []
    queue = iter(images)
    async with aiohttp.ClientSession() as session:

        async def worker() -> None:
            for data in queue:
                t0 = time.perf_counter()
                async with session.post(f"{url}/v1/encode", data=data) as resp:
                    assert resp.status == 200, await resp.text()
                    await resp.read()
                latencies.append(time.perf_counter() - t0)

        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        elapsed = time.perf_counter() - started
    latencies.sort()
    return len(images) / elapsed, percentile_ms(latencies, 0.5), percentile_ms(latencies, 0.99)


async def batch_stats(session: aiohttp.ClientSession, url: str) -> tuple[float, float]:
    async with session.get(f"{url}/metrics") as resp:
        text = await resp.text()
    values = {}
    for line in text.splitlines():
        if line.startswith(("vision_encoder_batch_size_sum", "vision_encoder_batch_size_count")):
            name, value = line.split()
            values[name] = float(value)
    return values["vision_encoder_batch_size_sum"], values["vision_encoder_batch_size_count"]


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--images", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--model", default="builtin:vit-small")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--max-batch-size", type=int, default=32)
    args = parser.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "backends.vision_encoder", "serve", "--model", args.model, "--device", args.device,
        "--port", str(port), "--max-batch-size", str(args.max_batch_size), "--log-level", "warning",
    )  # fmt: skip
    seed = 0
    rows: dict[str, list[tuple[float, float, float]]] = {}
    batches: dict[int, list[float]] = {}
    limits: list[float] = []
    try:
        await wait_up(f"{url}/health")
        async with aiohttp.ClientSession() as session:
            await drive(url, make_images(8, seed=999), 4)  # warm-up
            for _ in range(args.repeats):
                seed += 1
                limits.append(in_process_limit(args.model, args.device, make_images(args.images, seed)))
                for concurrency in (1, 4, 16):
                    seed += 1
                    images = make_images(args.images, seed)
                    before = await batch_stats(session, url)
                    result = await drive(url, images, concurrency)
                    after = await batch_stats(session, url)
                    rows.setdefault(f"backend, concurrency {concurrency}", []).append(result)
                    batches.setdefault(concurrency, []).append((after[0] - before[0]) / (after[1] - before[1]))
                    if concurrency == 16:  # the same images again: every one a cache hit
                        rows.setdefault("backend, concurrency 16, cache hits", []).append(
                            await drive(url, images, concurrency)
                        )
    finally:
        process.terminate()
        await process.wait()

    limit = statistics.median(limits)
    print(
        f"model {args.model} on {args.device}, {os.cpu_count()} cores; {args.images} distinct 640x480 JPEGs a run, "
        f"medians of {args.repeats} runs\n"
    )
    print(f"in-process decode + prepare + forward limit (best of batches 8, 16, 32): {limit:.1f} images/s\n")
    print("| path | images/s | % of limit | p50 ms | p99 ms | mean batch |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, results in rows.items():
        rate, p50, p99 = (statistics.median(r[i] for r in results) for i in range(3))
        concurrency = int(name.split("concurrency ")[1].split(",")[0])
        mean_batch = f"{statistics.median(batches[concurrency]):.1f}" if "cache" not in name else "-"
        print(f"| {name} | {rate:.1f} | {100 * rate / limit:.0f}% | {p50:.1f} | {p99:.1f} | {mean_batch} |")
    miss = statistics.median(r[0] for r in rows["backend, concurrency 16"])
    hit = statistics.median(r[0] for r in rows["backend, concurrency 16, cache hits"])
    print(f"\ncache-hit speedup at concurrency 16: {hit / miss:.1f}x")


if __name__ == "__main__":
    asyncio.run(main())

"""The backend's moving parts on their own: the cache, the batcher, timeouts, the Qwen2-VL reply, the decode budget."""

from __future__ import annotations

import asyncio
import base64
import io
import threading
from collections.abc import Sequence
from pathlib import Path

import aiohttp
import pytest
import torch
from aiohttp.test_utils import TestServer
from PIL import Image
from prometheus_client import CollectorRegistry

from backends.vision_encoder.batching import DynamicBatcher, QueueFullError
from backends.vision_encoder.cache import EmbeddingCache
from backends.vision_encoder.limits import DecodeLimits, PixelBudget
from backends.vision_encoder.server import build
from backends.vision_encoder.service import EncoderService
from backends.vision_encoder.towers import Encoded, Prepared, TowerInfo, VisionTower
from backends.vision_encoder.towers.builtin import BuiltinViT
from tests.backends.fixtures import png

# --- cache ------------------------------------------------------------------------------------------


def test_the_cache_evicts_least_recently_used_within_its_byte_budget() -> None:
    cache: EmbeddingCache[bytes] = EmbeddingCache(10, len)
    cache.put("a", b"1234")
    cache.put("b", b"1234")
    assert cache.get("a") == b"1234"  # a is now the most recent
    cache.put("c", b"1234")  # 12 bytes > 10: b goes
    assert (cache.get("a"), cache.get("b"), cache.get("c")) == (b"1234", None, b"1234")
    assert cache.bytes == 8 and len(cache) == 2
    cache.put("huge", b"x" * 11)  # larger than the whole budget: not kept, nothing evicted
    assert cache.get("huge") is None and len(cache) == 2


async def test_concurrent_misses_share_one_computation_and_a_giving_up_caller_cancels_nothing() -> None:
    cache: EmbeddingCache[str] = EmbeddingCache(1000, len)
    calls = 0
    release = asyncio.Event()

    async def compute() -> str:
        nonlocal calls
        calls += 1
        await release.wait()
        return "value"

    impatient = asyncio.ensure_future(asyncio.wait_for(cache.get_or_compute("k", compute), 0.05))
    patient = asyncio.ensure_future(cache.get_or_compute("k", compute))
    with pytest.raises(TimeoutError):
        await impatient
    release.set()
    assert (await patient)[0] == "value"
    assert calls == 1  # one computation, which the impatient caller's timeout did not cancel
    assert await cache.get_or_compute("k", compute) == ("value", True)


async def test_a_failed_computation_reaches_its_waiters_and_is_not_cached() -> None:
    cache: EmbeddingCache[str] = EmbeddingCache(1000, len)

    async def fail() -> str:
        await asyncio.sleep(0)
        raise ValueError("bad image")

    results = await asyncio.gather(*(cache.get_or_compute("k", fail) for _ in range(3)), return_exceptions=True)
    assert all(isinstance(r, ValueError) for r in results)
    assert cache.get("k") is None


# --- batcher ----------------------------------------------------------------------------------------


class RecordingTower(VisionTower):
    """A real (trivial) torch tower that records the batches it is given."""

    def __init__(self, delay: float = 0.0) -> None:
        self.info = TowerInfo("recording", "test", "recording/v1", hidden_size=2)
        self.device, self.dtype = torch.device("cpu"), torch.float32
        self.batches: list[int] = []
        self.delay = delay

    def prepare(self, image: Image.Image) -> Prepared:
        raise NotImplementedError

    def forward(self, batch: Sequence[Prepared]) -> list[Encoded]:
        import time

        time.sleep(self.delay)
        self.batches.append(len(batch))
        return [Encoded(p.pixels.float().reshape(-1, 2)) for p in batch]


async def until_running(batcher: DynamicBatcher) -> None:
    """Wait (bounded) until a batch is on the device."""
    for _ in range(500):
        if batcher.running:
            return
        await asyncio.sleep(0.01)
    raise AssertionError("no batch started")


def job(tokens: int = 1, value: int = 0) -> Prepared:
    return Prepared(torch.full((2 * tokens,), value, dtype=torch.uint8), tokens)


async def test_queued_images_ride_together_up_to_the_size_and_token_limits() -> None:
    tower = RecordingTower(delay=0.5)
    batcher = DynamicBatcher(tower, max_batch_size=4, max_batch_tokens=6)
    batcher.start()
    try:
        first = asyncio.ensure_future(batcher.submit(job()))
        await until_running(batcher)  # the first batch (1 image) is on the device now
        rest = [asyncio.ensure_future(batcher.submit(job(tokens=2, value=i))) for i in range(6)]
        results = await asyncio.gather(first, *rest)
    finally:
        await batcher.stop()
    assert tower.batches == [1, 3, 3]  # 3 images x 2 tokens = 6: the token budget cuts before 4 images
    assert [int(r.embeds[0, 0]) for r in results[1:]] == list(range(6))  # each caller gets its own row


async def test_a_delay_lets_a_lone_request_wait_for_company() -> None:
    tower = RecordingTower()
    batcher = DynamicBatcher(tower, max_batch_size=8, max_batch_delay_ms=100)
    batcher.start()
    try:
        first = asyncio.ensure_future(batcher.submit(job()))
        await asyncio.sleep(0.01)
        await asyncio.gather(first, batcher.submit(job()))
    finally:
        await batcher.stop()
    assert tower.batches == [2]


async def test_the_queue_is_bounded_and_timed_out_jobs_are_skipped() -> None:
    tower = RecordingTower(delay=0.3)
    batcher = DynamicBatcher(tower, max_batch_size=1, max_queue=2)
    batcher.start()
    try:
        running = asyncio.ensure_future(batcher.submit(job()))
        await until_running(batcher)
        stale = asyncio.ensure_future(batcher.submit(job(), timeout=0.05))
        kept = asyncio.ensure_future(batcher.submit(job()))
        await asyncio.sleep(0)
        with pytest.raises(QueueFullError):
            await batcher.submit(job())
        with pytest.raises(TimeoutError):
            await stale
        await asyncio.gather(running, kept)
    finally:
        await batcher.stop()
    assert tower.batches == [1, 1]  # the timed-out job never reached the device


async def test_a_forward_that_fails_fails_its_batch_and_the_batcher_goes_on() -> None:
    class Flaky(RecordingTower):
        def forward(self, batch: Sequence[Prepared]) -> list[Encoded]:
            if not self.batches:
                self.batches.append(-1)
                raise RuntimeError("CUDA out of memory (simulated)")
            return super().forward(batch)

    batcher = DynamicBatcher(Flaky(), max_batch_size=4)
    batcher.start()
    try:
        with pytest.raises(RuntimeError, match="out of memory"):
            await batcher.submit(job())
        assert (await batcher.submit(job(value=7))).embeds[0, 0] == 7
    finally:
        await batcher.stop()


# --- server: timeouts and the Qwen2-VL dict form --------------------------------------------------


async def test_an_encode_over_its_timeout_is_504(backend_factory) -> None:
    backend = await backend_factory(timeout_s=0.001)
    async with aiohttp.ClientSession() as session:
        async with session.post(f"{backend.url}/v1/encode", data=png((1, 1, 1), size=(512, 512))) as resp:
            assert resp.status == 504
            assert (await resp.json())["error"]["code"] == "encoder_timeout"
    assert backend.sample("vision_encoder_images_total", result="timeout") == 1


async def test_a_qwen2_5_vl_backend_replies_with_vllms_dict_form(tmp_path: Path) -> None:
    from tests.backends.test_towers import save_qwen

    save_qwen(tmp_path)
    app = build(str(tmp_path), device="cpu", registry=CollectorRegistry())
    server = TestServer(app, host="127.0.0.1", port=0)
    await server.start_server()
    try:
        async with aiohttp.ClientSession() as session:
            async with session.post(server.make_url("/v1/encode"), data=png(size=(56, 84))) as resp:
                assert resp.status == 200
                reply = await resp.json()
    finally:
        await server.close()
    value = reply["image_embeds"]
    assert set(value) == {"image_embeds", "image_grid_thw"}
    embeds = torch.load(io.BytesIO(base64.b64decode(value["image_embeds"])), weights_only=True)
    grid = torch.load(io.BytesIO(base64.b64decode(value["image_grid_thw"])), weights_only=True)
    t, h, w = reply["image_grid_thw"]
    assert grid.tolist() == [t, h, w] and grid.dtype == torch.int64
    assert embeds.dim() == 2 and embeds.shape[0] == t * h * w // 4 == reply["tokens"]


async def test_formats_outside_the_allowed_set_are_refused(backend_factory) -> None:
    backend = await backend_factory()
    buffer = io.BytesIO()
    Image.new("RGB", (8, 8)).save(buffer, "PPM")  # Pillow reads it; the backend does not take it
    async with aiohttp.ClientSession() as session:
        async with session.post(f"{backend.url}/v1/encode", data=buffer.getvalue()) as resp:
            assert resp.status == 400
            assert "unrecognized format" in (await resp.json())["error"]["message"]


async def test_a_stalled_batcher_makes_health_fail(backend_factory) -> None:
    backend = await backend_factory(timeout_s=0.2)
    backend.service.batcher.running = 1  # as if a forward pass had hung
    backend.service.batcher.last_progress -= 5
    async with aiohttp.ClientSession() as session:
        async with session.get(f"{backend.url}/health") as resp:
            assert resp.status == 503
            assert (await resp.json())["error"]["code"] == "encoder_unhealthy"
    backend.service.batcher.running = 0


# --- the decode budget ------------------------------------------------------------------------------


class PairingTower(RecordingTower):
    """prepare() waits for a partner (so two decodes must overlap) and records how many overlap."""

    def __init__(self) -> None:
        super().__init__()
        self.budget = PixelBudget(1)  # the service's, once there is one
        self.pairs = threading.Barrier(2, timeout=5)
        self.lock = threading.Lock()
        self.active = self.most_active = self.most_pixels = 0

    def prepare(self, image: Image.Image) -> Prepared:
        with self.lock:
            self.active += 1
            self.most_active = max(self.most_active, self.active)
            self.most_pixels = max(self.most_pixels, self.budget.in_flight)
        try:
            self.pairs.wait()  # a budget that let only one through would break this barrier
        finally:
            with self.lock:
                self.active -= 1
        return job()


async def test_concurrent_decodes_stay_within_the_pixel_budget() -> None:
    side = 100
    limits = DecodeLimits(budget_pixels=2 * side * side + 1)  # room for two images, not three
    tower = PairingTower()
    batcher = DynamicBatcher(tower)
    service = EncoderService(tower, batcher, cache_bytes=1 << 20, timeout_s=5, limits=limits, threads=6)
    tower.budget = service.decode_budget
    batcher.start()
    try:
        images = [png((i, 0, 0), size=(side, side)) for i in range(6)]
        await asyncio.gather(*(service.encode(image) for image in images))
    finally:
        await batcher.stop()
        service.close()
    assert tower.most_active == 2  # six threads were free, but the budget let two decode at once
    assert tower.most_pixels == 2 * side * side
    assert service.decode_budget.in_flight == 0 and service.decode_budget.waiting == 0


async def test_an_image_larger_than_the_whole_budget_is_decoded_alone() -> None:
    tower = BuiltinViT(torch.device("cpu"), torch.float32)
    batcher = DynamicBatcher(tower)
    limits = DecodeLimits(max_pixels=10_000, budget_pixels=100)
    service = EncoderService(tower, batcher, cache_bytes=1 << 20, timeout_s=5, limits=limits)
    batcher.start()
    try:
        reply, cached = await service.encode(png(size=(100, 100)))
    finally:
        await batcher.stop()
        service.close()
    assert (reply.tokens, cached) == (196, False) and service.decode_budget.in_flight == 0

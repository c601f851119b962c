"""The encoder backend over HTTP: encode, cache, errors, health, metrics, queue limits."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import io
from typing import Any

import aiohttp
import pytest
import torch

from tests.backends.fixtures import RGBA_BOMB, SLIVER, Backend, png
from tests.images import flat_png


def load_embeds(value: str) -> torch.Tensor:
    """As vLLM does: base64 -> torch.load(weights_only=True)."""
    return torch.load(io.BytesIO(base64.b64decode(value)), weights_only=True)


async def post(backend: Backend, data: bytes) -> tuple[int, dict[str, Any]]:
    async with aiohttp.ClientSession() as session:
        async with session.post(f"{backend.url}/v1/encode", data=data) as resp:
            return resp.status, await resp.json()


async def test_encode_returns_vllm_ready_embeddings(backend_factory) -> None:
    backend = await backend_factory()
    image = png()
    status, reply = await post(backend, image)
    assert status == 200
    assert reply["sha256"] == hashlib.sha256(image).hexdigest()
    assert (reply["tokens"], reply["hidden"], reply["dtype"]) == (196, 384, "float32")
    assert reply["model"] == "builtin:vit-small/v1/seed0/float32"
    assert reply["image_grid_thw"] is None and reply["cached"] is False
    tensor = load_embeds(reply["image_embeds"])
    assert tensor.shape == (196, 384) and tensor.dtype == torch.float32
    assert tensor.is_contiguous() and not tensor.is_sparse
    # the pickle holds this tensor's elements only, not a whole batch's storage
    assert tensor.untyped_storage().nbytes() == 196 * 384 * 4


async def test_a_cache_hit_skips_the_forward(backend_factory) -> None:
    backend = await backend_factory()
    image = png()
    _, first = await post(backend, image)
    _, second = await post(backend, image)
    assert second["cached"] is True and second["image_embeds"] == first["image_embeds"]
    assert backend.sample("vision_encoder_cache_hits_total") == 1
    assert backend.sample("vision_encoder_cache_misses_total") == 1
    assert backend.sample("vision_encoder_batch_size_count") == 1  # one forward pass in all
    assert backend.sample("vision_encoder_images_total", result="cached") == 1


async def test_concurrent_requests_for_one_image_share_one_computation(backend_factory) -> None:
    backend = await backend_factory()
    image = png((1, 2, 3))
    replies = await asyncio.gather(*(post(backend, image) for _ in range(6)))
    assert {r[1]["image_embeds"] for r in replies} == {replies[0][1]["image_embeds"]}
    assert backend.sample("vision_encoder_cache_misses_total") == 1
    assert backend.sample("vision_encoder_cache_hits_total") == 5
    assert backend.sample("vision_encoder_batch_size_sum") == 1


async def test_concurrent_distinct_images_are_batched(backend_factory) -> None:
    backend = await backend_factory(max_batch_size=8)
    images = [png((i, 0, 0)) for i in range(12)]
    replies = await asyncio.gather(*(post(backend, image) for image in images))
    assert all(status == 200 for status, _ in replies)
    batches = backend.sample("vision_encoder_batch_size_count")
    assert backend.sample("vision_encoder_batch_size_sum") == 12
    assert batches < 12  # requests that queued behind a running batch went together


@pytest.mark.parametrize(
    ("data", "fragment"),
    ids=["empty", "garbage", "truncated"],
    argvalues=[
        (b"", "empty image"),
        (b"not an image at all", "not a decodable image"),
        (png(size=(256, 256))[:-60], "corrupt image"),
    ],
)
async def test_undecodable_images_are_a_clear_400(backend_factory, data, fragment) -> None:
    backend = await backend_factory()
    status, reply = await post(backend, data)
    assert status == 400
    assert reply["error"]["code"] == "invalid_image" and fragment in reply["error"]["message"]
    assert backend.sample("vision_encoder_images_total", result="invalid") == 1
    status, _ = await post(backend, png())  # and it keeps serving
    assert status == 200


async def test_images_over_the_pixel_cap_are_refused_before_decoding(backend_factory) -> None:
    backend = await backend_factory(max_pixels=1000)
    status, reply = await post(backend, png(size=(100, 100)))
    assert status == 400 and "over the cap of 1000" in reply["error"]["message"]


@pytest.mark.parametrize(
    ("image", "options", "message"),
    [
        (RGBA_BOMB, {}, "image is 7071x7071 = 49999041 pixels, over the cap of 33554432"),
        (SLIVER, {}, "image is 1x40000000 = 40000000 pixels, over the cap of 33554432"),
        (SLIVER, {"max_pixels": 50_000_000}, "image is 1x40000000, an aspect ratio over the cap of 200"),
    ],
    ids=["rgba bomb", "sliver", "sliver under the pixel cap"],
)
async def test_image_bombs_are_a_400(backend_factory, image, options, message) -> None:
    backend = await backend_factory(**options)
    status, reply = await post(backend, flat_png(*image))
    assert (status, reply["error"]["code"], reply["error"]["message"]) == (400, "invalid_image", message)
    assert backend.sample("vision_encoder_images_total", result="invalid") == 1
    assert backend.service.decode_budget.in_flight == 0  # refused from the header: never held any


async def test_bodies_over_the_byte_limit_are_413(backend_factory) -> None:
    backend = await backend_factory(max_image_bytes=1024)
    status, reply = await post(backend, b"x" * 4096)
    assert status == 413 and reply["error"]["code"] == "payload_too_large"


async def test_a_full_queue_is_503_with_retry_after(backend_factory) -> None:
    backend = await backend_factory(max_queue=0)
    async with aiohttp.ClientSession() as session:
        async with session.post(f"{backend.url}/v1/encode", data=png()) as resp:
            assert resp.status == 503 and resp.headers["Retry-After"] == "1"
            assert (await resp.json())["error"]["code"] == "encoder_overloaded"


async def test_health_runs_a_real_encode_and_says_the_weights_are_demo(backend_factory) -> None:
    backend = await backend_factory()
    async with aiohttp.ClientSession() as session:
        async with session.get(f"{backend.url}/health") as resp:
            assert resp.status == 200
            health = await resp.json()
    assert health["demo_weights"] is True and "random demo weights" in health["note"]
    assert health["check"].startswith("encoded a 32x32 image to 196x384")
    assert health["device"] == "cpu" and health["model"] == "builtin:vit-small"
    assert health["decode"] == {"pixels": 0, "budget_pixels": 1 << 26, "waiting": 0}


async def test_metrics_endpoint_exposes_the_contract_names(backend_factory) -> None:
    backend = await backend_factory()
    await post(backend, png())
    async with aiohttp.ClientSession() as session:
        async with session.get(f"{backend.url}/metrics") as resp:
            text = await resp.text()
    for name in (
        'vision_encoder_images_total{result="ok"} 1.0',
        "vision_encoder_batch_size_bucket",
        "vision_encoder_queue_seconds_bucket",
        "vision_encoder_forward_seconds_bucket",
        "vision_encoder_cache_hits_total 0.0",
        "vision_encoder_cache_misses_total 1.0",
        "vision_encoder_decode_pixels 0.0",
        "vision_encoder_decode_waiting 0.0",
    ):
        assert name in text

"""The encode pipeline: bytes -> sha256 -> cache -> header (thread) -> decode budget ->
decode/prepare (thread) -> batcher -> reply.

The reply is what the gateway splices into the chat request unchanged: vLLM's ``image_embeds``
value, base64 of ``torch.save(tensor)`` (or, for the Qwen2-VL family, vLLM's dict form with
``image_grid_thw``). The backend has torch and the gateway must not, so the serialization vLLM
needs happens here, once per distinct image; the gateway never decodes, unpickles or re-encodes
embeddings. See docs/encoder.md for the API and the reasons.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import io
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch
from PIL import Image

from .batching import DynamicBatcher, QueueFullError
from .cache import EmbeddingCache
from .limits import DecodeLimits, PixelBudget
from .preprocess import load_rgb, open_image
from .towers import Encoded, Prepared, VisionTower

HASH_IN_THREAD_BYTES = 1 << 20  # hashing bigger bodies would hold the event loop for a millisecond or more


@dataclass(frozen=True)
class Reply:
    """One encoded image, ready to send (cached as is)."""

    sha256: str
    tokens: int
    hidden: int
    grid_thw: tuple[int, int, int] | None
    image_embeds: str | dict[str, str]  # exactly vLLM's image_embeds value

    @property
    def nbytes(self) -> int:
        value = self.image_embeds
        return len(value) if isinstance(value, str) else sum(len(v) for v in value.values())

    def to_json(self, *, model: str, dtype: str, cached: bool) -> dict[str, Any]:
        return {
            "model": model,
            "sha256": self.sha256,
            "tokens": self.tokens,
            "hidden": self.hidden,
            "dtype": dtype,
            "image_grid_thw": list(self.grid_thw) if self.grid_thw else None,
            "image_embeds": self.image_embeds,
            "cached": cached,
        }


def serialize_tensor(tensor: torch.Tensor) -> str:
    """base64 of torch.save(tensor), of the tensor's own elements only (never a larger storage)."""
    tensor = tensor.detach().to("cpu").contiguous()
    if tensor.storage_offset() != 0 or tensor.untyped_storage().nbytes() != tensor.numel() * tensor.element_size():
        tensor = tensor.clone()
    buffer = io.BytesIO()
    torch.save(tensor, buffer)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def to_reply(sha: str, encoded: Encoded) -> Reply:
    embeds = encoded.embeds
    value: str | dict[str, str]
    if encoded.grid_thw is None:
        value = serialize_tensor(embeds)
    else:
        # (3,): one image's (t, h, w). vLLM's dict form is one item a part, and its Qwen2-VL field
        # factory (model_executor/models/qwen2_vl.py) stacks the parts' grids itself; a (1, 3) grid
        # is refused there ("size_per_item should be a 1-D tensor")
        grid = torch.tensor(encoded.grid_thw, dtype=torch.int64)
        value = {"image_embeds": serialize_tensor(embeds), "image_grid_thw": serialize_tensor(grid)}
    return Reply(sha, embeds.shape[0], embeds.shape[1], encoded.grid_thw, value)


class EncoderService:
    def __init__(
        self,
        tower: VisionTower,
        batcher: DynamicBatcher,
        *,
        cache_bytes: int,
        timeout_s: float,
        limits: DecodeLimits | None = None,
        threads: int | None = None,
    ) -> None:
        self.tower = tower
        self.batcher = batcher
        self.cache: EmbeddingCache[Reply] = EmbeddingCache(cache_bytes, lambda r: r.nbytes)
        self.limits = limits or DecodeLimits()
        self.decode_budget = PixelBudget(self.limits.budget_pixels)
        self.timeout_s = timeout_s
        self.pool = ThreadPoolExecutor(max_workers=threads or os.cpu_count() or 1, thread_name_prefix="encoder-prep")
        self.dtype = str(tower.dtype).removeprefix("torch.")
        self.in_flight = 0
        self.max_in_flight = batcher.max_queue + batcher.max_batch_size

    async def encode(self, data: bytes) -> tuple[Reply, bool]:
        """(reply, cached). Raises ImageError, QueueFullError, TimeoutError."""
        # Bound everything in the pipeline (hashing, decoding, waiting for a batch), not only the
        # batch queue: bodies and decode jobs would otherwise pile up without limit under overload.
        if self.in_flight >= self.max_in_flight:
            raise QueueFullError(f"encoder is full ({self.in_flight} images in progress)")
        self.in_flight += 1
        try:
            return await self._encode(data)
        finally:
            self.in_flight -= 1

    async def _encode(self, data: bytes) -> tuple[Reply, bool]:
        loop = asyncio.get_running_loop()
        if len(data) > HASH_IN_THREAD_BYTES:
            sha = await loop.run_in_executor(self.pool, _sha256, data)
        else:
            sha = _sha256(data)
        key = f"{self.tower.info.fingerprint}/{sha}"
        return await self.cache.get_or_compute(key, lambda: self._compute(sha, data))

    async def encode_uncached(self, data: bytes) -> Reply:
        return await self._compute(_sha256(data), data)

    async def _compute(self, sha: str, data: bytes) -> Reply:
        loop = asyncio.get_running_loop()
        image = await loop.run_in_executor(self.pool, self._open, data)
        prepared = await self._prepare(image)
        encoded = await self.batcher.submit(prepared, timeout=self.timeout_s)
        return await loop.run_in_executor(self.pool, to_reply, sha, encoded)

    def _open(self, data: bytes) -> Image.Image:
        return open_image(data, max_pixels=self.limits.max_pixels, max_aspect_ratio=self.limits.max_aspect_ratio)

    async def _prepare(self, image: Image.Image) -> Prepared:
        """Decode and prepare on the pool, holding the image's pixels in the decode budget."""
        loop = asyncio.get_running_loop()
        pixels = image.width * image.height
        await self.decode_budget.acquire(pixels)
        try:
            job = self.pool.submit(self._decode_and_prepare, image)
        except BaseException:  # the pool is shut down
            self.decode_budget.release(pixels)
            raise
        # Released when the thread is done, not when this coroutine stops waiting: a cancelled
        # waiter leaves the decode running, and its pixels are held until it ends.
        job.add_done_callback(lambda _: _call_soon(loop, self.decode_budget.release, pixels))
        return await asyncio.wrap_future(job)

    def _decode_and_prepare(self, image: Image.Image) -> Prepared:
        return self.tower.prepare(load_rgb(image))

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)


def _call_soon(loop: asyncio.AbstractEventLoop, callback: Callable[[int], None], arg: int) -> None:
    try:
        loop.call_soon_threadsafe(callback, arg)
    except RuntimeError:  # the loop is closed: at shutdown there is no budget left to keep
        pass


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()

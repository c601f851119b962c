"""What decoding may cost: per image (:class:`DecodeLimits`) and over all requests (:class:`PixelBudget`).

Decoding is where a small body turns into a large allocation: a 200 KB PNG can state 50 MP, and
Pillow then holds 4 bytes a pixel, and more while converting. The per-image caps are checked from
the header, before any pixel is decoded (``preprocess.open_image``). The budget bounds what all
images being decoded cost together (a weighted semaphore over their pixels), so that N large images
sent at once queue for the decode threads instead of all holding their decoded pixels at the same
time. An image is weighed by the pixels its header states. Waiters go first come, first served: a
large image at the head is not overtaken by a stream of small ones, which would starve it. An image
larger than the whole budget (but under the pixel cap) goes when nothing else is being decoded,
alone, so it is slow rather than refused.
"""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass

# 32 MP (2**25) takes what phones and cameras save by default (24 MP iPhones, 6000x4000 cameras),
# far above what any of our towers keeps (Qwen2.5-VL's processor downsizes to 12.8 MP at most,
# SigLIP/CLIP to well under 1 MP). Pillow keeps RGB and RGBA alike in 4 bytes a pixel, and decoding
# holds two copies at most (the decoded image, and its RGB conversion or EXIF rotation): 256 MiB at
# this cap. The old cap, 50 MP, let one 200 KB PNG cost 760 MB.
MAX_PIXELS = 1 << 25
MAX_ASPECT_RATIO = 200.0  # Qwen2-VL's smart_resize refuses more; no photo or screenshot comes near it
DECODE_BUDGET_PIXELS = 1 << 26  # two images at the cap, or many ordinary ones: about 0.5 GB at worst


@dataclass(frozen=True, slots=True)
class DecodeLimits:
    """The backend's decode limits (``--max-pixels``, ``--max-aspect-ratio``, ``--decode-budget-pixels``)."""

    max_pixels: int = MAX_PIXELS
    max_aspect_ratio: float = MAX_ASPECT_RATIO
    budget_pixels: int = DECODE_BUDGET_PIXELS

    def __post_init__(self) -> None:
        for name in ("max_pixels", "max_aspect_ratio", "budget_pixels"):
            value = getattr(self, name)
            if not value >= 1:  # also refuses nan
                raise ValueError(f"{name} must be at least 1, got {value!r}")


class PixelBudget:
    """Pixels being decoded at once: :meth:`acquire` waits for room, :meth:`release` gives it back."""

    def __init__(self, limit: int) -> None:
        if limit < 1:
            raise ValueError(f"the decode budget must be at least 1 pixel, got {limit}")
        self.limit = limit
        self.in_flight = 0  # pixels granted and not yet released
        self._waiters: deque[tuple[int, asyncio.Future[None]]] = deque()

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    async def acquire(self, pixels: int) -> None:
        if not self._waiters and self._fits(pixels):
            self.in_flight += pixels
            return
        entry = (pixels, asyncio.get_running_loop().create_future())
        self._waiters.append(entry)
        try:
            await entry[1]
        except asyncio.CancelledError:
            if entry[1].done() and not entry[1].cancelled():  # granted, but its owner is gone
                self.release(pixels)
            else:
                if entry in self._waiters:  # _grant may have dropped it already
                    self._waiters.remove(entry)
                self._grant()  # a waiter that left the head may have been all that blocked the next
            raise

    def release(self, pixels: int) -> None:
        self.in_flight -= pixels
        self._grant()

    def _fits(self, pixels: int) -> bool:
        return self.in_flight == 0 or self.in_flight + pixels <= self.limit

    def _grant(self) -> None:
        while self._waiters:
            pixels, future = self._waiters[0]
            if future.done():  # cancelled, and its task has not run yet to leave the queue
                self._waiters.popleft()
                continue
            if not self._fits(pixels):
                return
            self._waiters.popleft()
            self.in_flight += pixels
            future.set_result(None)

"""Images made smaller before they are sent: ``on_oversize: downscale``.

Admission sized each image from its header and chose the size it goes at
(gateway.admission.visual); here its bytes are decoded, turned upright by its EXIF orientation
where admission read one (a JPEG's; a format Pillow sized, gateway.media.opened; PNG, WebP, GIF
and BMP orientations are neither read nor applied), resized to that size (the aspect kept) and
written again in its own format where that is a photo's or a screenshot's (JPEG, MPO as JPEG,
PNG, WebP; the others, GIF, BMP, TIFF, AVIF..., become PNG), as a data URL that takes the part's
place. Off the event loop, on the video decoders' threads
(gateway.media.decoders), under the backend's decode bound: a JPEG is decoded at the smallest of
its DCT scales (1/2, 1/4, 1/8) that still covers the target, and nothing decodes to more than
:data:`MAX_DECODED_PIXELS` (nor opens past Pillow's own bound, ~179 MP): ``image_too_large``.
Bytes Pillow cannot decode are ``invalid_image``.

Pillow, the field's standard for this (vLLM and the Hugging Face processors open images with
it), is imported when the first image is downscaled.
"""

from __future__ import annotations

import base64
import functools
import io
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..admission.parts import Part
from ..admission.route import RoutePlan
from ..errors import ImageTooLargeError, InvalidImageError, Rejection
from ..metrics import GatewayMetrics
from . import opened
from .conversions import ConversionCache
from .decoders import DecoderPool
from .fetch import decode_data_url, sha256

Replacements = dict[tuple[int, int], dict[str, Any]]  # (place, index) -> the part that takes its place

MAX_DECODED_PIXELS = 1 << 25  # the vision backend's own bound (backends/vision_encoder/limits.py)
JPEG_QUALITY = 90
# written as they came, else as PNG (lossless, what a screenshot needs)
KEPT_FORMATS = {"jpeg": ("JPEG", "image/jpeg"), "png": ("PNG", "image/png"), "webp": ("WEBP", "image/webp")}


@dataclass(frozen=True, slots=True)
class Downscaled:
    data: bytes
    media_type: str
    width: int
    height: int


class TooLarge(ValueError):
    """An image past what the gateway decodes."""


class Undecodable(ValueError):
    """Bytes Pillow cannot decode (truncated, corrupt, not the image their header says)."""


def downscale(data: bytes, size: tuple[int, int], stop: threading.Event | None = None) -> Downscaled:
    """``data`` decoded, upright, resized to ``size`` (width, height, as shown) and written again.
    :class:`TooLarge` past the decode bound, :class:`Undecodable` for bytes Pillow cannot read."""
    from PIL import Image

    try:
        return _downscale(data, size, stop)
    except Image.DecompressionBombError as exc:  # over Pillow's own bound (~179 MP) at open
        raise TooLarge(str(exc)) from None
    except (TooLarge, Undecodable):
        raise
    except Exception as exc:  # UnidentifiedImageError is an OSError; a truncated QOI's ValueError, AVIF's RuntimeError
        raise Undecodable(f"it cannot be decoded ({exc})") from None


def _downscale(data: bytes, size: tuple[int, int], stop: threading.Event | None) -> Downscaled:
    from PIL import Image, ImageOps

    width, height = size
    with Image.open(io.BytesIO(data)) as image:
        fmt = (image.format or "").lower()
        jpeg = fmt in ("jpeg", "mpo")  # a phone's photo with its MPF data opens as MPO
        # EXIF orientation as admission reads it: a JPEG's (gateway.admission.dimensions), and that
        # of the other formats Pillow sizes (gateway.media.opened; TIFF's plugin turns it itself)
        oriented = jpeg or opened.turned_by_exif(fmt)
        turned = oriented and image.getexif().get(0x0112, 1) in (5, 6, 7, 8)
        stored = (height, width) if turned else (width, height)  # the target as the pixels lie
        if jpeg:
            image.draft(image.mode if image.mode in ("RGB", "L") else "RGB", stored)  # a DCT scale that covers it
        if image.size[0] * image.size[1] > MAX_DECODED_PIXELS:
            raise TooLarge(f"{image.size[0]}x{image.size[1]} is over the {MAX_DECODED_PIXELS} pixels decoded at most")
        if stop is not None and stop.is_set():
            raise TooLarge("nobody waits for it any more")
        image.load()
        upright = ImageOps.exif_transpose(image) if oriented else image
        if upright.mode not in ("RGB", "RGBA", "L", "LA"):
            upright = upright.convert("RGBA" if "transparency" in upright.info or "A" in upright.mode else "RGB")
        smaller = upright.resize((width, height), Image.Resampling.LANCZOS, reducing_gap=3.0)
    writer, media_type = KEPT_FORMATS.get("jpeg" if jpeg else fmt, ("PNG", "image/png"))
    if writer == "JPEG" and smaller.mode not in ("RGB", "L"):
        smaller = smaller.convert("RGB")
    out = io.BytesIO()
    options: dict[str, Any] = {"quality": JPEG_QUALITY} if writer in ("JPEG", "WEBP") else {"optimize": False}
    smaller.save(out, writer, **options)
    return Downscaled(out.getvalue(), media_type, width, height)


@dataclass(frozen=True, slots=True)
class Resizing:
    """What downscaling needs of the process: its decoder threads, its conversions cache, its metrics."""

    decoders: DecoderPool
    cache: ConversionCache
    metrics: GatewayMetrics
    max_bytes: int  # media.max_image_bytes: a data URL's decoded bytes at most


async def downscale_for(
    plan: RoutePlan, body: dict[str, Any], resizing: Resizing, fetched: Mapping[tuple[int, int], bytes]
) -> Replacements:
    """Each image the plan downscales, resized, as the part that replaces it: the same part with
    its bytes in a data URL of the new size (Anthropic's: a base64 source). A conversation sends
    its screenshots again every turn: each is resized once per process, then taken from the
    conversions cache (``("downscale", width, height, sha256)``), the same bytes every turn."""
    assert plan.visual is not None
    contents = plan.contents(body)
    replacements: Replacements = {}
    for sized in plan.visual.downscaled:
        part = sized.part
        assert part.index is not None and sized.downscale is not None
        original = contents[part.message].value[part.index]
        data = fetched.get((part.message, part.index)) or bytes_of(original, part, resizing.max_bytes)
        target = sized.downscale
        make = functools.partial(resizing.decoders.run, functools.partial(downscale, data, target))
        try:
            if resizing.cache.enabled:
                key = ("downscale", *target, await sha256(data))
                made = await resizing.cache.get_or_make(key, make, lambda d: len(d.data), shared_errors=(ValueError,))
            else:
                made = await make()
        except (Undecodable, TooLarge) as exc:
            error, reason = (InvalidImageError, "invalid_content") if isinstance(exc, Undecodable) else (
                ImageTooLargeError, "image_too_large")  # fmt: skip
            raise error(
                f"Image at {part.location} cannot be downscaled for model '{plan.model.name}': {exc}",
                param=part.location,
                rejection=Rejection(plan.model.name, "image", reason),
            ) from None
        resizing.metrics.images_downscaled.labels(plan.model.name).inc()
        replacements[(part.message, part.index)] = _replaced(original, made)
    return replacements


def bytes_of(part: Mapping[str, Any], where: Part, max_bytes: int) -> bytes:
    """An inline image part's bytes (a data URL's, or Anthropic's base64 source's)."""
    if part.get("type") == "image":  # Anthropic's base64 source
        encoded = part["source"]["data"]
        try:
            return base64.b64decode(encoded, validate=False)
        except ValueError:
            raise InvalidImageError(f"Image at {where.location} is not valid base64", param=where.location) from None
    url = part["image_url"]
    url = url["url"] if isinstance(url, Mapping) else url
    return decode_data_url(url, max_bytes=max_bytes)


def _replaced(part: Mapping[str, Any], made: Downscaled) -> dict[str, Any]:
    """The part again, its image the smaller one (its other keys, ``detail`` say, kept)."""
    return with_bytes(part, made.data, made.media_type)


def with_bytes(part: Mapping[str, Any], data: bytes, media_type: str) -> dict[str, Any]:
    """An image part with ``data`` inline: a data URL, or Anthropic's base64 source."""
    encoded = base64.b64encode(data).decode()
    new = dict(part)
    if part.get("type") == "image":  # a base64 source, whatever it was (a URL fetched)
        new["source"] = {"type": "base64", "media_type": media_type, "data": encoded}
        return new
    url = f"data:{media_type};base64,{encoded}"
    image_url = part["image_url"]
    new["image_url"] = {**image_url, "url": url} if isinstance(image_url, Mapping) else url
    return new

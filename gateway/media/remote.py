"""Images sized after admission: remote ones by their header (``visual_tokens: {remote: fetch}``),
inline ones of formats the header reader does not know as Pillow opens them (gateway.media.opened).

Admission has no bytes of an image the client sent as a URL; for a model with ``remote: fetch``
the gateway fetches each such image with its media fetcher (the request's ``media:`` rules:
SSRF-safe, ``allow_domains``, ``max_image_bytes``, ``fetch_timeout_s``), reads its header, and
measures the plan again with what it found (gateway.admission.visual): the limits hold, and an
image over them is downscaled or refused, before any engine is touched. Either way the engine
gets the bytes the gateway measured, inline (a data URL; Anthropic's base64 source): sent on as
the URL, a server could answer the engine's fetch with another, larger image than the gateway's.
A request's images are fetched one after another, as the encoder fetches them.

An inline image of another format (TIFF, ICO, AVIF...) is opened by Pillow on a decoding thread
(header only), and measured again the same way; it goes on as the client sent it.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from typing import Any

from ..admission.dimensions import BadImage, Dimensions, NeedMore, read_dimensions
from ..admission.parts import Part
from ..admission.route import RoutePlan
from ..admission.visual import image_source, measure
from ..config import MediaConfig
from ..errors import GatewayError, ImageTooLargeError, InvalidImageError, Rejection
from ..modalities import Modality
from . import opened
from .decoders import DecoderPool
from .downscale import Replacements, bytes_of, with_bytes
from .fetch import MediaFetcher


async def sized(
    plan: RoutePlan, body: dict[str, Any], fetcher: MediaFetcher, media: MediaConfig, decoders: DecoderPool
) -> tuple[RoutePlan, dict[tuple[int, int], bytes]]:
    """The plan measured again with each remote image's header fetched, and each inline image of
    another format opened, and the bytes fetched (by (place, index): a downscale resizes them)."""
    assert plan.visual is not None
    contents = plan.contents(body)
    headers: dict[tuple[int, int], Dimensions] = {}
    fetched: dict[tuple[int, int], bytes] = {}
    for image in plan.visual.to_fetch:
        part = image.part
        assert part.index is not None
        value = contents[part.message].value[part.index]
        if image.source == "open":
            headers[(part.message, part.index)] = await _opened(plan, value, part, media, decoders)
            continue
        url = image_source(value, image.part.type)
        assert isinstance(url, str)  # measured as a remote image: a URL
        try:
            data = await fetcher.load(url, "image", media)
        except GatewayError as exc:
            raise exc.located_at(part.location, rejection=_refused(plan, exc)) from None
        try:
            headers[(part.message, part.index)] = read_dimensions(data)
        except (BadImage, NeedMore) as exc:  # NeedMore: the whole file is less than a header
            reason = "the image ends before its header does" if isinstance(exc, NeedMore) else str(exc)
            raise InvalidImageError(
                f"Image at {part.location} cannot be read: {reason}",
                param=part.location,
                rejection=Rejection(plan.model.name, Modality.IMAGE.value, "invalid_content"),
            ) from None
        fetched[(part.message, part.index)] = data
    images = [s.part for s in plan.visual.images]
    visual = measure(plan.model, images, contents, headers)
    return dataclasses.replace(plan, visual=visual), fetched


def inline(plan: RoutePlan, body: dict[str, Any], fetched: Mapping[tuple[int, int], bytes]) -> Replacements:
    """Each fetched image the plan does not downscale, as the part that replaces it: its bytes
    inline, the part's other keys kept."""
    assert plan.visual is not None
    contents = plan.contents(body)
    formats = {(s.part.message, s.part.index): s.format for s in plan.visual.images}
    replacements: Replacements = {}
    for (i, j), data in fetched.items():
        if (i, j) in plan.visual.downscaled_at:
            continue
        media_type = f"image/{formats.get((i, j)) or 'png'}"
        replacements[(i, j)] = with_bytes(contents[i].value[j], data, media_type)
    return replacements


async def _opened(
    plan: RoutePlan, value: Mapping[str, Any], part: Part, media: MediaConfig, decoders: DecoderPool
) -> Dimensions:
    """An inline image's size as Pillow opens it (gateway.media.opened), or its 400."""
    data = bytes_of(value, part, media.max_image_bytes)
    try:
        return await decoders.run(functools.partial(opened.dimensions, data))
    except BadImage as exc:
        too_large = isinstance(exc, opened.TooLargeToOpen)
        error, reason = (ImageTooLargeError, "image_too_large") if too_large else (InvalidImageError, "invalid_content")
        raise error(
            f"Image at {part.location} cannot be read: {exc}",
            param=part.location,
            rejection=Rejection(plan.model.name, Modality.IMAGE.value, reason),
        ) from None


def _refused(plan: RoutePlan, exc: GatewayError) -> Rejection:
    return exc.rejection or Rejection(plan.model.name, Modality.IMAGE.value, "media_refused")

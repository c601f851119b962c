"""Remote images sized by their header: ``visual_tokens: {remote: fetch}``.

Admission has no bytes of an image the client sent as a URL; for a model with ``remote: fetch``
the gateway fetches each such image with its media fetcher (the request's ``media:`` rules:
SSRF-safe, ``allow_domains``, ``max_image_bytes``, ``fetch_timeout_s``), reads its header, and
measures the plan again with what it found (gateway.admission.visual): the limits hold, and an
image over them is downscaled or refused, before any engine is touched. Either way the engine
gets the bytes the gateway measured, inline (a data URL; Anthropic's base64 source): sent on as
the URL, a server could answer the engine's fetch with another, larger image than the gateway's.
A request's images are fetched one after another, as the encoder fetches them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from ..admission.dimensions import BadImage, Dimensions, NeedMore, read_dimensions
from ..admission.plan import RoutePlan
from ..admission.visual import image_source, measure
from ..config import MediaConfig
from ..errors import GatewayError, InvalidImageError, Rejection
from ..modalities import Modality
from .downscale import Replacements, with_bytes
from .fetch import MediaFetcher


async def sized(
    plan: RoutePlan, body: dict[str, Any], fetcher: MediaFetcher, media: MediaConfig
) -> tuple[RoutePlan, dict[tuple[int, int], bytes]]:
    """The plan measured again with each remote image's header fetched, and the bytes fetched
    (by (place, index): a downscale resizes them)."""
    assert plan.visual is not None
    contents = plan.contents(body)
    headers: dict[tuple[int, int], Dimensions] = {}
    fetched: dict[tuple[int, int], bytes] = {}
    for image in plan.visual.to_fetch:
        part = image.part
        assert part.index is not None
        url = image_source(contents[part.message].value[part.index], image.part.type)
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


def _refused(plan: RoutePlan, exc: GatewayError) -> Rejection:
    return exc.rejection or Rejection(plan.model.name, Modality.IMAGE.value, "media_refused")

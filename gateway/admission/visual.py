"""A request's images and videos sized (from their headers, at admission) and counted in the
tokens they cost its model (gateway.admission.tokens: each family's formula), and held to the
model's limits: 400 ``image_too_large``, ``too_many_visual_tokens``, ``invalid_image``; or, with
``on_oversize: downscale``, what each is resized to.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Literal

from ..config import ModelConfig
from ..config.types import VideoTokens, VisualTokens
from ..errors import ImageTooLargeError, InvalidImageError, Rejection, TooManyVisualTokensError
from ..modalities import Modality
from ..values import record
from .dimensions import BadImage, Dimensions, NeedMore, OtherFormat, encoded_dimensions
from .parts import Content, Part
from .strings import Deferred
from .tokens import (
    VideoInfo,
    check_servable,
    count,
    fit,
    most_video,
    scaled,
    video_tokens,
)

# --- a request's images, sized and counted -----------------------------------------------------

# its header read (inline, or fetched by the gateway); to be fetched; the model's remote: [W, H];
# the most an image costs the model
# videos: read from the container (its metadata), or from the frames the gateway sampled; to probe
# (the container is read once the gateway has the video's bytes, after admission); an inline image
# of a format the header reader does not know, to open with Pillow after admission (TIFF, ICO...)
Source = Literal["header", "fetch", "assumed", "most", "frames", "pages", "container", "sampled", "probe", "open"]
LATER: frozenset[str] = frozenset({"fetch", "open"})  # images sized after admission (gateway.media.remote)


@record
class Sized:
    """One image as admission sized it."""

    part: Part
    width: int  # as shown (EXIF orientation applied); 0 when not known
    height: int
    tokens: int  # what it costs the model as it will be sent (after a downscale)
    source: Source
    downscale: tuple[int, int] | None = None  # (width, height) the gateway resizes it to
    format: str = ""
    frames: int = 0  # a video's: the frames the model takes of it

    def explain(self) -> dict[str, Any]:
        shown = ("header", "assumed", "frames", "pages", "container", "sampled")
        known = {"width": self.width, "height": self.height} if self.source in shown else {}
        resized = {"downscale_to": list(self.downscale)} if self.downscale is not None else {}
        frames = {"pages" if self.source == "pages" else "frames": self.frames} if self.frames else {}
        if self.source == "probe":  # explain does not read videos: the gateway does once it has them
            return {"size_from": "probe", "visual_tokens": None}
        return {**known, **frames, "size_from": self.source, "visual_tokens": self.tokens, **resized}


@record
class VisualCount:
    """A request's images as admission sized them, and what follows from them (worked out once:
    every stage asks)."""

    images: tuple[Sized, ...]
    tokens: int  # their visual tokens, in all
    downscaled: tuple[Sized, ...]  # those the gateway resizes
    downscaled_at: frozenset[tuple[int, int]]  # (place, index) of each of those
    to_fetch: tuple[Sized, ...]  # images sized after admission: remote ones fetched (``remote: fetch``), others opened
    to_probe: tuple[Sized, ...] = ()  # videos whose container the gateway reads first (``video:``)

    @classmethod
    def of(cls, images: Sequence[Sized]) -> VisualCount:
        tokens, downscaled, to_fetch, to_probe = 0, [], [], []
        for s in images:
            tokens += s.tokens
            if s.downscale is not None:
                downscaled.append(s)
            if s.source in LATER:
                to_fetch.append(s)
            elif s.source == "probe":
                to_probe.append(s)
        if not (downscaled or to_fetch or to_probe):  # the common count: every image sized, none resized
            return cls(tuple(images), tokens, (), _NOWHERE, ())
        at = frozenset((s.part.message, s.part.index or 0) for s in downscaled)
        return cls(tuple(images), tokens, tuple(downscaled), at, tuple(to_fetch), tuple(to_probe))

    @property
    def waits(self) -> bool:
        """Whether some of its images or videos are counted only after admission (fetched, probed)."""
        return bool(self.to_fetch or self.to_probe)


_NOWHERE: frozenset[tuple[int, int]] = frozenset()
Fetched = Mapping[tuple[int, int], Dimensions]  # (place, index) of a remote image -> its header's


def measure(
    model: ModelConfig,
    parts: Sequence[Part],
    contents: Sequence[Content],
    fetched: Fetched | None = None,
    *,
    deferred: Deferred | None = None,
) -> VisualCount:
    """Every image of ``parts`` sized (from its header, its model's assumption, or at its most),
    counted, and held to the model's limits: 400 ``image_too_large``, ``too_many_visual_tokens``,
    ``invalid_image``; or, with ``on_oversize: downscale``, what each is resized to. A remote
    image of a model with ``remote: fetch`` is left to fetch, and held to nothing, until
    ``fetched`` has its header: the plan is then measured again (gateway.media.remote). An
    image whose data URL ``deferred`` holds the rest of is read from its first characters; one
    whose header goes on past them has every deferred string put back, and is read again."""
    spec, oversize = model.visual_tokens, model.on_oversize
    downscaling = oversize.action == "downscale"
    limit = _least(model.max_image_pixels, oversize.max_pixels) if downscaling else model.max_image_pixels
    sized: list[Sized] = []
    total = 0  # their tokens
    for part in parts:
        assert part.index is not None
        place = contents[part.message]
        value = place.holder[place.key][part.index]
        if part.modalities[0] is Modality.VIDEO:
            if spec is not None and spec.video is not None and (video := _video(part, value, spec)) is not None:
                sized.append(video)
                total += video.tokens
            continue
        header = fetched.get((part.message, part.index)) if fetched is not None else None
        if header is not None:
            if spec is not None:
                check_servable(spec, header, model=model.name, part=part)
            found: tuple[int, int, Source, str] | None = (header.width, header.height, "header", header.format)
        else:
            found = _size(value, spec, model=model.name, part=part, deferred=deferred)
        if found is None:  # an embedding, or a file the gateway cannot read: the engine's to count
            continue
        width, height, source, fmt = found
        if source in LATER:
            sized.append(Sized(part, 0, 0, 0, source))
            continue
        tokens = count(spec, width, height) if spec is not None and source != "most" else _most(spec)
        item = Sized(part, width, height, tokens, source, None, fmt)
        if source == "header" and limit is not None and width * height > limit:
            if not downscaling:
                raise ImageTooLargeError(
                    f"Model '{model.name}' takes images of at most {limit} pixels (limits.image_pixels): "
                    f"{part.location} is {width}x{height} = {width * height}.",
                    param=part.location,
                    rejection=Rejection(model.name, Modality.IMAGE.value, "image_too_large"),
                )
            item = _downscaled(item, spec, fit(spec, width, height, max_pixels=limit, max_tokens=None))
        sized.append(item)
        total += item.tokens
    budget = _least(model.max_visual_tokens, oversize.max_tokens) if downscaling else model.max_visual_tokens
    if budget is not None and total > budget:
        sized = _within(model, sized, budget) if downscaling else _over(model, sized, budget)
    return VisualCount.of(sized)


def with_frames(
    model: ModelConfig,
    visual: VisualCount | None,
    made: Sequence[tuple[Part, Sequence[Dimensions]]],
    source: Literal["frames", "pages"] = "frames",
) -> VisualCount:
    """The request's count with the images the gateway made of its parts: each video's sampled
    frames (``on_unsupported: {video: {frames: N}}``), each PDF's page images (``extract:
    {page_images: true}``); one entry a part, its images' tokens; held to
    ``limits.visual_tokens`` (they are not downscaled: fewer, or a smaller ``max_side`` or
    ``dpi``, is the policy's to say)."""
    spec = model.visual_tokens
    assert spec is not None
    sized = list(visual.images) if visual is not None else []
    for part, images in made:
        tokens = sum(count(spec, f.width, f.height) for f in images)
        first = images[0] if images else Dimensions(0, 0, "jpeg")
        sized.append(Sized(part, first.width, first.height, tokens, source, None, first.format, len(images)))
    return _held(model, sized)


def with_videos(model: ModelConfig, visual: VisualCount, videos: Mapping[tuple[int, int], VideoInfo]) -> VisualCount:
    """The request's count with each probed (or sampled) video counted, by (place, index); held
    to ``limits.visual_tokens`` (a video is not downscaled: fewer frames, or smaller ones, are the
    model's ``video:`` to say, or the client's)."""
    spec = model.visual_tokens
    assert spec is not None and spec.video is not None
    sized = []
    for item in visual.images:
        info = videos.get((item.part.message, item.part.index or 0))
        if info is not None and item.part.modality is Modality.VIDEO:
            item = _video_counted(item.part, spec.video, info, "sampled" if info.sampled else "container")
        sized.append(item)
    return _held(model, sized)


def _held(model: ModelConfig, sized: list[Sized]) -> VisualCount:
    """The count, held to ``limits.visual_tokens`` as it is (what is counted after admission,
    frames and videos, is not downscaled)."""
    budget = model.max_visual_tokens
    if budget is not None and sum(s.tokens for s in sized) > budget:
        _over(model, sized, budget)
    return VisualCount.of(sized)


def _video(part: Part, value: Mapping[str, Any], spec: VisualTokens) -> Sized | None:
    """A video part as admission can size it: to probe (its bytes inline, or fetched with
    ``remote: fetch``), of the assumed size (``remote: [W, H]``: its most frames), or at its most."""
    assert spec.video is not None
    url = video_source(value, part.type)
    if url is None:
        return None  # a cached video (a uuid), or one the gateway cannot read: the engine's to count
    if url[:5].lower() == "data:" or spec.remote == "fetch":
        return Sized(part, 0, 0, 0, "probe")
    frames = spec.video.frames or spec.video.max_frames
    if isinstance(spec.remote, tuple):  # its size assumed, its length not: at the most it can cost
        width, height = spec.remote
        return Sized(part, width, height, most_video(spec.video, (width, height)), "assumed", None, "", frames)
    return Sized(part, 0, 0, most_video(spec.video), "most", frames=frames)


def video_source(value: Mapping[str, Any], kind: str | None = None) -> str | None:
    """A ``video_url`` part's URL (a data URL, or a remote one), or None (a cached video's uuid).
    ``kind``: the part's type as classification read it (see :func:`image_source`)."""
    kind = value.get("type", "video_url") if kind is None else kind
    url = value.get("video_url") if kind == "video_url" else None
    if isinstance(url, Mapping):
        url = url.get("url")
    return url if isinstance(url, str) and url else None


def _video_counted(part: Part, spec: VideoTokens, info: VideoInfo, source: Source) -> Sized:
    tokens, frames = video_tokens(spec, info)
    return Sized(part, info.width, info.height, tokens, source, None, info.format, frames)


def _least(limit: int | None, target: int | None) -> int | None:
    """What a downscale brings an image (or a request) to: its target, within the limit; either
    alone (a target without a limit is one)."""
    if limit is None or target is None:
        return limit if target is None else target
    return min(limit, target)


def _downscaled(item: Sized, spec: VisualTokens | None, size: tuple[int, int]) -> Sized:
    if size == (item.width, item.height):
        return item
    tokens = count(spec, *size) if spec is not None else 0
    return Sized(item.part, item.width, item.height, tokens, item.source, size, item.format)


def _over(model: ModelConfig, sized: list[Sized], budget: int) -> list[Sized]:
    total = 0
    for item in sized:
        total += item.tokens
        if total > budget:
            break
    raise TooManyVisualTokensError(
        f"Model '{model.name}' takes at most {budget} visual tokens a request (limits.visual_tokens): its "
        f"{_media(sized)} come to {sum(s.tokens for s in sized)}, past the limit at {item.part.location} "
        f"({_described(item)}).",
        param=item.part.location,
        rejection=Rejection(model.name, item.part.modality.value, "too_many_visual_tokens"),
    )


def _within(model: ModelConfig, sized: list[Sized], budget: int) -> list[Sized]:
    """The images whose header was read, all scaled by one factor, the largest that brings the
    request within ``budget``; the others (assumed, or counted at their most) as they are."""
    spec = model.visual_tokens
    assert spec is not None
    # a tiling model's count follows the image's aspect, not its size: nothing to gain by scaling
    shrinks = spec.kind in ("grid", "longest_edge")  # anyres, like tiles, follows the aspect
    fixed = sum(s.tokens for s in sized if s.source != "header" or not shrinks)
    scalable = [i for i, s in enumerate(sized) if s.source == "header" and shrinks]

    def at(scale: float) -> list[tuple[int, int]]:
        return [scaled(*(sized[i].downscale or (sized[i].width, sized[i].height)), scale) for i in scalable]

    def cost(sizes: list[tuple[int, int]]) -> int:
        return fixed + sum(count(spec, w, h) for w, h in sizes)

    low, high = 0.0, 1.0
    for _ in range(24):  # the scale within 1e-7: a pixel of a 10,000-pixel side
        middle = (low + high) / 2
        if cost(at(middle)) <= budget:
            low = middle
        else:
            high = middle
    sizes = at(low)
    if not scalable or cost(sizes) > budget:  # the smallest images still cost more
        return _over(model, sized, budget)
    new = dict(zip(scalable, sizes, strict=True))
    return [_downscaled(s, spec, new[i]) if i in new else s for i, s in enumerate(sized)]


def _media(sized: Sequence[Sized]) -> str:
    videos = any(s.part.modality is Modality.VIDEO for s in sized)
    images = any(s.part.modality is Modality.IMAGE for s in sized)
    return "images and videos" if videos and images else "videos" if videos else "images"


def _described(item: Sized) -> str:
    if item.part.modality is Modality.VIDEO and item.source != "frames":
        if item.source == "most":
            return f"{item.tokens} tokens: a remote video counted at the most a video costs the model"
        seen = {"assumed": ", its size assumed", "sampled": ", as the gateway sampled them"}.get(item.source, "")
        return f"{item.tokens} tokens, {item.frames} frames at {item.width}x{item.height}{seen}"
    if item.source == "frames":
        return f"{item.tokens} tokens, its frames at {item.width}x{item.height}"
    if item.source == "pages":
        return f"{item.tokens} tokens, its {item.frames} page image(s), the first {item.width}x{item.height}"
    if item.source == "most":
        return f"{item.tokens} tokens: a remote image counted at the most an image costs the model"
    seen = "assumed" if item.source == "assumed" else "its header says"
    return f"{item.tokens} tokens, {seen} {item.width}x{item.height}"


def _most(spec: VisualTokens | None) -> int:
    """The most tokens one image can cost the model (whatever its size)."""
    if spec is None:
        return 0
    if spec.kind == "fixed":
        return spec.fixed
    if spec.kind == "tiles":
        return 2 + spec.fixed * (spec.tiles[1] + (1 if spec.tiles[1] > 1 else 0))
    if spec.kind == "anyres":  # the largest grid, unpadded whole
        patches = spec.side // spec.patch
        grid = max(h * w for h, w in spec.pinpoints) // (spec.side * spec.side)
        rows = max(h for h, _ in spec.pinpoints) // spec.side * patches
        return grid * patches * patches + rows + patches * patches
    if spec.kind == "grid":
        return spec.max_pixels // (spec.patch * spec.patch * spec.merge * spec.merge)
    side = spec.longest_edge // spec.patch
    return side * (side + 1)


def _size(
    value: Mapping[str, Any], spec: VisualTokens | None, *, model: str, part: Part, deferred: Deferred | None = None
) -> tuple[int, int, Source, str] | None:
    """(width, height, how it is known, format) of an image part; None: not the gateway's to count.
    A data URL of which ``deferred`` holds the rest is read from what it holds when its header
    lies there, else again once the strings are whole (in their places: ``value`` holds it then)."""
    encoded = image_source(value, part.type)
    if encoded is None:
        return None
    if isinstance(encoded, str):  # a remote URL
        if spec is not None and spec.remote == "fetch":
            return 0, 0, "fetch", ""
        if spec is not None and isinstance(spec.remote, tuple):
            return spec.remote[0], spec.remote[1], "assumed", ""
        return 0, 0, "most", ""
    text, start, base64 = encoded
    partial = deferred is not None and deferred.holds(text)
    try:
        image = encoded_dimensions(text, start, base64=base64, whole=not partial)
    except OtherFormat:  # perhaps a format Pillow opens: sized once admission is done, off the loop
        return 0, 0, "open", ""
    except (BadImage, NeedMore) as exc:
        if partial:
            assert deferred is not None
            deferred.restore()
            return _size(value, spec, model=model, part=part)
        raise InvalidImageError(
            f"Image at {part.location} cannot be read: {exc}", param=part.location,
            rejection=Rejection(model, Modality.IMAGE.value, "invalid_content"),
        ) from None  # fmt: skip
    if spec is not None:
        check_servable(spec, image, model=model, part=part)
    return image.width, image.height, "header", image.format


def image_source(value: Mapping[str, Any], kind: str | None = None) -> tuple[str, int, bool] | str | None:
    """Where an image part's bytes are: (text, start, base64) inline, a remote URL, or None.
    ``kind``: the part's type as classification read it (a part with a uuid, or none, is read by
    its media key, whatever its ``type`` field says); by default its ``type`` field."""
    kind = value.get("type") if kind is None else kind
    if kind == "image":  # Anthropic's: a source of base64 data, a URL, or a file
        source = value.get("source")
        if not isinstance(source, Mapping):
            return None
        if source.get("type") == "base64" and isinstance(source.get("data"), str):
            return source["data"], 0, True
        return source["url"] if source.get("type") == "url" and isinstance(source.get("url"), str) else None
    if kind not in ("image_url", "input_image"):
        return None
    url = value.get("image_url")
    if type(url) is dict or isinstance(url, Mapping):  # a parsed body's is a dict: no ABC check
        url = url.get("url")
    if not isinstance(url, str):
        return None  # a file_id: the engine's
    if url[:5].lower() != "data:":
        return url
    comma = url.find(",", 5)
    if comma < 0:
        return url, len(url), True  # read as nothing: "ends before its header"
    return url, comma + 1, url[5:comma].rstrip().lower().endswith(";base64")

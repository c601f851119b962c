"""What an image costs a model in tokens, counted at admission from its header alone.

A model's ``visual_tokens:`` (:class:`~gateway.config.types.VisualTokens`) says how its image
processor turns an image into tokens; each formula here is that processor's, and
tests/admission/test_visual.py holds every preset to the Hugging Face processor's own count over a
grid of sizes:

``grid``
    Qwen2-VL, Qwen2.5-VL, Qwen3-VL (``smart_resize``): both sides rounded to multiples of
    ``patch * merge``, the pixels brought within ``[min_pixels, max_pixels]`` keeping the aspect;
    one token a ``merge x merge`` block of ``patch``-pixel patches.
``longest_edge``
    Pixtral, Mistral Small 3.1: the longest edge brought down to ``longest_edge``, then one token
    a ``patch``-pixel square (patch x merge of the vision tower), and one more a row (its
    ``[IMG_BREAK]``, the last ``[IMG_END]``).
``fixed``
    LLaVA 1.5 (576), Gemma 3 (256): the same count for every image.
``anyres``
    LLaVA-NeXT: a base image of ``side`` pixels and the grid (of ``pinpoints``) that best holds
    the image, its padding left out, a newline token a row.
``tiles``
    InternVL 3 (GOT-OCR2's ``crop_to_patches``): the grid of ``patch``-pixel tiles, within the
    fewest and most tiles, whose aspect is nearest the image's (more tiles on a tie while they
    cover no more than twice its area), and a thumbnail when there is more than one tile; ``fixed``
    tokens a tile, and 2 (``<img>``, ``</img>``).

:func:`count` gives an image's tokens; :func:`fit` the largest size of the same aspect an image
may be downscaled to for a pixel or a token target.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from ..config import ModelConfig
from ..config.types import VideoTokens, VisualTokens
from ..errors import ImageTooLargeError, InvalidImageError, Rejection, TooManyVisualTokensError
from ..modalities import Modality
from ..values import record
from .dimensions import BadImage, Dimensions, NeedMore, OtherFormat, encoded_dimensions
from .parts import Content, Part
from .strings import Deferred

MAX_ASPECT_RATIO = 200  # Qwen's processors refuse a longer side over 200 times the shorter


def count(spec: VisualTokens, width: int, height: int) -> int:
    """The tokens an image of ``width`` x ``height`` costs the model."""
    if spec.kind == "fixed":
        return spec.fixed
    if spec.kind == "grid":
        h, w = smart_resize(height, width, spec.patch * spec.merge, spec.min_pixels, spec.max_pixels)
        return (h // spec.patch) * (w // spec.patch) // (spec.merge * spec.merge)
    if spec.kind == "tiles":
        columns, rows = tile_grid(width, height, spec.patch, *spec.tiles)
        tiles = 1 + columns * rows if columns * rows > 1 else 1
        return 2 + spec.fixed * tiles
    if spec.kind == "anyres":
        return _anyres(spec, width, height)
    rows, columns = _edge_grid(spec, width, height)
    return (columns + 1) * rows


def resized(spec: VisualTokens, width: int, height: int) -> tuple[int, int]:
    """The (width, height) the model's processor resizes an image to (``fixed``: as it is given)."""
    if spec.kind == "grid":
        h, w = smart_resize(height, width, spec.patch * spec.merge, spec.min_pixels, spec.max_pixels)
        return w, h
    if spec.kind == "longest_edge":
        rows, columns = _edge_grid(spec, width, height)
        return columns * spec.patch, rows * spec.patch
    return width, height


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """Qwen2-VL's ``smart_resize`` (transformers' ``image_processing_qwen2_vl``): (height, width)."""
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def tile_grid(width: int, height: int, tile: int, fewest: int, most: int) -> tuple[int, int]:
    """(columns, rows) of tiles (GOT-OCR2's ``get_optimal_tiled_canvas``)."""
    grids = sorted(((w, h) for w in range(1, most + 1) for h in range(1, most + 1) if fewest <= w * h <= most),
                   key=lambda g: g[0] * g[1])  # fmt: skip
    aspect, area = width / height, width * height
    best, best_diff = (1, 1), float("inf")
    for grid in grids:
        diff = abs(aspect - grid[0] / grid[1])
        if diff < best_diff:
            best, best_diff = grid, diff
        elif diff == best_diff and area > 0.5 * tile * tile * grid[0] * grid[1]:
            best = grid
    return best


def _anyres(spec: VisualTokens, width: int, height: int) -> int:
    """LLaVA-NeXT's count (``LlavaNextProcessor._get_number_of_features``, the default feature
    strategy): the base image's patches, and its best resolution's, unpadded, a newline a row."""
    best_h, best_w, best_effective, best_wasted = 0, 0, 0, float("inf")
    for h, w in spec.pinpoints:  # transformers' select_best_resolution
        scale = min(w / width, h / height)
        effective = min(int(width * scale) * int(height * scale), width * height)
        wasted = w * h - effective
        if effective > best_effective or (effective == best_effective and wasted < best_wasted):
            best_h, best_w, best_effective, best_wasted = h, w, effective, wasted
    patches = spec.side // spec.patch
    current_h, current_w = patches * (best_h // spec.side), patches * (best_w // spec.side)
    if width / height > current_w / current_h:
        padding = (current_h - int(round(height * (current_w / width), 7))) // 2
        current_h -= 2 * padding
    else:
        padding = (current_w - int(round(width * (current_h / height), 7))) // 2
        current_w -= 2 * padding
    return current_h * current_w + current_h + patches * patches


def _edge_grid(spec: VisualTokens, width: int, height: int) -> tuple[int, int]:
    """Pixtral's rows and columns of tokens (``get_resize_output_image_size``)."""
    ratio = max(height / spec.longest_edge, width / spec.longest_edge)
    if ratio > 1:
        height, width = math.floor(height / ratio), math.floor(width / ratio)
    return (height - 1) // spec.patch + 1, (width - 1) // spec.patch + 1


# --- videos -------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class VideoInfo:
    """What a video's token count depends on, from its container (gateway.media.probe), or the
    frames the gateway sampled of it (``sampled``: the engine takes each)."""

    frames: int  # in all (0: the container does not say)
    fps: float  # frames a second (0: the container does not say)
    width: int
    height: int
    format: str = ""  # the container's (FFmpeg's demuxer name), or "jpeg" for sampled frames
    sampled: bool = False


def sampled_frames(spec: VideoTokens, video: VideoInfo) -> int:
    """The frames of ``video`` the model's processor takes: ``frames`` spread over it (all of a
    shorter one: vLLM's loader), or ``fps`` a second as the processor samples them (Qwen2-VL's
    ``sample_frames`` rounds down to whole temporal patches; Qwen3-VL's does not)."""
    total = video.frames
    if video.sampled:
        return max(1, total)
    if spec.frames is not None:
        return spec.frames if total <= 0 else min(spec.frames, total)
    assert spec.fps is not None
    fps = video.fps if video.fps > 0 else 24.0  # what the processors assume of a video that says none
    if total <= 0:
        return spec.max_frames
    if spec.per == "video":  # Qwen3VLVideoProcessor.sample_frames
        return max(1, min(max(int(total / fps * spec.fps), spec.min_frames), spec.max_frames, total))
    t = spec.temporal_patch  # Qwen2VLVideoProcessor.sample_frames
    most = math.floor(min(spec.max_frames, total) / t) * t
    wanted = max(1, math.floor(min(max(total / fps * spec.fps, spec.min_frames), most, total) / t) * t)
    # its indices are arange(0, total, total / wanted): a float step, one more index where it rounds down
    return math.ceil(total / (total / wanted))


def video_tokens(spec: VideoTokens, video: VideoInfo) -> tuple[int, int]:
    """(tokens, frames): what ``video`` costs the model, and the frames it takes of it: a token a
    ``merge x merge`` block of patches of ``temporal_patch`` frames (the last padded), each frame
    resized as its processor resizes it."""
    frames = sampled_frames(spec, video)
    factor = spec.patch * spec.merge
    if spec.per == "video":
        h, w = _video_resize(spec, frames, video.height, video.width)
    else:
        h, w = smart_resize(video.height, video.width, factor, spec.min_pixels, spec.max_pixels)
    grid_t = -(-frames // spec.temporal_patch)
    return grid_t * (h // spec.patch) * (w // spec.patch) // (spec.merge * spec.merge), frames


def _video_resize(spec: VideoTokens, frames: int, height: int, width: int) -> tuple[int, int]:
    """Qwen3-VL's video ``smart_resize`` (transformers' ``video_processing_qwen3_vl``): the pixel
    bounds over all the frames; a side under one patch scaled up first."""
    temporal, factor, min_pixels, max_pixels = (
        spec.temporal_patch,
        spec.patch * spec.merge,
        spec.min_pixels,
        spec.max_pixels,
    )
    frames = max(frames, temporal)  # it refuses fewer: a one-frame video is padded to one patch
    if height < factor or width < factor:
        scale = max(factor / height, factor / width)
        height, width = int(height * scale), int(width * scale)
    h_bar, w_bar = round(height / factor) * factor, round(width / factor) * factor
    t_bar = round(frames / temporal) * temporal
    if t_bar * h_bar * w_bar > max_pixels:
        beta = math.sqrt((frames * height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif t_bar * h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (frames * height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


# frame sizes that cost a video the most: large, and slivers (a side pinned at one patch while
# the other takes the pixels), at the aspect Qwen's processors allow at most
_COSTLY_SIZES = ((8000, 8000), (8000, 40), (40, 8000), (16000, 80), (3200, 16), (1920, 1080), (64, 64), (16, 16))


@functools.cache
def _most_video(spec: VideoTokens, size: tuple[int, int] | None = None) -> int:
    """The most tokens a video can cost the model, whatever its length (and size, unless
    ``size`` is given): every count of frames it may take, at each costly size. Qwen3-VL's
    bounds hold all the frames, so fewer frames, or slivers, can cost more than the most frames."""
    most = spec.frames if spec.frames is not None else spec.max_frames
    if spec.per == "frame" and size is None:  # each frame within its bounds: the most frames cost most
        block = (spec.patch * spec.merge) ** 2
        return -(-most // spec.temporal_patch) * max(spec.max_pixels // block, 1)
    exact = dataclasses.replace(spec, frames=None, fps=None)
    sizes = (size,) if size is not None else _COSTLY_SIZES
    return max(
        video_tokens(exact, VideoInfo(n, 0.0, w, h, sampled=True))[0] for n in range(1, most + 1) for w, h in sizes
    )


def check_servable(spec: VisualTokens, image: Dimensions, *, model: str, part: Part) -> None:
    """400 for an image the model's processor refuses outright (Qwen's: an aspect over 200)."""
    if spec.kind == "grid" and max(image.width, image.height) > MAX_ASPECT_RATIO * min(image.width, image.height):
        raise ImageTooLargeError(
            f"Model '{model}' takes no image with one side over {MAX_ASPECT_RATIO} times the other: {part.location} "
            f"is {image.width}x{image.height}.",
            param=part.location,
            rejection=Rejection(model, "image", "image_too_large"),
        )


def fit(
    spec: VisualTokens | None, width: int, height: int, *, max_pixels: int | None, max_tokens: int | None
) -> tuple[int, int]:
    """The largest (width, height) of the image's aspect within ``max_pixels`` and, counted with
    ``spec``, ``max_tokens`` tokens: what a downscale makes of it. The image itself when it fits."""
    scale = 1.0
    if max_pixels is not None and width * height > max_pixels:
        scale = math.sqrt(max_pixels / (width * height))
    w, h = _scaled(width, height, scale)
    if max_tokens is None or spec is None or spec.kind == "fixed":
        return w, h
    low, high = 0.0, scale  # the largest scale whose count fits: tokens grow with the scale
    if count(spec, w, h) <= max_tokens:
        return w, h
    for _ in range(24):
        middle = (low + high) / 2
        if count(spec, *_scaled(width, height, middle)) <= max_tokens:
            low = middle
        else:
            high = middle
    return _scaled(width, height, low)


def _scaled(width: int, height: int, scale: float) -> tuple[int, int]:
    """The size at ``scale``, its aspect kept within MAX_ASPECT_RATIO (rounding a short side
    down must not make an image Qwen's processors refuse)."""
    if scale >= 1:
        return width, height
    w, h = max(1, math.floor(width * scale)), max(1, math.floor(height * scale))
    if w > MAX_ASPECT_RATIO * h:
        h = math.ceil(w / MAX_ASPECT_RATIO)
    elif h > MAX_ASPECT_RATIO * w:
        w = math.ceil(h / MAX_ASPECT_RATIO)
    return w, h


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
        return Sized(part, width, height, _most_video(spec.video, (width, height)), "assumed", None, "", frames)
    return Sized(part, 0, 0, _most_video(spec.video), "most", frames=frames)


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
        return [_scaled(*(sized[i].downscale or (sized[i].width, sized[i].height)), scale) for i in scalable]

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

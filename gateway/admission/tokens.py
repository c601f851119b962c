"""What an image or a video of a given size costs a model in tokens: each family's formula.

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
may be downscaled to for a pixel or a token target; :func:`video_tokens` a video's. A request's
images are sized and counted with these by gateway.admission.visual.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass

from ..config.types import VideoTokens, VisualTokens
from ..errors import ImageTooLargeError, Rejection
from .dimensions import Dimensions
from .parts import Part

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
def most_video(spec: VideoTokens, size: tuple[int, int] | None = None) -> int:
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
    w, h = scaled(width, height, scale)
    if max_tokens is None or spec is None or spec.kind == "fixed":
        return w, h
    low, high = 0.0, scale  # the largest scale whose count fits: tokens grow with the scale
    if count(spec, w, h) <= max_tokens:
        return w, h
    for _ in range(24):
        middle = (low + high) / 2
        if count(spec, *scaled(width, height, middle)) <= max_tokens:
            low = middle
        else:
            high = middle
    return scaled(width, height, low)


def scaled(width: int, height: int, scale: float) -> tuple[int, int]:
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

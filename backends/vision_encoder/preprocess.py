"""Image decoding and the resize rules of the image processors our towers mirror.

Everything here runs on CPU worker threads, one image at a time, and ends with a uint8 tensor:
normalization (mean/std) happens once per batch on the device, in the tower's ``forward``.
Decoding refuses what it should: bytes that are not an image, and images over a pixel cap or an
aspect-ratio cap (decompression bombs, slivers), from the header, before their pixels are decoded.
It comes in two steps, :func:`open_image` (header) and :func:`load_rgb` (pixels), so that the
service can hold room in its decode budget (:mod:`.limits`) for as many pixels as the header states.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from io import BytesIO

import torch
from PIL import Image, ImageOps, UnidentifiedImageError

from .limits import MAX_ASPECT_RATIO

OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
HALF = (0.5, 0.5, 0.5)

# The formats images arrive in. Pillow opens many more (EPS would run Ghostscript); they are refused.
FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP", "TIFF")  # JPEG covers phones' MPO files

RESAMPLE = {"bicubic": Image.Resampling.BICUBIC, "bilinear": Image.Resampling.BILINEAR}

COMPOSITE_BAND_PIXELS = 1 << 18  # pixels composited at a time in _to_rgb (1 MB of RGBA)


class ImageError(ValueError):
    """The bytes are not an image this backend will decode (the reply is a 400)."""


def decode_image(data: bytes, *, max_pixels: int, max_aspect_ratio: float = MAX_ASPECT_RATIO) -> Image.Image:
    """Bytes -> an RGB PIL image, upright per its EXIF orientation."""
    return load_rgb(open_image(data, max_pixels=max_pixels, max_aspect_ratio=max_aspect_ratio))


def open_image(data: bytes, *, max_pixels: int, max_aspect_ratio: float = MAX_ASPECT_RATIO) -> Image.Image:
    """Bytes -> a PIL image whose header passed the caps; no pixel is decoded yet (see :func:`load_rgb`)."""
    if not data:
        raise ImageError("empty image")
    with _image_errors():
        image: Image.Image = Image.open(BytesIO(data), formats=FORMATS)
    width, height = image.size  # known from the header: checked before any pixel is decoded
    if width * height > max_pixels:
        raise ImageError(f"image is {width}x{height} = {width * height} pixels, over the cap of {max_pixels}")
    if width < 1 or height < 1:
        raise ImageError("image has no pixels")
    # A sliver costs what its pixels cost to decode, and then far more to resize: Pillow's
    # resampling weights grow with the scale factor (1x40M -> 224x224 took 1.4 to 1.7 GB).
    if max(width, height) / min(width, height) > max_aspect_ratio:
        raise ImageError(f"image is {width}x{height}, an aspect ratio over the cap of {max_aspect_ratio:g}")
    return image


def load_rgb(image: Image.Image) -> Image.Image:
    """Decode an image from :func:`open_image` -> RGB, upright per its EXIF orientation."""
    with _image_errors():  # a mode Pillow cannot convert is the image's fault too
        image.load()
        # in place: otherwise Pillow returns a full copy even when there is nothing to rotate
        ImageOps.exif_transpose(image, in_place=True)
        return _to_rgb(image)


@contextmanager
def _image_errors() -> Iterator[None]:
    """Pillow's ways of saying the bytes are no image we take -> ImageError (a 400, never a 500)."""
    try:
        yield
    except UnidentifiedImageError:
        raise ImageError("not a decodable image (unrecognized format)") from None
    except Image.DecompressionBombError as exc:
        raise ImageError(f"not a decodable image: {exc}") from None
    except (OSError, ValueError, SyntaxError, EOFError) as exc:  # truncated or corrupt data
        raise ImageError(f"corrupt image: {exc}") from None


def _to_rgb(image: Image.Image) -> Image.Image:
    """Transparency is composited onto white, as transformers' ``convert_to_rgb`` does.

    The composite goes band by band: done on the whole image at once it keeps an RGBA copy, a
    white background and their composite alive next to the decoded image (four full-size copies,
    750 MB for a 50 MP image). Each pixel's result depends on that pixel only, so bands give the
    same bytes.
    """
    if image.mode == "RGB":
        return image
    if "A" not in image.getbands() and image.info.get("transparency") is None:
        return image.convert("RGB")
    rgb = Image.new("RGB", image.size)
    rows = max(1, COMPOSITE_BAND_PIXELS // image.width)
    for top in range(0, image.height, rows):
        box = (0, top, image.width, min(top + rows, image.height))
        band = image.crop(box).convert("RGBA")
        white = Image.new("RGBA", band.size, (255, 255, 255, 255))
        rgb.paste(Image.alpha_composite(white, band).convert("RGB"), box)
    return rgb


def to_tensor(image: Image.Image) -> torch.Tensor:
    """RGB PIL image -> uint8 tensor (3, H, W)."""
    data = torch.frombuffer(bytearray(image.tobytes()), dtype=torch.uint8)
    return data.view(image.height, image.width, 3).permute(2, 0, 1).contiguous()


def resize_exact(image: Image.Image, height: int, width: int, resample: str = "bicubic") -> Image.Image:
    """SigLIP's rule: straight to (height, width), aspect ratio not kept."""
    if image.size == (width, height):
        return image
    return image.resize((width, height), resample=RESAMPLE[resample])


def resize_shortest_edge(image: Image.Image, shortest_edge: int, resample: str = "bicubic") -> Image.Image:
    """CLIP's rule: the short side becomes ``shortest_edge``, the long side keeps the ratio (truncated)."""
    short, long = sorted(image.size)
    new_short, new_long = shortest_edge, int(shortest_edge * long / short)
    width, height = (new_short, new_long) if image.width <= image.height else (new_long, new_short)
    return image.resize((width, height), resample=RESAMPLE[resample])


def center_crop(pixels: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """Crop (C, H, W) to the center (height, width), padding with zeros where the image is smaller."""
    _, h, w = pixels.shape
    if h < height or w < width:
        padded = torch.zeros((pixels.shape[0], max(h, height), max(w, width)), dtype=pixels.dtype)
        # transformers rounds the padding up on the top/left side (ceil), so the image sits low/right
        top, left = -((h - max(h, height)) // 2), -((w - max(w, width)) // 2)
        padded[:, top : top + h, left : left + w] = pixels
        pixels, h, w = padded, padded.shape[1], padded.shape[2]
    top, left = (h - height) // 2, (w - width) // 2
    return pixels[:, top : top + height, left : left + width]


def smart_resize(height: int, width: int, *, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """Qwen2-VL's rule: both sides multiples of ``factor``, pixels within [min, max], ratio kept."""
    if max(height, width) / min(height, width) > 200:
        raise ImageError(f"aspect ratio over 200 ({width}x{height})")
    # No floor at ``factor`` here, as in transformers' smart_resize: a side under factor / 2 rounds
    # to 0 and the min_pixels branch below scales the whole image up instead.
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
    if h_bar < factor or w_bar < factor:
        raise ImageError(f"image too small to resize ({width}x{height})")
    return h_bar, w_bar


def normalize(
    pixels: torch.Tensor, mean: Sequence[float], std: Sequence[float], *, channel_dim: int = 1
) -> torch.Tensor:
    """uint8 -> float32 in [0, 1] -> (x - mean) / std, per channel, for a whole batch at once."""
    shape = [1] * pixels.dim()
    shape[channel_dim] = 3
    m = torch.tensor(mean, dtype=torch.float32, device=pixels.device).view(shape)
    s = torch.tensor(std, dtype=torch.float32, device=pixels.device).view(shape)
    return (pixels.to(torch.float32) * (1 / 255) - m) / s

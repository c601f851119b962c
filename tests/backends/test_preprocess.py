"""Decoding, and the resize rules against transformers' own image processors (the PIL backends)."""

from __future__ import annotations

import struct
import subprocess
import sys
import zlib
from io import BytesIO
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image, ImageFile

from backends.vision_encoder import preprocess
from backends.vision_encoder.limits import MAX_PIXELS
from backends.vision_encoder.preprocess import (
    ImageError,
    center_crop,
    decode_image,
    resize_exact,
    resize_shortest_edge,
    smart_resize,
    to_tensor,
)
from tests.backends.fixtures import RGBA_BOMB, SLIVER
from tests.images import flat_png

CAP = 10_000_000


def encoded(picture: Image.Image, fmt: str = "PNG", **options: object) -> bytes:
    buffer = BytesIO()
    picture.save(buffer, fmt, **options)
    return buffer.getvalue()


def noise(width: int, height: int, mode: str = "RGB", seed: int = 0) -> Image.Image:
    bands = len(Image.new(mode, (1, 1)).getbands())
    g = torch.Generator().manual_seed(seed)
    data = torch.randint(0, 256, (height, width, bands), dtype=torch.uint8, generator=g)
    return Image.frombytes(mode, (width, height), data.numpy().tobytes())


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def png_header(width: int, height: int) -> bytes:
    """A PNG that states its size, then stops a few bytes into its pixel data."""
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", ihdr) + _chunk(b"IDAT", zlib.compress(b"\0" * 16))


# --- decode_image -------------------------------------------------------------------------------------


def test_empty_bytes_are_refused() -> None:
    with pytest.raises(ImageError, match="empty image"):
        decode_image(b"", max_pixels=CAP)


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b"definitely not an image", "not a decodable image"),
        (encoded(noise(64, 64))[:300], "corrupt image"),
        (encoded(noise(64, 64), "JPEG")[:400], "corrupt image"),
        (png_header(64, 64), "corrupt image"),
    ],
    ids=["garbage", "truncated png", "truncated jpeg", "header only"],
)
def test_undecodable_bytes_are_an_image_error(data: bytes, message: str) -> None:
    with pytest.raises(ImageError, match=message):
        decode_image(data, max_pixels=CAP)


def test_images_over_the_pixel_cap_are_refused_before_decoding(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(self: ImageFile.ImageFile) -> None:
        raise AssertionError("the pixels were decoded")

    monkeypatch.setattr(ImageFile.ImageFile, "load", refuse)
    with pytest.raises(ImageError, match=r"image is 9000x8000 = 72000000 pixels, over the cap of 10000000"):
        decode_image(png_header(9000, 8000), max_pixels=CAP)
    with pytest.raises(ImageError, match=r"image is 11x10 = 110 pixels, over the cap of 109"):
        decode_image(encoded(noise(11, 10)), max_pixels=109)


def test_the_cap_is_inclusive() -> None:
    assert decode_image(encoded(noise(11, 10)), max_pixels=110).size == (11, 10)


@pytest.mark.parametrize(("width", "height"), [(1, 40_000_000), (40_000_000, 1), (201, 1), (3, 604)])
def test_slivers_are_refused_before_decoding(monkeypatch: pytest.MonkeyPatch, width: int, height: int) -> None:
    def refuse(self: ImageFile.ImageFile) -> None:
        raise AssertionError("the pixels were decoded")

    monkeypatch.setattr(ImageFile.ImageFile, "load", refuse)
    with pytest.raises(ImageError, match=rf"image is {width}x{height}, an aspect ratio over the cap of 200$"):
        decode_image(png_header(width, height), max_pixels=50_000_000)


def test_the_aspect_ratio_cap_is_inclusive_and_configurable() -> None:
    assert decode_image(encoded(noise(200, 1)), max_pixels=CAP).size == (200, 1)
    assert decode_image(encoded(noise(3, 600)), max_pixels=CAP).size == (3, 600)
    with pytest.raises(ImageError, match=r"an aspect ratio over the cap of 2\.5$"):
        decode_image(encoded(noise(6, 2)), max_pixels=CAP, max_aspect_ratio=2.5)


# Decodes one PNG in a fresh process and prints its peak RSS growth in KB. Pillow allocates outside
# tracemalloc's view, and ru_maxrss would not do: Linux carries it over from the forking parent
# (pytest, with torch) across exec. The decode path never touches torch, and importing it would
# take 1.4 s.
MEASURE = """
import sys, types
sys.modules["torch"] = types.ModuleType("torch")
from backends.vision_encoder.preprocess import ImageError, decode_image
def peak():
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmHWM:"))
data = open(sys.argv[1], "rb").read()
before = peak()
try:
    decode_image(data, max_pixels=int(sys.argv[2]))
    outcome = "decoded"
except ImageError as exc:
    outcome = str(exc)
print(peak() - before, outcome)
"""


def peak_growth_mb(tmp_path: Path, data: bytes, max_pixels: int) -> tuple[float, str]:
    path = tmp_path / "image.png"
    path.write_bytes(data)
    root = Path(__file__).resolve().parents[2]
    command = [sys.executable, "-c", MEASURE, str(path), str(max_pixels)]
    result = subprocess.run(command, cwd=root, capture_output=True, text=True, timeout=30, check=True)
    kilobytes, outcome = result.stdout.strip().split(" ", 1)
    return int(kilobytes) / 1024, outcome


@pytest.mark.parametrize(
    ("image", "max_pixels", "message"),
    [
        (RGBA_BOMB, MAX_PIXELS, "image is 7071x7071 = 49999041 pixels, over the cap of 33554432"),
        (SLIVER, 50_000_000, "image is 1x40000000, an aspect ratio over the cap of 200"),
    ],
    ids=["rgba 7071x7071", "sliver 1x40M"],
)
def test_refusing_a_bomb_costs_almost_no_memory(
    tmp_path: Path, image: tuple[int, int, bytes], max_pixels: int, message: str
) -> None:
    growth, outcome = peak_growth_mb(tmp_path, flat_png(*image), max_pixels)
    assert outcome == message
    assert growth < 50  # decoding them cost 760 MB and 1.5 GB


def test_an_rgba_image_under_the_cap_costs_two_copies_not_four(tmp_path: Path) -> None:
    width = height = 3000
    growth, outcome = peak_growth_mb(tmp_path, flat_png(width, height, bytes((1, 2, 3, 4))), MAX_PIXELS)
    assert outcome == "decoded"
    # Pillow keeps RGBA and RGB alike in 4 bytes a pixel: the decoded image and the RGB result
    # (69 MB here, 75 MB measured). Compositing the whole image at once held four (140 MB measured).
    assert growth < 10 * width * height / 2**20


@pytest.mark.parametrize(
    ("orientation", "transpose"),
    [
        (2, Image.Transpose.FLIP_LEFT_RIGHT),
        (3, Image.Transpose.ROTATE_180),
        (6, Image.Transpose.ROTATE_270),
        (8, Image.Transpose.ROTATE_90),
    ],
)
def test_exif_orientation_is_applied(orientation: int, transpose: Image.Transpose) -> None:
    picture = noise(6, 4)
    exif = Image.Exif()
    exif[0x0112] = orientation
    decoded = decode_image(encoded(picture, exif=exif), max_pixels=CAP)
    expected = picture.transpose(transpose)
    assert decoded.size == expected.size
    assert decoded.tobytes() == expected.tobytes()


def _palette_with_transparency() -> Image.Image:
    picture = noise(8, 6).quantize(16)
    picture.info["transparency"] = 3
    return picture


@pytest.mark.parametrize(
    ("picture", "fmt"),
    [
        (noise(8, 6), "PNG"),
        (noise(8, 6, "RGBA"), "PNG"),
        (noise(8, 6, "LA"), "PNG"),
        (noise(8, 6, "L"), "PNG"),
        (noise(8, 6).quantize(16), "PNG"),
        (_palette_with_transparency(), "PNG"),
        (noise(8, 6, "CMYK"), "JPEG"),
        (noise(8, 6).quantize(16), "GIF"),
    ],
    ids=["RGB", "RGBA", "LA", "L", "P", "P+transparency", "CMYK jpeg", "GIF"],
)
def test_every_mode_becomes_rgb_as_transformers_converts_it(picture: Image.Image, fmt: str) -> None:
    from transformers.image_transforms import convert_to_rgb

    data = encoded(picture, fmt)
    decoded = decode_image(data, max_pixels=CAP)
    assert decoded.mode == "RGB" and decoded.size == (8, 6)
    with Image.open(BytesIO(data)) as original:
        expected = convert_to_rgb(original, return_numpy=True)
    np.testing.assert_array_equal(np.asarray(decoded), expected)


@pytest.mark.parametrize(
    "picture",
    [noise(7, 9, "RGBA"), noise(7, 9, "LA"), _palette_with_transparency().resize((7, 9))],
    ids=["RGBA", "LA", "P+transparency"],
)
def test_compositing_band_by_band_gives_transformers_bytes(
    monkeypatch: pytest.MonkeyPatch, picture: Image.Image
) -> None:
    from transformers.image_transforms import convert_to_rgb

    monkeypatch.setattr(preprocess, "COMPOSITE_BAND_PIXELS", 15)  # 2 rows a band, the last one short
    data = encoded(picture)
    with Image.open(BytesIO(data)) as original:
        expected = convert_to_rgb(original, return_numpy=True)
    np.testing.assert_array_equal(np.asarray(decode_image(data, max_pixels=CAP)), expected)


def test_transparency_is_composited_onto_white() -> None:
    picture = Image.new("RGBA", (2, 1), (0, 0, 0, 0))
    picture.putpixel((1, 0), (200, 0, 0, 255))
    decoded = decode_image(encoded(picture), max_pixels=CAP)
    assert [decoded.getpixel((0, 0)), decoded.getpixel((1, 0))] == [(255, 255, 255), (200, 0, 0)]


# --- resize rules against transformers ----------------------------------------------------------------

SHAPES = [(32, 32), (64, 40), (36, 60), (28, 29), (63, 17), (17, 63), (5, 50), (100, 3)]


@pytest.mark.parametrize("resample", [2, 3], ids=["bilinear", "bicubic"])
def test_resize_exact_matches_siglips_processor(resample: int) -> None:
    from transformers import SiglipImageProcessorPil

    processor = SiglipImageProcessorPil(
        size={"height": 24, "width": 32}, resample=resample, do_rescale=False, do_normalize=False
    )
    name = {2: "bilinear", 3: "bicubic"}[resample]
    for i, (width, height) in enumerate(SHAPES):
        picture = noise(width, height, seed=i)
        expected = processor(images=picture, return_tensors="pt")["pixel_values"][0]
        ours = to_tensor(resize_exact(picture, 24, 32, name))
        assert torch.equal(ours, expected.to(torch.uint8)), (width, height)


@pytest.mark.parametrize(("shortest_edge", "crop"), [(32, (32, 32)), (24, (32, 32)), (32, (20, 28)), (30, (31, 33))])
def test_shortest_edge_and_center_crop_match_clips_processor(shortest_edge: int, crop: tuple[int, int]) -> None:
    from transformers import CLIPImageProcessorPil

    processor = CLIPImageProcessorPil(
        size={"shortest_edge": shortest_edge},
        crop_size={"height": crop[0], "width": crop[1]},
        do_rescale=False,
        do_normalize=False,
    )
    for i, (width, height) in enumerate(SHAPES):
        picture = noise(width, height, seed=i)
        expected = processor(images=picture, return_tensors="pt")["pixel_values"][0]
        ours = center_crop(to_tensor(resize_shortest_edge(picture, shortest_edge)), *crop)
        assert ours.shape == (3, *crop)
        assert torch.equal(ours, expected.to(torch.uint8)), (width, height)


SIDES = [1, 5, 13, 14, 15, 27, 28, 29, 41, 42, 56, 100, 333, 1000, 2000, 5000]
PIXEL_RANGES = [(56 * 56, 28 * 28 * 1280), (28 * 28, 56 * 84), (3136, 12845056), (200_000, 300_000)]


@pytest.mark.parametrize(("min_pixels", "max_pixels"), PIXEL_RANGES)
def test_smart_resize_matches_transformers(min_pixels: int, max_pixels: int) -> None:
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize as reference

    for height in SIDES:
        for width in SIDES:
            try:
                expected = reference(height, width, factor=28, min_pixels=min_pixels, max_pixels=max_pixels)
            except ValueError:
                with pytest.raises(ImageError, match="aspect ratio over 200"):
                    smart_resize(height, width, factor=28, min_pixels=min_pixels, max_pixels=max_pixels)
                continue
            ours = smart_resize(height, width, factor=28, min_pixels=min_pixels, max_pixels=max_pixels)
            assert ours == expected, (height, width)

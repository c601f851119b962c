"""Decoding, and the resize rules against transformers' own image processors (the PIL backends)."""

from __future__ import annotations

import struct
import zlib
from io import BytesIO

import numpy as np
import pytest
import torch
from PIL import Image, ImageFile

from backends.vision_encoder.preprocess import (
    ImageError,
    center_crop,
    decode_image,
    resize_exact,
    resize_shortest_edge,
    smart_resize,
    to_tensor,
)

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

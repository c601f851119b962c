"""gateway.media.opened: inline images of formats the header reader does not know (TIFF, ICO, PPM,
TGA, JPEG 2000, AVIF...) sized as Pillow opens and loads them, after admission, and held to the
model's limits like any image (issue 40, finding 1: they were 400 invalid_image on any counting
model, though the engines take them)."""

from __future__ import annotations

import base64
import io
from typing import Any

import openai
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.admission.dimensions import BadImage
from gateway.media import opened
from tests.conftest import Upstream, error_body, routing

Image = pytest.importorskip("PIL.Image")
pytestmark = pytest.mark.timeout(60)

# format -> (Pillow's name to save, mode): each one Pillow writes and opens
SAVED = {
    "tiff": ("TIFF", "RGB"),
    "ico": ("ICO", "RGBA"),
    "ppm": ("PPM", "RGB"),
    "tga": ("TGA", "RGB"),
    "jpeg2000": ("JPEG2000", "RGB"),
    "avif": ("AVIF", "RGB"),
    "qoi": ("QOI", "RGB"),
    "sgi": ("SGI", "RGB"),
    "pcx": ("PCX", "RGB"),
}


def saved(fmt: str, width: int, height: int, orientation: int = 1) -> bytes:
    name, mode = SAVED[fmt]
    image = Image.new(mode, (width, height), (40, 90, 200, 255)[: len(mode)])
    out = io.BytesIO()
    options: dict[str, Any] = {"sizes": [(width, height)]} if name == "ICO" else {}
    if orientation != 1:
        exif = Image.Exif()
        exif[0x0112] = orientation
        options["exif"] = exif.tobytes() if name != "TIFF" else exif
    image.save(out, name, **options)
    return out.getvalue()


def loaded_size(data: bytes) -> tuple[int, int]:
    """What an engine's processor gets: the image loaded, turned upright."""
    from PIL import ImageOps

    with Image.open(io.BytesIO(data)) as image:
        image.load()
        return ImageOps.exif_transpose(image).size


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(sorted(SAVED)), st.integers(1, 256), st.integers(1, 256))
def test_the_size_is_what_pillow_loads(fmt: str, width: int, height: int) -> None:
    if fmt == "ico":  # ICO holds icons of 256 at most
        width, height = min(width, 256), min(height, 256)
    data = saved(fmt, width, height)
    found = opened.dimensions(data)
    assert (found.width, found.height) == loaded_size(data) and found.format in (fmt, "jpeg2000", "ico")


@pytest.mark.parametrize("fmt", ["tiff", "avif"])
@pytest.mark.parametrize("orientation", [1, 3, 5, 6, 8])
def test_an_exif_orientation_turns_its_sides_as_pillow_and_exif_transpose_do(fmt: str, orientation: int) -> None:
    """TIFF's plugin turns the image as it opens it; AVIF's leaves it to exif_transpose."""
    data = saved(fmt, 30, 10, orientation=orientation)
    found = opened.dimensions(data)
    assert (found.width, found.height) == loaded_size(data) == ((10, 30) if orientation >= 5 else (30, 10))


@pytest.mark.parametrize(
    "data",
    [b"not an image at all", b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 10 10\n", b"II*\x00" + b"\xff" * 20],
    ids=["junk", "eps", "broken-tiff"],
)
def test_what_is_no_picture_an_engine_takes_is_refused(data: bytes) -> None:
    with pytest.raises(BadImage):
        opened.dimensions(data)


def url(data: bytes, media_type: str) -> str:
    return f"data:{media_type};base64," + base64.b64encode(data).decode()


def ask(*urls: str) -> list[Any]:
    parts = [{"type": "image_url", "image_url": {"url": u}} for u in urls]
    return [{"role": "user", "content": [{"type": "text", "text": "what is this?"}, *parts]}]


async def test_a_tiff_is_counted_and_held_to_the_models_limits(gateway_factory, upstream: Upstream) -> None:
    gw = await gateway_factory(
        routing(
            f"  - {{name: q, upstreams: [{upstream.url}], accepts: [text, image], "
            "visual_tokens: {preset: qwen2.5-vl}, limits: {visual_tokens: 3000, image_pixels: 40000}}"
        )
    )
    small, large = url(saved("tiff", 100, 100), "image/tiff"), url(saved("tiff", 300, 300), "image/tiff")
    async with gw.client() as client:
        await client.chat.completions.create(model="q", messages=ask(small))
        with pytest.raises(openai.BadRequestError) as too_large:
            await client.chat.completions.create(model="q", messages=ask(large))
        with pytest.raises(openai.BadRequestError) as junk:
            await client.chat.completions.create(model="q", messages=ask(url(b"II*\x00" + b"\xff" * 64, "image/tiff")))
    assert upstream.received[0].json()["messages"][0]["content"][1]["image_url"]["url"] == small  # as it came
    assert gw.sample("gateway_visual_tokens_total", model="q") > 0
    error = error_body(too_large.value)
    assert error["code"] == "image_too_large" and "300x300" in error["message"]
    assert error_body(junk.value)["code"] == "invalid_image"
    assert len(upstream.received) == 1


async def test_an_avif_turned_by_its_exif_is_downscaled_upright(gateway_factory, upstream: Upstream) -> None:
    gw = await gateway_factory(
        routing(
            f"  - {{name: down, upstreams: [{upstream.url}], accepts: [text, image], on_oversize: downscale, "
            "visual_tokens: {preset: qwen2.5-vl}, limits: {image_pixels: 40000}}"
        )
    )
    async with gw.client() as client:  # stored 600x200, turned a quarter (EXIF 6): shown 200x600
        raw = await client.chat.completions.with_raw_response.create(
            model="down", messages=ask(url(saved("avif", 600, 200, orientation=6), "image/avif"))
        )
    assert raw.headers["X-Gateway-Route"] == "downscale"
    sent = upstream.received[-1].json()["messages"][0]["content"][1]["image_url"]["url"]
    with Image.open(io.BytesIO(base64.b64decode(sent.split(",", 1)[1]))) as image:
        width, height = image.size
    assert width < height and width * height <= 40_000 and abs(width / height - 1 / 3) < 0.02


async def test_a_corrupt_or_truncated_image_of_another_format_is_400_not_500(
    gateway_factory, upstream: Upstream
) -> None:
    """Pillow's plugins raise their own (a corrupt AVIF's RuntimeError as it opens, a truncated
    QOI's ValueError as it decodes for a downscale): each is the image's fault, 400 invalid_image."""
    gw = await gateway_factory(
        routing(
            f"  - {{name: down, upstreams: [{upstream.url}], accepts: [text, image], on_oversize: downscale, "
            "visual_tokens: {preset: qwen2.5-vl}, limits: {image_pixels: 40000}}"
        )
    )
    avif = saved("avif", 64, 64)
    corrupt = avif[:40] + bytes(len(avif) - 40)
    truncated = saved("qoi", 400, 300)[:300]
    async with gw.client() as client:
        for data, media_type in ((corrupt, "image/avif"), (truncated, "image/qoi")):
            with pytest.raises(openai.BadRequestError) as caught:
                await client.chat.completions.create(model="down", messages=ask(url(data, media_type)))
            assert error_body(caught.value)["code"] == "invalid_image", media_type
    assert gw.sample("gateway_requests_total", model="down", code="500") in (None, 0)
    assert not upstream.received

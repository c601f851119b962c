"""gateway.admission.dimensions: an image's size from its header, held to Pillow's answers (its
lazy open, then ``exif_transpose``) over every format, orientation and a grid of sizes."""

from __future__ import annotations

import base64
import io
import struct
import warnings
from typing import Any

import hypothesis
import pytest
from hypothesis import strategies as st

from gateway.admission.dimensions import PNG_SIGNATURE, BadImage, NeedMore, data_url_dimensions, read_dimensions

Image = pytest.importorskip("PIL.Image")
ImageOps = pytest.importorskip("PIL.ImageOps")

SIZES = [(1, 1), (7, 3), (640, 480), (1280, 720), (333, 4097), (4097, 17), (16383, 2)]
FORMATS: list[tuple[str, dict[str, Any]]] = [
    ("PNG", {}),
    ("PNG", {"mode": "RGBA"}),
    ("JPEG", {}),
    ("JPEG", {"progressive": True}),
    ("JPEG", {"subsampling": 0, "quality": 95}),
    ("WEBP", {}),
    ("WEBP", {"lossless": True}),
    ("WEBP", {"mode": "RGBA"}),  # alpha: the extended VP8X form
    ("GIF", {}),
    ("BMP", {}),
]


def encode(size: tuple[int, int], fmt: str, mode: str = "RGB", **options: Any) -> bytes:
    out = io.BytesIO()
    Image.new(mode, size, (200, 30, 10, 255)[: len(mode)]).save(out, fmt, **options)
    return out.getvalue()


def shown(data: bytes) -> tuple[int, int]:
    """Pillow's answer: the size once its EXIF orientation is applied."""
    with Image.open(io.BytesIO(data)) as image:
        return ImageOps.exif_transpose(image).size


def data_url(data: bytes) -> str:
    return "data:image/x;base64," + base64.b64encode(data).decode()


@pytest.mark.parametrize(("fmt", "options"), FORMATS, ids=lambda v: str(v))
def test_every_format_over_the_grid_reads_as_pillow_reads_it(fmt: str, options: dict[str, Any]) -> None:
    for size in SIZES:
        data = encode(size, fmt, **options)
        found = read_dimensions(data)
        assert (found.width, found.height) == shown(data) == size, (fmt, options, size)
        assert found.format == fmt.lower()
        assert data_url_dimensions(data_url(data)) == found


def with_orientation(data: bytes, orientation: int, *, padding: int = 0) -> bytes:
    """A JPEG with an EXIF APP1 segment saying ``orientation`` (and ``padding`` bytes of a
    maker note before it, as phones write)."""
    exif = Image.Exif()
    exif[0x0112] = orientation
    if padding:
        exif[0x927C] = b"\x00" * padding
    with Image.open(io.BytesIO(data)) as image:
        out = io.BytesIO()
        image.save(out, "JPEG", exif=exif.tobytes())
    return out.getvalue()


@pytest.mark.parametrize("orientation", range(1, 9))
def test_a_jpegs_exif_orientation_turns_it_as_pillow_turns_it(orientation: int) -> None:
    data = with_orientation(encode((640, 200), "JPEG"), orientation)
    found = read_dimensions(data)
    assert (found.width, found.height) == shown(data)
    assert found.orientation == orientation
    assert (found.width, found.height) == ((200, 640) if orientation >= 5 else (640, 200))


def test_a_header_behind_a_large_exif_is_read_from_more_of_the_data_url() -> None:
    data = with_orientation(encode((300, 100), "JPEG"), 6, padding=40_000)
    with pytest.raises(NeedMore):
        read_dimensions(data[:1024])
    found = data_url_dimensions(data_url(data))
    assert (found.width, found.height, found.orientation) == (100, 300, 6) == (*shown(data), 6)


def test_base64_in_lines_and_percent_encoded_data_urls() -> None:
    data = encode((50, 60), "PNG")
    lines = base64.encodebytes(data).decode()  # 76 characters a line
    assert data_url_dimensions("data:image/png;base64," + lines).width == 50
    percent = "data:image/png," + "".join(f"%{b:02X}" for b in data)
    assert (data_url_dimensions(percent).width, data_url_dimensions(percent).height) == (50, 60)


HOSTILE = {
    "wrong magic": b"GIF90a" + b"\x00" * 40,
    "not an image": b"%PDF-1.7\n" + b"\x00" * 40,
    "zero width PNG": encode((4, 4), "PNG")[:16] + struct.pack(">II", 0, 4) + encode((4, 4), "PNG")[24:],
    "zero height GIF": b"GIF89a" + struct.pack("<HH", 5, 0) + b"\x00\x00\x00," + struct.pack("<HHHH", 0, 0, 5, 0),
    "a GIF with no image": b"GIF89a" + struct.pack("<HH", 5, 5) + b"\x00\x00\x00;" + b"\x00" * 30,
    "a GIF of stray bytes": b"GIF89a" + struct.pack("<HH", 5, 5) + b"\x00\x00\x00" + b"\x01" * 5000,
    "PNG without IHDR first": b"\x89PNG\r\n\x1a\n" + b"\x00\x00\x00\x0dtEXt" + b"\x00" * 20,
    "a BMP header of 20 bytes": b"BM" + b"\x00" * 12 + struct.pack("<I", 20) + b"\x00" * 20,
    "a BMP of 2^31 x 2^31": b"BM" + b"\x00" * 12 + struct.pack("<Iii", 40, 2**31 - 1, 2**31 - 1) + b"\x00" * 8,
    "a JPEG scan before its frame": b"\xff\xd8\xff\xda\x00\x08" + b"\x00" * 40,
    "a JPEG segment shorter than its length": b"\xff\xd8\xff\xe0\x00\x01" + b"\x00" * 40,
    "a JPEG of garbage between segments": b"\xff\xd8\xff\xe0\x00\x04\x00\x00\x12\x34" + b"\x00" * 30,
    "a WebP of an unknown chunk": b"RIFF\x00\x00\x00\x00WEBPXXXX" + b"\x00" * 30,
}


@pytest.mark.parametrize("name", HOSTILE)
def test_hostile_headers_are_bad_images(name: str) -> None:
    with pytest.raises(BadImage):
        read_dimensions(HOSTILE[name])
    with pytest.raises(BadImage):
        data_url_dimensions(data_url(HOSTILE[name]))


def test_a_claimed_100k_by_100k_is_read_as_claimed_from_its_header_alone() -> None:
    """The limits (image_pixels) judge it: nothing is allocated for its pixels here."""
    png = encode((4, 4), "PNG")
    claimed = png[:16] + struct.pack(">II", 100_000, 100_000) + png[24:33]
    assert read_dimensions(claimed).pixels == 10**10


@pytest.mark.parametrize(("fmt", "options"), FORMATS[:1] + FORMATS[2:3] + FORMATS[5:6] + FORMATS[8:], ids=str)
def test_a_truncated_image_needs_more_and_a_data_url_of_it_is_bad(fmt: str, options: dict[str, Any]) -> None:
    data = encode((64, 48), fmt, **options)
    for cut in (3, 11):
        with pytest.raises((NeedMore, BadImage)):
            read_dimensions(data[:cut])
        with pytest.raises(BadImage, match="ends before its header"):
            data_url_dimensions(data_url(data[:cut]))


def test_a_data_url_that_is_not_base64_is_bad() -> None:
    for url in ("data:image/png;base64,@@@@****", "data:image/png;base64", "data:image/png;base64,ü"):
        with pytest.raises(BadImage):
            data_url_dimensions(url)


def test_a_jpeg_of_endless_segments_or_fill_bytes_is_bad_within_its_bounds() -> None:
    many = b"\xff\xd8" + b"\xff\xfe\x00\x02" * 300  # 300 empty comments before any frame header
    with pytest.raises(BadImage, match="first 256 segments"):
        read_dimensions(many)
    with pytest.raises(BadImage, match="past its first 1048576 bytes"):
        data_url_dimensions(data_url(b"\xff\xd8" + b"\xff" * (1 << 21)))


def _gif(
    screen: tuple[int, int],
    frame: tuple[int, int, int, int],
    palette_bits: int | None,
    blocks: list[bytes],
    stray: bytes,
) -> bytes:
    flags = 0x80 | (palette_bits - 1) if palette_bits is not None else 0
    head = b"GIF89a" + struct.pack("<HH", *screen) + bytes([flags, 0, 0])
    palette = bytes(3 << palette_bits) if palette_bits is not None else b""
    extensions = b"".join(b"!\xfe" + b"".join(bytes([len(c)]) + c for c in [block] if c) + b"\x00" for block in blocks)
    image = b"," + struct.pack("<HHHH", *frame) + b"\x00\x02\x02\x44\x01\x00;"
    return head + palette + extensions + stray + image


@hypothesis.settings(max_examples=300, derandomize=True, database=None, deadline=None)
@hypothesis.given(
    screen=st.tuples(st.integers(1, 400), st.integers(1, 400)),
    frame=st.tuples(st.integers(0, 300), st.integers(0, 300), st.integers(1, 400), st.integers(1, 400)),
    palette_bits=st.none() | st.integers(1, 8),
    blocks=st.lists(st.binary(max_size=255), max_size=3),
    stray=st.binary(max_size=4).filter(lambda b: not set(b) & {0x21, 0x2C, 0x3B}),
)
def test_a_gif_is_the_size_pillow_opens_it_at_its_frame_past_its_screen_included(
    screen: tuple[int, int],
    frame: tuple[int, int, int, int],
    palette_bits: int | None,
    blocks: list[bytes],
    stray: bytes,
) -> None:
    """A GIF's screen is grown to its first frame's extent when Pillow opens it (and so when the
    engines do): sized from the screen alone, a 16x16 screen around a 12000x12000 frame passed
    every pixel limit."""
    data = _gif(screen, frame, palette_bits, blocks, stray)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)
        expected = Image.open(io.BytesIO(data)).size
    found = read_dimensions(data)
    assert (found.width, found.height) == expected
    assert data_url_dimensions(data_url(data)).pixels == expected[0] * expected[1]


def test_a_small_screen_around_a_huge_frame_is_the_huge_frame() -> None:
    data = _gif((16, 16), (0, 0, 12000, 12000), 1, [], b"")
    assert read_dimensions(data).pixels == 144_000_000


def test_an_apng_frame_past_its_canvas_hides_no_pixels() -> None:
    """Issue 40, finding 1: unlike a GIF's, an APNG's frames do not grow its canvas: one whose
    first frame says 12000x12000 in a 16x16 canvas is no image Pillow opens (nor, so, an engine),
    and the reader's 16x16 is all that could ever be decoded."""
    import zlib

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    rows = zlib.compress(b"".join(b"\x00" * 17 for _ in range(16)))
    frame = struct.pack(">IIIIIHHBB", 0, 12000, 12000, 0, 0, 1, 1, 0, 0)
    apng = (PNG_SIGNATURE + chunk(b"IHDR", struct.pack(">IIBBBBB", 16, 16, 8, 0, 0, 0, 0))
            + chunk(b"acTL", struct.pack(">II", 1, 0)) + chunk(b"fcTL", frame) + chunk(b"IDAT", rows)
            + chunk(b"IEND", b""))  # fmt: skip
    with pytest.raises(Image.UnidentifiedImageError):
        Image.open(io.BytesIO(apng))
    assert read_dimensions(apng).pixels == 256


def test_an_image_sent_again_is_sized_from_its_first_characters_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """The header read from a data URL's first characters is kept by those characters: the same
    image again (each turn of a conversation) is not decoded again; a header that goes on past
    them (a JPEG with a long EXIF) is read in full each time; the cache is bounded."""
    from gateway.admission import dimensions

    monkeypatch.setattr(dimensions, "_SEEN", {})
    monkeypatch.setattr(dimensions, "SEEN_MOST", 2)
    png = "data:image/png;base64," + base64.b64encode(encode((640, 480), "PNG")).decode()
    first = data_url_dimensions(png)
    assert (first.width, first.height, first.format) == (640, 480, "png")

    def decode(data: bytes) -> dimensions.Dimensions:
        raise AssertionError("decoded again")

    with monkeypatch.context() as patched:
        patched.setattr(dimensions, "read_dimensions", decode)
        assert data_url_dimensions(png) is first  # from the cache: nothing decoded
    exif = Image.Exif()
    exif[0x010E] = "x" * 4000  # ImageDescription: the frame header lies past the first bytes
    jpeg = "data:image/jpeg;base64," + base64.b64encode(encode((30, 20), "JPEG", exif=exif.tobytes())).decode()
    before = dict(dimensions._SEEN)
    assert (data_url_dimensions(jpeg).width, data_url_dimensions(jpeg).height) == (30, 20)
    assert dimensions._SEEN == before  # read in full, not kept
    for side in (1, 2, 3):
        data_url_dimensions("data:image/png;base64," + base64.b64encode(encode((side, side), "PNG")).decode())
    assert len(dimensions._SEEN) <= 2

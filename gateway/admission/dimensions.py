"""An image's width and height from its first bytes, without decoding it.

PNG (and APNG), JPEG (baseline, progressive, lossless: every SOF marker; the EXIF orientation of
its APP1 segment), WebP (lossy ``VP8``, lossless ``VP8L``, extended ``VP8X``), GIF and BMP. What
an image *shows*: a JPEG whose EXIF orientation turns it (5-8) has its width and height swapped,
as ``PIL.ImageOps.exif_transpose`` (and Hugging Face's ``load_image``) would turn it.

A parser of its own rather than Pillow's lazy ``Image.open``: it works on a prefix (a data URL's
first kilobytes decoded, not all of it), reads nothing past the header, allocates nothing beyond
it, and takes a few microseconds; Pillow's WebP plugin reads the whole file to open it, and its
open costs 10-25 µs. Tests hold it to Pillow's answers over every format and orientation.

:func:`read_dimensions` answers :class:`Dimensions`, or raises :class:`NeedMore` (the header
goes on past the bytes given: call again with more) or :class:`BadImage` (a header that
contradicts itself, a zero size: no more bytes would help; :class:`OtherFormat`, a BadImage, when
it is none of these formats: another format Pillow opens is sized by Pillow, off the event loop,
once admission is done: gateway.media.opened).
"""

from __future__ import annotations

import binascii
import re
import struct
from urllib.parse import unquote_to_bytes

from ..values import record

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
# JPEG start-of-frame markers (the frame's size): every one but DHT (C4), JPG (C8) and DAC (CC)
_SOF = frozenset({0xC0, 0xC1, 0xC2, 0xC3, 0xC5, 0xC6, 0xC7, 0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF})
_STANDALONE = frozenset({0x01, *range(0xD0, 0xD8)})  # TEM, RST0-7: no length follows
_FILL = re.compile(rb"\xff*")
MAX_SEGMENTS = 256  # before the frame header: cameras write a dozen (APPn, DQT, DRI, COM)
MAX_GIF_STEPS = 4096  # blocks and stray bytes before a GIF's first image (an encoder writes a few)
MAX_SIDE = 1 << 24  # no format here says more (WebP's VP8X, 24 bits); a BMP claiming more is refused


@record
class Dimensions:
    width: int  # as shown: after the EXIF orientation
    height: int
    format: str  # "png", "jpeg", "webp", "gif", "bmp"
    orientation: int = 1  # EXIF orientation (1-8; 1: as stored)

    @property
    def pixels(self) -> int:
        return self.width * self.height


class NeedMore(Exception):
    """The header goes on past the bytes given."""

    def __init__(self, at_least: int) -> None:
        super().__init__(at_least)
        self.at_least = at_least  # how many bytes the header needs, at least


class BadImage(Exception):
    """Not an image this reads, or one whose header cannot be."""


class OtherFormat(BadImage):
    """Not a PNG, JPEG, WebP, GIF or BMP: perhaps an image of a format Pillow opens (TIFF, ICO,
    PPM, TGA, JPEG 2000, AVIF...), which the engines take (gateway.media.opened sizes it)."""


def read_dimensions(data: bytes) -> Dimensions:
    """The dimensions of the image ``data`` begins (see the module's docstring)."""
    if len(data) < 12:
        if any(data[: len(m)] == m[: len(data)] for m in _MAGICS):  # an image's start, cut short
            raise NeedMore(32)
        raise OtherFormat("not a PNG, JPEG, WebP, GIF or BMP image")
    if data.startswith(PNG_SIGNATURE):
        return _png(data)
    if data.startswith(b"\xff\xd8"):
        return _jpeg(data)
    if data.startswith(b"RIFF") and data[8:12] == b"WEBP":
        return _webp(data)
    if data.startswith((b"GIF87a", b"GIF89a")):
        return _gif(data)
    if data.startswith(b"BM"):
        return _bmp(data)
    raise OtherFormat("not a PNG, JPEG, WebP, GIF or BMP image")


_MAGICS = (PNG_SIGNATURE, b"\xff\xd8\xff", b"RIFF", b"GIF8", b"BM")


def _sized(fmt: str, width: int, height: int, orientation: int = 1) -> Dimensions:
    if width <= 0 or height <= 0:
        raise BadImage(f"the {fmt.upper()} header says {width}x{height}: an image has no zero side")
    if width > MAX_SIDE or height > MAX_SIDE:
        raise BadImage(f"the {fmt.upper()} header says {width}x{height}, which no image of the format is")
    if orientation in (5, 6, 7, 8):  # turned a quarter: shown as height x width
        width, height = height, width
    return Dimensions(width, height, fmt, orientation)


def _png(data: bytes) -> Dimensions:
    if len(data) < 24:
        raise NeedMore(24)
    if data[12:16] != b"IHDR":
        raise BadImage("a PNG must begin with its IHDR chunk")
    width, height = struct.unpack_from(">II", data, 16)
    return _sized("png", width, height)


def _gif(data: bytes) -> Dimensions:
    """The logical screen, grown to the first frame's extent, as Pillow grows it when it opens the
    image (``GifImagePlugin._seek(0)``) and so as the engines decode it: a screen of 16x16 whose
    frame is 12000x12000 is an image of 144 Mpx. The blocks before the frame are walked as Pillow
    walks them: extensions skipped sub-block by sub-block, any other byte skipped alone."""
    if len(data) < 13:
        raise NeedMore(13)
    width, height = struct.unpack_from("<HH", data, 6)
    flags = data[10]
    at, end = 13 + ((3 << ((flags & 7) + 1)) if flags & 0x80 else 0), len(data)  # past the global palette
    for _ in range(MAX_GIF_STEPS):
        if at >= end:
            raise NeedMore(at + 64)
        tag = data[at]
        at += 1
        if tag == 0x3B:  # the trailer: no image at all
            break
        if tag == 0x21:  # an extension: its label, then sub-blocks to an empty one
            at += 1
            while at < end and data[at]:
                at += 1 + data[at]
            at += 1
        elif tag == 0x2C:  # the first image's descriptor: left, top, width, height
            if at + 8 > end:
                raise NeedMore(at + 8)
            left, top, frame_width, frame_height = struct.unpack_from("<HHHH", data, at)
            return _sized("gif", max(width, left + frame_width), max(height, top + frame_height))
    else:
        raise BadImage(f"a GIF's first image must come within its first {MAX_GIF_STEPS} blocks")
    raise BadImage("a GIF with no image in it")


def _bmp(data: bytes) -> Dimensions:
    if len(data) < 26:
        raise NeedMore(26)
    (header,) = struct.unpack_from("<I", data, 14)
    if header == 12:  # OS/2 BITMAPCOREHEADER: 16-bit sides
        width, height = struct.unpack_from("<HH", data, 18)
    elif header >= 40:
        width, height = struct.unpack_from("<ii", data, 18)
        height = abs(height)  # negative: stored top-down
    else:
        raise BadImage(f"a BMP's header of {header} bytes is none of the format's")
    return _sized("bmp", width, height)


def _webp(data: bytes) -> Dimensions:
    if len(data) < 30:
        raise NeedMore(30)
    chunk = data[12:16]
    if chunk == b"VP8X":  # extended: the canvas, 24 bits each, less one
        width = int.from_bytes(data[24:27], "little") + 1
        height = int.from_bytes(data[27:30], "little") + 1
        return _sized("webp", width, height)
    if chunk == b"VP8L":  # lossless: a signature byte, then 14 bits each, less one
        if data[20] != 0x2F:
            raise BadImage("a lossless WebP's VP8L chunk lacks its signature")
        (bits,) = struct.unpack_from("<I", data, 21)
        return _sized("webp", (bits & 0x3FFF) + 1, ((bits >> 14) & 0x3FFF) + 1)
    if chunk == b"VP8 ":  # lossy: a key frame's start code, then 14 bits each (2 bits of scale above)
        if data[23:26] != b"\x9d\x01\x2a":
            raise BadImage("a lossy WebP's VP8 chunk lacks its key frame's start code")
        width, height = struct.unpack_from("<HH", data, 26)
        return _sized("webp", width & 0x3FFF, height & 0x3FFF)
    raise BadImage(f"a WebP's first chunk must be VP8, VP8L or VP8X, not {chunk!r}")


def _jpeg(data: bytes) -> Dimensions:
    """The segments in order up to the first SOF: its frame's size, turned by the orientation of
    an EXIF APP1 segment before it (where cameras write it)."""
    orientation = 1
    at, end = 2, len(data)
    for _ in range(MAX_SEGMENTS):
        if at >= end:  # the next segment (past one skipped) begins beyond these bytes
            raise NeedMore(at + 64)
        at = _FILL.match(data, at).end()  # type: ignore[union-attr]  # fill bytes before a marker (0xFF*)
        if at >= end:
            raise NeedMore(end + 64)
        marker = data[at]
        if data[at - 1] != 0xFF or marker == 0x00:
            raise BadImage("a JPEG's segments end before its frame header")
        at += 1
        if marker in _STANDALONE:
            continue
        if marker in (0xD8, 0xD9, 0xDA):  # another SOI, EOI or scan data before any frame header
            raise BadImage("a JPEG's scan comes before its frame header")
        if at + 2 > end:
            raise NeedMore(at + 64)
        (length,) = struct.unpack_from(">H", data, at)
        if length < 2:
            raise BadImage("a JPEG segment's length is less than its own 2 bytes")
        if marker in _SOF:
            if at + 7 > end:
                raise NeedMore(at + 7)
            height, width = struct.unpack_from(">HH", data, at + 3)
            return _sized("jpeg", width, height, orientation)
        if marker == 0xE1 and orientation == 1:
            if at + length > end:
                raise NeedMore(at + length)
            orientation = _exif_orientation(data[at + 2 : at + length])
        at += length
    raise BadImage(f"a JPEG's frame header must come within its first {MAX_SEGMENTS} segments")


def _exif_orientation(segment: bytes) -> int:
    """The orientation tag (0x0112) of an APP1 segment's IFD0; 1 when it is not Exif or has none
    (as Pillow reads a broken Exif: the image as stored)."""
    if not segment.startswith(b"Exif\x00\x00") or len(segment) < 14:
        return 1
    tiff = segment[6:]
    order = {b"II": "<", b"MM": ">"}.get(tiff[:2])
    if order is None:
        return 1
    (ifd,) = struct.unpack_from(order + "I", tiff, 4)
    if ifd + 2 > len(tiff):
        return 1
    (count,) = struct.unpack_from(order + "H", tiff, ifd)
    for i in range(min(count, (len(tiff) - ifd - 2) // 12)):
        tag, kind, _, value = struct.unpack_from(order + "HHIH", tiff, ifd + 2 + 12 * i)
        if tag == 0x0112:
            return value if kind == 3 and 1 <= value <= 8 else 1
    return 1


# bytes of a data URL's image decoded first: every header here (but a JPEG's, past its tables and
# EXIF: read again with what its segments say they need); a KiB would cost a few µs more to decode
FIRST_READ = 192
MAX_HEADER_BYTES = 1 << 20  # a JPEG whose frame header is further in is refused (Pillow's own JPEG limit is the file)


def data_url_dimensions(url: str) -> Dimensions:
    """The dimensions of the image of a ``data:`` URL, from the fewest of its first bytes decoded
    (192 bytes, more only when the header goes on). :class:`BadImage` for a URL that holds no image."""
    comma = url.find(",", 5)
    if comma < 0:
        raise BadImage("the data URL has no ',' before its data")
    return encoded_dimensions(url, comma + 1, base64=url[5:comma].rstrip().lower().endswith(";base64"))


def encoded_dimensions(text: str, start: int = 0, *, base64: bool = True, whole: bool = True) -> Dimensions:
    """The dimensions of the image whose bytes ``text`` holds from ``start`` on, base64 (or
    percent-encoded), decoding only what its header needs. ``whole=False``: ``text`` is the
    first part of the data only (gateway.admission.strings' Deferred), and a read that would
    reach its end raises :class:`NeedMore` before it is made: the whole might read otherwise
    (a percent escape cut in two decodes as two other bytes)."""
    if base64:  # an image sent again (a conversation sends its images with every turn): sized once
        first = text[start : start + _FIRST_CHARS]
        seen = _SEEN.get(first)
        if seen is not None:
            return seen
        if (whole or len(first) == _FIRST_CHARS) and (head := _strict(first)) is not None:
            try:
                found = read_dimensions(head[:FIRST_READ])
            except NeedMore:
                pass  # (BadImage: raised as it would be below)
            else:
                if len(_SEEN) >= SEEN_MOST:
                    _SEEN.clear()
                _SEEN[first] = found
                return found
    want = FIRST_READ
    while True:
        if not whole and start + _reach(want, base64) > len(text):  # a read would run into its end
            raise NeedMore(want)
        head = _head(text, start, want, base64)
        try:
            return read_dimensions(head)
        except NeedMore as more:
            if len(head) < want:
                raise BadImage("the image ends before its header does") from None
            if want >= MAX_HEADER_BYTES:
                raise BadImage(f"the image's header goes on past its first {MAX_HEADER_BYTES} bytes") from None
            want = min(MAX_HEADER_BYTES, max(more.at_least, 4 * want))


_FIRST_CHARS = (FIRST_READ + 2) // 3 * 4  # the base64 characters of FIRST_READ bytes
SEEN_MOST = 1024  # the headers read from their first characters kept, by those characters
_SEEN: dict[str, Dimensions] = {}


def _strict(chars: str) -> bytes | None:
    """``chars`` as strict base64 (whole groups of four), or None where they are not: a byte
    outside the alphabet is an error, as b64decode(validate=True) has it (without its regex)."""
    try:
        return binascii.a2b_base64(chars[: len(chars) // 4 * 4], strict_mode=True)
    except (binascii.Error, ValueError):  # ValueError: not ASCII
        return None


def _reach(size: int, is_base64: bool) -> int:
    """The most characters :func:`_head` reads for ``size`` bytes (base64 in lines: twice)."""
    return 2 * ((size + 2) // 3 * 4) if is_base64 else 3 * size


def _head(url: str, start: int, size: int, is_base64: bool) -> bytes:
    """The first ``size`` bytes of a data URL's data (fewer when it holds fewer)."""
    if not is_base64:
        return unquote_to_bytes(url[start : start + 3 * size])[:size]
    n = (size + 2) // 3 * 4
    head = _strict(url[start : start + n])
    if head is None:
        head = _strict("".join(url[start : start + 2 * n].split())[:n])  # base64 in lines (RFC 2045)
    if head is None:
        raise BadImage("the data URL is not valid base64")
    return head[:size]

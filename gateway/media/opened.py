"""Inline images of the formats the header reader does not know, sized as Pillow opens them.

gateway.admission.dimensions reads PNG, JPEG, WebP, GIF and BMP headers itself, in microseconds,
on the event loop. The engines open images with Pillow (vLLM's media connector, the Hugging Face
processors), which takes more: TIFF, ICO, PPM, TGA, JPEG 2000, AVIF and a few others. An image of
one of :data:`FORMATS` is sized after admission, as Pillow's ``Image.open`` says (its header
only: nothing is decoded; its EXIF orientation applied, as ``exif_transpose`` would turn it), on
a decoding thread (gateway.media.decoders: bounded, shared fairly among keys), and the request is
measured again with that size: the model's limits and visual-token budgets hold as for any image.
Formats whose opening runs other programs or that are no picture a model takes (EPS, WMF, PSD,
FITS, GRIB, HDF5, MPEG...) stay 400 ``invalid_image``.
"""

from __future__ import annotations

import io
import threading

from ..admission.dimensions import MAX_SIDE, BadImage, Dimensions

# what Pillow opens that an engine would take as a picture (Pillow 13: each registered, AVIF and
# JPEG 2000 with their libraries in the wheel)
FORMATS = ("TIFF", "ICO", "PPM", "TGA", "JPEG2000", "AVIF", "QOI", "SGI", "PCX", "DDS", "ICNS")
NAMES = "TIFF, ICO, PPM, TGA, JPEG 2000, AVIF, QOI, SGI, PCX, DDS or ICNS"


def turned_by_exif(fmt: str) -> bool:
    """Whether an image of ``fmt`` (Pillow's name, lower case) is sized turned by its EXIF
    orientation here, as ``exif_transpose`` turns it (TIFF's plugin turns it as it opens it)."""
    return fmt != "tiff" and fmt.upper() in FORMATS


class TooLargeToOpen(BadImage):
    """Past Pillow's own decompression-bomb bound: no engine opens it either."""


def dimensions(data: bytes, stop: threading.Event | None = None) -> Dimensions:
    """The image's size as Pillow opens it (on a decoding thread); BadImage when Pillow opens
    no image of :data:`FORMATS` there, TooLargeToOpen past its bomb bound."""
    from PIL import Image, UnidentifiedImageError

    try:  # (no catch_warnings: its filters are the process's, and this runs on a thread)
        with Image.open(io.BytesIO(data), formats=FORMATS) as image:
            width, height = image.size
            fmt = (image.format or "").lower()
            # TIFF's plugin turns the image by its orientation as it opens it: its size is as shown
            turned = image.getexif().get(0x0112, 1) if turned_by_exif(fmt) else 1
    except Image.DecompressionBombError as exc:
        raise TooLargeToOpen(str(exc)) from None
    except UnidentifiedImageError:
        raise BadImage(f"not an image of a format the engines open (PNG, JPEG, WebP, GIF, BMP, {NAMES})") from None
    except Exception as exc:  # a plugin's own (AVIF's RuntimeError, a corrupt EXIF's Warning where warnings are errors)
        raise BadImage(f"Pillow cannot open it: {exc}"[:300]) from None
    if not (0 < width <= MAX_SIDE and 0 < height <= MAX_SIDE):
        raise BadImage(f"Pillow reads it as {width}x{height}, which no image a model takes is")
    orientation = turned if isinstance(turned, int) and 1 <= turned <= 8 else 1
    if orientation >= 5:  # turned a quarter: its sides as shown
        width, height = height, width
    return Dimensions(width, height, fmt, orientation)

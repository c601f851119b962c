"""A PDF's text, page by page, read with PDFium (pypdfium2) in a reader process of its own.

PDFium is not thread-safe and parses what a stranger wrote, so the gateway never loads it:
``python -m gateway.media.pdf`` is a reader process (gateway.media.readers starts and kills them)
that caps its own address space (:data:`MEMORY_BYTES`) before it imports PDFium, then answers one
job after another on its stdin and stdout. A frame is a 4-byte big-endian length and its bytes; a
job is two frames (its JSON header, the PDF), an answer one (JSON: ``{"pages": [...]}``, with
``"images": [[width, height, base64 PNG], ...]`` when the job asks for page images, or
``{"error": ...}``). A document that breaks a bound is an error answer; one that makes PDFium
abort (out of its memory) ends the process, which its parent reports; the parent kills one that
takes too long. This PDFium has no JavaScript engine: nothing a document carries is run, and a
document that carries scripts is refused.
"""

from __future__ import annotations

import base64
import io
import math
import re
import sys
from dataclasses import dataclass
from typing import Any, BinaryIO

MEMORY_BYTES = 1 << 30  # a reader's address space: a decompression bomb ends it, not the gateway
# names of script actions, as written or with #xx escapes (pdfid's test): refused
_SCRIPT_NAME = re.compile(rb"/(?:J|#4[aA])(?:S|#53)(?![A-Za-z0-9#])|/(?:J|#4[aA])(?:a|#61)(?:v|#76)(?:a|#61)")


MAX_SIDE = 4096  # a page image's side at most, in pixels
MAX_ASPECT = 200  # a page longer than this times its width (or wider) is no image a model takes


def _scripted(data: bytes) -> bool:
    """Whether the document names a script action outside its streams (what a stream holds is
    compressed or content: random bytes there spell ``/JS`` about once in 22 MB, a scanned page's
    false alarm). A script in a compressed object stream is not seen: this PDFium runs none."""
    at = 0
    while True:
        start = data.find(b"stream", at)
        if _SCRIPT_NAME.search(data, at, len(data) if start < 0 else start):
            return True
        end = data.find(b"endstream", start + 6) if start >= 0 else -1
        if end < 0:
            return False
        at = end + 9


class Refused(Exception):
    """The document breaks a bound, or PDFium cannot read it: said to the client as 400."""


@dataclass(frozen=True, slots=True)
class Render:
    """How page images are made: at ``dpi``, each within ``max_pixels`` (a larger page is
    rendered smaller, its aspect kept) and, as PNG, ``max_bytes``; a document's within
    ``max_total_bytes``."""

    dpi: int
    max_pixels: int
    max_bytes: int
    max_total_bytes: int


PageImage = tuple[int, int, str]  # width, height, the PNG in base64


def read(
    data: bytes, *, max_pages: int, max_chars: int, render: Render | None = None
) -> tuple[list[str], list[PageImage]]:
    """The text of each page of the PDF in ``data`` (lines joined by ``\\n``), at most
    ``max_pages`` pages and ``max_chars`` characters in all, and with ``render`` an image of each
    page; else :class:`Refused`."""
    import pypdfium2 as pdfium
    import pypdfium2.raw as raw

    if _scripted(data):
        raise Refused("it carries JavaScript, which the gateway does not run; a PDF with scripts is refused")
    try:
        document = pdfium.PdfDocument(data)
    except pdfium.PdfiumError as exc:
        code = raw.FPDF_GetLastError()
        if code in (raw.FPDF_ERR_PASSWORD, raw.FPDF_ERR_SECURITY):
            raise Refused("it is encrypted (password-protected); send it without a password") from None
        raise Refused(f"PDFium cannot read it: malformed or truncated ({exc})") from None
    try:
        if raw.FPDFDoc_GetJavaScriptActionCount(document) > 0:
            raise Refused("it carries JavaScript, which the gateway does not run; a PDF with scripts is refused")
        count = len(document)
        if count == 0:
            raise Refused("it has no pages")
        if count > max_pages:
            raise Refused(f"it has {count} pages, more than the {max_pages} the model takes (extract.max_pages)")
        pages: list[str] = []
        images: list[PageImage] = []
        chars = 0
        for i in range(count):
            page = document[i]
            try:
                textpage = page.get_textpage()
                text = textpage.get_text_bounded().replace("\r\n", "\n").replace("\r", "\n").strip()
                textpage.close()
                chars += len(text)
                if chars > max_chars:
                    raise Refused(f"its text passes {max_chars} characters (server.max_text_chars) by page {i + 1}")
                pages.append(text)
                if render is not None:
                    images.append(_image(page, i + 1, render))
                    made = sum(len(b) for _, _, b in images) // 4 * 3
                    if made > render.max_total_bytes:
                        raise Refused(
                            f"its page images pass {render.max_total_bytes} bytes as PNG by page {i + 1}; "
                            "send fewer pages, or a lower extract.dpi"
                        )
            finally:
                page.close()
        return pages, images
    finally:
        document.close()


def _image(page: Any, number: int, render: Render) -> PageImage:
    """Page ``number`` rendered at the dpi, or smaller to fit the pixels, as PNG."""
    width, height = page.get_size()  # points (1/72 inch), its rotation applied
    if not (width >= 1 and height >= 1):
        raise Refused(f"its page {number} has no size ({width:g}x{height:g} points)")
    if max(width, height) > MAX_ASPECT * min(width, height):
        raise Refused(
            f"its page {number} is {width:g}x{height:g} points, one side over {MAX_ASPECT} times the other: "
            "no image a model takes"
        )
    scale = min(render.dpi / 72, MAX_SIDE / width, MAX_SIDE / height, math.sqrt(render.max_pixels / (width * height)))
    while math.ceil(width * scale) * math.ceil(height * scale) > render.max_pixels:  # PDFium rounds up
        scale *= 0.99
    bitmap = page.render(scale=scale, may_draw_forms=True)
    try:
        image = _grey_if_grey(bitmap.to_pil())
        out = io.BytesIO()
        image.save(out, "PNG", compress_level=6)
    finally:
        bitmap.close()
    png = out.getvalue()
    if len(png) > render.max_bytes:
        raise Refused(
            f"the image of its page {number} is {len(png)} bytes as PNG, "
            f"over media.max_image_bytes ({render.max_bytes})"
        )
    return image.width, image.height, base64.b64encode(png).decode()


def _grey_if_grey(image: Any) -> Any:
    """An RGB page whose every pixel is grey as one channel, losing nothing: a page of text is,
    and its PNG is a tenth the bytes and a fifth the time (docs/benchmarks.md)."""
    from PIL import ImageChops

    if image.mode != "RGB":
        return image
    red, green, blue = image.split()
    if ImageChops.difference(red, green).getbbox() is None and ImageChops.difference(green, blue).getbbox() is None:
        return red
    return image


def _frame(stream: BinaryIO) -> bytes | None:
    head = stream.read(4)
    if len(head) < 4:
        return None
    size = int.from_bytes(head, "big")
    data = stream.read(size)
    return data if len(data) == size else None


def _answer(stream: BinaryIO, answer: dict[str, Any]) -> None:
    import orjson

    data = orjson.dumps(answer)
    stream.write(len(data).to_bytes(4, "big") + data)
    stream.flush()


def main() -> None:  # pragma: no cover - run as a process (tests/media/test_documents.py)
    import resource

    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_BYTES, MEMORY_BYTES))
    import orjson

    source, sink = sys.stdin.buffer, sys.stdout.buffer
    while (header := _frame(source)) is not None and (data := _frame(source)) is not None:
        job = orjson.loads(header)
        render = Render(**job["render"]) if job.get("render") else None
        try:
            pages, images = read(data, max_pages=job["max_pages"], max_chars=job["max_chars"], render=render)
            _answer(sink, {"pages": pages, "images": images} if render is not None else {"pages": pages})
        except Refused as exc:
            _answer(sink, {"error": str(exc)})
        except MemoryError:
            _answer(sink, {"error": f"reading it needs more than the reader's {MEMORY_BYTES >> 20} MiB", "last": True})
            return  # a fresh process for the next document
        except Exception as exc:  # PDFium or Pillow failing on it: said, and a fresh process for the next
            _answer(sink, {"error": f"PDFium cannot read it ({type(exc).__name__}: {exc})", "last": True})
            return


if __name__ == "__main__":  # pragma: no cover
    main()

"""PDFs written byte by byte, for the tests and bench/documents.py: real documents PDFium reads (text, several pages, a
page that is only an image, as a scan is) and hostile ones (encrypted, truncated, scripted, a
page-count bomb, a decompression bomb), each a few KB."""

from __future__ import annotations

import zlib
from collections.abc import Sequence


def pdf(objects: Sequence[bytes], *, trailer: bytes = b"") -> bytes:
    """A PDF of ``objects`` (object 1 the catalog), with its cross-reference table."""
    out = bytearray(b"%PDF-1.7\n%\xe2\xe3\xcf\xd3\n")
    offsets = []
    for i, body in enumerate(objects, 1):
        offsets.append(len(out))
        out += b"%d 0 obj\n" % i + body + b"\nendobj\n"
    xref = len(out)
    out += b"xref\n0 %d\n0000000000 65535 f \n" % (len(objects) + 1)
    out += b"".join(b"%010d 00000 n \n" % o for o in offsets)
    out += b"trailer\n<< /Size %d /Root 1 0 R %s>>\nstartxref\n%d\n%%%%EOF\n" % (len(objects) + 1, trailer, xref)
    return bytes(out)


def stream(data: bytes, extra: bytes = b"") -> bytes:
    return b"<< /Length %d %s>>\nstream\n" % (len(data), extra) + data + b"\nendstream"


def text_pdf(pages: Sequence[str], *, scan_page: int | None = None) -> bytes:
    """A letter-size page for each text (its lines, Helvetica 12); ``scan_page``: that page (from
    0) holds only an image of 64x64 grey pixels drawn over the page, no text."""
    objects: list[bytes] = [
        b"<< /Type /Catalog /Pages 2 0 R >>",
        b"",
        b"<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica >>",
    ]
    kids = []
    for i, text in enumerate(pages):
        n = len(objects) + 1
        kids.append(b"%d 0 R" % n)
        if i == scan_page:
            pixels = bytes(range(64)) * 64 * 3
            image = stream(zlib.compress(pixels), b"/Type /XObject /Subtype /Image /Width 64 /Height 64 "
                           b"/ColorSpace /DeviceGray /BitsPerComponent 8 /Filter /FlateDecode ")  # fmt: skip
            content = b"q 612 0 0 792 0 0 cm /Im1 Do Q"
            resources = b"<< /XObject << /Im1 %d 0 R >> >>" % (n + 2)
        else:
            lines = b"".join(b"(%s) Tj 0 -14 Td " % line.encode() for line in text.split("\n"))
            content = b"BT /F1 12 Tf 72 720 Td " + lines + b"ET"
            resources = b"<< /Font << /F1 3 0 R >> >>"
        objects.append(b"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] /Resources %s /Contents %d 0 R >>"
                       % (resources, n + 1))  # fmt: skip
        objects.append(stream(content))
        if i == scan_page:
            objects.append(image)
    objects[1] = b"<< /Type /Pages /Kids [" + b" ".join(kids) + b"] /Count %d >>" % len(kids)
    return pdf(objects)


def _one_page(catalog: bytes, *more: bytes, page: bytes = b"") -> list[bytes]:
    return [catalog, b"<< /Type /Pages /Kids [3 0 R] /Count 1 >>",
            b"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] %s>>" % page, *more]  # fmt: skip


def encrypted() -> bytes:
    """The standard security handler with a user password nobody gave."""
    handler = b"<< /Filter /Standard /V 2 /R 3 /Length 128 /P -4 /O <%s> /U <%s> >>" % (b"ab" * 32, b"cd" * 32)
    ident = b"<0123456789abcdef0123456789abcdef>"
    return pdf(
        _one_page(b"<< /Type /Catalog /Pages 2 0 R >>", handler),
        trailer=b"/Encrypt 4 0 R /ID [%s %s] " % (ident, ident),
    )


def scripted() -> bytes:
    """A script run when the document opens."""
    return pdf(
        _one_page(
            b"<< /Type /Catalog /Pages 2 0 R /OpenAction 4 0 R >>", b"<< /S /JavaScript /JS (app.alert\\(1\\)) >>"
        )
    )


def page_bomb(pages: int = 100_000) -> bytes:
    """``pages`` pages, each the same one page object: a few hundred KB."""
    kids = b"3 0 R " * pages
    return pdf([b"<< /Type /Catalog /Pages 2 0 R >>", b"<< /Type /Pages /Kids [%s] /Count %d >>" % (kids, pages),
                b"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] >>"])  # fmt: skip


def decompression_bomb(megabytes: int = 2048) -> bytes:
    """A page whose content stream inflates from ~2 MB to ``megabytes`` MB of spaces: 16 MiB
    compressed once and its bytes repeated (each block after a full flush stands alone; the
    checksum at the end is wrong, which a reader finds only after inflating it all)."""
    compressor = zlib.compressobj(9, zlib.DEFLATED, 15, 9, zlib.Z_RLE)
    chunk = b" " * (1 << 24)
    first = compressor.compress(chunk) + compressor.flush(zlib.Z_FULL_FLUSH)
    again = compressor.compress(chunk) + compressor.flush(zlib.Z_FULL_FLUSH)
    data = first + again * ((megabytes >> 4) - 1) + compressor.flush()
    return pdf(
        _one_page(
            b"<< /Type /Catalog /Pages 2 0 R >>", stream(data, b"/Filter /FlateDecode "), page=b"/Contents 4 0 R "
        )
    )


def deep() -> bytes:
    """An object graph 100,000 arrays deep."""
    return pdf(_one_page(b"<< /Type /Catalog /Pages 2 0 R /Deep " + b"[" * 100_000 + b"]" * 100_000 + b" >>"))

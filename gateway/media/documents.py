"""Documents a model cannot take, served as their text (``on_unsupported: {file: {extract: {...}}}``).

Each file part of the request (chat ``file`` with ``file_data``, Responses ``input_file`` with
``file_data`` or ``file_url``, an Anthropic ``document`` with a ``base64``, ``url`` or ``text``
source; within ``media.max_file_bytes``, a URL fetched under the ``media:`` rules) is replaced
by a text part of the request's API: ``[Text of the user's file 'NAME']`` and its text, a PDF's
page by page (``[Page 2 of 5]``). What is read:

- a PDF (by its ``%PDF-`` header, whatever it is labelled): its text, by PDFium in a reader
  process (gateway.media.readers, gateway.media.pdf), at most ``extract.max_pages`` pages, within
  ``extract.timeout_s`` (for all the request's PDFs together), the reader's 1 GiB and
  ``server.max_text_chars``; encrypted, malformed,
  truncated, scripted or over-long documents are 400 ``invalid_file``. One reading per distinct
  document: the conversions cache keeps it by the bytes' sha256 and the bounds, and requests that
  carry the same document at once share one reading.
- plain text (``text/plain``, ``text/markdown``, ``text/csv``, ``application/json``, or a
  ``.txt``, ``.md``, ``.csv``, ``.json`` name): its UTF-8 text as it is.

Any other type is 400 ``invalid_file`` naming those. What is lost: a PDF's layout, tables (their
cells become lines of text), figures and anything drawn rather than written (a scanned page has
no text: its page says so).

With ``extract: {page_images: true}`` (a model that accepts images) a PDF's pages go as images
too: each page's text, then an image part of the API's (a PNG at ``extract.dpi``, smaller where
the page would pass 4096x4096 pixels or the model's ``limits.image_pixels``, each within
``media.max_image_bytes``, a document's within :func:`page_images_bound`: 16 times the PDF's
bytes, 4 MiB at least, 64 MiB at most). They lose nothing
the pages show, and cost what images cost: the caller counts them against the model's image
limit and ``limits.visual_tokens`` (gateway.server.exchange).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ..admission.parts import Part
from ..admission.plan import EXPAND
from ..admission.route import RoutePlan
from ..config import MediaConfig, ModelConfig
from ..errors import (
    DecodersBusyError,
    GatewayError,
    InvalidFileError,
    MediaRefusedError,
    Rejection,
    UnsupportedModalityError,
)
from ..fanout import gather_all
from ..metrics import GatewayMetrics
from ..modalities import Modality
from .conversions import ConversionCache
from .decoders import DecoderPool
from .fetch import MediaFetcher, sha256
from .pdf import PageImage
from .readers import ReaderFailed, Readers, ReaderStopped

MARK = "[Text of the user's file"  # opens the text part that replaced a file
TEXT_TYPES = {"text/plain": "text", "text/markdown": "Markdown", "text/x-markdown": "Markdown",
              "text/csv": "CSV", "application/json": "JSON"}  # fmt: skip
TEXT_NAMES = {".txt": "text/plain", ".md": "text/markdown", ".markdown": "text/markdown", ".csv": "text/csv",
              ".json": "application/json"}  # fmt: skip
READS = "PDF, plain text, Markdown, CSV and JSON"  # what an error names
TEXT_IN_THREAD_BYTES = 1 << 20  # larger text files are decoded off the event loop
RENDER_MAX_PIXELS = 4096 * 4096  # a page image's pixels at most, whatever the dpi
PAGE_IMAGES_MAX_BYTES = 64 << 20  # a document's page images, as PNG, at most
PAGE_IMAGES_RATIO = 16  # ... and at most this many times the PDF's own bytes (4 MiB at least):
PAGE_IMAGES_FLOOR = 4 << 20  # a 7 KB PDF whose page boxes say 200 inches does not become 20 MB


def page_images_bound(pdf_bytes: int) -> int:
    """The most a PDF's page images may weigh as PNG: relative to what was sent."""
    return min(PAGE_IMAGES_MAX_BYTES, max(PAGE_IMAGES_FLOOR, PAGE_IMAGES_RATIO * pdf_bytes))


def _spent(timeout_s: float) -> InvalidFileError:
    return InvalidFileError(f"the request's files took extract.timeout_s ({timeout_s:g}s) in all")


class _BudgetSpent(Exception):
    """A reading stopped by the request's budget (not the document's fault: never shared)."""


@dataclass(slots=True)
class _Job:
    """One request's extraction: its plan and bounds, and the reading time its PDFs have left
    (``timeout_s`` for all of them together, not for each: a request of eight slow PDFs holds a
    decoding thread for ``timeout_s``, not eight times it; they are read one after another, so
    that the bound is exact, and the request holds one decoding thread, not all)."""

    plan: RoutePlan
    max_chars: int
    media: MediaConfig
    left_s: float
    reading: asyncio.Lock = field(default_factory=asyncio.Lock)  # its PDFs read one after another

    def spend(self, seconds: float) -> None:
        self.left_s -= seconds


@dataclass(frozen=True, slots=True)
class _File:
    name: str  # as the client named it ("" when it did not)
    media_type: str  # as labelled ("" when not)
    data: bytes | None  # its bytes; None for text given as text
    text: str | None = None  # an Anthropic ``text`` source


@dataclass(frozen=True, slots=True)
class _Read:
    kind: str  # "pdf", "text"
    pages: list[str]  # a PDF's text page by page; a text file's one
    images: list[PageImage]  # a PDF's page images (extract.page_images), else none

    def size(self) -> int:
        """What it holds of the conversions cache, in bytes."""
        return sum(len(p.encode()) + 64 for p in self.pages) + sum(len(png) + 64 for _, _, png in self.images)


class Documents:
    """Turns file parts into their text (see the module docstring)."""

    def __init__(
        self,
        metrics: GatewayMetrics,
        fetcher: MediaFetcher,
        decoders: DecoderPool,
        cache: ConversionCache | None = None,
    ) -> None:
        self._metrics = metrics
        self._fetcher = fetcher
        self._decoders = decoders
        self._cache = cache if cache is not None else ConversionCache(0)
        self._readers = Readers()

    def close(self) -> None:
        self._readers.close()

    async def extract(
        self, plan: RoutePlan, body: dict[str, Any], *, max_text_chars: int, media: MediaConfig
    ) -> dict[tuple[int, int], dict[str, Any]]:
        """What replaces each file of ``plan.extract_parts``: its text part, or (a PDF with page
        images) an expansion into its pages' text and images, with their ``sizes``."""
        contents = plan.contents(body)
        job = _Job(plan, max_text_chars, media, plan.model.policy(Modality.FILE).timeout_s)

        async def one(part: Part) -> tuple[tuple[int, int], dict[str, Any]]:
            assert part.index is not None
            return (part.message, part.index), await self._one(contents[part.message].value[part.index], part, job)

        return dict(await gather_all(*(one(p) for p in plan.extract_parts)))

    async def _one(self, value: Mapping[str, Any], part: Part, job: _Job) -> dict[str, Any]:
        plan = job.plan
        model = plan.model.name
        refused = Rejection(model, "file", "media_refused")
        try:
            file = await self._file(value, part, model, job.media)
            read = await self._read(file, job)
        except (InvalidFileError, MediaRefusedError) as exc:  # the file's fault (or size), said at its part
            raise exc.located_at(part.location, rejection=refused) from None
        self._metrics.files_extracted.labels(model, read.kind).inc()
        title = f"{MARK} '{file.name}']" if file.name else f"{MARK}]"
        text_part = plan.api.text_part
        if read.kind == "text":
            return {"type": text_part, "text": f"{title}\n{read.pages[0]}"}
        count = len(read.pages)
        if not read.images:
            said = [
                f"[Page {i} of {count}]\n{text}" if text else f"[Page {i} of {count}: no text; it may be a scan]"
                for i, text in enumerate(read.pages, 1)
            ]
            return {"type": text_part, "text": title + "\n" + "\n\n".join(said)}
        parts: list[dict[str, Any]] = []
        for i, (text, (_, _, png)) in enumerate(zip(read.pages, read.images, strict=True), 1):
            page = f"[Page {i} of {count}]\n{text}" if text else f"[Page {i} of {count}: no text, only its image]"
            parts.append({"type": text_part, "text": f"{title}\n{page}" if i == 1 else page})
            parts.append(plan.api.image_part("image/png", png))
        return {"type": EXPAND, "parts": parts, "sizes": [(w, h) for w, h, _ in read.images]}

    async def _read(self, file: _File, job: _Job) -> _Read:
        """What kind of file it is (``pdf``, ``text``) and its text, a PDF's page by page (a text
        file's is one page), within ``max_chars``; a PDF's page images when the plan sends them."""
        max_chars = job.max_chars
        if file.data is not None and file.data[:1024].find(b"%PDF-") >= 0:
            return await self._pdf(file.data, job)
        text = file.text if file.text is not None else await self._text(file)
        if len(text) > max_chars:
            raise InvalidFileError(f"its text is {len(text)} characters, over server.max_text_chars ({max_chars})")
        return _Read("text", [text], [])

    async def _text(self, file: _File) -> str:
        """A plain-text file's text, by its type or name; 400 for any other type."""
        data = file.data
        assert data is not None
        media_type = file.media_type or TEXT_NAMES.get(_suffix(file.name), "")
        if media_type == "application/pdf":
            raise InvalidFileError(
                f"the file is labelled a PDF but is not one (no %PDF- header); the gateway reads {READS}"
            )
        if media_type not in TEXT_TYPES:
            what = f"'{media_type}'" if media_type else "of no type the gateway knows"
            raise InvalidFileError(f"the file is {what}; the gateway reads {READS} files")
        if len(data) > TEXT_IN_THREAD_BYTES:
            return await asyncio.to_thread(_utf8, data, TEXT_TYPES[media_type])
        return _utf8(data, TEXT_TYPES[media_type])

    async def _pdf(self, data: bytes, job: _Job) -> _Read:
        plan = job.plan
        policy = plan.model.policy(Modality.FILE)
        render = _render(plan.model, job.media, len(data)) if plan.page_images else None
        asked = {"max_pages": policy.max_pages, "max_chars": job.max_chars, "render": render}
        model = plan.model.name

        def reading(stop: threading.Event) -> Any:  # on a decoding thread: its time is the job's
            given = job.left_s
            if given <= 0:
                raise _BudgetSpent
            started = time.perf_counter()
            try:
                return self._readers.read(asked, data, timeout_s=given, stop=stop)
            except ReaderFailed:
                if given < policy.timeout_s and time.perf_counter() - started >= given:
                    raise _BudgetSpent from None  # the request's budget ran out, not the document's own
                raise
            finally:
                job.spend(time.perf_counter() - started)

        async def make() -> _Read:
            started = time.perf_counter()
            try:
                answer = await self._decoders.run(reading)
            except ReaderFailed as exc:
                raise InvalidFileError(f"the PDF cannot be read: {exc}") from None
            except ReaderStopped:  # the gateway stops (a request that left hears nothing)
                raise DecodersBusyError("The gateway is shutting down; retry on another", reason="queue_full") from None
            if "error" in answer:
                raise InvalidFileError(f"the PDF is refused: {answer['error']}")
            images = [(int(w), int(h), str(png)) for w, h, png in answer.get("images", ())]
            self._metrics.file_extract_seconds.labels(model).observe(time.perf_counter() - started)
            self._metrics.file_pages.labels(model).inc(len(answer["pages"]))
            if images:
                self._metrics.file_page_images.labels(model).inc(len(images))
            return _Read("pdf", list(answer["pages"]), images)

        cache = self._cache
        if job.left_s <= 0:
            raise _spent(policy.timeout_s)
        try:
            async with job.reading:  # the request's PDFs one after another; a joined reading waits on none of it
                if not cache.enabled:
                    return await make()
                shape = tuple(sorted(render.items())) if render is not None else ()
                key = ("document", policy.max_pages, policy.timeout_s, job.max_chars, shape, await sha256(data))
                # what the document itself is (refused, unreadable) is said to every request that
                # shares its reading; a request's own budget spent is its own (_BudgetSpent: the
                # others read it themselves)
                return await cache.get_or_make(
                    key,
                    make,
                    size_of=_Read.size,
                    shared_errors=(InvalidFileError, DecodersBusyError),
                )
        except _BudgetSpent:
            raise _spent(policy.timeout_s) from None
        except DecodersBusyError as exc:
            self._metrics.video_decode_shed.labels(model, exc.reason).inc()
            raise

    async def _file(self, value: Mapping[str, Any], part: Part, model: str, media: MediaConfig) -> _File:
        """The file a part carries: its name, type and bytes (decoded, or fetched)."""
        file = value.get("file") if part.type == "file" else value
        file = file if isinstance(file, Mapping) else {}
        name = _name(file.get("filename") or value.get("title") or "")
        source = value.get("source") if part.type == "document" else None
        if isinstance(source, Mapping):
            return await self._source(source, name, part, model, media)
        data = file.get("file_data")
        url = file.get("file_url")
        if isinstance(data, str) and data:
            if data[:5].lower() != "data:":  # bare base64, as some clients send it
                return _File(name, "", await _base64(data, media.max_file_bytes))
            return _File(name, _data_type(data), await self._load(data, part, model, media))
        if isinstance(url, str) and url:
            return _File(name or _url_name(url), "", await self._load(url, part, model, media))
        raise _reference(part, model)

    async def _source(self, source: Mapping[str, Any], name: str, part: Part, model: str, media: MediaConfig) -> _File:
        kind = source.get("type")
        media_type = str(source.get("media_type") or "")
        if kind == "base64":
            return _File(name, media_type, await _base64(str(source.get("data", "")), media.max_file_bytes))
        if kind == "url":
            url = str(source.get("url", ""))
            return _File(name or _url_name(url), media_type, await self._load(url, part, model, media))
        if kind == "text":
            return _File(name, media_type or "text/plain", None, str(source.get("data", "")))
        if kind == "content":
            content = source.get("content")
            if isinstance(content, str):
                return _File(name, "text/plain", None, content)
            if isinstance(content, list) and all(isinstance(b, dict) and b.get("type") == "text" for b in content):
                return _File(name, "text/plain", None, "\n\n".join(str(b.get("text", "")) for b in content))
            raise InvalidFileError("a document of content blocks is read here when its blocks are text blocks only")
        raise _reference(part, model)

    async def _load(self, url: str, part: Part, model: str, media: MediaConfig) -> bytes:
        try:
            return await self._fetcher.load(url, "file", media)  # the size limit, and the fetch rules
        except GatewayError as exc:
            kind = MediaRefusedError if isinstance(exc, MediaRefusedError) else InvalidFileError
            refused = Rejection(model, "file", "media_refused")
            raise kind(f"{part.location}: {exc.message}", param=part.location, rejection=refused) from None


def _render(model: ModelConfig, media: MediaConfig, pdf_bytes: int) -> dict[str, int]:
    """How a PDF's page images are made for ``model`` (gateway.media.pdf.Render): at the policy's
    dpi, within the render cap and the pixels the model takes (its downscale target too), all of
    them within :func:`page_images_bound` of the PDF's size."""
    oversize = model.on_oversize
    caps = (RENDER_MAX_PIXELS, model.max_image_pixels, oversize.max_pixels if oversize.action == "downscale" else None)
    return {
        "dpi": model.policy(Modality.FILE).dpi,
        "max_pixels": min(c for c in caps if c is not None),
        "max_bytes": media.max_image_bytes,
        "max_total_bytes": page_images_bound(pdf_bytes),
    }


def _reference(part: Part, model: str) -> UnsupportedModalityError:
    return UnsupportedModalityError(
        f"Model '{model}' does not accept file input, and {part.location} ('{part.type}') cannot be read: it "
        "carries a file id, not the file; send its data (file_data, or a base64 source)",
        param=part.location,
        rejection=Rejection(model, "file", "unsupported"),
    )


async def _base64(data: str, max_bytes: int) -> bytes:
    if len(data) // 4 * 3 > max_bytes + 2:
        raise MediaRefusedError(f"the file is larger than media.max_file_bytes ({max_bytes} bytes)")
    try:
        if len(data) > TEXT_IN_THREAD_BYTES:  # off the event loop, as a large data URL is
            return await asyncio.to_thread(base64.b64decode, data, validate=True)
        return base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise InvalidFileError("the file's data is not valid base64") from None


def _data_type(url: str) -> str:
    """A data URL's media type ("" when it names none)."""
    head = url[5 : url.find(",")] if "," in url else ""
    return head.split(";", 1)[0].strip().lower()


def _utf8(data: bytes, what: str) -> str:
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise InvalidFileError(f"the {what} file is not UTF-8 text (byte {exc.start})") from None
    if "\x00" in text:
        raise InvalidFileError(f"the {what} file holds NUL characters: it is not text")
    return text


def _name(name: Any) -> str:
    """A file name as the text says it: printable, short, no brackets or quotes."""
    text = "".join(c for c in str(name) if c.isprintable() and c not in "[]'")
    return text[:128]


def _url_name(url: str) -> str:
    """A fetched file's name, from the last segment of its URL's path ("" for a data URL or none):
    what says a text file's type when its part says nothing."""
    if url[:5].lower() == "data:":
        return ""
    path = url.split("?", 1)[0].split("#", 1)[0]
    return _name(path.rsplit("/", 1)[-1]) if "://" in path and path.count("/") > 2 else ""


def _suffix(name: str) -> str:
    dot = name.rfind(".")
    return name[dot:].lower() if dot >= 0 else ""

"""Files served as their text (``on_unsupported: {file: {extract: ...}}``, gateway/media/documents.py):
PDFs written in the tests read by PDFium in its reader processes, plain-text types, hostile
documents refused within their bounds; the real openai and anthropic SDKs as clients."""

from __future__ import annotations

import asyncio
import base64
import io
import time
from typing import Any

import anthropic
import openai
import pytest

from gateway.config import parse_config
from gateway.errors import ConfigError
from gateway.media.documents import MARK
from gateway.modalities import Modality
from tests.conftest import Upstream, error_body, needs_video, routing
from tools import pdfs

pytestmark = pytest.mark.timeout(60)


def table(chat: Upstream | str, policy: str = "{extract: {max_pages: 20}}", media: str = "") -> str:
    url = chat if isinstance(chat, str) else chat.url
    return routing(
        f"  - {{name: texty, upstreams: [{url}], accepts: [text], on_unsupported: {{file: {policy}}}}}", extra=media
    )


def file_part(data: bytes, media_type: str = "application/pdf", name: str = "report.pdf") -> dict[str, Any]:
    url = f"data:{media_type};base64,{base64.b64encode(data).decode()}"
    return {"type": "file", "file": {"filename": name, "file_data": url}}


def ask(*parts: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"role": "user", "content": [{"type": "text", "text": "summarize"}, *parts]}]


def sent(chat: Upstream) -> list[dict[str, Any]]:
    (message,) = chat.received[-1].json()["messages"]
    parts: list[dict[str, Any]] = message["content"]
    return parts


async def test_a_pdf_becomes_its_text_page_by_page(gateway_factory, upstream_factory) -> None:
    chat = await upstream_factory("chat")
    gw = await gateway_factory(table(chat))
    document = pdfs.text_pdf(["Quarterly report\nRevenue rose", "Costs fell", ""], scan_page=2)
    async with gw.client() as client:
        raw = await client.chat.completions.with_raw_response.create(model="texty", messages=ask(file_part(document)))
    assert raw.headers["X-Gateway-Route"] == "extract"
    first, text = sent(chat)
    assert first == {"type": "text", "text": "summarize"}
    assert text == {
        "type": "text",
        "text": f"{MARK} 'report.pdf']\n[Page 1 of 3]\nQuarterly report\nRevenue rose\n\n[Page 2 of 3]\nCosts fell\n\n"
        "[Page 3 of 3: no text; it may be a scan]",
    }
    assert gw.sample("gateway_files_extracted_total", model="texty", kind="pdf") == 1
    assert gw.sample("gateway_file_pages_total", model="texty") == 3
    assert gw.sample("gateway_file_extract_seconds_count", model="texty") == 1


async def test_one_reading_per_distinct_pdf_across_parallel_requests_and_turns(
    gateway_factory, upstream_factory
) -> None:
    chat = await upstream_factory("chat")
    gw = await gateway_factory(table(chat))
    same, other = pdfs.text_pdf(["same"]), pdfs.text_pdf(["other"])
    async with gw.client() as client:
        await asyncio.gather(
            *(client.chat.completions.create(model="texty", messages=ask(file_part(same))) for _ in range(4)),
            client.chat.completions.create(model="texty", messages=ask(file_part(same), file_part(other))),
        )
        await client.chat.completions.create(model="texty", messages=ask(file_part(same)))  # a later turn
    assert gw.sample("gateway_file_extract_seconds_count", model="texty") == 2  # read once each
    assert gw.sample("gateway_files_extracted_total", model="texty", kind="pdf") == 7  # served 7 times
    assert all(p["text"].startswith(MARK) for r in chat.received for p in r.json()["messages"][0]["content"][1:])


@pytest.mark.parametrize(
    ("data", "media_type", "name"),
    [
        (b"plain words\nline two", "text/plain", "notes.txt"),
        (b"# Title\n\n- item", "text/markdown", "readme.md"),
        (b"a,b\n1,2", "text/csv", "table.csv"),
        (b'{"k": [1, 2]}', "application/json", "data.json"),
        (b"\xef\xbb\xbfnamed by its suffix", "application/octet-stream", "named.md"),
    ],
)
async def test_plain_text_files_become_their_text(gateway_factory, upstream_factory, data, media_type, name) -> None:
    chat = await upstream_factory("chat")
    gw = await gateway_factory(table(chat))
    media_type = "" if media_type == "application/octet-stream" else media_type
    async with gw.client() as client:
        await client.chat.completions.create(model="texty", messages=ask(file_part(data, media_type, name)))
    _, text = sent(chat)
    assert text["text"] == f"{MARK} '{name}']\n" + data.decode("utf-8-sig")
    assert gw.sample("gateway_files_extracted_total", model="texty", kind="text") == 1


@pytest.mark.parametrize(
    ("data", "media_type", "message"),
    [
        (pdfs.encrypted(), "application/pdf", "encrypted"),
        (pdfs.text_pdf(["whole"])[:200], "application/pdf", "malformed or truncated"),
        (pdfs.scripted(), "application/pdf", "JavaScript"),
        (pdfs.page_bomb(), "application/pdf", "it has 100000 pages, more than the 20"),
        (b"GIF89a", "image/gif", "the file is 'image/gif'; the gateway reads PDF, plain text, Markdown, CSV and JSON"),
        (b"\xff\xfe\x00bad", "text/plain", "not UTF-8 text"),
        (b"no header here", "application/pdf", "labelled a PDF but is not one"),
    ],
)
async def test_files_the_gateway_cannot_read_are_400_invalid_file(
    gateway_factory, upstream_factory, data, media_type, message
) -> None:
    chat = await upstream_factory("chat")
    gw = await gateway_factory(table(chat))
    async with gw.client() as client:
        with pytest.raises(openai.BadRequestError) as caught:
            await client.chat.completions.create(model="texty", messages=ask(file_part(data, media_type)))
    error = error_body(caught.value)
    assert error["code"] == "invalid_file" and error["param"] == "messages[0].content[1]"
    assert message in error["message"]
    assert not chat.received
    assert gw.sample("gateway_modality_rejections_total", model="texty", modality="file", reason="media_refused") == 1


async def test_a_decompression_bomb_ends_its_reader_not_the_gateway(gateway_factory, upstream_factory) -> None:
    chat = await upstream_factory("chat")
    gw = await gateway_factory(table(chat))
    async with gw.client() as client:
        with pytest.raises(openai.BadRequestError) as caught:  # 2 GB of content in a 2 MB file
            await client.chat.completions.create(model="texty", messages=ask(file_part(pdfs.decompression_bomb())))
        error = error_body(caught.value)
        assert error["code"] == "invalid_file" and "out of its memory (1 GiB)" in error["message"]
        await client.chat.completions.create(model="texty", messages=ask(file_part(pdfs.text_pdf(["after"]))))
    assert "after" in sent(chat)[1]["text"]  # a fresh reader for the next document


async def test_a_requests_pdfs_share_one_reading_time(gateway_factory, upstream_factory, monkeypatch) -> None:
    """Issue 40, finding 3: extract.timeout_s bounds all of a request's PDFs together, read one
    after another (before: each had it, so eight slow PDFs held a thread eight times as long).
    The reader here takes 0.6 s of its time, or fails at its timeout if that is shorter."""
    from gateway.media.readers import ReaderFailed, Readers
    from gateway.server.state import SERVICES_KEY

    given: list[float] = []

    def read(self: Readers, job: Any, data: bytes, *, timeout_s: float, stop: Any) -> Any:
        given.append(timeout_s)
        time.sleep(min(0.6, timeout_s))
        if timeout_s < 0.6:
            raise ReaderFailed(f"it took over {timeout_s:g}s (extract.timeout_s)")
        return {"pages": ["read"]}

    chat = await upstream_factory("chat")
    gw = await gateway_factory(table(chat, "{extract: {timeout_s: 1}}"))
    documents = gw.app[SERVICES_KEY].documents
    assert documents is not None
    monkeypatch.setattr(type(documents._readers), "read", read)
    three = [file_part(pdfs.text_pdf([f"report {n}"])) for n in range(3)]
    async with gw.client() as client:
        with pytest.raises(openai.BadRequestError) as caught:
            await client.chat.completions.create(model="texty", messages=ask(*three))
    assert error_body(caught.value)["code"] == "invalid_file"
    assert given[0] == 1.0 and len(given) == 2 and given[1] <= 0.4  # the first spent 0.6 of the 1 s
    assert not chat.received


async def test_files_over_max_files_or_max_file_bytes_are_refused(gateway_factory, upstream_factory) -> None:
    chat = await upstream_factory("chat")
    gw = await gateway_factory(table(chat, "{extract: {}, max_files: 2}", "media: {max_file_bytes: 1000}\n"))
    small = file_part(b"x", "text/plain", "a.txt")
    async with gw.client() as client:
        with pytest.raises(openai.BadRequestError) as caught:
            await client.chat.completions.create(model="texty", messages=ask(small, small, small))
        assert error_body(caught.value)["code"] == "too_many_items"
        with pytest.raises(openai.BadRequestError) as caught:
            await client.chat.completions.create(model="texty", messages=ask(file_part(b"y" * 2000, "text/plain")))
        assert "media.max_file_bytes (1000 bytes)" in error_body(caught.value)["message"]
        file_id = {"type": "file", "file": {"file_id": "file-abc"}}
        with pytest.raises(openai.BadRequestError) as caught:
            await client.chat.completions.create(model="texty", messages=ask(file_id))
        assert error_body(caught.value)["code"] == "unsupported_modality"
    assert not chat.received


async def test_responses_input_file_and_messages_documents_become_their_apis_text(
    gateway_factory, upstream_factory
) -> None:
    chat = await upstream_factory("chat")
    gw = await gateway_factory(table(chat))
    document = pdfs.text_pdf(["from the responses api"])
    url = f"data:application/pdf;base64,{base64.b64encode(document).decode()}"
    async with gw.client() as client:
        raw = await client.responses.with_raw_response.create(
            model="texty",
            input=[{"role": "user", "content": [{"type": "input_text", "text": "read"},
                                                {"type": "input_file", "filename": "r.pdf", "file_data": url}]}],
        )  # fmt: skip
    assert raw.headers["X-Gateway-Route"] == "extract"
    part = chat.received[-1].json()["input"][0]["content"][1]
    assert part == {"type": "input_text", "text": f"{MARK} 'r.pdf']\n[Page 1 of 1]\nfrom the responses api"}

    def pdf_document(data: bytes) -> dict[str, Any]:
        source = {"type": "base64", "media_type": "application/pdf", "data": base64.b64encode(data).decode()}
        return {"type": "document", "title": "m.pdf", "source": source}

    pdf_block = pdf_document(pdfs.text_pdf(["from messages"]))
    text_block = {"type": "document", "source": {"type": "text", "media_type": "text/plain", "data": "plain doc"}}
    async with anthropic.AsyncAnthropic(base_url=gw.url, api_key="sk", max_retries=0) as a:
        await a.messages.create(
            model="texty", max_tokens=8, messages=[{"role": "user", "content": [pdf_block, text_block]}]
        )
        parts = chat.received[-1].json()["messages"][0]["content"]
        assert parts == [
            {"type": "text", "text": f"{MARK} 'm.pdf']\n[Page 1 of 1]\nfrom messages"},
            {"type": "text", "text": "plain doc"},  # plain text is text: sent as a text block, not extracted
        ]
        bad = pdf_document(pdfs.encrypted())
        with pytest.raises(anthropic.BadRequestError) as caught:
            await a.messages.create(model="texty", max_tokens=8, messages=[{"role": "user", "content": [bad]}])
    body = caught.value.body
    assert isinstance(body, dict) and body["type"] == "error"
    assert body["error"]["type"] == "invalid_request_error" and "encrypted" in body["error"]["message"]


async def test_a_model_that_accepts_files_gets_them_as_sent(gateway_factory, upstream_factory) -> None:
    chat = await upstream_factory("chat")
    gw = await gateway_factory(
        routing(f"  - {{name: filer, upstreams: [{chat.url}], accepts: [text, file], engine: openai}}")
    )
    part = file_part(pdfs.text_pdf(["kept"]))
    async with gw.client() as client:
        raw = await client.chat.completions.with_raw_response.create(model="filer", messages=ask(part))
    assert raw.headers["X-Gateway-Route"] == "direct" and sent(chat)[1] == part


def test_explain_and_admin_config_show_extract() -> None:
    from gateway.admission.plan import admit
    from gateway.config import as_dict

    config = parse_config(table("http://c:1", "{extract: {max_pages: 5, timeout_s: 2}, max_files: 3}"))
    (model,) = as_dict(config)["models"]
    extract = {"max_pages": 5, "timeout_s": 2.0, "page_images": False, "dpi": 100}
    assert model["on_unsupported"]["file"] == {"extract": extract, "max_files": 3}
    assert parse_config(table("http://c:1", str(model["on_unsupported"]["file"]))) is not None  # parses back
    plan = admit(config, {"model": "texty", "messages": ask(file_part(b"x", "text/plain"))})
    assert plan.route == "extract" and plan.explain()["parts"][1]["action"] == "extract"


@pytest.mark.parametrize(
    ("policy", "message"),
    [
        ("{extract: {max_pages: 0}}", "max_pages"),
        ("{extract: {timeout_s: 900}}", "at most 300 seconds"),
        ("{extract: {dpi: 20}}", "extract.dpi"),
        ("{extract: {page_images: 1}}", "must be true or false"),
        ("{extract: {page_images: true}}", "page images are images: the model must accept image"),
        ("{extract: {pages: 3}}", "pages"),
        ("{extract: 5}", "must be a mapping"),
    ],
)
def test_extract_config_is_checked(policy, message) -> None:
    with pytest.raises(ConfigError) as caught:
        parse_config(table("http://c:1", policy))
    assert message in str(caught.value)


def test_only_files_are_extracted() -> None:
    text = routing("  - {name: t, upstreams: ['http://c:1'], accepts: [text], on_unsupported: {image: {extract: {}}}}")
    with pytest.raises(ConfigError) as caught:
        parse_config(text)
    assert "only files can be extracted, not 'image'" in str(caught.value)


async def test_a_reader_that_died_while_idle_costs_the_next_pdf_nothing(gateway_factory, upstream_factory) -> None:
    from gateway.server.state import SERVICES_KEY

    chat = await upstream_factory("chat")
    gw = await gateway_factory(table(chat))
    async with gw.client() as client:
        await client.chat.completions.create(model="texty", messages=ask(file_part(pdfs.text_pdf(["first"]))))
        documents = gw.app[SERVICES_KEY].documents
        assert documents is not None
        ((process, _),) = documents._readers._idle
        process.kill()  # between two jobs, as an OOM killer would
        process.wait()
        killed = process.pid
        await client.chat.completions.create(model="texty", messages=ask(file_part(pdfs.text_pdf(["second"]))))
    assert "second" in sent(chat)[1]["text"]
    ((fresh, _),) = documents._readers._idle
    assert fresh.pid != killed


def vision(chat: Upstream, extract: str = "page_images: true, dpi: 72", more: str = "") -> str:
    """A model that takes images but not files: its PDFs as text and page images."""
    return routing(
        f"  - {{name: seer, upstreams: [{chat.url}], accepts: [text, image]{more}, "
        f"on_unsupported: {{file: {{extract: {{{extract}}}}}}}}}"
    )


def _png() -> str:
    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", (8, 8), "white").save(out, "PNG")
    return base64.b64encode(out.getvalue()).decode()


PNG = _png()


def png_size(data: str) -> tuple[int, int]:
    from PIL import Image

    with Image.open(io.BytesIO(base64.b64decode(data))) as image:
        assert image.format == "PNG"
        return image.size


async def test_a_vision_model_gets_each_page_as_its_text_then_its_image(gateway_factory, upstream_factory) -> None:
    chat = await upstream_factory("chat")
    gw = await gateway_factory(vision(chat))
    document = pdfs.text_pdf(["Quarterly report", "Costs fell", ""], scan_page=2)
    async with gw.client() as client:
        raw = await client.chat.completions.with_raw_response.create(model="seer", messages=ask(file_part(document)))
    assert raw.headers["X-Gateway-Route"] == "extract"
    ask_text, *parts = sent(chat)
    assert ask_text == {"type": "text", "text": "summarize"}
    assert [p["type"] for p in parts] == ["text", "image_url"] * 3
    assert parts[0]["text"] == f"{MARK} 'report.pdf']\n[Page 1 of 3]\nQuarterly report"
    assert parts[2]["text"] == "[Page 2 of 3]\nCosts fell"
    assert parts[4]["text"] == "[Page 3 of 3: no text, only its image]"
    prefix = "data:image/png;base64,"
    urls = [p["image_url"]["url"] for p in parts[1::2]]
    assert all(u.startswith(prefix) for u in urls)
    assert [png_size(u[len(prefix) :]) for u in urls] == [(612, 792)] * 3  # letter at 72 dpi
    assert gw.sample("gateway_file_page_images_total", model="seer") == 3
    assert gw.sample("gateway_file_pages_total", model="seer") == 3


async def test_page_images_are_held_to_the_image_pixels_and_rendered_once(gateway_factory, upstream_factory) -> None:
    chat = await upstream_factory("chat")
    gw = await gateway_factory(vision(chat, "page_images: true, dpi: 300", ", limits: {image_pixels: 100000}"))
    part = file_part(pdfs.text_pdf(["one"]))
    async with gw.client() as client:
        for _ in range(2):  # a later turn: from the conversions cache
            await client.chat.completions.create(model="seer", messages=ask(part))
    url = sent(chat)[2]["image_url"]["url"]
    width, height = png_size(url.split(",", 1)[1])
    assert width * height <= 100_000 and abs(width / height - 612 / 792) < 0.01  # smaller, its aspect kept
    assert gw.sample("gateway_file_extract_seconds_count", model="seer") == 1
    assert gw.sample("gateway_file_page_images_total", model="seer") == 1


async def test_page_images_count_against_the_image_limit_and_visual_tokens(gateway_factory, upstream_factory) -> None:
    chat = await upstream_factory("chat")
    three = file_part(pdfs.text_pdf(["a", "b", "c"]))
    gw = await gateway_factory(vision(chat, more=", limits: {image: 3}"))
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64," + PNG}}
    async with gw.client() as client:
        await client.chat.completions.create(model="seer", messages=ask(three))  # 3 of 3
        with pytest.raises(openai.BadRequestError) as caught:
            await client.chat.completions.create(model="seer", messages=ask(image, three))
    error = error_body(caught.value)
    assert error["code"] == "too_many_items" and error["param"] == "messages[0].content[2]"
    assert "at most 3 image(s)" in error["message"] and "3 make 4" in error["message"]
    assert len(chat.received) == 1
    # Qwen2.5-VL: a letter page at 72 dpi is 616x784 after its smart_resize, 22x28 = 616 tokens
    qwen = ", visual_tokens: {preset: qwen2.5-vl}, limits: {visual_tokens: 1500}"
    gw = await gateway_factory(vision(chat, more=qwen))
    async with gw.client() as client:
        await client.chat.completions.create(model="seer", messages=ask(file_part(pdfs.text_pdf(["a", "b"]))))
        assert gw.sample("gateway_visual_tokens_total", model="seer") == 1232
        with pytest.raises(openai.BadRequestError) as caught:
            await client.chat.completions.create(model="seer", messages=ask(three))
    error = error_body(caught.value)
    assert error["code"] == "too_many_visual_tokens" and "1848" in error["message"]
    assert len(chat.received) == 2


async def test_page_images_go_in_the_shape_of_each_api(gateway_factory, upstream_factory) -> None:
    chat = await upstream_factory("chat")
    gw = await gateway_factory(vision(chat))
    document = pdfs.text_pdf(["page"])
    data = base64.b64encode(document).decode()
    async with gw.client() as client:
        await client.responses.create(
            model="seer",
            input=[{"role": "user", "content": [{"type": "input_file", "filename": "r.pdf",
                                                "file_data": f"data:application/pdf;base64,{data}"}]}],
        )  # fmt: skip
    text, image = chat.received[-1].json()["input"][0]["content"]
    assert text == {"type": "input_text", "text": f"{MARK} 'r.pdf']\n[Page 1 of 1]\npage"}
    assert image["type"] == "input_image" and image["image_url"].startswith("data:image/png;base64,")
    block = {"type": "document", "source": {"type": "base64", "media_type": "application/pdf", "data": data}}
    async with anthropic.AsyncAnthropic(base_url=gw.url, api_key="sk", max_retries=0) as a:
        await a.messages.create(model="seer", max_tokens=8, messages=[{"role": "user", "content": [block]}])
    text, image = chat.received[-1].json()["messages"][0]["content"]
    assert text == {"type": "text", "text": f"{MARK}]\n[Page 1 of 1]\npage"}
    assert image["type"] == "image" and image["source"]["media_type"] == "image/png"
    assert png_size(image["source"]["data"]) == (612, 792)


async def test_a_page_image_over_max_image_bytes_is_400_invalid_file(gateway_factory, upstream_factory) -> None:
    chat = await upstream_factory("chat")
    table = vision(chat).replace("models:", "media: {max_image_bytes: 2000}\nmodels:", 1)
    gw = await gateway_factory(table)
    async with gw.client() as client:
        with pytest.raises(openai.BadRequestError) as caught:
            await client.chat.completions.create(model="seer", messages=ask(file_part(pdfs.text_pdf(["wordy " * 50]))))
    error = error_body(caught.value)
    assert error["code"] == "invalid_file" and "over media.max_image_bytes (2000)" in error["message"]
    assert not chat.received


async def test_page_images_are_bounded_by_what_was_sent(gateway_factory, upstream_factory, monkeypatch) -> None:
    """Issue 40, finding 3: a small PDF whose page box is huge does not become a huge upstream
    body: its page images weigh at most 16 times its bytes (4 MiB at least; that floor is taken
    away here so that a test-sized PDF shows the bound)."""
    from gateway.media import documents

    monkeypatch.setattr(documents, "PAGE_IMAGES_FLOOR", 0)
    chat = await upstream_factory("chat")
    gw = await gateway_factory(vision(chat, "page_images: true, dpi: 72"))
    big = pdfs.text_pdf(["wide " * 40] * 3).replace(b"[0 0 612 792]", b"[0 0 4000 4000]")
    async with gw.client() as client:
        with pytest.raises(openai.BadRequestError) as caught:
            await client.chat.completions.create(model="seer", messages=ask(file_part(big)))
        error = error_body(caught.value)
        assert error["code"] == "invalid_file" and f"pass {16 * len(big)} bytes as PNG" in error["message"]
        await client.chat.completions.create(model="seer", messages=ask(file_part(pdfs.text_pdf(["small"]))))
    assert len(chat.received) == 1


def test_page_images_bound() -> None:
    from gateway.media.documents import page_images_bound

    assert page_images_bound(7_000) == 4 << 20
    assert page_images_bound(1 << 20) == 16 << 20
    assert page_images_bound(100 << 20) == 64 << 20


def test_a_page_renders_within_its_pixels_whatever_its_size_or_rotation() -> None:
    from gateway.media.pdf import Render, read

    render = Render(dpi=300, max_pixels=1 << 20, max_bytes=1 << 24, max_total_bytes=1 << 26)
    letter = pdfs.text_pdf(["x"])
    huge = letter.replace(b"/MediaBox [0 0 612 792]", b"/MediaBox [0 0 14400 14400]")
    turned = letter.replace(b"/MediaBox [0 0 612 792]", b"/MediaBox [0 0 612 792] /Rotate 90")
    ((w, h, _),) = read(huge, max_pages=1, max_chars=100, render=render)[1]
    assert w * h <= 1 << 20 and w == h
    ((w, h, _),) = read(turned, max_pages=1, max_chars=100, render=Render(72, 1 << 24, 1 << 24, 1 << 26))[1]
    assert (w, h) == (792, 612)  # as shown: turned
    assert read(letter, max_pages=1, max_chars=100) == (["x"], [])  # no render: no images


def test_a_grey_page_is_one_channel_and_a_coloured_one_keeps_its_colour() -> None:
    from PIL import Image

    from gateway.media.pdf import Render, read

    render = Render(dpi=72, max_pixels=1 << 24, max_bytes=1 << 24, max_total_bytes=1 << 26)
    red = pdfs.pdf(pdfs._one_page(b"<< /Type /Catalog /Pages 2 0 R >>", pdfs.stream(b"1 0 0 rg 72 72 200 200 re f"),
                                  page=b"/Contents 4 0 R "))  # fmt: skip
    modes = []
    for document in (pdfs.text_pdf(["grey text"]), red):
        ((_, _, png),) = read(document, max_pages=1, max_chars=100, render=render)[1]
        with Image.open(io.BytesIO(base64.b64decode(png))) as image:
            modes.append(image.mode)
            if image.mode == "RGB":
                assert image.getpixel((100, 792 - 100)) == (255, 0, 0)
    assert modes == ["L", "RGB"]


async def test_a_reader_that_stops_reading_is_killed_at_the_timeout(gateway_factory, upstream_factory) -> None:
    import os
    import signal

    from gateway.server.state import SERVICES_KEY

    chat = await upstream_factory("chat")
    gw = await gateway_factory(table(chat, "{extract: {timeout_s: 1.5}}"))  # a reader starts in ~0.2 s
    async with gw.client() as client:
        await client.chat.completions.create(model="texty", messages=ask(file_part(pdfs.text_pdf(["first"]))))
        documents = gw.app[SERVICES_KEY].documents
        assert documents is not None
        ((process, _),) = documents._readers._idle
        os.kill(process.pid, signal.SIGSTOP)  # alive, reading nothing: the pipe fills
        large = pdfs.text_pdf(["large"]) + b"%" + b"x" * (1 << 20) + b"\n"
        with pytest.raises(openai.BadRequestError) as caught:
            await client.chat.completions.create(model="texty", messages=ask(file_part(large)))
        assert "took over 1.5s (extract.timeout_s)" in error_body(caught.value)["message"]
        assert process.poll() is not None  # killed
        await client.chat.completions.create(model="texty", messages=ask(file_part(pdfs.text_pdf(["after"]))))
    assert "after" in sent(chat)[1]["text"]


def test_explain_says_a_pdf_goes_with_its_page_images() -> None:
    from gateway.admission.plan import admit
    from gateway.config import as_dict

    config = parse_config(
        routing("  - {name: seer, upstreams: ['http://c:1'], accepts: [text, image], "
                "on_unsupported: {file: {extract: {page_images: true, dpi: 150}}}}")
    )  # fmt: skip
    plan = admit(config, {"model": "seer", "messages": ask(file_part(b"x", "text/plain"))})
    assert plan.route == "extract" and plan.explain()["parts"][1]["action"] == "extract, page images of a PDF"
    extract = as_dict(config)["models"][0]["on_unsupported"]["file"]["extract"]
    assert extract["page_images"] is True and extract["dpi"] == 150
    assert "page images at 150 dpi" in str(config.models[0].policy(Modality.FILE))


async def test_a_fetched_file_is_named_by_its_url(gateway_factory, upstream_factory) -> None:
    files = {"/notes.md": b"# From a URL", "/report.pdf": pdfs.text_pdf(["fetched"])}
    server = await upstream_factory("media", files=files)
    chat = await upstream_factory("chat")
    gw = await gateway_factory(table(chat, media="media: {allow_private_networks: true}\n"))
    parts = [{"type": "input_file", "file_url": f"{server.url}{path}?v=1"} for path in files]
    async with gw.client() as client:
        await client.responses.create(model="texty", input=[{"role": "user", "content": parts}])
    texts = [p["text"] for p in chat.received[-1].json()["input"][0]["content"]]
    assert texts == [f"{MARK} 'notes.md']\n# From a URL", f"{MARK} 'report.pdf']\n[Page 1 of 1]\nfetched"]


@needs_video
async def test_a_videos_frames_make_room_for_page_images(gateway_factory, upstream_factory) -> None:
    from tests.videos import video, video_part

    chat = await upstream_factory("chat")
    policies = "file: {extract: {page_images: true, dpi: 36}}, video: {frames: 8, timestamps: false}"
    gw = await gateway_factory(
        routing(f"  - {{name: seer, upstreams: [{chat.url}], accepts: [text, image], limits: {{image: 8}}, "
                f"on_unsupported: {{{policies}}}}}")
    )  # fmt: skip
    clip = video_part(video())
    async with gw.client() as client:
        await client.chat.completions.create(model="seer", messages=ask(clip, file_part(pdfs.text_pdf(["one", "two"]))))
        images = [p for p in sent(chat) if p["type"] == "image_url"]
        assert len(images) == 8  # 6 frames and 2 pages, where the video alone gets 8
        with pytest.raises(openai.BadRequestError) as caught:  # 8 pages leave no frame for the video
            await client.chat.completions.create(model="seer", messages=ask(clip, file_part(pdfs.text_pdf(["p"] * 8))))
    error = error_body(caught.value)
    assert error["code"] == "too_many_items" and error["param"] == "messages[0].content[2]"
    assert "a frame for each of 1 video(s)" in error["message"] and "make 9" in error["message"]
    assert len(chat.received) == 1


def test_a_pdf_is_refused_for_scripts_it_names_not_for_bytes_in_its_streams() -> None:
    from gateway.media.pdf import Refused, read

    noise = pdfs.stream(b"\x00/JS\x01 random image bytes /JavaScript", b"/Subtype /Image ")
    harmless = pdfs.pdf(pdfs._one_page(b"<< /Type /Catalog /Pages 2 0 R >>", noise))
    assert read(harmless, max_pages=1, max_chars=100) == ([""], [])
    with pytest.raises(Refused, match="JavaScript"):
        read(pdfs.scripted(), max_pages=1, max_chars=100)


def test_a_page_of_no_image_shape_is_refused_and_a_long_one_kept_within_its_side() -> None:
    from gateway.media.pdf import Refused, Render, read

    render = Render(dpi=300, max_pixels=1 << 24, max_bytes=1 << 24, max_total_bytes=1 << 26)
    letter = pdfs.text_pdf(["x"])
    with pytest.raises(Refused, match="over 200 times the other"):
        read(letter.replace(b"[0 0 612 792]", b"[0 0 3 14400]"), max_pages=1, max_chars=100, render=render)
    ((w, h, _),) = read(letter.replace(b"[0 0 612 792]", b"[0 0 300 14400]"), max_pages=1, max_chars=100,
                        render=render)[1]  # fmt: skip
    assert h == 4096 and w == 86

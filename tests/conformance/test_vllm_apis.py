"""The other APIs, held to vLLM 0.33's own code: Responses (vLLM's ``ResponsesRequest`` and its
conversion to chat), Messages (vLLM's ``AnthropicMessagesRequest`` and its own Anthropic-to-chat
conversion), the pooling APIs in every shape their request models take, and transcription."""

from __future__ import annotations

import base64
from typing import Any

import aiohttp
import pytest

from tests.conformance.conftest import Engine
from tests.conftest import routing
from tests.images import data_url, png
from tests.media.test_transcribe import wav
from tools import pdfs

pytestmark = pytest.mark.timeout(180)
PNG = png(size=(32, 32))
B64 = base64.b64encode(PNG).decode()


async def post(url: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    async with aiohttp.ClientSession() as session, session.post(url, json=body) as resp:
        return resp.status, await resp.json()


# --- Responses ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "image",
    [
        {"type": "input_image", "image_url": data_url(PNG), "detail": "auto"},
        {"type": "input_image", "image_url": {"url": data_url(PNG)}},  # the chat shape: normalized
    ],
)
async def test_responses_images_are_what_vllm_decodes(gateway_factory, vllm, image: dict[str, Any]) -> None:
    engine: Engine = await vllm()
    gw = await gateway_factory(routing(f"  - {{name: omni, upstreams: [{engine.url}], accepts: [text, image]}}"))
    body = {
        "model": "omni",
        "instructions": "be brief",
        "input": [
            {"role": "user", "content": [{"type": "input_text", "text": "what is it?"}, image]},
            {"type": "function_call", "call_id": "c1", "name": "shot", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": [image]},
            {"type": "custom_tool_call", "call_id": "c2", "name": "patch", "input": "x"},
            {"type": "custom_tool_call_output", "call_id": "c2", "output": [image]},
        ],
    }
    status, answer = await post(f"{gw.url}/v1/responses", body)
    assert status == 200, answer
    assert engine.last().found.counts == {"image": 3}  # the custom tool's output is read for images too


async def test_a_responses_pdf_as_its_text_and_page_images_is_what_vllm_decodes(gateway_factory, vllm) -> None:
    engine: Engine = await vllm()
    gw = await gateway_factory(
        routing(
            f"  - {{name: pager, upstreams: [{engine.url}], accepts: [text, image], "
            "on_unsupported: {file: {extract: {page_images: true, dpi: 36}}}}"
        )
    )
    data = base64.b64encode(pdfs.text_pdf(["one"])).decode()
    part = {"type": "input_file", "filename": "r.pdf", "file_data": f"data:application/pdf;base64,{data}"}
    status, answer = await post(
        f"{gw.url}/v1/responses", {"model": "pager", "input": [{"role": "user", "content": [part]}]}
    )
    assert status == 200, answer
    assert engine.last().found.counts == {"image": 1}


# --- Messages -----------------------------------------------------------------------------------


async def test_messages_images_and_tool_results_pass_vllms_own_conversion(gateway_factory, vllm) -> None:
    engine: Engine = await vllm()
    gw = await gateway_factory(
        routing(f"  - {{name: omni, upstreams: [{engine.url}], accepts: [text, image], apis: [messages]}}")
    )
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": B64}}
    body = {
        "model": "omni",
        "max_tokens": 16,
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "look"}, image]},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "read", "input": {}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": [image]}]},
        ],
    }
    status, answer = await post(f"{gw.url}/v1/messages", body)
    assert status == 200, answer
    assert engine.last("/v1/messages").found.counts == {"image": 2}


async def test_a_messages_document_as_its_text_passes_vllms_own_conversion(gateway_factory, vllm) -> None:
    engine: Engine = await vllm()
    gw = await gateway_factory(
        routing(
            f"  - {{name: texty, upstreams: [{engine.url}], accepts: [text], apis: [messages], "
            "on_unsupported: {file: {extract: {max_pages: 4}}}}"
        )
    )
    data = base64.b64encode(pdfs.text_pdf(["hello"])).decode()
    document = {"type": "document", "source": {"type": "base64", "media_type": "application/pdf", "data": data}}
    body = {"model": "texty", "max_tokens": 16, "messages": [{"role": "user", "content": [document]}]}
    status, answer = await post(f"{gw.url}/v1/messages", body)
    assert status == 200, answer
    checked = engine.last("/v1/messages")
    assert checked.found.counts == {}


async def test_plain_text_documents_and_a_stripped_image_are_text_vllms_conversion_takes(gateway_factory, vllm) -> None:
    """vLLM's Messages API has no document block: a plain-text document (as a conversation begun
    on Anthropic's API carries one) goes as a text block; a stripped image leaves a text note."""
    engine: Engine = await vllm()
    gw = await gateway_factory(
        routing(
            f"  - {{name: texty, upstreams: [{engine.url}], accepts: [text], apis: [messages], "
            "on_unsupported: {image: strip}}"
        )
    )
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": B64}}
    text = {
        "type": "document",
        "source": {"type": "text", "media_type": "text/plain", "data": "the notes"},
        "title": "n",
    }
    blocks = {"type": "document", "source": {"type": "content", "content": [{"type": "text", "text": "one"}]}}
    content = [{"type": "text", "text": "read these"}, text, blocks]
    messages: list[dict[str, Any]] = [{"role": "user", "content": content}]
    messages += [
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "Read", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": [image]}]},
    ]
    status, answer = await post(f"{gw.url}/v1/messages", {"model": "texty", "max_tokens": 16, "messages": messages})
    assert status == 200, answer
    checked = engine.last("/v1/messages")
    assert checked.found.counts == {}
    sent = checked.body["messages"]
    assert sent[0]["content"][1:] == [{"type": "text", "text": "n\n\nthe notes"}, {"type": "text", "text": "one"}]
    note = sent[2]["content"][0]["content"][0]
    assert note == {
        "type": "text",
        "text": "[An image was removed here by the gateway: model 'texty' does not take image input]",
    }


# --- pooling ------------------------------------------------------------------------------------

IMAGE = {"type": "image_url", "image_url": {"url": data_url(PNG)}}
CONVERSATION = [{"role": "user", "content": [{"type": "text", "text": "a cat"}, IMAGE]}]
POOLING = [
    ("/v1/embeddings", {"input": "text"}, 0),
    ("/v1/embeddings", {"input": [[1, 2], [3]]}, 0),
    ("/v1/embeddings", {"messages": CONVERSATION}, 1),
    ("/v1/embeddings", {"messages": [CONVERSATION, CONVERSATION]}, 2),
    ("/v1/embeddings", {"input": CONVERSATION}, 1),
    ("/v1/embeddings", {"input": [CONVERSATION]}, 1),
    ("/score", {"queries": "a cat", "documents": [{"content": [IMAGE]}]}, 1),
    ("/score", {"queries": "a cat", "items": [{"content": [IMAGE]}, "text"]}, 1),
    ("/score", {"data_1": {"content": [IMAGE]}, "data_2": ["a"]}, 1),
    ("/v1/score", {"text_1": "a cat", "text_2": {"content": [IMAGE]}}, 1),
    ("/rerank", {"query": "a cat", "documents": ["a", {"content": [IMAGE]}]}, 1),
    ("/v2/rerank", {"query": {"content": [IMAGE]}, "documents": ["a"]}, 1),
]


@pytest.mark.parametrize(("path", "fields", "images"), POOLING, ids=[f"{p} {sorted(f)}" for p, f, _ in POOLING])
async def test_every_pooling_shape_is_admitted_as_vllm_reads_it(
    gateway_factory, vllm, path: str, fields: dict[str, Any], images: int
) -> None:
    engine: Engine = await vllm()
    gw = await gateway_factory(
        routing(
            f"  - {{name: text, upstreams: [{engine.url}], accepts: [text], apis: [embeddings, score, rerank]}}",
            f"  - {{name: vision, upstreams: [{engine.url}], accepts: [text, image], "
            "apis: [embeddings, score, rerank]}",
        )
    )
    status, answer = await post(gw.url + path, {"model": "vision", **fields})
    assert status == 200, answer
    assert engine.last().found.count("image") >= images  # a 1:N pair shows the query's image N times
    status, answer = await post(gw.url + path, {"model": "text", **fields})
    if images:
        assert status == 400 and answer["error"]["code"] == "unsupported_modality", answer
    else:
        assert status == 200
    assert engine.refusals() == []


# --- transcription ------------------------------------------------------------------------------


async def test_a_transcription_upload_is_what_vllm_decodes(gateway_factory, vllm) -> None:
    engine: Engine = await vllm("whisper")
    gw = await gateway_factory(
        routing(f"  - {{name: whisper, upstreams: [{engine.url}], apis: [transcriptions], accepts: [text, audio]}}")
    )
    form = aiohttp.FormData()
    form.add_field("model", "whisper")
    form.add_field("file", wav(0.5), filename="a.wav", content_type="audio/wav")
    form.add_field("language", "en")
    async with aiohttp.ClientSession() as session, session.post(f"{gw.url}/v1/audio/transcriptions", data=form) as resp:
        assert resp.status == 200, await resp.text()
    assert engine.last().found.duration_s == pytest.approx(0.5, abs=0.01)


async def test_responses_audio_to_a_vllm_model_is_refused_at_the_door_or_its_transcript(
    gateway_factory, vllm, upstream_factory
) -> None:
    """vLLM's Responses API has no audio part: what the gateway sends instead is what vLLM takes."""
    engine: Engine = await vllm()
    whisper = await upstream_factory("whisper")
    gw = await gateway_factory(
        routing(
            f"  - {{name: omni, upstreams: [{engine.url}], accepts: [text, audio]}}",
            f"  - {{name: heard, upstreams: [{engine.url}], accepts: [text, audio], "
            "on_unsupported: {audio: {transcribe: whisper}}}",
            f"  - {{name: whisper, upstreams: [{whisper.url}], apis: [transcriptions], accepts: [text, audio]}}",
        )
    )
    audio = {"type": "input_audio", "input_audio": {"data": base64.b64encode(wav(0.25)).decode(), "format": "wav"}}
    body = {"input": [{"role": "user", "content": [{"type": "input_text", "text": "what was said?"}, audio]}]}
    status, answer = await post(f"{gw.url}/v1/responses", {"model": "omni", **body})
    assert status == 400 and "vLLM's responses API has no audio part" in answer["error"]["message"]
    assert engine.checked == []
    status, answer = await post(f"{gw.url}/v1/responses", {"model": "heard", **body})
    assert status == 200, answer
    assert engine.last().found.counts == {}


async def test_a_translation_and_a_count_tokens_body_are_what_vllm_takes(gateway_factory, vllm) -> None:
    engine: Engine = await vllm()
    gw = await gateway_factory(
        routing(
            f"  - {{name: whisper, upstreams: [{engine.url}], apis: [transcriptions, translations], "
            "accepts: [text, audio]}",
            f"  - {{name: omni, upstreams: [{engine.url}], accepts: [text, image], apis: [messages]}}",
        )
    )
    form = aiohttp.FormData()
    form.add_field("model", "whisper")
    form.add_field("file", wav(0.5), filename="a.wav", content_type="audio/wav")
    async with aiohttp.ClientSession() as session, session.post(f"{gw.url}/v1/audio/translations", data=form) as resp:
        assert resp.status == 200, await resp.text()
    assert engine.last("/v1/audio/translations").found.duration_s == pytest.approx(0.5, abs=0.01)
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": B64}}
    body = {"model": "omni", "messages": [{"role": "user", "content": [{"type": "text", "text": "look"}, image]}]}
    status, answer = await post(f"{gw.url}/v1/messages/count_tokens", body)
    assert status == 200, answer
    assert engine.last("/v1/messages/count_tokens").found.counts == {"image": 1}

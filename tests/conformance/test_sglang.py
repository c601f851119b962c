"""What the gateway sends a model on SGLang (``engine: sglang``), held to SGLang 0.5.23's own request
models: its chat parts, its Responses parts (audio included, which vLLM's lacks), its embedding
items and rerank parts, a transcription upload."""

from __future__ import annotations

import base64
from typing import Any

import aiohttp
import pytest

from tests.conformance.conftest import Engine
from tests.conftest import routing
from tests.images import data_url, image_part, png
from tests.media.test_transcribe import input_audio, wav
from tests.videos import video, video_part

pytestmark = pytest.mark.timeout(180)
PNG = data_url(png(size=(32, 32)))
IMAGE = {"type": "image_url", "image_url": {"url": PNG}}


async def post(url: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    async with aiohttp.ClientSession() as session, session.post(url, json=body) as resp:
        return resp.status, await resp.json()


def table(engine: Engine) -> str:
    apis = "apis: [chat, responses, messages, embeddings, rerank]"
    return routing(
        f"  - {{name: sg, upstreams: [{engine.url}], engine: sglang, accepts: [text, image, video, audio], {apis}}}",
        f"  - {{name: text, upstreams: [{engine.url}], engine: sglang, accepts: [text], apis: [embeddings, rerank]}}",
    )


async def test_chat_media_and_their_conversions_are_what_sglang_takes(gateway_factory, sglang) -> None:
    engine: Engine = await sglang()
    gw = await gateway_factory(table(engine))
    parts = [image_part(png()), video_part(video(seconds=1)), input_audio(wav(0.25))]
    async with gw.client() as client:
        await client.chat.completions.create(model="sg", messages=[{"role": "user", "content": parts}])
    assert engine.last().found.counts() == {"image": 1, "video": 1, "audio": 1}


async def test_responses_images_and_audio_are_what_sglang_takes(gateway_factory, sglang) -> None:
    engine: Engine = await sglang()
    gw = await gateway_factory(table(engine))
    image = {"type": "input_image", "image_url": {"url": PNG}}  # normalized: a string, with its detail
    flat = {"type": "input_audio", "data": base64.b64encode(wav(0.25)).decode(), "format": "wav"}  # normalized: nested
    body = {"model": "sg", "input": [{"role": "user", "content": [{"type": "input_text", "text": "hi"}, image, flat]}]}
    status, answer = await post(f"{gw.url}/v1/responses", body)
    assert status == 200, answer
    assert engine.last().found.counts() == {"image": 1, "audio": 1}


async def test_messages_images_are_what_sglang_takes(gateway_factory, sglang) -> None:
    engine: Engine = await sglang()
    gw = await gateway_factory(table(engine))
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": PNG.split(",")[1]}}
    body = {"model": "sg", "max_tokens": 8, "messages": [{"role": "user", "content": [image]}]}
    status, answer = await post(f"{gw.url}/v1/messages", body)
    assert status == 200, answer
    assert engine.last().found.counts() == {"image": 1}


@pytest.mark.parametrize(
    ("path", "fields", "images"),
    [
        ("/v1/embeddings", {"input": [{"text": "a cat", "image": PNG}]}, 1),
        ("/v1/embeddings", {"input": ["a", "b"]}, 0),
        ("/v1/rerank", {"query": "a cat", "documents": ["a", [{"type": "text", "text": "d"}, IMAGE]]}, 1),
        ("/v1/rerank", {"query": [{"type": "text", "text": "q"}, IMAGE], "documents": ["a"]}, 1),
    ],
)
async def test_sglangs_pooling_shapes_are_admitted_as_sglang_reads_them(
    gateway_factory, sglang, path: str, fields: dict[str, Any], images: int
) -> None:
    engine: Engine = await sglang()
    gw = await gateway_factory(table(engine))
    status, answer = await post(gw.url + path, {"model": "sg", **fields})
    assert status == 200, answer
    assert engine.last().found.counts().get("image", 0) == images
    status, answer = await post(gw.url + path, {"model": "text", **fields})
    assert (status, answer.get("error", {}).get("code")) == ((400, "unsupported_modality") if images else (200, None))


async def test_a_transcription_upload_is_what_sglang_takes(gateway_factory, sglang) -> None:
    engine: Engine = await sglang("whisper")
    gw = await gateway_factory(
        routing(
            f"  - {{name: whisper, upstreams: [{engine.url}], engine: sglang, apis: [transcriptions], "
            "accepts: [text, audio]}"
        )
    )
    form = aiohttp.FormData()
    form.add_field("model", "whisper")
    form.add_field("file", wav(0.5), filename="a.wav", content_type="audio/wav")
    async with aiohttp.ClientSession() as session, session.post(f"{gw.url}/v1/audio/transcriptions", data=form) as resp:
        assert resp.status == 200, await resp.text()
    engine.last()


async def test_an_image_generation_is_what_sglangs_diffusion_server_takes_and_answers(gateway_factory, sglang) -> None:
    """``images.generate`` through the gateway: the body SGLang's diffusion server validates
    (``ImageGenerationsRequest``), asking base64 of a model whose images come back inline, and
    the answer the client reads held to its ``ImageResponse``; a model of ``image_urls: shared``
    gets the request as sent (SGLang's default is then a URL)."""
    from tests.conformance.engines import sglang_side

    engine: Engine = await sglang()
    gw = await gateway_factory(
        routing(
            f"  - {{name: flux, upstreams: [{engine.url}], engine: sglang, accepts: [text], produces: [image],"
            " apis: [images], output_limits: {image: 4, image_sizes: [1024x1024]}}",
            f"  - {{name: stored, upstreams: [{engine.url}], engine: sglang, accepts: [text], produces: [image],"
            " apis: [images], image_urls: shared}",
        )
    )
    async with gw.client() as client:
        made = await client.images.generate(model="flux", prompt="a cat", n=2, size="1024x1024")
        linked = await client.images.generate(model="stored", prompt="a cat")
    inline, shared = (c for c in engine.checked if c.path == "/v1/images/generations")
    assert inline.refused is None and shared.refused is None
    assert inline.body["response_format"] == "b64_json" and "response_format" not in shared.body
    for answer in (made, linked):
        sglang_side.image_response(answer.model_dump())
    assert made.data is not None and len(made.data) == 2 and made.data[0].b64_json
    assert linked.data is not None and (linked.data[0].url or "").startswith("/v1/images/")
    # what SGLang refuses, the gateway refuses first, in its own error shape (not FastAPI's {detail})
    sent = len(engine.checked)
    for field in ({"size": "big"}, {"response_format": "jpeg"}):
        with pytest.raises(sglang_side.Refused):
            sglang_side.image_generation({"prompt": "a", **field})
        status, refused = await post(f"{gw.url}/v1/images/generations", {"model": "stored", "prompt": "a", **field})
        assert status == 400 and refused["error"]["param"] == next(iter(field))
    assert len(engine.checked) == sent

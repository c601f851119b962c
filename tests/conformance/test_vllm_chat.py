"""Every conversion the gateway performs on the chat API, held to vLLM 0.33's own code: each body
it sends is validated by vLLM's ``ChatCompletionRequest`` and parsed by vLLM's chat parser with its
media decoded, and what vLLM found is what the gateway meant to send."""

from __future__ import annotations

import base64
from typing import Any

import pytest

from tests.conformance.conftest import Engine
from tests.conftest import routing
from tests.images import data_url, image_part, png
from tests.media.test_transcribe import input_audio, wav
from tests.videos import video, video_part
from tools import pdfs

pytestmark = pytest.mark.timeout(180)


def ask(*parts: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"role": "user", "content": [{"type": "text", "text": "what is it?"}, *parts]}]


def audio_url(data: bytes) -> dict[str, Any]:
    return {"type": "audio_url", "audio_url": {"url": "data:audio/wav;base64," + base64.b64encode(data).decode()}}


def file_part(data: bytes) -> dict[str, Any]:
    encoded = base64.b64encode(data).decode()
    return {"type": "file", "file": {"file_data": f"data:application/pdf;base64,{encoded}", "filename": "r.pdf"}}


async def test_media_sent_as_they_came_are_what_vllm_decodes(gateway_factory, vllm) -> None:
    engine: Engine = await vllm()
    gw = await gateway_factory(
        routing(f"  - {{name: omni, upstreams: [{engine.url}], accepts: [text, image, video, audio]}}")
    )
    parts = (image_part(png(size=(64, 48))), video_part(video(seconds=1)), input_audio(wav(0.5)), audio_url(wav(0.25)))
    async with gw.client() as client:
        await client.chat.completions.create(model="omni", messages=ask(*parts))
    found = engine.last().found
    assert found.counts == {"image": 1, "video": 1, "audio": 2}
    assert found.images[0].size == (64, 48)


async def test_a_uuid_reference_to_cached_media_is_what_vllm_takes(gateway_factory, vllm) -> None:
    engine: Engine = await vllm()
    gw = await gateway_factory(routing(f"  - {{name: omni, upstreams: [{engine.url}], accepts: [text, image]}}"))
    cached = {"type": "image_url", "image_url": None, "uuid": "sha256-of-an-image-sent-before"}
    with_uuid = {**image_part(png()), "uuid": "mine"}
    async with gw.client() as client:
        await client.chat.completions.create(model="omni", messages=ask(cached, with_uuid))
    found = engine.last().found
    assert found.counts == {"image": 2} and found.uuid_only == 1


async def test_video_as_frames_is_images_to_vllm(gateway_factory, vllm) -> None:
    engine: Engine = await vllm()
    gw = await gateway_factory(
        routing(
            f"  - {{name: framed, upstreams: [{engine.url}], accepts: [text, image], "
            "on_unsupported: {video: {frames: 4}}}"
        )
    )
    async with gw.client() as client:
        await client.chat.completions.create(model="framed", messages=ask(video_part(video(seconds=2))))
    assert engine.last().found.counts == {"image": 4}


async def test_a_pre_sampled_video_is_one_video_of_its_frames_to_vllm(gateway_factory, vllm) -> None:
    engine: Engine = await vllm()
    gw = await gateway_factory(
        routing(
            f"  - {{name: sampled, upstreams: [{engine.url}], accepts: [text, video], "
            "video: {sample: {frames: 4}}}"
        )
    )
    async with gw.client() as client:
        await client.chat.completions.create(model="sampled", messages=ask(video_part(video(seconds=2))))
    found = engine.last().found
    assert found.counts == {"video": 1}
    frames, _ = found.videos[0]
    assert len(frames) == 4


async def test_audio_as_its_transcript_reaches_vllm_as_text(gateway_factory, vllm, upstream_factory) -> None:
    engine: Engine = await vllm()
    whisper = await upstream_factory("whisper")
    gw = await gateway_factory(
        routing(
            f"  - {{name: texty, upstreams: [{engine.url}], accepts: [text], "
            "on_unsupported: {audio: {transcribe: whisper}}}",
            f"  - {{name: whisper, upstreams: [{whisper.url}], apis: [transcriptions], accepts: [text, audio]}}",
        )
    )
    async with gw.client() as client:
        await client.chat.completions.create(model="texty", messages=ask(input_audio(wav(0.5)), audio_url(wav(0.25))))
    checked = engine.last()
    assert checked.found.counts == {}
    assert all(p["type"] == "text" for p in checked.body["messages"][0]["content"])


async def test_a_pdf_as_its_text_and_page_images_is_what_vllm_decodes(gateway_factory, vllm) -> None:
    engine: Engine = await vllm()
    gw = await gateway_factory(
        routing(
            f"  - {{name: pager, upstreams: [{engine.url}], accepts: [text, image], "
            "on_unsupported: {file: {extract: {page_images: true, dpi: 36}}}}"
        )
    )
    async with gw.client() as client:
        await client.chat.completions.create(model="pager", messages=ask(file_part(pdfs.text_pdf(["one", "two"]))))
    found = engine.last().found
    assert found.counts == {"image": 2}
    assert all(image.size[0] > 0 for image in found.images)


async def test_a_downscaled_image_is_decoded_by_vllm_within_its_pixels(gateway_factory, vllm) -> None:
    engine: Engine = await vllm()
    gw = await gateway_factory(
        routing(
            f"  - {{name: small, upstreams: [{engine.url}], accepts: [text, image], "
            "limits: {image_pixels: 1024}, on_oversize: downscale}"
        )
    )
    async with gw.client() as client:
        await client.chat.completions.create(model="small", messages=ask(image_part(png(size=(256, 128)))))
    (image,) = engine.last().found.images
    assert image.size[0] * image.size[1] <= 1024


async def test_described_and_stripped_images_leave_vllm_text_and_the_describer_gets_vllms_shape(
    gateway_factory, vllm
) -> None:
    engine: Engine = await vllm()
    describer: Engine = await vllm("describer")
    gw = await gateway_factory(
        routing(
            f"  - {{name: texty, upstreams: [{engine.url}], accepts: [text], "
            "on_unsupported: {image: {describe: vision}}}",
            f"  - {{name: stripper, upstreams: [{engine.url}], accepts: [text], on_unsupported: {{image: strip}}}}",
            f"  - {{name: vision, upstreams: [{describer.url}], accepts: [text, image]}}",
        )
    )
    async with gw.client() as client:
        await client.chat.completions.create(model="texty", messages=ask(image_part(png())))
        assert engine.last().found.counts == {}
        assert describer.last().found.counts == {"image": 1}
        await client.chat.completions.create(model="stripper", messages=ask(image_part(png())))
        assert engine.last().found.counts == {}
    assert engine.refusals() == [] and describer.refusals() == []


async def test_a_part_smuggled_under_a_text_type_with_a_uuid_is_what_vllm_reads_as_an_image(
    gateway_factory, vllm
) -> None:
    """vLLM reads a part with a uuid by its media key: the gateway reads it so too."""
    engine: Engine = await vllm()
    gw = await gateway_factory(routing(f"  - {{name: omni, upstreams: [{engine.url}], accepts: [text, image]}}"))
    smuggled = {"type": "text", "text": "", "image_url": {"url": data_url(png())}, "uuid": "x"}
    for model, status in (("omni", 200),):
        async with gw.client() as client:
            raw = await client.chat.completions.with_raw_response.create(model=model, messages=ask(smuggled))
        assert raw.status_code == status
    assert engine.last().found.counts == {"image": 1}

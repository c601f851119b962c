"""What the gateway reads from engines' replies, as the stand-ins write it, held to vLLM 0.33's own
response models: chat completions and their stream chunks, Responses objects and every stream event,
Anthropic Messages and their events, error bodies in both shapes, and an encoder instance's
``ec_transfer_params``. A stand-in that answered otherwise than vLLM would make every test that
relies on it a test of our idea of vLLM."""

from __future__ import annotations

from typing import Any

import aiohttp
import orjson
import pytest

from tools.vllm_epd import EncoderInstance

pytestmark = pytest.mark.timeout(120)


async def _post(url: str, body: dict[str, Any], headers: dict[str, str] | None = None) -> tuple[int, bytes]:
    async with aiohttp.ClientSession() as session, session.post(url, json=body, headers=headers or {}) as resp:
        return resp.status, await resp.read()


def _events(data: bytes) -> list[dict[str, Any]]:
    """The JSON of each SSE event (``[DONE]`` left out)."""
    out = []
    for block in data.decode().split("\n\n"):
        for line in block.splitlines():
            if line.startswith("data: ") and line != "data: [DONE]":
                out.append(orjson.loads(line[6:]))
    return out


CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


@pytest.mark.parametrize("stream", [False, True])
async def test_chat_replies_are_vllms(upstream, stream: bool) -> None:
    from tests.conformance.engines import vllm_side

    status, data = await _post(f"{upstream.url}/v1/chat/completions", {**CHAT, "stream": stream})
    assert status == 200
    if stream:
        chunks = _events(data)
        assert chunks and all(vllm_side.chat_chunk(c) for c in chunks)
    else:
        vllm_side.chat_response(orjson.loads(data))


@pytest.mark.parametrize("stream", [False, True])
async def test_responses_replies_and_every_event_are_vllms(upstream, stream: bool) -> None:
    from tests.conformance.engines import vllm_side

    status, data = await _post(f"{upstream.url}/v1/responses", {"model": "m", "input": "hi", "stream": stream})
    assert status == 200
    if stream:
        events = _events(data)
        assert [e["type"] for e in events][:: len(events) - 1] == ["response.created", "response.completed"]
        for event in events:
            vllm_side.responses_event(event)
    else:
        vllm_side.responses_response(orjson.loads(data))


@pytest.mark.parametrize("stream", [False, True])
async def test_messages_replies_and_every_event_are_vllms(upstream, stream: bool) -> None:
    from tests.conformance.engines import vllm_side

    status, data = await _post(f"{upstream.url}/v1/messages", {**CHAT, "stream": stream})
    assert status == 200
    if stream:
        for event in _events(data):
            vllm_side.messages_event(event)
    else:
        vllm_side.messages_response(orjson.loads(data))


async def test_error_bodies_are_vllms_in_each_apis_shape(upstream) -> None:
    from tests.conformance.engines import vllm_side

    for status in (400, 503):
        got, data = await _post(f"{upstream.url}/v1/chat/completions", CHAT, {"X-Standin-Status": str(status)})
        assert got == status
        vllm_side.error_response(orjson.loads(data))
        got, data = await _post(f"{upstream.url}/v1/messages", CHAT, {"X-Standin-Status": str(status)})
        assert got == status
        vllm_side.messages_error(orjson.loads(data))


async def test_an_encoder_instances_reply_is_vllms_with_its_ec_transfer_params(upstream_factory) -> None:
    from tests.conformance.engines import vllm_side
    from tests.images import data_url, png

    instance = EncoderInstance("enc", set())
    encoder = await upstream_factory("enc", instance.app())
    images = [{"type": "image_url", "image_url": {"url": data_url(png())}, "uuid": f"u{i}"} for i in range(2)]
    body = {"model": "m", "messages": [{"role": "user", "content": images}], "stream": False}
    status, data = await _post(f"{encoder.url}/v1/chat/completions", body)
    assert status == 200
    reply = vllm_side.chat_response(orjson.loads(data))
    params: Any = reply.ec_transfer_params  # type: ignore[attr-defined]
    # as vLLM's collect_ec_item_metadata writes it: per item its modality, its positions, one image's grid
    assert sorted(params) == ["u0", "u1"]
    for i in range(2):
        entry = params[f"u{i}"]
        assert (entry["modality"], entry["item_indices"]) == ("image", [i])
        assert [type(n) for n in entry["metadata"]["image_grid_thw"]] == [int, int, int]

"""gateway.server.exchange: what one request is, read once as it begins: its key, and its body
as admission reads it (images' data URLs as far as their headers) and as every other stage does
(whole), through a live gateway with the real openai and anthropic SDKs."""

from __future__ import annotations

import base64
import io
import random
from typing import Any

import aiohttp
import anthropic
import openai
import orjson
import pytest
from aiohttp.test_utils import make_mocked_request

from gateway.admission.strings import PREFIX
from gateway.config.types import ApiKey
from gateway.server.state import API_KEY_KEY, admitted_as
from tests.conftest import Upstream, routing


def test_a_request_keeps_the_key_it_was_let_in_with() -> None:
    """The front middleware found its key; a reload since that took ``auth:`` off does not
    unkey it (its budgets and its tokens' key label stay its key's)."""
    keyed = make_mocked_request("POST", "/v1/chat/completions", headers={"x-priority": "bulk"})
    keyed[API_KEY_KEY] = key = ApiKey("team-a", key_env="UNUSED")
    assert admitted_as(keyed)[0] is key
    anonymous = make_mocked_request("POST", "/v1/chat/completions")
    assert admitted_as(anonymous)[0] is None


# --- the body as admission reads it, and as every other stage does ------------------------------

Image = pytest.importorskip("PIL.Image")


def noise(width: int = 200, height: int = 150) -> str:
    """A PNG's base64 of noise: far longer than the characters admission reads of it."""
    image = Image.frombytes("RGB", (width, height), random.Random(0).randbytes(width * height * 3))
    out = io.BytesIO()
    image.save(out, "PNG")
    data = base64.b64encode(out.getvalue()).decode()
    assert len(data) > 4 * PREFIX
    return data


def table(upstream: Upstream, **extra: str) -> str:
    more = "".join(f", {k}: {v}" for k, v in extra.items())
    models = [
        f"  - {{name: {name}, upstreams: [{upstream.url}], accepts: [text, image], "
        f"visual_tokens: {{preset: qwen2.5-vl}}, apis: [chat, responses, messages]{rename}{more}}}"
        for name, rename in (("same", ""), ("renamed", ", upstream_model: org/Renamed"))
    ]
    return routing(*models)


async def test_an_image_sent_on_as_it_came_reaches_the_engine_in_the_clients_bytes(
    gateway_factory, upstream: Upstream
) -> None:
    gw = await gateway_factory(table(upstream))
    body = orjson.dumps(chat_body("same", "data:image/png;base64," + noise()))
    async with aiohttp.ClientSession() as session:
        async with session.post(f"{gw.url}/v1/chat/completions", data=body, headers=JSON) as resp:
            assert resp.status == 200
    assert upstream.received[0].body == body


@pytest.mark.parametrize("model", ["same", "renamed"])
async def test_every_api_sends_each_image_whole_when_the_body_is_written_again(
    gateway_factory, upstream: Upstream, model: str
) -> None:
    """A rename (and any other rewrite) writes the body again: the images' data URLs, held back
    at admission, are put back whole first; one with a JSON escape in it as orjson reads it."""
    gw = await gateway_factory(table(upstream))
    data = noise()
    image = "data:image/png;base64," + data
    escaped = orjson.dumps(chat_body(model, image)).replace(
        data[-40:].encode(), data[-40:].replace("/", "\\/").encode()
    )
    source = {"type": "base64", "media_type": "image/png", "data": data}
    async with (
        openai.AsyncOpenAI(base_url=f"{gw.url}/v1", api_key="none", max_retries=0) as chat,
        anthropic.AsyncAnthropic(base_url=gw.url, api_key="none", max_retries=0) as messages,
    ):
        await chat.chat.completions.create(model=model, messages=chat_body(model, image)["messages"])
        part = {"type": "input_image", "image_url": image, "detail": "auto"}
        await chat.responses.create(model=model, input=[{"role": "user", "content": [part]}])
        block = {"type": "image", "source": source}
        await messages.messages.create(model=model, max_tokens=8, messages=[{"role": "user", "content": [block]}])
    async with aiohttp.ClientSession() as session:
        async with session.post(f"{gw.url}/v1/chat/completions", data=escaped, headers=JSON) as resp:
            assert resp.status == 200
    sent = [r.json() for r in upstream.received]
    assert sent[0]["messages"][0]["content"][0]["image_url"]["url"] == image
    assert sent[1]["input"][0]["content"][0]["image_url"] == image
    assert sent[2]["messages"][0]["content"][0]["source"]["data"] == data
    assert sent[3]["messages"][0]["content"][0]["image_url"]["url"] == image
    assert {s["model"] for s in sent} == {"org/Renamed" if model == "renamed" else model}


async def test_an_image_held_back_that_orjson_refuses_is_a_400_once_it_is_read(
    gateway_factory, upstream: Upstream
) -> None:
    """Bytes past the characters admission reads, put back for a rewrite, that are not JSON."""
    gw = await gateway_factory(table(upstream))
    data = noise()
    body = orjson.dumps(chat_body("renamed", "data:image/png;base64," + data)).replace(
        data[-40:].encode(), b"\xff" + data[-40:].encode()
    )
    async with aiohttp.ClientSession() as session:
        async with session.post(f"{gw.url}/v1/chat/completions", data=body, headers=JSON) as resp:
            assert resp.status == 400
            error = (await resp.json())["error"]
    assert error["code"] == "invalid_request" and "not valid JSON" in error["message"]
    at = int(error["message"].rsplit("at char ", 1)[1])
    assert body[at : at + 1] == b'"' and body.index(b"\xff") > at  # the string's place in the body's bytes
    assert not upstream.received
    # refused before anything of it was spent: its visual tokens not counted as admitted
    assert not gw.sample("gateway_visual_tokens_total", model="renamed")


async def test_on_the_messages_door_the_400_is_in_anthropics_shape(gateway_factory, upstream: Upstream) -> None:
    """The same refusal on /v1/messages (bytes no SDK would write: an escape JSON has not)."""
    gw = await gateway_factory(table(upstream))
    data = noise()
    block = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": data}}
    body = orjson.dumps({"model": "renamed", "max_tokens": 8, "messages": [{"role": "user", "content": [block]}]})
    body = body.replace(data[-40:].encode(), b"\\x" + data[-40:].encode())
    async with aiohttp.ClientSession() as session:
        async with session.post(f"{gw.url}/v1/messages", data=body, headers=JSON) as resp:
            assert resp.status == 400
            error = await resp.json()
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
    assert "not valid JSON" in error["error"]["message"] and not upstream.received


def chat_body(model: str, url: str) -> dict[str, Any]:
    return {
        "model": model,
        "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}],
    }


JSON = {"Content-Type": "application/json"}

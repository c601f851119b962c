"""Images served as a vision model's description (``on_unsupported: {image: {describe: M}}``,
gateway/media/describe.py): a stand-in vision model speaking the chat API, the real openai and
anthropic SDKs as clients, on chat, Responses and Messages."""

from __future__ import annotations

import asyncio
import base64
from typing import Any

import anthropic
import openai
import pytest

from gateway.admission.plan import admit
from gateway.config import parse_config
from gateway.errors import ConfigError
from gateway.media.describe import DESCRIPTION
from tests.conftest import Upstream, error_body, routing
from tests.images import data_url, image_part, png

pytestmark = pytest.mark.timeout(60)
PROMPT = "Say what is in the picture."


def table(chat: Upstream, vision: Upstream, policy: str = "{describe: vision}") -> str:
    return routing(
        f"  - {{name: texty, upstreams: [{chat.url}], accepts: [text], on_unsupported: {{image: {policy}}}}}",
        f"  - {{name: vision, upstream_model: org/Vision-7B, upstreams: [{vision.url}], accepts: [text, image]}}",
    )


def ask(*parts: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"role": "user", "content": [{"type": "text", "text": "what is it?"}, *parts]}]


def sent_parts(chat: Upstream) -> list[dict[str, Any]]:
    (message,) = chat.received[-1].json()["messages"]
    parts: list[dict[str, Any]] = message["content"]
    return parts


# what an image no describer could read leaves
FAILED = (
    "[An image was removed here by the gateway: model 'texty' does not take image input, and its description failed]"
)


async def test_an_image_becomes_the_vision_models_description(gateway_factory, upstream_factory) -> None:
    chat, vision = await upstream_factory("chat"), await upstream_factory("vision")
    gw = await gateway_factory(table(chat, vision, f"{{describe: vision, prompt: '{PROMPT}'}}"))
    image = png()
    async with gw.client() as client:
        raw = await client.chat.completions.with_raw_response.create(model="texty", messages=ask(image_part(image)))
    assert raw.headers["X-Gateway-Route"] == "describe"
    first, described = sent_parts(chat)
    assert first == {"type": "text", "text": "what is it?"} and described["type"] == "text"
    assert described["text"].startswith(DESCRIPTION + "[vision] model=org/Vision-7B")
    (asked,) = vision.received
    assert asked.path == "/v1/chat/completions"
    question = asked.json()
    assert question["model"] == "org/Vision-7B" and question["stream"] is False
    (message,) = question["messages"]
    assert message["content"] == [
        {"type": "text", "text": PROMPT},
        {"type": "image_url", "image_url": {"url": data_url(image)}},
    ]
    assert gw.sample("gateway_images_described_total", model="texty") == 1
    assert gw.sample("gateway_image_describe_seconds_count", model="texty") == 1


async def test_one_description_per_distinct_image_across_parallel_requests(gateway_factory, upstream_factory) -> None:
    chat, vision = await upstream_factory("chat"), await upstream_factory("vision")
    vision.standin.delay_ms = 100  # the first still describing while the others come
    gw = await gateway_factory(table(chat, vision))
    same, other = png((10, 200, 10)), png((10, 10, 200))
    async with gw.client() as client:
        await asyncio.gather(
            *(client.chat.completions.create(model="texty", messages=ask(image_part(same))) for _ in range(4)),
            client.chat.completions.create(model="texty", messages=ask(image_part(same), image_part(other))),
        )
        await client.chat.completions.create(model="texty", messages=ask(image_part(same)))  # a later turn
    assert len(vision.received) == 2  # one for each distinct image
    assert len(chat.received) == 6
    assert all(p["text"].startswith(DESCRIPTION) for r in chat.received for p in r.json()["messages"][0]["content"][1:])


async def test_responses_and_messages_images_are_described_as_their_apis_text(
    gateway_factory, upstream_factory
) -> None:
    chat, vision = await upstream_factory("chat"), await upstream_factory("vision")
    gw = await gateway_factory(table(chat, vision))
    image = png((1, 2, 3))
    async with gw.client() as client:
        raw = await client.responses.with_raw_response.create(
            model="texty",
            input=[{"role": "user", "content": [{"type": "input_text", "text": "what?"},
                                                {"type": "input_image", "image_url": data_url(image)}]}],
        )  # fmt: skip
    assert raw.headers["X-Gateway-Route"] == "describe"
    parts = chat.received[-1].json()["input"][0]["content"]
    assert parts[1]["type"] == "input_text" and parts[1]["text"].startswith(DESCRIPTION)
    block = {
        "type": "image",
        "source": {"type": "base64", "media_type": "image/png", "data": base64.b64encode(image).decode()},
    }
    async with anthropic.AsyncAnthropic(base_url=gw.url, api_key="sk", max_retries=0) as a:
        await a.messages.create(
            model="texty",
            max_tokens=8,
            messages=[{"role": "user", "content": [{"type": "text", "text": "what?"}, block]}],
        )
    parts = chat.received[-1].json()["messages"][0]["content"]
    assert parts[1]["type"] == "text" and parts[1]["text"].startswith(DESCRIPTION)
    assert len(vision.received) == 1  # the same image: described once, for both APIs


async def test_an_image_that_cannot_be_described_is_dropped_with_on_error_strip(
    gateway_factory, upstream_factory
) -> None:
    chat, vision = await upstream_factory("chat"), await upstream_factory("vision")
    vision.standin.fail_status = 500
    gw = await gateway_factory(table(chat, vision, "{describe: vision, on_error: strip}"))
    async with gw.client() as client:
        raw = await client.chat.completions.with_raw_response.create(model="texty", messages=ask(image_part(png())))
    assert raw.headers["X-Gateway-Route"] == "strip, describe"  # said as strip says it
    note = {"type": "text", "text": FAILED}  # the image dropped, and a note in its place says so
    assert sent_parts(chat) == [{"type": "text", "text": "what is it?"}, note]


@pytest.mark.parametrize(("on_error", "status", "code"), [("fail", 502, "upstream_error"),
                                                          ("reject", 400, "unsupported_modality")])  # fmt: skip
async def test_a_failed_description_is_the_policys_error(
    gateway_factory, upstream_factory, on_error, status, code
) -> None:
    chat, vision = await upstream_factory("chat"), await upstream_factory("vision")
    vision.standin.fail_status = 500
    gw = await gateway_factory(table(chat, vision, f"{{describe: vision, on_error: {on_error}}}"))
    async with gw.client() as client:
        with pytest.raises(openai.APIStatusError) as caught:
            await client.chat.completions.create(model="texty", messages=ask(image_part(png())))
    assert caught.value.status_code == status
    body = error_body(caught.value)
    assert body["code"] == code and body["param"] == "messages[0].content[1]"
    assert chat.received == []  # the model was never asked


async def test_an_image_the_vision_model_refuses_is_a_400_at_its_part(gateway_factory, upstream_factory) -> None:
    chat, vision = await upstream_factory("chat"), await upstream_factory("vision")
    vision.standin.fail_status = 400
    gw = await gateway_factory(table(chat, vision))
    async with gw.client() as client:
        with pytest.raises(openai.BadRequestError) as caught:
            await client.chat.completions.create(model="texty", messages=ask(image_part(png())))
    body = error_body(caught.value)
    assert body["code"] == "invalid_image" and body["param"] == "messages[0].content[1]"
    assert "describing model 'vision' could not read the image (HTTP 400" in body["message"]
    assert gw.sample("gateway_modality_rejections_total", model="texty", reason="media_refused") == 1


@pytest.mark.parametrize(
    ("policy", "problem"),
    [
        ("audio: {describe: vision}", "models[0].on_unsupported.audio.describe: only images can be described"),
        ("image: {describe: nobody}", "describing model 'nobody' is not a model here"),
        ("image: {describe: whisper}", "describing model 'whisper' must accept image and serve chat"),
        ("image: {describe: vision, on_error: shrug}", "models[0].on_unsupported.image.on_error: unknown action"),
        ("image: {describe: vision, frames: 2}", "unknown key 'frames'"),
    ],
)
def test_a_describe_policy_is_checked(policy: str, problem: str) -> None:
    text = (
        "version: 1\nmodels:\n"
        f"  - {{name: texty, upstreams: ['http://c:1'], accepts: [text], on_unsupported: {{{policy}}}}}\n"
        "  - {name: vision, upstreams: ['http://v:1'], accepts: [text, image]}\n"
        "  - {name: whisper, upstreams: ['http://w:1'], accepts: [text, audio]}\n"
    )
    with pytest.raises(ConfigError) as caught:
        parse_config(text, filename="r.yaml")
    assert problem in str(caught.value)


def test_explain_says_which_images_are_described() -> None:
    config = parse_config(
        "version: 1\nmodels:\n"
        "  - {name: texty, upstreams: ['http://c:1'], accepts: [text], on_unsupported: {image: {describe: vision}}}\n"
        "  - {name: vision, upstreams: ['http://v:1'], accepts: [text, image]}\n"
    )
    plan = admit(config, {"model": "texty", "messages": ask(image_part(png()))})
    assert plan.route == "describe" and [p["action"] for p in plan.explain()["parts"]] == ["accept", "describe"]


async def test_an_image_only_message_whose_image_is_dropped_keeps_its_note(gateway_factory, upstream_factory) -> None:
    chat, vision = await upstream_factory("chat"), await upstream_factory("vision")
    vision.standin.fail_status = 503
    gw = await gateway_factory(table(chat, vision, "{describe: vision, on_error: strip}"))
    async with gw.client() as client:
        raw = await client.chat.completions.with_raw_response.create(
            model="texty", messages=[{"role": "user", "content": [image_part(png())]}]
        )
    assert raw.headers["X-Gateway-Route"] == "strip, describe"
    assert chat.received[-1].json()["messages"] == [{"role": "user", "content": [{"type": "text", "text": FAILED}]}]
    assert gw.sample("gateway_modality_stripped_parts_total", model="texty", modality="image") == 1


async def test_a_reply_with_no_text_is_the_models_answer_not_a_failing_replica(
    gateway_factory, upstream_factory
) -> None:
    from aiohttp import web

    async def thinking(request: web.Request) -> web.Response:  # a reasoning model out of tokens
        await request.read()
        message = {"role": "assistant", "content": None, "reasoning_content": "hmm..."}
        return web.json_response({"choices": [{"index": 0, "message": message, "finish_reason": "length"}]})

    app = web.Application()
    app.router.add_post("/v1/chat/completions", thinking)
    chat, vision = await upstream_factory("chat"), await upstream_factory("vision", app)
    gw = await gateway_factory(table(chat, vision))
    async with gw.client() as client:
        with pytest.raises(openai.APIStatusError) as caught:
            await client.chat.completions.create(model="texty", messages=ask(image_part(png())))
    assert caught.value.status_code == 502 and "answered with no text" in error_body(caught.value)["message"]
    assert gw.sample("gateway_upstream_ejections_total", model="vision") == 0


async def test_more_images_than_max_images_is_a_400_before_any_is_described(gateway_factory, upstream_factory) -> None:
    chat, vision = await upstream_factory("chat"), await upstream_factory("vision")
    gw = await gateway_factory(table(chat, vision, "{describe: vision, max_images: 2}"))
    images = [image_part(png((i, 0, 0))) for i in range(3)]
    async with gw.client() as client:
        with pytest.raises(openai.BadRequestError) as caught:
            await client.chat.completions.create(model="texty", messages=ask(*images))
    body = error_body(caught.value)
    assert body["code"] == "too_many_items" and body["param"] == "messages[0].content[3]"
    assert vision.received == [] and chat.received == []


def test_admin_config_shows_the_policy_as_routing_yaml_spells_it() -> None:
    from gateway.config import as_dict

    text = (
        "version: 1\nmodels:\n"
        "  - {name: texty, upstreams: ['http://c:1'], accepts: [text], on_unsupported: {image: {describe: vision, "
        "prompt: 'What is it?', on_error: strip, max_images: 3}}}\n"
        "  - {name: vision, upstreams: ['http://v:1'], accepts: [text, image]}\n"
    )
    shown = as_dict(parse_config(text))["models"][0]["on_unsupported"]["image"]
    assert shown == {"describe": "vision", "prompt": "What is it?", "on_error": "strip", "max_images": 3}


async def test_a_descriptions_tokens_are_the_describing_models_and_spent_of_the_key(
    gateway_factory, upstream_factory
) -> None:
    import hashlib

    chat, vision = await upstream_factory("chat"), await upstream_factory("vision")
    key = "sk-describe-0123456789"
    digest = hashlib.sha256(key.encode()).hexdigest()
    keyed = f"    - {{name: team, key_sha256: {digest}, rate_limit: {{tokens_per_day: 100000}}}}\n"
    gw = await gateway_factory(table(chat, vision).replace("models:\n", f"auth:\n  keys:\n{keyed}models:\n", 1))
    async with openai.AsyncOpenAI(base_url=f"{gw.url}/v1", api_key=key, max_retries=0) as client:
        await client.chat.completions.create(model="texty", messages=ask(image_part(png())))
        first = gw.sample("gateway_tokens_total", key="team")  # the description's and the reply's
        raw = await client.chat.completions.with_raw_response.create(model="texty", messages=ask())
    description = chat.received[0].json()["messages"][0]["content"][1]["text"].removeprefix(DESCRIPTION)
    # the stand-in's usage: 10 prompt tokens, a completion token a word
    assert gw.sample("gateway_tokens_total", model="vision", key="team", kind="prompt") == 10
    assert gw.sample("gateway_tokens_total", model="vision", key="team", kind="completion") == len(description.split())
    assert 100000 - int(raw.headers["x-ratelimit-remaining-tokens-day"]) >= first - 1  # both spent (1: refilled)


async def test_descriptions_made_are_counted_though_another_image_of_the_request_fails(
    gateway_factory, upstream_factory
) -> None:
    from aiohttp import web

    answered = []

    async def once(request: web.Request) -> web.Response:  # the first answer, then failing
        await request.read()
        answered.append(1)
        if len(answered) > 1:
            return web.json_response({"error": {"message": "down"}}, status=500)
        message = {"role": "assistant", "content": "a red square"}
        usage = {"prompt_tokens": 30, "completion_tokens": 3, "total_tokens": 33}
        return web.json_response({"choices": [{"index": 0, "message": message}], "usage": usage})

    app = web.Application()
    app.router.add_post("/v1/chat/completions", once)
    chat, vision = await upstream_factory("chat"), await upstream_factory("vision", app)
    gw = await gateway_factory(table(chat, vision))
    async with gw.client() as client:
        with pytest.raises(openai.APIStatusError) as caught:
            await client.chat.completions.create(
                model="texty", messages=ask(image_part(png((1, 0, 0))), image_part(png((2, 0, 0))))
            )
    assert caught.value.status_code == 502
    assert gw.sample("gateway_tokens_total", model="vision", kind="prompt") == 30  # the one made, counted
    assert gw.sample("gateway_tokens_total", model="vision", kind="completion") == 3


async def test_a_failed_description_on_messages_is_an_error_in_anthropics_shape(
    gateway_factory, upstream_factory
) -> None:
    chat, vision = await upstream_factory("chat"), await upstream_factory("vision")
    vision.standin.fail_status = 500
    gw = await gateway_factory(table(chat, vision, "{describe: vision, on_error: reject}"))
    block = {
        "type": "image",
        "source": {"type": "base64", "media_type": "image/png", "data": base64.b64encode(png()).decode()},
    }
    async with anthropic.AsyncAnthropic(base_url=gw.url, api_key="sk", max_retries=0) as a:
        with pytest.raises(anthropic.BadRequestError) as caught:
            await a.messages.create(model="texty", max_tokens=8, messages=[{"role": "user", "content": [block]}])
    body: Any = caught.value.body
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert "its description failed" in body["error"]["message"]
    assert chat.received == []


async def test_what_a_url_returns_is_described_only_if_it_is_an_image(gateway_factory, upstream_factory) -> None:
    """It was labelled image/png whatever it was (an HTML page, a PDF) and sent to the describer."""
    chat, vision = await upstream_factory("chat"), await upstream_factory("vision")
    media = await upstream_factory("media", files={"/page": b"<html>not an image</html>", "/cat": png()})
    gw = await gateway_factory(
        "version: 1\nmedia: {allow_private_networks: true}\n" + table(chat, vision).removeprefix("version: 1\n")
    )
    async with gw.client() as client:
        with pytest.raises(openai.BadRequestError) as caught:
            await client.chat.completions.create(model="texty", messages=ask(image_part_url(f"{media.url}/page")))
        await client.chat.completions.create(model="texty", messages=ask(image_part_url(f"{media.url}/cat")))
    body = error_body(caught.value)
    assert body["code"] == "invalid_image" and "is not an image" in body["message"]
    (asked,) = vision.received  # the cat alone, as a PNG
    assert "data:image/png;base64," in asked.body.decode()


def image_part_url(url: str) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url}}

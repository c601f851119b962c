"""Visual tokens at the door: limits and downscaling through a live gateway, with the real openai
and anthropic SDKs as clients and a stand-in that records what reaches the engine."""

from __future__ import annotations

import base64
import io
from typing import Any

import anthropic
import openai
import pytest

from tests.conftest import Gateway, Upstream, error_body, routing

Image = pytest.importorskip("PIL.Image")
pytestmark = pytest.mark.timeout(60)


def table(upstream: Upstream) -> str:
    models = "\n".join(
        f"  - {{name: {name}, upstreams: [{upstream.url}], accepts: [text, image], "
        f"visual_tokens: {{preset: qwen2.5-vl}}, limits: {{visual_tokens: 3000, image_pixels: 4000000}}{extra}}}"
        for name, extra in (("q", ""), ("down", ", on_oversize: downscale"))
    )
    return routing(models)


def jpeg(width: int, height: int, *, orientation: int = 1) -> bytes:
    """A photo whose left half is red and right half blue, as stored; EXIF may turn it."""
    image = Image.new("RGB", (width, height), (220, 0, 0))
    image.paste((0, 0, 220), (width // 2, 0, width, height))
    exif = Image.Exif()
    exif[0x0112] = orientation
    out = io.BytesIO()
    image.save(out, "JPEG", exif=exif.tobytes())
    return out.getvalue()


def url(data: bytes, media_type: str = "image/jpeg") -> str:
    return f"data:{media_type};base64," + base64.b64encode(data).decode()


def ask(*urls: str) -> list[Any]:
    parts = [{"type": "image_url", "image_url": {"url": u, "detail": "high"}} for u in urls]
    return [{"role": "user", "content": [{"type": "text", "text": "what is this?"}, *parts]}]


def sent_image(received: Any) -> Any:
    """The image the engine was sent, decoded."""
    sent = received.json()["messages"][0]["content"][1]["image_url"]
    assert sent["detail"] == "high"  # the part's other keys stay
    head, _, data = sent["url"].partition(",")
    assert head == "data:image/jpeg;base64"
    return Image.open(io.BytesIO(base64.b64decode(data)))


@pytest.fixture
async def gw(gateway_factory, upstream: Upstream) -> Gateway:
    return await gateway_factory(table(upstream))


async def test_over_the_visual_token_limit_is_a_400_before_the_engine(gw: Gateway, upstream: Upstream) -> None:
    image = url(jpeg(1280, 720))
    async with gw.client() as client:
        with pytest.raises(openai.BadRequestError) as caught:
            await client.chat.completions.create(model="q", messages=ask(image, image, image))
        reply = await client.chat.completions.create(model="q", messages=ask(image, image))
    error = error_body(caught.value)
    assert (error["code"], error["param"]) == ("too_many_visual_tokens", "messages[0].content[3]")
    assert "come to 3588" in error["message"] and "1280x720" in error["message"]
    assert len(upstream.received) == 1 and reply.choices[0].message.content is not None
    assert gw.sample("gateway_modality_rejections_total", model="q", reason="too_many_visual_tokens") == 1
    assert gw.sample("gateway_visual_tokens_total", model="q") == 2 * 1196
    assert gw.sample("gateway_request_visual_tokens_count", model="q") == 1


async def test_a_photo_too_large_is_downscaled_upright_to_fit(gw: Gateway, upstream: Upstream) -> None:
    """3000x2000 stored, EXIF 6 (a phone held upright): shown 2000x3000, sent smaller, turned."""
    async with gw.client() as client:
        raw = await client.chat.completions.with_raw_response.create(
            model="down",
            messages=ask(url(jpeg(3000, 2000, orientation=6))),
        )
    assert raw.headers["X-Gateway-Route"] == "downscale"
    image = sent_image(upstream.received[-1])
    width, height = image.size
    assert width < height and width * height <= 4_000_000 and abs(width / height - 2 / 3) < 0.01
    assert image.getexif().get(0x0112, 1) == 1  # the pixels are upright: no orientation left to apply
    top, bottom = image.getpixel((width // 2, height // 8)), image.getpixel((width // 2, height * 7 // 8))
    assert top[0] > 150 > bottom[0] and bottom[2] > 150  # the stored left (red) is on top once turned
    assert gw.sample("gateway_images_downscaled_total", model="down") == 1
    assert 0 < gw.sample("gateway_visual_tokens_total", model="down") <= 3000
    async with gw.client() as client:  # the next turn sends it again: resized once, the same bytes
        await client.chat.completions.create(model="down", messages=ask(url(jpeg(3000, 2000, orientation=6))))
    assert upstream.received[-1].json()["messages"] == upstream.received[-2].json()["messages"]
    assert gw.sample("gateway_media_cache_requests_total", kind="downscale", result="hit") == 1


async def test_over_the_pixel_limit_without_downscale_is_image_too_large(gw: Gateway, upstream: Upstream) -> None:
    async with gw.client() as client:
        with pytest.raises(openai.BadRequestError) as caught:
            await client.chat.completions.create(model="q", messages=ask(url(jpeg(3000, 2000))))
    assert error_body(caught.value)["code"] == "image_too_large" and upstream.received == []


async def test_the_responses_and_messages_apis_are_limited_and_downscaled_too(
    gateway_factory, upstream: Upstream
) -> None:
    gw = await gateway_factory(
        table(upstream).replace("accepts: [text, image]", "accepts: [text, image], apis: [chat, responses, messages]")
    )
    image = jpeg(1280, 720)
    item = {"type": "input_image", "image_url": url(image)}
    async with gw.client() as client:
        with pytest.raises(openai.BadRequestError) as caught:
            await client.responses.create(model="q", input=[{"role": "user", "content": [item, item, item]}])
    assert (error_body(caught.value)["code"], error_body(caught.value)["param"]) == (
        "too_many_visual_tokens",
        "input[0].content[2]",
    )
    block = {
        "type": "image",
        "source": {"type": "base64", "media_type": "image/jpeg", "data": base64.b64encode(jpeg(3000, 2000)).decode()},
    }
    async with anthropic.AsyncAnthropic(base_url=gw.url, api_key="sk-test", max_retries=0) as client:
        with pytest.raises(anthropic.BadRequestError) as refused:
            await client.messages.create(model="q", max_tokens=8, messages=[{"role": "user", "content": [block]}])
        await client.messages.create(model="down", max_tokens=8, messages=[{"role": "user", "content": [block]}])
    assert isinstance(refused.value.body, dict) and refused.value.body["error"]["type"] == "invalid_request_error"
    assert "4000000 pixels" in refused.value.body["error"]["message"]
    source = upstream.received[-1].json()["messages"][0]["content"][0]["source"]
    assert source["type"] == "base64" and source["media_type"] == "image/jpeg"
    width, height = Image.open(io.BytesIO(base64.b64decode(source["data"]))).size
    assert width * height <= 4_000_000 and abs(width / height - 1.5) < 0.01


def png(width: int, height: int) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (width, height)).save(out, "PNG")
    return out.getvalue()


async def test_remote_images_are_fetched_for_their_header_with_remote_fetch(gateway_factory, upstream_factory) -> None:
    files = {"/small.png": png(640, 480), "/photo.jpg": jpeg(3000, 2000), "/notes.txt": b"not an image at all"}
    server = await upstream_factory("media", files=files)
    upstream = await upstream_factory("up")
    models = "\n".join(
        f"  - {{name: {name}, upstreams: [{upstream.url}], accepts: [text, image], "
        f"visual_tokens: {{preset: qwen2.5-vl, remote: fetch}}, limits: {{visual_tokens: 3000, image_pixels: 4000000}}"
        f"{extra}}}"
        for name, extra in (("q", ""), ("down", ", on_oversize: downscale"))
    )
    gw = await gateway_factory(routing(models, extra="media: {allow_private_networks: true}\n"))
    async with gw.client() as client:
        raw = await client.chat.completions.with_raw_response.create(model="q", messages=ask(f"{server.url}/small.png"))
        assert raw.headers["X-Gateway-Route"] == "direct"
        sent = upstream.received[-1].json()["messages"][0]["content"][1]["image_url"]["url"]
        # within the limits, and sent as the bytes measured: the engine does not fetch another
        assert sent == "data:image/png;base64," + base64.b64encode(files["/small.png"]).decode()
        assert gw.sample("gateway_visual_tokens_total", model="q") == 391
        with pytest.raises(openai.BadRequestError) as large:
            await client.chat.completions.create(model="q", messages=ask(f"{server.url}/photo.jpg"))
        with pytest.raises(openai.BadRequestError) as text:
            await client.chat.completions.create(model="q", messages=ask(f"{server.url}/notes.txt"))
        raw = await client.chat.completions.with_raw_response.create(
            model="down", messages=ask(f"{server.url}/photo.jpg")
        )
    assert (error_body(large.value)["code"], error_body(large.value)["param"]) == (
        "image_too_large",
        "messages[0].content[1]",
    )
    assert error_body(text.value)["code"] == "invalid_image"
    assert len(upstream.received) == 2  # neither refused one reached the engine
    assert raw.headers["X-Gateway-Route"] == "downscale"
    width, height = sent_image(upstream.received[-1]).size  # sent inline at its new size
    assert width * height <= 4_000_000 and abs(width / height - 1.5) < 0.01
    assert gw.sample("gateway_modality_rejections_total", model="q", reason="image_too_large") == 1


async def test_an_image_whose_body_is_not_its_header_is_400_not_500(gw: Gateway, upstream: Upstream) -> None:
    whole = jpeg(3000, 2000)
    async with gw.client() as client:
        for broken in (whole[: len(whole) // 2], whole[:700], whole[:400] + b"\x00" * 5000):
            with pytest.raises(openai.BadRequestError) as caught:
                await client.chat.completions.create(model="down", messages=ask(url(broken)))
            assert error_body(caught.value)["code"] in ("invalid_image", "image_too_large"), broken[:8]
        reply = await client.chat.completions.create(model="down", messages=ask(url(jpeg(64, 64))))
    assert reply.choices and upstream.received  # the gateway keeps serving


async def test_count_tokens_spends_no_visual_tokens_of_the_key(
    gateway_factory, upstream: Upstream, monkeypatch
) -> None:
    monkeypatch.setenv("MODALITY_GATEWAY_TEST_VISUAL_KEY", "sk-visual")
    model = (
        f"  - {{name: q, upstreams: [{upstream.url}], accepts: [text, image], apis: [messages], "
        "visual_tokens: {preset: qwen2.5-vl}}"
    )
    keys = (
        "auth:\n  keys:\n    - {name: k, key_env: MODALITY_GATEWAY_TEST_VISUAL_KEY, "
        "rate_limit: {visual_tokens_per_minute: 1500}}\n"
    )
    gw = await gateway_factory(routing(model, extra=keys))
    data = base64.b64encode(jpeg(1280, 720)).decode()
    block = {"type": "image", "source": {"type": "base64", "media_type": "image/jpeg", "data": data}}
    ask_one = [{"role": "user", "content": [block]}]
    async with anthropic.AsyncAnthropic(base_url=gw.url, api_key="sk-visual", max_retries=0) as client:
        for _ in range(3):  # Claude Code counts before it sends
            await client.messages.count_tokens(model="q", messages=ask_one)
        await client.messages.create(model="q", max_tokens=8, messages=ask_one)
    assert gw.sample("gateway_visual_tokens_total", model="q") == 1196  # the message's, once
    assert gw.sample("gateway_rate_limited_total", key="k") == 0

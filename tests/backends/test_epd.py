"""Encode/Prefill/Decode: images become vLLM image_embeds parts on their way upstream.

The real encoder backend (the builtin tower, on CPU) runs behind a real server on 127.0.0.1, the
gateway in front of it, a stand-in vLLM behind it, and the real openai SDK drives it all.
"""

from __future__ import annotations

import base64
import hashlib
import io

import aiohttp
import openai
import pytest
import torch
from aiohttp import web

from tests.backends.fixtures import Backend, png
from tests.conftest import Gateway, Upstream, error_body, routing
from tests.images import data_url, image_part
from tests.videos import video, video_part  # each skips without PyAV


def load_as_vllm_does(value: str) -> torch.Tensor:
    tensor = torch.load(io.BytesIO(base64.b64decode(value)), weights_only=True)
    assert isinstance(tensor, torch.Tensor) and tensor.layout == torch.strided and tensor.dim() == 2
    return tensor


def epd_config(upstream: Upstream, encoder_urls: list[str], *, passthrough: bool = False, extra: str = "") -> str:
    on_error = ", on_encoder_error: passthrough" if passthrough else ""
    return routing(
        f"  - {{name: vl, upstreams: [{upstream.url}], accepts: [text, image], encode: {{image: vision}}{on_error}}}",
        f"  - {{name: plain, upstreams: [{upstream.url}], accepts: [text, image]}}",
        extra=f"encoders:\n  vision: {{kind: http, urls: [{', '.join(encoder_urls)}], timeout_s: 30}}\n{extra}",
    )


@pytest.fixture
async def backend(backend_factory) -> Backend:
    return await backend_factory()


@pytest.fixture
async def gw(gateway_factory, upstream: Upstream, backend: Backend) -> Gateway:
    return await gateway_factory(epd_config(upstream, [backend.url]))


async def test_images_reach_the_upstream_as_loadable_image_embeds(gw: Gateway, upstream: Upstream) -> None:
    red, blue = png((255, 0, 0)), png((0, 0, 255), size=(30, 90))
    message = {
        "role": "user",
        "content": [{"type": "text", "text": "compare"}, image_part(red), image_part(blue)],
    }
    async with gw.client() as client:
        raw = await client.chat.completions.with_raw_response.create(model="vl", messages=[message])
    assert raw.headers["x-gateway-encoded"] == "2"
    sent = upstream.received[0].json()["messages"][0]["content"]
    assert sent[0] == {"type": "text", "text": "compare"}
    for part, image in zip(sent[1:], (red, blue), strict=True):
        assert set(part) == {"type", "image_embeds", "uuid"} and part["type"] == "image_embeds"
        assert part["uuid"] == hashlib.sha256(image).hexdigest()
        assert load_as_vllm_does(part["image_embeds"]).shape == (196, 384)
    assert gw.sample("gateway_encoder_requests_total", encoder="vision", outcome="ok") == 2


async def test_identical_images_in_one_request_are_encoded_once(gw: Gateway, upstream, backend) -> None:
    image = png((9, 9, 9))
    messages = [
        {"role": "user", "content": [image_part(image)]},
        {"role": "assistant", "content": "seen"},
        {"role": "user", "content": [image_part(image), {"image_url": {"url": data_url(image)}}]},
    ]
    async with gw.client() as client:
        await client.chat.completions.create(model="vl", messages=messages)
    sent = upstream.received[0].json()["messages"]
    embeds = {sent[0]["content"][0]["image_embeds"], *(p["image_embeds"] for p in sent[2]["content"])}
    assert len(embeds) == 1
    assert backend.sample("vision_encoder_cache_misses_total") == 1
    assert backend.sample("vision_encoder_cache_hits_total") == 0  # deduplicated before the backend
    assert gw.sample("gateway_encoder_requests_total", encoder="vision", outcome="ok") == 1


async def test_models_without_encode_pass_images_through(gw: Gateway, upstream) -> None:
    image = image_part(png())
    async with gw.client() as client:
        raw = await client.chat.completions.with_raw_response.create(
            model="plain", messages=[{"role": "user", "content": [image]}]
        )
    assert "x-gateway-encoded" not in raw.headers
    assert upstream.received[0].json()["messages"][0]["content"] == [image]


async def test_parts_without_image_bytes_pass_through(gw: Gateway, upstream) -> None:
    cached = {"type": "image_url", "image_url": None, "uuid": "abc"}
    embeds = {"type": "image_embeds", "image_embeds": "AAAA"}
    async with aiohttp.ClientSession() as session:
        body = {"model": "vl", "messages": [{"role": "user", "content": [cached, embeds]}]}
        async with session.post(f"{gw.url}/v1/chat/completions", json=body) as resp:
            assert resp.status == 200
            assert resp.headers["X-Gateway-Encoded"] == "0"
    assert upstream.received[0].json()["messages"][0]["content"] == [cached, embeds]


async def test_an_undecodable_image_is_a_400_naming_the_part(gw: Gateway, upstream) -> None:
    bad = {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(b"nope").decode()}}
    async with gw.client() as client:
        with pytest.raises(openai.BadRequestError) as caught:
            await client.chat.completions.create(
                model="vl", messages=[{"role": "user", "content": [image_part(png()), bad]}]
            )
    assert error_body(caught.value)["code"] == "invalid_image"
    assert error_body(caught.value)["param"] == "messages[0].content[1]"
    assert "not a decodable image" in error_body(caught.value)["message"]
    assert not upstream.received
    assert gw.sample("gateway_modality_rejections_total", model="vl", modality="image", reason="media_refused") == 1


async def test_a_malformed_data_url_is_refused_before_the_encoder(gw: Gateway, upstream, backend) -> None:
    bad = {"type": "image_url", "image_url": {"url": "data:image/png;base64,!!!not-base64!!!"}}
    async with gw.client() as client:
        with pytest.raises(openai.BadRequestError) as caught:
            await client.chat.completions.create(model="vl", messages=[{"role": "user", "content": [bad]}])
    assert error_body(caught.value)["code"] == "invalid_image"
    assert error_body(caught.value)["param"] == "messages[0].content[0]"
    assert backend.sample("vision_encoder_cache_misses_total") == 0


async def test_image_urls_are_fetched_under_the_media_rules(gateway_factory, upstream, backend) -> None:
    image = png((5, 6, 7))

    async def serve_image(request: web.Request) -> web.Response:
        return web.Response(body=image, content_type="image/png")

    media_app = web.Application()
    media_app.router.add_get("/cat.png", serve_image)
    from aiohttp.test_utils import TestServer

    media = TestServer(media_app, host="127.0.0.1", port=0)
    await media.start_server()
    try:
        url = str(media.make_url("/cat.png"))
        message = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}]
        refusing = await gateway_factory(epd_config(upstream, [backend.url]))
        async with refusing.client() as client:
            with pytest.raises(openai.BadRequestError) as caught:
                await client.chat.completions.create(model="vl", messages=message)
        assert error_body(caught.value)["code"] == "media_refused"
        allowing = await gateway_factory(
            epd_config(upstream, [backend.url], extra="media: {allow_private_networks: true}\n")
        )
        async with allowing.client() as client:
            await client.chat.completions.create(model="vl", messages=message)
    finally:
        await media.close()
    part = upstream.received[0].json()["messages"][0]["content"][0]
    assert part["uuid"] == hashlib.sha256(image).hexdigest()


async def test_an_unreachable_encoder_is_503_encoder_unavailable(gateway_factory, upstream) -> None:
    from tests.upstream.test_client import dead_url

    gw = await gateway_factory(epd_config(upstream, [dead_url()]))
    async with gw.client() as client:
        with pytest.raises(openai.InternalServerError) as caught:
            await client.chat.completions.create(
                model="vl", messages=[{"role": "user", "content": [image_part(png())]}]
            )
    assert caught.value.status_code == 503
    assert error_body(caught.value)["code"] == "encoder_unavailable"
    assert not upstream.received
    assert gw.sample("gateway_encoder_requests_total", encoder="vision", outcome="connect_error") == 1


async def test_passthrough_sends_the_original_images_when_the_encoder_fails(gateway_factory, upstream) -> None:
    from tests.upstream.test_client import dead_url

    gw = await gateway_factory(epd_config(upstream, [dead_url()], passthrough=True))
    image = image_part(png())
    async with gw.client() as client:
        raw = await client.chat.completions.with_raw_response.create(
            model="vl", messages=[{"role": "user", "content": [image]}]
        )
    assert raw.headers["x-gateway-encoded"] == "0"
    assert upstream.received[0].json()["messages"][0]["content"] == [image]
    assert gw.sample("gateway_encoder_passthrough_total", model="vl", encoder="vision") == 1


async def test_encoders_fail_over_and_spread_load(gateway_factory, upstream, backend_factory) -> None:
    from tests.upstream.test_client import dead_url

    first, second = await backend_factory(), await backend_factory()
    gw = await gateway_factory(epd_config(upstream, [dead_url(), first.url, second.url]))
    sent = 0
    async with gw.client() as client:
        # p2c draws two backends at random: both take images within a few requests
        while not (
            first.sample("vision_encoder_cache_misses_total") and second.sample("vision_encoder_cache_misses_total")
        ):
            assert sent < 40, "one backend took every image"
            await client.chat.completions.create(
                model="vl", messages=[{"role": "user", "content": [image_part(png((sent, sent, sent)))]}]
            )
            sent += 1
    misses = first.sample("vision_encoder_cache_misses_total") + second.sample("vision_encoder_cache_misses_total")
    assert misses == sent  # each image encoded once, the dead URL skipped


async def test_explain_shows_the_encode_action(gw: Gateway) -> None:
    from gateway.admission.plan import admit

    plan = admit(gw.config, {"model": "vl", "messages": [{"role": "user", "content": [image_part(png())]}]})
    decision = plan.explain()
    assert decision["encoder"] == "vision"
    assert decision["parts"][0]["action"] == "encode"


async def test_an_overloaded_backend_is_skipped_for_another(gateway_factory, upstream, backend) -> None:
    from aiohttp.test_utils import TestServer

    async def overloaded(request: web.Request) -> web.Response:
        await request.read()
        body = {"error": {"message": "queue full", "type": "server_error", "param": None, "code": "encoder_overloaded"}}
        return web.json_response(body, status=503, headers={"Retry-After": "1"})

    busy_app = web.Application()
    busy_app.router.add_post("/v1/encode", overloaded)
    busy = TestServer(busy_app, host="127.0.0.1", port=0)
    await busy.start_server()
    try:
        gw = await gateway_factory(epd_config(upstream, [str(busy.make_url("")).rstrip("/"), backend.url]))
        sent = 0
        async with gw.client() as client:
            # until p2c has drawn the busy backend once (within a few requests), then 4 more
            while sent < 4 or gw.sample("gateway_encoder_requests_total", encoder="vision", outcome="overloaded") == 0:
                assert sent < 40, "the busy backend was never chosen"
                await client.chat.completions.create(
                    model="vl", messages=[{"role": "user", "content": [image_part(png((sent, 1, 1)))]}]
                )
                sent += 1
            for i in range(4):
                await client.chat.completions.create(
                    model="vl", messages=[{"role": "user", "content": [image_part(png((i, 2, 1)))]}]
                )
    finally:
        await busy.close()
    assert len(upstream.received) == sent + 4
    assert backend.sample("vision_encoder_cache_misses_total") == sent + 4
    assert gw.sample("gateway_encoder_requests_total", encoder="vision", outcome="overloaded") == 1  # then skipped


async def test_many_images_in_one_request_are_encoded_with_bounded_concurrency(gateway_factory, upstream, backend):
    gw = await gateway_factory(epd_config(upstream, [backend.url]))
    parts = [image_part(png((i, 2, 3), size=(16, 16))) for i in range(32)]  # the default limit, twice the bound
    async with gw.client() as client:
        raw = await client.chat.completions.with_raw_response.create(
            model="vl", messages=[{"role": "user", "content": parts}]
        )
    assert raw.headers["x-gateway-encoded"] == "32"
    assert backend.sample("vision_encoder_cache_misses_total") == 32


def framed(upstream: Upstream, backend: Backend, encode: str, frames: str) -> str:
    """A model that takes video as frames and encodes its images on ``backend``."""
    return routing(
        f"  - {{name: vl, upstreams: [{upstream.url}], accepts: [text, image], encode: {encode}, "
        f"on_unsupported: {{video: {frames}}}}}",
        extra=f"encoders:\n  vision: {{kind: http, urls: [{backend.url}], timeout_s: 30}}\n",
    )


async def test_video_frames_go_through_the_encoder_like_images(gateway_factory, upstream, backend) -> None:
    """on_unsupported: {video: {frames: N}} with encode: {image: ...}: each frame is an image to
    the encoder (batched, cached: the same video again is all cache hits), placed in order."""

    gw = await gateway_factory(framed(upstream, backend, "{image: vision}", "{frames: 3, max_side: 32}"))
    clip = video()
    content = [{"type": "text", "text": "what happens?"}, image_part(png((1, 2, 3))), video_part(clip)]
    async with gw.client() as client:
        for _ in range(2):
            raw = await client.chat.completions.with_raw_response.create(
                model="vl", messages=[{"role": "user", "content": content}]
            )
            assert raw.headers["x-gateway-encoded"] == "4"  # the image and three frames
            assert raw.headers["x-gateway-route"] == "transcode"
    first, second = (r.json()["messages"][0]["content"] for r in upstream.received)
    assert first == second
    assert [p["type"] for p in first] == ["text", "image_embeds"] + ["text", "image_embeds"] * 3
    assert [p["text"] for p in first[2::2]] == [
        "[Video frame at 0.5s]",
        "[Video frame at 1.5s]",
        "[Video frame at 2.5s]",
    ]
    frames = [load_as_vllm_does(p["image_embeds"]) for p in first[3::2]]
    assert all(f.shape == (196, 384) for f in frames)
    assert not torch.equal(frames[0], frames[1])  # each second its own shade, its own embedding
    assert len({p["uuid"] for p in first[1::2]}) == 4
    assert backend.sample("vision_encoder_cache_misses_total") == 4
    assert backend.sample("vision_encoder_cache_hits_total") == 4  # the second request: the same frames
    assert gw.sample("gateway_encode_decisions_total", model="vl", decision="encoded") == 2
    assert gw.sample("gateway_video_frames_total", model="vl") == 6


async def test_video_frames_count_toward_min_images(gateway_factory, upstream, backend) -> None:

    config = framed(upstream, backend, "{image: vision, min_images: 4}", "{frames: 2, timestamps: false}")
    gw = await gateway_factory(config)
    async with gw.client() as client:
        one = await client.chat.completions.with_raw_response.create(
            model="vl", messages=[{"role": "user", "content": [video_part(video())]}]
        )
        two = await client.chat.completions.with_raw_response.create(
            model="vl", messages=[{"role": "user", "content": [video_part(video()), video_part(video(seconds=2))]}]
        )
    assert "x-gateway-encoded" not in one.headers  # 2 frames: under min_images, sent raw
    assert [p["type"] for p in upstream.received[0].json()["messages"][0]["content"]] == ["image_url"] * 2
    assert two.headers["x-gateway-encoded"] == "4"
    assert [p["type"] for p in upstream.received[1].json()["messages"][0]["content"]] == ["image_embeds"] * 4
    assert gw.sample("gateway_encode_decisions_total", model="vl", decision="direct") == 1

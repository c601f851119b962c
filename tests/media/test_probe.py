"""A video's tokens counted from its container (gateway/media/probe.py): small real videos made
with PyAV, read without decoding a frame, then counted and limited through a live gateway with
the real openai SDK (visual_tokens: {video: ...})."""

from __future__ import annotations

import base64
import io
from typing import Any

import openai
import pytest

from gateway.admission.tokens import VideoInfo, video_tokens
from gateway.config import parse_config
from gateway.errors import ConfigError, InvalidVideoError
from gateway.media.probe import read_video, sampled_info
from tests.conftest import Upstream, error_body, routing
from tests.videos import playlist, video, video_part

av = pytest.importorskip("av")
pytest.importorskip("numpy")
pytestmark = pytest.mark.timeout(60)


def mkv(seconds: int = 2, fps: int = 12, size: tuple[int, int] = (80, 60)) -> bytes:
    """A Matroska file, whose container counts no frames: its duration at its rate stands for them."""
    import numpy as np

    out = io.BytesIO()
    with av.open(out, "w", format="matroska") as container:
        stream = container.add_stream("mpeg4", rate=fps)
        stream.width, stream.height, stream.pix_fmt = size[0], size[1], "yuv420p"
        for i in range(seconds * fps):
            frame = av.VideoFrame.from_ndarray(np.full((size[1], size[0], 3), i, dtype=np.uint8), format="rgb24")
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode(None):
            container.mux(packet)
    return out.getvalue()


def test_a_videos_frames_rate_and_size_come_from_its_container() -> None:
    info = read_video(video(seconds=3, fps=10, size=(64, 48)))
    assert (info.frames, info.fps, info.width, info.height) == (30, 10.0, 64, 48)
    assert "mp4" in info.format and not info.sampled


def test_a_container_that_counts_no_frames_gives_its_duration_at_its_rate() -> None:
    info = read_video(mkv(seconds=2, fps=12, size=(80, 60)))
    assert (info.width, info.height, info.fps) == (80, 60, 12.0)
    assert abs(info.frames - 24) <= 1 and info.format.startswith("matroska")


@pytest.mark.parametrize(
    "data", [b"", b"not a video at all", b"\x00\x00\x00\x18ftypmp42" + b"\x00" * 64, playlist("clip.mp4")]
)
def test_what_is_not_a_video_the_gateway_reads_is_invalid_video(data: bytes) -> None:
    with pytest.raises(InvalidVideoError):
        read_video(data)


def test_a_video_the_gateway_sampled_counts_the_frames_it_sends() -> None:
    from PIL import Image

    frame = io.BytesIO()
    Image.new("RGB", (32, 24)).save(frame, "JPEG")
    encoded = base64.b64encode(frame.getvalue()).decode()
    info = sampled_info("data:video/jpeg;base64," + ",".join([encoded] * 5))
    assert info == VideoInfo(5, 0.0, 32, 24, "jpeg", sampled=True)


# --- through the gateway -----------------------------------------------------------------------------


def vid(upstream: Upstream, video_spec: str = "{frames: 8}", limits: str = "", extra: str = "") -> str:
    return routing(
        f"  - {{name: vid, upstreams: [{upstream.url}], accepts: [text, image, video], "
        f"visual_tokens: {{preset: qwen2.5-vl, video: {video_spec}}}{limits}{extra}}}"
    )


def ask(*parts: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"role": "user", "content": [{"type": "text", "text": "what happens?"}, *parts]}]


def expected(model: str, config_text: str, info: VideoInfo) -> int:
    found = parse_config(config_text).model(model)
    spec = found.visual_tokens if found is not None else None
    assert spec is not None and spec.video is not None
    return video_tokens(spec.video, info)[0]


async def test_a_videos_tokens_are_counted_and_limited_before_the_engine(gateway_factory, upstream) -> None:
    clip = video(seconds=3, fps=10, size=(640, 360))
    text = vid(upstream)
    tokens = expected("vid", text, VideoInfo(30, 10.0, 640, 360))
    assert tokens == 4 * 13 * 23  # 8 frames: 4 temporal patches of 644x364 (23x13 tokens each)
    gw = await gateway_factory(text)
    async with gw.client() as client:
        raw = await client.chat.completions.with_raw_response.create(model="vid", messages=ask(video_part(clip)))
    assert raw.headers["X-Gateway-Route"] == "direct"
    assert upstream.received[-1].json()["messages"][0]["content"][1] == video_part(clip)  # as sent
    assert gw.sample("gateway_visual_tokens_total", model="vid") == tokens
    tight = await gateway_factory(vid(upstream, limits=f", limits: {{visual_tokens: {tokens - 1}}}"))
    async with tight.client() as client:
        with pytest.raises(openai.BadRequestError) as caught:
            await client.chat.completions.create(model="vid", messages=ask(video_part(clip)))
    error = error_body(caught.value)
    assert (error["code"], error["param"]) == ("too_many_visual_tokens", "messages[0].content[1]")
    assert f"its videos come to {tokens}" in error["message"] and "8 frames at 640x360" in error["message"]
    assert len(upstream.received) == 1  # the refused one never left
    assert tight.sample("gateway_modality_rejections_total", model="vid", reason="too_many_visual_tokens") == 1


async def test_fps_sampling_counts_a_longer_video_more(gateway_factory, upstream) -> None:
    text = vid(upstream, "{fps: 2}")
    gw = await gateway_factory(text)
    async with gw.client() as client:
        await client.chat.completions.create(model="vid", messages=ask(video_part(video(seconds=3, fps=10))))
        short = gw.sample("gateway_visual_tokens_total", model="vid")
        await client.chat.completions.create(model="vid", messages=ask(video_part(video(seconds=6, fps=10))))
    assert short == expected("vid", text, VideoInfo(30, 10.0, 64, 48))  # 6 frames
    assert gw.sample("gateway_visual_tokens_total", model="vid") - short == expected(
        "vid", text, VideoInfo(60, 10.0, 64, 48)
    )  # 12 frames


async def test_a_video_and_images_share_the_requests_budget(gateway_factory, upstream) -> None:
    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", (1280, 720)).save(out, "PNG")
    image = {
        "type": "image_url",
        "image_url": {"url": "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()},
    }
    text = vid(upstream, limits=", limits: {visual_tokens: 1200}")
    video_cost = expected("vid", text, VideoInfo(30, 10.0, 64, 48))
    assert 1196 + video_cost > 1200 >= 1196
    gw = await gateway_factory(text)
    async with gw.client() as client:
        await client.chat.completions.create(model="vid", messages=ask(image))
        with pytest.raises(openai.BadRequestError) as caught:
            await client.chat.completions.create(model="vid", messages=ask(image, video_part(video())))
    assert "its images and videos come to" in error_body(caught.value)["message"]
    assert error_body(caught.value)["param"] == "messages[0].content[2]"


async def test_a_video_the_gateway_samples_counts_the_frames_it_sends(gateway_factory, upstream) -> None:
    text = vid(upstream, "{}", extra=", video: {sample: {frames: 3, max_side: 32}}")
    gw = await gateway_factory(text)
    async with gw.client() as client:
        raw = await client.chat.completions.with_raw_response.create(model="vid", messages=ask(video_part(video())))
    assert raw.headers["X-Gateway-Route"] == "transcode"
    sent = upstream.received[-1].json()["messages"][0]["content"][1]["video_url"]["url"]
    assert sent.startswith("data:video/jpeg;base64,") and sent.count(",") == 3
    assert gw.sample("gateway_visual_tokens_total", model="vid") == expected(
        "vid", text, VideoInfo(3, 0.0, 32, 24, sampled=True)
    )


async def test_an_unreadable_video_is_400_invalid_video_and_the_gateway_keeps_serving(
    gateway_factory, upstream
) -> None:
    gw = await gateway_factory(vid(upstream))
    broken = {
        "type": "video_url",
        "video_url": {"url": "data:video/mp4;base64," + base64.b64encode(b"x" * 500).decode()},
    }
    async with gw.client() as client:
        with pytest.raises(openai.BadRequestError) as caught:
            await client.chat.completions.create(model="vid", messages=ask(broken))
        await client.chat.completions.create(model="vid", messages=ask(video_part(video())))
    assert (error_body(caught.value)["code"], error_body(caught.value)["param"]) == (
        "invalid_video",
        "messages[0].content[1]",
    )
    assert len(upstream.received) == 1
    assert gw.sample("gateway_modality_rejections_total", model="vid", reason="invalid_content") == 1


async def test_a_remote_video_is_fetched_counted_and_sent_as_the_bytes_counted(
    gateway_factory, upstream_factory
) -> None:
    from aiohttp import web

    clip = video(seconds=2, fps=10, size=(320, 240))

    async def serve(request: web.Request) -> web.Response:
        return web.Response(body=clip, content_type="video/mp4")

    media = web.Application()
    media.router.add_get("/clip.mp4", serve)
    server = await upstream_factory("media", app=media)
    upstream = await upstream_factory("up")
    text = routing(
        f"  - {{name: vid, upstreams: [{upstream.url}], accepts: [text, video], "
        "visual_tokens: {preset: qwen2.5-vl, remote: fetch, video: {frames: 8}}}",
        extra="media: {allow_private_networks: true}\n",
    )
    gw = await gateway_factory(text)
    part = {"type": "video_url", "video_url": {"url": f"{server.url}/clip.mp4"}}
    async with gw.client() as client:
        await client.chat.completions.create(model="vid", messages=ask(part))
    sent = upstream.received[-1].json()["messages"][0]["content"][1]["video_url"]["url"]
    assert sent == "data:video/mp4;base64," + base64.b64encode(clip).decode()
    assert gw.sample("gateway_visual_tokens_total", model="vid") == expected("vid", text, VideoInfo(20, 10.0, 320, 240))


@pytest.mark.parametrize(
    ("video_spec", "problem"),
    [
        ("{frames: 8, fps: 2}", "one or the other"),
        ("{frames: 0}", "frames"),
        ("{min_frames: 9, max_frames: 4}", "at least min_frames"),
        ("{max_pixels: 10}", "one token's"),
        ("{speed: 2}", "speed"),
    ],
)
def test_a_video_spec_is_checked_where_it_is_written(video_spec: str, problem: str) -> None:
    text = routing(
        "  - {name: vid, upstreams: ['http://127.0.0.1:1'], accepts: [text, video], "
        f"visual_tokens: {{preset: qwen2.5-vl, video: {video_spec}}}}}"
    )
    with pytest.raises(ConfigError) as caught:
        parse_config(text)
    assert problem in str(caught.value) and "visual_tokens.video" in str(caught.value)


def test_a_formula_without_a_video_processor_takes_no_video_spec() -> None:
    text = routing(
        "  - {name: vid, upstreams: ['http://127.0.0.1:1'], accepts: [text, video], "
        "visual_tokens: {fixed: 576, video: {}}}"
    )
    with pytest.raises(ConfigError, match="grid formulas"):
        parse_config(text)


def test_the_effective_config_spells_the_video_spec_as_routing_yaml_does() -> None:
    import json

    from gateway.config.export import as_dict

    def table(spec: str) -> str:
        return routing(
            f"  - {{name: vid, upstreams: ['http://127.0.0.1:1'], accepts: [text, video], visual_tokens: {spec}}}"
        )

    config = parse_config(table("{preset: qwen2.5-vl, video: {fps: 2, max_frames: 64}}"))
    shown = next(m for m in as_dict(config)["models"] if m["name"] == "vid")["visual_tokens"]
    assert shown["video"] == {"fps": 2.0, "min_frames": 4, "max_frames": 64, "min_pixels": 3136,
                              "max_pixels": 12845056, "temporal_patch": 2}  # fmt: skip
    again, first = parse_config(table(json.dumps(shown))).model("vid"), config.model("vid")
    assert again is not None and first is not None
    assert again.visual_tokens == first.visual_tokens  # what it shows reads back as the same

"""Sampling a video's frames (gateway/media/video.py) on small real videos made here with PyAV: a solid
shade per second, so that every sampled frame says which second it came from."""

from __future__ import annotations

import base64
from typing import Any

import openai
import pytest

from gateway.config import parse_config
from gateway.errors import ConfigError, InvalidVideoError, TooManyItemsError
from gateway.media.video import VIDEO_PIXELS, Bounds, Budget, DecodeStopped, sample_frames
from gateway.server.state import SERVICES_KEY
from tests.conftest import error_body, routing
from tests.videos import SHADES, long_gop, playlist, shade, video, video_part

pytest.importorskip("av")
pytest.importorskip("numpy")


def test_frames_are_spread_evenly_in_order_each_from_its_second() -> None:
    frames = sample_frames(video(), frames=6)
    assert [round(f.seconds, 1) for f in frames] == [0.3, 0.8, 1.3, 1.8, 2.3, 2.8]  # the first frame at/after each
    expected = [30, 30, 130, 130, 230, 230]
    assert all(abs(shade(f.jpeg) - s) < 8 for f, s in zip(frames, expected, strict=True))  # JPEG: within a few
    assert all(f.jpeg.startswith(b"\xff\xd8\xff") for f in frames)


def test_fps_samples_fewer_when_it_gives_fewer() -> None:
    frames = sample_frames(video(), frames=8, fps=1.0)
    assert len(frames) == 3
    assert [abs(shade(f.jpeg) - s) < 8 for f, s in zip(frames, SHADES, strict=True)] == [True] * 3
    assert len(sample_frames(video(), frames=2, fps=10.0)) == 2  # capped by frames


def test_frames_are_scaled_to_max_side_keeping_the_aspect() -> None:
    (frame,) = sample_frames(video(seconds=1, size=(320, 180)), frames=1, max_side=64)
    assert (frame.width, frame.height) == (64, 36)
    (small,) = sample_frames(video(seconds=1, size=(64, 48)), frames=1, max_side=768)
    assert (small.width, small.height) == (64, 48)  # never scaled up


def test_h264_is_read_too() -> None:
    frames = sample_frames(video(codec="libx264"), frames=3)
    assert [abs(shade(f.jpeg) - s) < 8 for f, s in zip(frames, SHADES, strict=True)] == [True] * 3


@pytest.mark.parametrize(
    "data",
    [b"", b"not a video at all" * 100, b"\x00\x00\x00\x18ftypmp42" + b"\x00" * 500],
    ids=["empty", "text", "a-bare-mp4-header"],
)
def test_what_is_not_a_video_is_invalid_video(data: bytes) -> None:
    with pytest.raises(InvalidVideoError) as caught:
        sample_frames(data, frames=4)
    assert caught.value.code == "invalid_video" and caught.value.status == 400


def test_a_truncated_video_is_invalid_or_gives_the_frames_it_has() -> None:
    whole = video()
    for cut in (len(whole) // 3, len(whole) * 2 // 3, len(whole) - 10):
        try:
            frames = sample_frames(whole[:cut], frames=6)
        except InvalidVideoError:
            continue
        assert 1 <= len(frames) <= 6


def test_long_or_huge_videos_are_refused_before_decoding() -> None:
    with pytest.raises(InvalidVideoError, match="over the 2s allowed"):
        sample_frames(video(seconds=3), frames=2, bounds=Bounds(max_seconds=2))
    with pytest.raises(InvalidVideoError, match="over the 1000 pixels allowed"):
        sample_frames(video(seconds=1), frames=2, bounds=Bounds(max_pixels=1000))


# --- served: on_unsupported: {video: {frames: N}} ----------------------------------------------------


def framed(upstream: Any, policy: str = "{frames: 4}", limits: str = "") -> str:
    return routing(
        f"  - {{name: texty, upstreams: [{upstream.url}], accepts: [text, image]{limits}, "
        f"on_unsupported: {{video: {policy}}}}}"
    )


def sent_parts(upstream: Any) -> list[dict[str, Any]]:
    (message,) = upstream.received[-1].json()["messages"]
    return message["content"]


async def test_a_video_reaches_the_model_as_frames_with_their_times(gateway_factory, upstream) -> None:
    gw = await gateway_factory(framed(upstream, "{frames: 3, max_side: 32}"))
    async with gw.client() as client:
        raw = await client.chat.completions.with_raw_response.create(
            model="texty",
            messages=[{"role": "user", "content": [{"type": "text", "text": "what happens?"}, video_part(video())]}],
        )
    assert raw.headers["X-Gateway-Route"] == "transcode"
    parts = sent_parts(upstream)
    assert [p["type"] for p in parts] == ["text"] + ["text", "image_url"] * 3
    assert [p["text"] for p in parts[1::2]] == [
        "[Video frame at 0.5s]",
        "[Video frame at 1.5s]",
        "[Video frame at 2.5s]",
    ]
    shades = [shade(base64.b64decode(p["image_url"]["url"].split(",", 1)[1])) for p in parts[2::2]]
    assert all(abs(s - e) < 8 for s, e in zip(shades, SHADES, strict=True))
    assert gw.sample("gateway_video_frames_total", model="texty") == 3
    assert gw.sample("gateway_video_decode_seconds_count", model="texty") == 1


async def test_frames_fit_the_models_image_limit(gateway_factory, upstream) -> None:
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}
    gw = await gateway_factory(framed(upstream, "{frames: 8, timestamps: false}", ", limits: {image: 3}"))
    async with gw.client() as client:
        await client.chat.completions.create(
            model="texty", messages=[{"role": "user", "content": [image, video_part(video())]}]
        )
        assert [p["type"] for p in sent_parts(upstream)] == ["image_url"] * 3  # 1 image + 2 frames
        with pytest.raises(openai.BadRequestError) as caught:
            content = [image, image, image, video_part(video())]
            await client.chat.completions.create(model="texty", messages=[{"role": "user", "content": content}])
    assert error_body(caught.value)["code"] == "too_many_items"
    assert error_body(caught.value)["param"] == "messages[0].content[3]"


async def test_a_file_that_is_not_a_video_is_a_400(gateway_factory, upstream) -> None:
    gw = await gateway_factory(framed(upstream))
    async with gw.client() as client:
        with pytest.raises(openai.BadRequestError) as caught:
            await client.chat.completions.create(
                model="texty", messages=[{"role": "user", "content": [video_part(b"not a video" * 50)]}]
            )
    assert (error_body(caught.value)["code"], error_body(caught.value)["param"]) == (
        "invalid_video",
        "messages[0].content[0]",
    )
    assert upstream.received == []
    assert gw.sample("gateway_modality_rejections_total", model="texty", modality="video", reason="media_refused") == 1


@pytest.mark.parametrize(
    ("line", "problem"),
    [
        ("accepts: [text, image], on_unsupported: {audio: {frames: 4}}", "only video can be sent as frames"),
        ("accepts: [text], on_unsupported: {video: {frames: 4}}", "frames are images: the model must accept image"),
        ("accepts: [text, image], on_unsupported: {video: {frames: 0}}", "video.frames: must be"),
        ("accepts: [text, image], on_unsupported: {video: {frames: 4, speed: 2}}", "unknown key 'speed'"),
        # video: {sample: ...}, vLLM's pre-sampled form
        ("accepts: [text, image], video: {sample: {frames: 4}}", "video.sample is for a model that accepts video"),
        ("accepts: [text, video], video: {frames: 4}", "models[0].video: must be {sample: {frames: N}}"),
        ("accepts: [text, video], video: {sample: {fps: 1}}", "(frames required)"),
        ("accepts: [text, video], video: {sample: {frames: 99}}", "models[0].video.sample.frames: must be"),
    ],
)
def test_a_frames_policy_or_video_sample_is_checked(line: str, problem: str) -> None:
    with pytest.raises(ConfigError) as caught:
        parse_config(f"version: 1\nmodels:\n  - {{name: m, upstreams: ['http://u:1'], {line}}}\n", filename="r.yaml")
    assert problem in str(caught.value)


def test_a_request_gets_64_frames_at_most_whatever_the_model_allows() -> None:
    from gateway.admission.plan import admit

    config = parse_config(
        "version: 1\nmodels:\n  - {name: m, upstreams: ['http://u:1'], accepts: [text, image], "
        "on_unsupported: {video: {frames: 8}}}\n"
    )
    videos = [{"type": "video_url", "video_url": {"url": f"https://example.com/{i}.mp4"}} for i in range(9)]
    plan = admit(config, {"model": "m", "messages": [{"role": "user", "content": videos}]})
    assert plan.frames_per_video == 7 and plan.route == "transcode"  # 64 // 9
    many = [{"type": "video_url", "video_url": {"url": f"https://example.com/{i}.mp4"}} for i in range(65)]
    with pytest.raises(TooManyItemsError):
        admit(config, {"model": "m", "messages": [{"role": "user", "content": many}]})


async def test_a_videos_audio_track_goes_with_it(gateway_factory, upstream) -> None:
    gw = await gateway_factory(framed(upstream, "{frames: 2}"))
    async with gw.client() as client:
        await client.chat.completions.create(
            model="texty",
            messages=[{"role": "user", "content": [video_part(video())]}],
            extra_body={"mm_processor_kwargs": {"use_audio_in_video": True}},
        )  # audio is rejected by this model, but the track leaves with the video
    assert upstream.received[-1].json()["mm_processor_kwargs"] == {"use_audio_in_video": False}


# --- video: {sample: {frames: N}}: vLLM's pre-sampled form for a model that takes video -------------


async def test_a_video_model_gets_vllms_pre_sampled_form(gateway_factory, upstream) -> None:
    gw = await gateway_factory(
        routing(
            f"  - {{name: omni, upstreams: [{upstream.url}], accepts: [text, video], "
            "video: {sample: {frames: 3, max_side: 32}}}"
        )
    )
    async with gw.client() as client:
        raw = await client.chat.completions.with_raw_response.create(
            model="omni", messages=[{"role": "user", "content": [{"type": "text", "text": "hi"}, video_part(video())]}]
        )
    assert raw.headers["X-Gateway-Route"] == "transcode"
    text, sent = sent_parts(upstream)
    assert text == {"type": "text", "text": "hi"} and sent["type"] == "video_url"
    prefix, _, frames = sent["video_url"]["url"].partition(",")
    assert prefix == "data:video/jpeg;base64"
    shades = [shade(base64.b64decode(f)) for f in frames.split(",")]
    assert len(shades) == 3 and all(abs(s - e) < 8 for s, e in zip(shades, SHADES, strict=True))
    assert gw.sample("gateway_video_frames_total", model="omni") == 3


async def test_videos_are_held_to_max_video_bytes_not_the_image_limit(gateway_factory, upstream) -> None:
    clip = video()
    media = f"media: {{max_image_bytes: 100, max_video_bytes: {len(clip)}}}\n"
    gw = await gateway_factory(framed(upstream, "{frames: 2}").replace("models:", media + "models:", 1))
    async with gw.client() as client:
        await client.chat.completions.create(model="texty", messages=[{"role": "user", "content": [video_part(clip)]}])
        assert len(sent_parts(upstream)) == 4  # within max_video_bytes, though 100 times max_image_bytes
        with pytest.raises(openai.BadRequestError) as caught:
            content = [video_part(clip + b"\x00")]
            await client.chat.completions.create(model="texty", messages=[{"role": "user", "content": content}])
    error = error_body(caught.value)
    assert (error["code"], error["param"]) == ("media_refused", "messages[0].content[0]")
    assert error["message"] == (
        f"messages[0].content[0]: Video is larger than media.max_video_bytes ({len(clip)} bytes)"
    )
    assert len(upstream.received) == 1
    assert gw.sample("gateway_modality_rejections_total", model="texty", modality="video", reason="media_refused") == 1


def test_a_host_without_pyav_refuses_frames_and_pre_sampling_at_load(monkeypatch: pytest.MonkeyPatch) -> None:
    """serve, reloads and check --here refuse a table that samples video where PyAV is missing,
    rather than answering 500 to every video."""
    import importlib

    validate = importlib.import_module("gateway.config.validate")  # the module, not its function
    real = validate.find_spec
    monkeypatch.setattr(validate, "find_spec", lambda name: None if name == "av" else real(name))
    text = (
        "version: 1\nmodels:\n"
        "  - {name: a, upstreams: ['http://u:1'], accepts: [text, image], on_unsupported: {video: {frames: 4}}}\n"
        "  - {name: b, upstreams: ['http://u:1'], accepts: [text, video], video: {sample: {frames: 4}}}\n"
    )
    parse_config(text)  # anywhere else: fine
    with pytest.raises(ConfigError) as caught:
        parse_config(text, filename="r.yaml", here=True)
    problems = [f"{p.path}: {p.message}" for p in caught.value.problems]
    assert problems == [
        "models[0].on_unsupported.video.frames: video frames need PyAV, which is not installed here: "
        "pip install 'modality-gateway[video]'",
        "models[1].video.sample: pre-sampled video frames need PyAV, which is not installed here: "
        "pip install 'modality-gateway[video]'",
    ]


def test_a_config_built_in_code_is_refused_too_where_pyav_is_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    """A config built in code skipped the check (a 500 for every video): the config store
    refuses it as serve and reloads do."""
    import importlib

    from gateway.server.app import create_app

    validate = importlib.import_module("gateway.config.validate")
    real = validate.find_spec
    monkeypatch.setattr(validate, "find_spec", lambda name: None if name == "av" else real(name))
    config = parse_config(
        "version: 1\nmodels:\n"
        "  - {name: a, upstreams: ['http://u:1'], accepts: [text, image], on_unsupported: {video: {frames: 4}}}\n"
    )
    with pytest.raises(ConfigError) as caught:
        create_app(config)
    assert [p.path for p in caught.value.problems] == ["models[0].on_unsupported.video.frames"]


def test_corrupted_videos_give_frames_or_invalid_video_never_anything_else() -> None:
    """Bytes of a real video overwritten, cut, or repeated (what a hostile or broken upload holds):
    sampling ends in frames or in 400 invalid_video, within the decode bounds, never another
    exception."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    whole = video(seconds=2, codec="libx264")

    @settings(max_examples=120, deadline=None, derandomize=True, database=None,
              suppress_health_check=[HealthCheck.too_slow])  # fmt: skip
    @given(edits=st.lists(st.tuples(st.integers(0, len(whole) - 1), st.binary(min_size=1, max_size=16)), max_size=6),
           cut=st.integers(len(whole) // 2, len(whole)), repeat=st.booleans())  # fmt: skip
    def sample(edits: list[tuple[int, bytes]], cut: int, repeat: bool) -> None:
        data = bytearray(whole)
        for at, junk in edits:
            data[at : at + len(junk)] = junk
        data = data[:cut] + (data[cut // 2 :] if repeat else b"")
        try:
            frames = sample_frames(bytes(data), frames=4, max_side=32)
        except InvalidVideoError:
            return
        assert 0 < len(frames) <= 4 and all(f.jpeg.startswith(b"\xff\xd8") for f in frames)

    sample()


async def test_the_same_video_in_a_later_turn_is_sampled_once(gateway_factory, upstream) -> None:
    clip = video()
    gw = await gateway_factory(framed(upstream, "{frames: 3, max_side: 32}"))
    first = [{"role": "user", "content": [video_part(clip)]}]
    async with gw.client() as client:
        await client.chat.completions.create(model="texty", messages=first)
        later = [*first, {"role": "assistant", "content": "seen"}, {"role": "user", "content": "and?"}]
        await client.chat.completions.create(model="texty", messages=later)
        await client.chat.completions.create(model="texty", messages=first)
    turns = [r.json()["messages"][0]["content"] for r in upstream.received]
    assert turns[0] == turns[1] == turns[2] and len(turns[0]) == 6
    assert gw.sample("gateway_video_decode_seconds_count", model="texty") == 1  # decoded once
    assert gw.sample("gateway_video_frames_total", model="texty") == 9  # served three times
    assert gw.sample("gateway_media_cache_requests_total", kind="frames", result="hit") == 2


async def test_a_pre_sampled_video_is_kept_too(gateway_factory, upstream) -> None:
    config = routing(
        f"  - {{name: vid, upstreams: [{upstream.url}], accepts: [text, video], video: {{sample: {{frames: 2}}}}}}"
    )
    gw = await gateway_factory(config)
    async with gw.client() as client:
        for _ in range(2):
            await client.chat.completions.create(
                model="vid", messages=[{"role": "user", "content": [video_part(video())]}]
            )
    urls = [r.json()["messages"][0]["content"][0]["video_url"]["url"] for r in upstream.received]
    assert urls[0] == urls[1] and urls[0].startswith("data:video/jpeg;base64,")
    assert gw.sample("gateway_video_decode_seconds_count", model="vid") == 1
    assert gw.sample("gateway_media_cache_requests_total", kind="presample", result="hit") == 1


async def test_parallel_requests_with_the_same_video_decode_it_once(gateway_factory, upstream) -> None:
    """A batch asking several questions about one video at once: one decode, shared."""
    import asyncio

    clip = video()
    gw = await gateway_factory(framed(upstream, "{frames: 2}"))
    async with gw.client() as client:
        await asyncio.gather(
            *(
                client.chat.completions.create(
                    model="texty",
                    messages=[
                        {"role": "user", "content": [{"type": "text", "text": f"question {i}"}, video_part(clip)]}
                    ],
                )
                for i in range(4)
            )
        )
    assert len(upstream.received) == 4
    assert len({str(r.json()["messages"][0]["content"][1:]) for r in upstream.received}) == 1  # the same frames
    assert gw.sample("gateway_video_decode_seconds_count", model="texty") == 1
    shared = gw.sample("gateway_media_cache_requests_total", kind="frames", result="shared")
    hits = gw.sample("gateway_media_cache_requests_total", kind="frames", result="hit")
    assert shared + hits == 3  # waited for the one decode, or came after it


async def test_parallel_requests_with_the_same_bad_video_each_hear_of_their_own_part(gateway_factory, upstream) -> None:
    import asyncio

    bad = video()[:300]  # cut before its first frame
    gw = await gateway_factory(framed(upstream))
    async with gw.client() as client:

        async def ask(position: int) -> dict[str, Any]:
            content: list[dict[str, Any]] = [{"type": "text", "text": "q"}] * position + [video_part(bad)]
            with pytest.raises(openai.BadRequestError) as caught:
                await client.chat.completions.create(model="texty", messages=[{"role": "user", "content": content}])
            return error_body(caught.value)

        errors = await asyncio.gather(*(ask(i) for i in range(3)))
    assert [(e["code"], e["param"]) for e in errors] == [
        ("invalid_video", f"messages[0].content[{i}]") for i in range(3)
    ]
    assert all(e["message"].startswith(f"messages[0].content[{i}]: ") for i, e in enumerate(errors))
    assert upstream.received == []


# --- hostile videos (issue 20) ----------------------------------------------------------------


@pytest.mark.parametrize("policy", ["frames", "sample"])
async def test_a_playlist_naming_a_file_beside_the_gateway_is_invalid_video(
    policy: str, gateway_factory, upstream, tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An ffconcat playlist sent as a video made FFmpeg open the file it names, relative to the
    gateway's working directory, and that file's frames reached the model."""
    (tmp_path / "sub").mkdir()
    for name in ("secret.mp4", "sub/secret.mp4"):
        (tmp_path / name).write_bytes(video(seconds=1))
    monkeypatch.chdir(tmp_path)
    if policy == "frames":
        config = framed(upstream, "{frames: 2}")
        model = "texty"
    else:
        config = routing(
            f"  - {{name: vid, upstreams: [{upstream.url}], accepts: [text, video], video: {{sample: {{frames: 2}}}}}}"
        )
        model = "vid"
    gw = await gateway_factory(config)
    async with gw.client() as client:
        for name in ("secret.mp4", "sub/secret.mp4"):
            with pytest.raises(openai.BadRequestError) as caught:
                await client.chat.completions.create(
                    model=model, messages=[{"role": "user", "content": [video_part(playlist(name))]}]
                )
            assert error_body(caught.value)["code"] == "invalid_video"
    assert upstream.received == []


def test_a_long_gop_costs_its_budget_at_most_and_still_gives_frames() -> None:
    """The decode bomb's shape (one keyframe, every frame after it depending on it): each sample
    decodes from the keyframe again. The work is bounded by the budget's pixels, not by the file,
    and the frames reached stand for the samples."""
    clip = long_gop(frames=240)  # 8 s at 30 fps, 320x240
    whole = Budget()
    exact = sample_frames(clip, frames=8, budget=whole)
    assert [round(f.seconds, 1) for f in exact] == [0.5, 1.5, 2.5, 3.5, 4.5, 5.5, 6.5, 7.5]
    frame = 320 * 240
    spent = VIDEO_PIXELS - whole.pixels
    assert spent == 968 * frame  # each sample from the keyframe to its frame: 16 + 46 + ... + 226 frames
    tight = Budget(pixels=100 * frame)
    frames = sample_frames(clip, frames=8, budget=tight)
    assert 0 < len(frames) < 8 and all(f.seconds < 1.0 for f in frames)  # near the keyframe, in time order
    assert 0 <= tight.pixels < frame  # spent, within one frame, never past


def test_a_video_that_needs_more_than_its_budget_for_one_frame_is_refused() -> None:
    with pytest.raises(InvalidVideoError, match="needs more decoding to sample than its budget allows"):
        sample_frames(video(seconds=1, size=(320, 240)), frames=2, budget=Budget(pixels=1000))


@pytest.mark.parametrize("frames", [1, 2, 8])
def test_a_video_never_spends_more_than_its_budget(frames: int) -> None:
    """A sample's share is twice an even one, never more than what is left: a bomb sampled once
    decoded twice its budget."""
    frame = 320 * 240
    budget = Budget(pixels=100 * frame)
    sample_frames(long_gop(frames=240), frames=frames, budget=budget)
    assert 0 <= budget.pixels


def test_a_decode_stops_between_two_frames_when_nobody_waits() -> None:
    budget = Budget()
    budget.stop.set()
    with pytest.raises(DecodeStopped):
        sample_frames(long_gop(frames=60), frames=4, budget=budget)
    with pytest.raises(InvalidVideoError, match="took over"):
        sample_frames(long_gop(frames=60), frames=4, budget=Budget(deadline=0.0))


async def test_a_requests_videos_share_one_account(gateway_factory, upstream, monkeypatch) -> None:
    """A request's videos draw on one account: once spent, it starts no decode. A video decoded
    or kept already still serves it, and what a decode makes is the video's alone (its own
    budget, whatever the account had left), so the next request finds it whole."""
    import gateway.media.video as video_module

    clip_a, clip_b = long_gop(frames=60), long_gop(frames=61)
    frame = 320 * 240
    monkeypatch.setattr(video_module, "REQUEST_PIXELS", 30 * frame)
    gw = await gateway_factory(framed(upstream, "{frames: 1, timestamps: false}"))
    async with gw.client() as client:
        with pytest.raises(openai.BadRequestError) as caught:
            await client.chat.completions.create(
                model="texty", messages=[{"role": "user", "content": [video_part(clip_a), video_part(clip_b)]}]
            )  # the first takes its frame at 1 s (31 frames decoded): the account is spent for the second
        error = error_body(caught.value)
        assert (error["code"], error["param"]) == ("invalid_video", "messages[0].content[1]")
        assert "the request's videos need more decoding than a request may spend" in error["message"]
        assert upstream.received == []
        # clip_a, sampled whole before the account ran out, is kept; clip_b alone is decoded anew
        await client.chat.completions.create(
            model="texty", messages=[{"role": "user", "content": [video_part(clip_a), video_part(clip_b)]}]
        )
    assert gw.sample("gateway_media_cache_requests_total", kind="frames", result="hit") == 1
    assert gw.sample("gateway_video_decode_seconds_count", model="texty") == 2


def hold_the_decoding_thread(monkeypatch: pytest.MonkeyPatch, **pool: float) -> tuple[Any, Any]:
    """One decoding thread (and ``pool``'s other settings); each decode waits for ``release``
    once it ``began``."""
    import threading

    import gateway.media.decoders as decoders
    import gateway.media.video as video_module

    monkeypatch.setattr(decoders, "THREADS", 1)
    for name, value in pool.items():
        monkeypatch.setattr(decoders, name, value)
    began, release = threading.Event(), threading.Event()
    real = video_module.sample_frames

    def held(data: bytes, **kwargs: Any) -> Any:
        began.set()
        release.wait(10)
        return real(data, **kwargs)

    monkeypatch.setattr(video_module, "sample_frames", held)
    return began, release


async def test_busy_decoders_are_a_503_with_retry_after_not_the_videos_fault(
    gateway_factory, upstream, monkeypatch
) -> None:
    """50 valid clips at once got 400 invalid_video for waiting for one of two threads: a client
    error that clients do not retry, counted as refused media. Saturation is the gateway's: 503
    decoders_busy with Retry-After, counted apart; the clip that waited is served."""
    import asyncio

    began, release = hold_the_decoding_thread(monkeypatch, QUEUE=0)
    gw = await gateway_factory(framed(upstream, "{frames: 2}"))
    async with gw.client() as client:
        first = asyncio.create_task(
            client.chat.completions.create(model="texty", messages=[{"role": "user", "content": [video_part(video())]}])
        )
        assert await asyncio.to_thread(began.wait, 10)
        try:
            with pytest.raises(openai.InternalServerError) as caught:
                await client.chat.completions.with_raw_response.create(
                    model="texty", messages=[{"role": "user", "content": [video_part(video(seconds=2))]}]
                )
        finally:
            release.set()
        assert (await first).choices
    assert caught.value.status_code == 503 and caught.value.response.headers["Retry-After"] == "1"
    assert error_body(caught.value)["code"] == "decoders_busy"
    assert gw.sample("gateway_video_decode_shed_total", model="texty", reason="queue_full") == 1
    assert gw.sample("gateway_modality_rejections_total", model="texty", modality="video") == 0
    assert len(upstream.received) == 1


async def test_requests_that_share_a_decode_share_its_busy_answer(gateway_factory, upstream, monkeypatch) -> None:
    """Requests carrying the same video wait for one decode; when the threads stay busy, all of
    them hear 503 once, each counted, rather than each waiting the whole wait out again."""
    import asyncio

    began, release = hold_the_decoding_thread(monkeypatch, WAIT_S=0.3)
    gw = await gateway_factory(framed(upstream, "{frames: 2}"))
    pool = gw.app[SERVICES_KEY].decoders
    async with gw.client() as client:
        first = asyncio.create_task(
            client.chat.completions.create(model="texty", messages=[{"role": "user", "content": [video_part(video())]}])
        )
        assert await asyncio.to_thread(began.wait, 10)
        try:
            same = [video_part(video(seconds=2))]
            results = await asyncio.gather(
                *(client.chat.completions.create(model="texty", messages=[{"role": "user", "content": same}])
                  for _ in range(3)),
                return_exceptions=True,
            )  # fmt: skip
        finally:
            release.set()
        await first
    assert all(isinstance(r, openai.InternalServerError) and r.status_code == 503 for r in results), results
    assert gw.sample("gateway_video_decode_shed_total", model="texty", reason="queue_timeout") == 3
    assert gw.sample("gateway_media_cache_requests_total", kind="frames", result="shared") == 2
    assert pool.waiting == 0


async def test_a_videos_frames_count_as_the_visual_tokens_they_are(gateway_factory, upstream) -> None:
    """Frames are images to the model: with visual_tokens:, their tokens count and are limited."""
    counted = ", visual_tokens: {preset: qwen2.5-vl}, limits: {visual_tokens: 200}"
    gw = await gateway_factory(framed(upstream, "{frames: 3, max_side: 112}", counted))
    ask = [{"role": "user", "content": [{"type": "text", "text": "what happens?"}, video_part(video())]}]
    async with gw.client() as client:
        await client.chat.completions.create(model="texty", messages=ask)
    frames = [p for p in sent_parts(upstream) if p["type"] == "image_url"]
    assert len(frames) == 3
    per_frame = gw.sample("gateway_visual_tokens_total", model="texty") / 3
    assert per_frame > 0 and per_frame == int(per_frame)
    limit = int(per_frame) * 2  # 8 frames will not fit
    counted = f", visual_tokens: {{preset: qwen2.5-vl}}, limits: {{visual_tokens: {limit}}}"
    tight = framed(upstream, "{frames: 8, max_side: 112}", counted)
    gw = await gateway_factory(tight)
    async with gw.client() as client:
        with pytest.raises(openai.BadRequestError) as caught:
            await client.chat.completions.create(model="texty", messages=ask)
    error = error_body(caught.value)
    assert (error["code"], error["param"]) == ("too_many_visual_tokens", "messages[0].content[1]")
    assert "its frames at" in error["message"]

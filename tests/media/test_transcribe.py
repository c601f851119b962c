"""Audio served as its transcript (``on_unsupported: {audio: {transcribe: M}}``, gateway/media/transcribe.py).

Real WAV files written with the standard library, a stand-in transcription server speaking the
OpenAI API (``POST /v1/audio/transcriptions``, multipart) and the real openai SDK as the client.
"""

from __future__ import annotations

import base64
import io
import wave
from typing import Any

import openai
import orjson
import pytest

from gateway.admission.plan import admit
from gateway.config import parse_config
from gateway.errors import ConfigError
from gateway.media.transcribe import TRANSCRIPT as TRANSCRIPT_MARK
from tests.conftest import Upstream, error_body, free_port, routing

pytestmark = pytest.mark.timeout(60)


def wav(seconds: float, rate: int = 16000) -> bytes:
    out = io.BytesIO()
    with wave.open(out, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(b"\x00\x01" * int(seconds * rate))
    return out.getvalue()


def input_audio(data: bytes, fmt: str = "wav") -> dict[str, Any]:
    return {"type": "input_audio", "input_audio": {"data": base64.b64encode(data).decode(), "format": fmt}}


def ask(*parts: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"role": "user", "content": [{"type": "text", "text": "what was said?"}, *parts]}]


def table(chat: Upstream, *whisper_urls: str, policy: str = "{transcribe: whisper}") -> str:
    urls = ", ".join(whisper_urls)
    return routing(
        f"  - {{name: texty, upstreams: [{chat.url}], accepts: [text, image], on_unsupported: {{audio: {policy}}}}}",
        f"  - {{name: whisper, upstream_model: openai/whisper-large-v3, upstreams: [{urls}], accepts: [text, audio]}}",
    )


def chat_parts(chat: Upstream) -> list[dict[str, Any]]:
    (message,) = chat.received[-1].json()["messages"]
    parts: list[dict[str, Any]] = message["content"]
    return parts


async def test_audio_parts_become_their_transcript(gateway_factory, upstream_factory) -> None:
    chat, whisper = await upstream_factory("chat"), await upstream_factory("whisper")
    gw = await gateway_factory(table(chat, whisper.url))
    one, two = wav(1.0), wav(0.5)
    data_url = {"type": "audio_url", "audio_url": {"url": "data:audio/wav;base64," + base64.b64encode(two).decode()}}
    async with gw.client() as client:
        raw = await client.chat.completions.with_raw_response.create(
            model="texty", messages=ask(input_audio(one), data_url)
        )
    assert raw.headers["X-Gateway-Route"] == "transcribe"
    assert chat_parts(chat) == [
        {"type": "text", "text": "what was said?"},
        {
            "type": "text",
            "text": f"{TRANSCRIPT_MARK}[whisper] openai/whisper-large-v3 heard audio.wav ({len(one)} bytes)",
        },
        {
            "type": "text",
            "text": f"{TRANSCRIPT_MARK}[whisper] openai/whisper-large-v3 heard audio.wav ({len(two)} bytes)",
        },
    ]
    assert chat.received[-1].json()["model"] == "texty"
    sent = [orjson.loads(r.body) for r in whisper.received]
    assert all(s["file"][1] == "audio/wav" and s["model"][2] > 0 for s in sent)
    assert whisper.received[0].path == "/v1/audio/transcriptions"
    assert gw.sample("gateway_audio_transcribed_seconds_total", model="texty") == pytest.approx(1.5)


async def test_a_failing_transcription_replica_is_passed_over(gateway_factory, upstream_factory) -> None:
    chat, bad, good = await upstream_factory("chat"), await upstream_factory("bad"), await upstream_factory("good")
    bad.standin.fail_status = 503
    dead = f"http://127.0.0.1:{free_port()}"
    gw = await gateway_factory(table(chat, dead, bad.url, good.url))
    async with gw.client() as client:
        for i in range(3):  # three clips: the same one again would be a cache hit
            await client.chat.completions.create(model="texty", messages=ask(input_audio(wav(0.1 + i / 100))))
    assert len(good.standin.received) == 3
    assert all("[good]" in chat_parts(chat)[1]["text"] for _ in range(1))


@pytest.mark.parametrize(
    ("policy", "status", "code"),
    [("{transcribe: whisper}", 502, "upstream_error"), ("{transcribe: whisper, on_error: reject}", 400,
                                                          "unsupported_modality")],
)  # fmt: skip
async def test_when_no_replica_can_transcribe(gateway_factory, upstream_factory, policy, status, code) -> None:
    chat, whisper = await upstream_factory("chat"), await upstream_factory("whisper")
    whisper.standin.fail_status = 500
    gw = await gateway_factory(table(chat, whisper.url, policy=policy))
    async with gw.client() as client:
        with pytest.raises(openai.APIStatusError) as caught:
            await client.chat.completions.create(model="texty", messages=ask(input_audio(wav(0.1))))
    assert caught.value.status_code == status
    body = error_body(caught.value)
    assert body["code"] == code and body["param"] == "messages[0].content[1]"
    assert chat.received == []  # the model was never asked


async def test_audio_that_is_not_base64_is_a_400(gateway_factory, upstream_factory) -> None:
    chat, whisper = await upstream_factory("chat"), await upstream_factory("whisper")
    gw = await gateway_factory(table(chat, whisper.url))
    bad = {"type": "input_audio", "input_audio": {"data": "not base64!!", "format": "wav"}}
    async with gw.client() as client:
        with pytest.raises(openai.BadRequestError) as caught:
            await client.chat.completions.create(model="texty", messages=ask(bad))
    assert error_body(caught.value)["code"] == "invalid_audio"
    assert whisper.received == [] and chat.received == []


async def test_a_stream_is_served_after_transcription(gateway_factory, upstream_factory) -> None:
    chat, whisper = await upstream_factory("chat"), await upstream_factory("whisper")
    gw = await gateway_factory(table(chat, whisper.url))
    async with gw.client() as client:
        stream = await client.chat.completions.create(model="texty", messages=ask(input_audio(wav(0.2))), stream=True)
        chunks = [c async for c in stream]
    assert chunks[-1].choices[0].finish_reason == "stop"
    assert chat_parts(chat)[1]["text"].startswith(TRANSCRIPT_MARK)


@pytest.mark.parametrize(
    ("policy", "problem"),
    [
        ("image: {transcribe: whisper}", "models[0].on_unsupported.image.transcribe: only audio can be transcribed"),
        ("audio: {transcribe: nobody}", "transcription model 'nobody' is not a model here"),
        ("audio: {transcribe: whisper, on_error: shrug}", "models[0].on_unsupported.audio.on_error: unknown action"),
        ("audio: {transcribe: whisper, redirect: x}", "unknown key 'redirect'"),
    ],
)
def test_a_transcribe_policy_is_checked(policy: str, problem: str) -> None:
    text = (
        "version: 1\nmodels:\n"
        f"  - {{name: texty, upstreams: ['http://c:1'], accepts: [text], on_unsupported: {{{policy}}}}}\n"
        "  - {name: whisper, upstreams: ['http://w:1'], accepts: [text, audio]}\n"
    )
    with pytest.raises(ConfigError) as caught:
        parse_config(text, filename="r.yaml")
    assert problem in str(caught.value)


def test_explain_says_which_parts_are_transcribed() -> None:
    config = parse_config(
        "version: 1\nmodels:\n"
        "  - {name: texty, upstreams: ['http://c:1'], accepts: [text],\n"
        "     on_unsupported: {audio: {transcribe: whisper}}}\n"
        "  - {name: whisper, upstreams: ['http://w:1'], accepts: [text, audio]}\n"
    )
    body = {"model": "texty", "messages": ask(input_audio(wav(0.1)))}
    plan = admit(config, body)
    decision = plan.explain()
    assert decision["route"] == "transcribe"
    assert [p["action"] for p in decision["parts"]] == ["accept", "transcribe"]
    assert [p.location for p in plan.transcribe_parts] == ["messages[0].content[1]"]


@pytest.mark.parametrize(
    "part",
    [
        {"type": "input_audio", "input_audio": None, "uuid": "cached-1"},
        {"type": "audio_embeds", "audio_embeds": "AAAA"},
    ],
    ids=["cached-reference", "embeddings"],
)
async def test_audio_without_its_sound_is_rejected_not_transcribed(gateway_factory, upstream_factory, part) -> None:
    chat, whisper = await upstream_factory("chat"), await upstream_factory("whisper")
    gw = await gateway_factory(table(chat, whisper.url))
    async with gw.client() as client:
        with pytest.raises(openai.BadRequestError) as caught:
            await client.chat.completions.create(model="texty", messages=ask(part))
    body = error_body(caught.value)
    assert (body["code"], body["param"]) == ("unsupported_modality", "messages[0].content[1]")
    assert whisper.received == [] and chat.received == []


async def test_replicas_that_are_not_transcription_servers_or_time_out_are_passed_over(
    gateway_factory, upstream_factory
) -> None:
    from aiohttp import web

    async def not_found(request: web.Request) -> web.Response:
        return web.Response(status=404, text="no such route")

    async def not_json(request: web.Request) -> web.Response:
        return web.Response(text="<html>a proxy page</html>")

    apps = []
    for handler in (not_found, not_json):
        app = web.Application()
        app.router.add_post("/v1/audio/transcriptions", handler)
        apps.append(await upstream_factory(handler.__name__, app))
    slow, good = await upstream_factory("slow"), await upstream_factory("good")
    slow.standin.delay_ms = 60_000  # never in time: it is the timeout that fires, not a race
    chat = await upstream_factory("chat")
    text = table(chat, apps[0].url, apps[1].url, slow.url, good.url).replace(
        "accepts: [text, audio]}",
        # the good replica's answer must come within first_byte_s: 1.5 s of room on a loaded machine
        "accepts: [text, audio], timeouts: {first_byte_s: 1.5}, balance: round_robin, retries: {attempts: 3}}",
    )
    gw = await gateway_factory(text)
    async with gw.client() as client:
        await client.chat.completions.create(model="texty", messages=ask(input_audio(wav(0.1))))
    assert "[good]" in chat_parts(chat)[1]["text"]


async def test_audio_is_held_to_max_audio_bytes_before_any_transcription(gateway_factory, upstream_factory) -> None:
    chat, whisper = await upstream_factory("chat"), await upstream_factory("whisper")
    clip = wav(0.5)
    media = f"media: {{max_image_bytes: 100, max_audio_bytes: {len(clip)}}}\n"
    gw = await gateway_factory(table(chat, whisper.url).replace("models:", media + "models:", 1))
    as_url = {"type": "audio_url", "audio_url": {"url": "data:audio/wav;base64," + base64.b64encode(clip).decode()}}
    async with gw.client() as client:
        await client.chat.completions.create(model="texty", messages=ask(input_audio(clip), as_url))
        # within max_audio_bytes, though far over max_image_bytes (the same clip twice: transcribed once)
        assert len(whisper.received) == 1 and len(chat_parts(chat)) == 3
        for part in (
            input_audio(clip + b"\x00"),
            {
                "type": "audio_url",
                "audio_url": {"url": "data:audio/wav;base64," + base64.b64encode(clip + b"\x00").decode()},
            },
        ):
            with pytest.raises(openai.BadRequestError) as caught:
                await client.chat.completions.create(model="texty", messages=ask(part))
            error = error_body(caught.value)
            assert (error["code"], error["param"]) == ("media_refused", "messages[0].content[1]")
            assert error["message"] == (
                f"messages[0].content[1]: Audio is larger than media.max_audio_bytes ({len(clip)} bytes)"
            )
    assert len(whisper.received) == 1 and len(chat.received) == 1
    assert gw.sample("gateway_modality_rejections_total", model="texty", modality="audio", reason="media_refused") == 2


async def test_the_transcription_models_retries_attempts_bound_the_tries(gateway_factory, upstream_factory) -> None:
    chat = await upstream_factory("chat")
    failing = [await upstream_factory(f"bad-{i}") for i in range(3)]
    for upstream in failing:
        upstream.standin.fail_status = 503
    dead = f"http://127.0.0.1:{free_port()}"
    config = table(chat, dead, *(u.url for u in failing)).replace(
        "accepts: [text, audio]}", "accepts: [text, audio], retries: {attempts: 1}}"
    )
    gw = await gateway_factory(config)
    async with gw.client() as client:
        with pytest.raises(openai.APIStatusError) as caught:
            await client.chat.completions.create(model="texty", messages=ask(input_audio(wav(0.1))))
    assert caught.value.status_code == 502
    assert sum(len(u.standin.received) for u in failing) == 2  # one try and one retry; the refused one is free
    assert chat.received == []


async def test_the_transcription_models_total_s_bounds_all_its_tries(gateway_factory, upstream_factory) -> None:
    """timeouts.total_s counts over every try of one audio part, as over every attempt of a chat
    request: a second try gets what the first left (however slow the machine, the answer is 504)."""
    chat = await upstream_factory("chat")
    slow = [await upstream_factory(f"slow-{i}") for i in range(2)]
    for upstream in slow:
        upstream.standin.fail_status, upstream.standin.delay_ms = 503, 200
    config = table(chat, *(u.url for u in slow)).replace(
        "accepts: [text, audio]}", "accepts: [text, audio], timeouts: {total_s: 0.3}}"
    )
    gw = await gateway_factory(config)
    async with gw.client() as client:
        with pytest.raises(openai.APIStatusError) as caught:
            await client.with_options(max_retries=0).chat.completions.create(
                model="texty", messages=ask(input_audio(wav(0.1)))
            )
    assert (caught.value.status_code, error_body(caught.value)["code"]) == (504, "upstream_timeout")
    assert chat.received == []


def mp3(seconds: float) -> bytes:
    """An MP3 of silence, made with PyAV (FFmpeg's LAME)."""
    av, np = pytest.importorskip("av"), pytest.importorskip("numpy")
    out = io.BytesIO()
    with av.open(out, "w", format="mp3") as container:
        stream = container.add_stream("libmp3lame", rate=16000)
        stream.layout = "mono"
        frame = av.AudioFrame.from_ndarray(
            np.zeros((1, int(16000 * seconds)), dtype=np.float32), format="fltp", layout="mono"
        )
        frame.sample_rate = 16000
        for packet in [*stream.encode(frame), *stream.encode(None)]:
            container.mux(packet)
    return out.getvalue()


async def test_the_seconds_of_compressed_audio_are_counted_too(gateway_factory, upstream_factory) -> None:
    chat, whisper = await upstream_factory("chat"), await upstream_factory("whisper")
    gw = await gateway_factory(table(chat, whisper.url))
    async with gw.client() as client:
        await client.chat.completions.create(model="texty", messages=ask(input_audio(mp3(3.0), "mp3")))
        await client.chat.completions.create(model="texty", messages=ask(input_audio(b"not audio" * 20, "mp3")))
    assert whisper.received[0].headers["Content-Type"].startswith("multipart/form-data")
    # the first: 3 s from the MP3's header; the second: nothing FFmpeg can read, counted as 0
    assert gw.sample("gateway_audio_transcribed_seconds_total", model="texty") == pytest.approx(3.0, abs=0.1)


async def test_the_same_clip_in_a_later_turn_is_transcribed_once(gateway_factory, upstream_factory) -> None:
    """A conversation sends its first turn's audio again every turn: the transcript is kept (by
    the clip's sha256 and the transcription model), so later turns cost no transcription and carry
    the same words, which keeps the engine's prefix cache."""
    chat, whisper = await upstream_factory("chat"), await upstream_factory("whisper")
    gw = await gateway_factory(table(chat, whisper.url))
    clip = input_audio(wav(0.5))
    first = ask(clip)
    async with gw.client() as client:
        await client.chat.completions.create(model="texty", messages=first)
        later = [*first, {"role": "assistant", "content": "heard"}, {"role": "user", "content": "and?"}]
        await client.chat.completions.create(model="texty", messages=later)
    assert len(whisper.received) == 1
    turns = [r.json()["messages"][0]["content"] for r in chat.received]
    assert turns[0] == turns[1]
    assert gw.sample("gateway_media_cache_requests_total", kind="transcript", result="miss") == 1
    assert gw.sample("gateway_media_cache_requests_total", kind="transcript", result="hit") == 1
    assert gw.sample("gateway_audio_transcribed_seconds_total", model="texty") == pytest.approx(1.0)  # 0.5 s twice


async def test_media_cache_bytes_0_keeps_nothing(gateway_factory, upstream_factory) -> None:
    chat, whisper = await upstream_factory("chat"), await upstream_factory("whisper")
    gw = await gateway_factory(table(chat, whisper.url).replace("models:", "media: {cache_bytes: 0}\nmodels:", 1))
    async with gw.client() as client:
        for _ in range(2):
            await client.chat.completions.create(model="texty", messages=ask(input_audio(wav(0.2))))
    assert len(whisper.received) == 2
    assert not gw.sample("gateway_media_cache_requests_total", kind="transcript", result="miss")  # nor hashed


async def test_an_empty_transcript_is_not_kept(gateway_factory, upstream_factory) -> None:
    from aiohttp import web

    heard: list[int] = []

    async def silent(request: web.Request) -> web.Response:
        await request.read()
        heard.append(1)
        return web.json_response({"text": ""})

    app = web.Application()
    app.router.add_post("/v1/audio/transcriptions", silent)
    chat, whisper = await upstream_factory("chat"), await upstream_factory("whisper", app)
    gw = await gateway_factory(table(chat, whisper.url))
    async with gw.client() as client:
        for _ in range(2):
            await client.chat.completions.create(model="texty", messages=ask(input_audio(wav(0.2))))
    assert len(heard) == 2  # asked again: a replica that heard nothing may hear something next time


# --- counters that trust the client (issue 20) -----------------------------------------------


def lying_wav(claimed_s: float, real_s: float, rate: int = 16000) -> bytes:
    """A WAV whose header states ``claimed_s`` seconds and whose bytes hold ``real_s``."""
    data = bytearray(wav(real_s, rate))
    frames = int(claimed_s * rate)
    data[4:8] = (36 + frames * 2).to_bytes(4, "little")  # RIFF size
    data[40:44] = (frames * 2).to_bytes(4, "little")  # the data chunk's size
    return bytes(data)


async def test_a_wav_header_claiming_hours_counts_the_seconds_it_holds(gateway_factory, upstream_factory) -> None:
    """A 10 h header on 1 s of samples added 36,000 s to the counter."""
    chat, whisper = await upstream_factory("chat"), await upstream_factory("whisper")
    gw = await gateway_factory(table(chat, whisper.url))
    async with gw.client() as client:
        await client.chat.completions.create(model="texty", messages=ask(input_audio(lying_wav(36_000, 1.0))))
    assert gw.sample("gateway_audio_transcribed_seconds_total", model="texty") == pytest.approx(1.0, abs=0.01)


async def test_a_wav_whose_chunks_lie_is_transcribed_and_counted_never_a_500(gateway_factory, upstream_factory) -> None:
    """A fmt chunk that claims 64 KiB in a 1 KB file made the wave module raise RuntimeError, after
    the transcription was paid for: a 500."""
    chat, whisper = await upstream_factory("chat"), await upstream_factory("whisper")
    gw = await gateway_factory(table(chat, whisper.url))
    data = bytearray(wav(0.03))
    data[16:20] = (0xFFFF).to_bytes(4, "little")
    async with gw.client() as client:
        await client.chat.completions.create(model="texty", messages=ask(input_audio(bytes(data))))
    assert len(whisper.received) == 1
    assert gw.sample("gateway_audio_transcribed_seconds_total", model="texty") <= len(data) * 8 / 6000


async def test_a_replys_duration_is_bounded_by_the_bytes_sent(gateway_factory, upstream_factory) -> None:
    """A transcription reply's ``duration: 1e18`` was counted as it said, on every cache hit
    again; where the gateway reads nothing of the clip itself, the reply's word is held to what
    the bytes could hold at 6 kb/s."""
    from aiohttp import web

    async def transcribe(request: web.Request) -> web.Response:
        await request.read()
        return web.json_response({"text": "words", "duration": 1e18})

    app = web.Application()
    app.router.add_post("/v1/audio/transcriptions", transcribe)
    chat, whisper = await upstream_factory("chat"), await upstream_factory("whisper", app)
    gw = await gateway_factory(table(chat, whisper.url))
    clip = b"\x00not a container FFmpeg reads" * 100  # 2,900 bytes: at most 3.9 s at 6 kb/s
    async with gw.client() as client:
        for _ in range(2):  # the second from the cache
            await client.chat.completions.create(model="texty", messages=ask(input_audio(clip, "mp3")))
    assert gw.sample("gateway_audio_transcribed_seconds_total", model="texty") == pytest.approx(
        2 * len(clip) * 8 / 6000
    )


async def test_an_audio_playlist_opens_no_file(gateway_factory, upstream_factory, tmp_path, monkeypatch) -> None:
    """What the gateway reads of a clip (its length) is read by a demuxer that opens nothing else.
    The playlist names a FIFO beside the gateway: whoever opens it to read shows, since a writer
    can then open it without waiting (FFmpeg's concat demuxer opened it, and waited for data)."""
    import asyncio
    import errno
    import os

    from tests.videos import playlist

    pytest.importorskip("av")
    fifo = tmp_path / "clip.mp3"
    os.mkfifo(fifo)
    monkeypatch.chdir(tmp_path)
    chat, whisper = await upstream_factory("chat"), await upstream_factory("whisper")
    gw = await gateway_factory(table(chat, whisper.url))
    opened = False

    def release_a_reader() -> None:  # lets a reader that waits on the FIFO go on (it reads EOF)
        nonlocal opened
        try:
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
            opened = True
        except OSError as exc:
            assert exc.errno == errno.ENXIO  # nobody has it open to read

    async with gw.client() as client:
        request = asyncio.create_task(
            client.chat.completions.create(model="texty", messages=ask(input_audio(playlist("clip.mp3"), "mp3")))
        )
        while not request.done():
            await asyncio.to_thread(release_a_reader)
            await asyncio.wait({request}, timeout=0.05)
        await request
    assert not opened
    assert gw.sample("gateway_audio_transcribed_seconds_total", model="texty") == 0


async def test_transcription_retries_are_the_transcription_models_own_counted_and_budgeted(
    gateway_factory, upstream_factory
) -> None:
    # one attempt loop: a transcription's retries are counted like a chat request's, under the
    # transcription model's name, and drawn from its retry budget (here spent: none is made)
    chat, bad, good = await upstream_factory("chat"), await upstream_factory("bad"), await upstream_factory("good")
    bad.standin.fail_status = 503
    dead = f"http://127.0.0.1:{free_port()}"
    config = table(chat, dead, bad.url, good.url).replace(
        "accepts: [text, audio]}", "accepts: [text, audio], balance: round_robin}"
    )
    gw = await gateway_factory(config)
    async with gw.client() as client:
        await client.chat.completions.create(model="texty", messages=ask(input_audio(wav(0.1))))
    assert gw.sample("gateway_retries_total", model="whisper", reason="connect_error") == 1
    assert gw.sample("gateway_retries_total", model="whisper", reason="http_503") == 1
    assert len(good.standin.received) == 1

    spent = table(chat, bad.url, good.url).replace(
        "accepts: [text, audio]}", "accepts: [text, audio], balance: round_robin, retries: {budget: 0, min_per_s: 0}}"
    )
    gw = await gateway_factory(spent)
    async with gw.client() as client:
        with pytest.raises(openai.APIStatusError) as caught:
            await client.chat.completions.create(model="texty", messages=ask(input_audio(wav(0.2))))
    assert caught.value.status_code == 502
    assert gw.sample("gateway_retries_refused_total", model="whisper") == 1

"""Audio uploads (``/v1/audio/transcriptions``, ``/translations``, multipart/form-data) through
admission, with the real openai SDK as the client and a stand-in that answers as vLLM's Whisper
serving does."""

from __future__ import annotations

import aiohttp
import openai
import pytest

from tests.conftest import Upstream, error_body, routing
from tests.media.test_transcribe import wav

pytestmark = pytest.mark.timeout(60)
APIS = "apis: [chat, transcriptions, translations]"


def table(whisper: Upstream, texty: Upstream, extra: str = "") -> str:
    return routing(
        f"  - {{name: whisper, upstream_model: openai/whisper-large-v3, upstreams: [{whisper.url}], "
        f"accepts: [text, audio], {APIS}}}",
        f"  - {{name: texty, upstreams: [{texty.url}], accepts: [text], {APIS}{extra}}}",
        f"  - {{name: chatty, upstreams: [{texty.url}], accepts: [text, audio]}}",
        extra="media: {max_audio_bytes: 100000}\n",
    )


@pytest.fixture
async def both(upstream_factory) -> tuple[Upstream, Upstream]:
    return await upstream_factory("whisper"), await upstream_factory("texty")


async def test_an_upload_reaches_the_engine_as_sent_its_model_renamed(gateway_factory, both) -> None:
    whisper, texty = both
    gw = await gateway_factory(table(whisper, texty))
    clip = wav(0.5)
    async with gw.client() as client:
        reply = await client.audio.transcriptions.create(model="whisper", file=("hello.wav", clip), language="en")
    form = aiohttp.FormData()  # translations: the SDK marks its method deprecated; the route is vLLM's
    form.add_field("model", "whisper")
    form.add_field("file", clip, filename="hola.wav", content_type="audio/wav")
    async with aiohttp.ClientSession() as session, session.post(f"{gw.url}/v1/audio/translations", data=form) as resp:
        translated = await resp.json()
    assert reply.text == f"[whisper] openai/whisper-large-v3 heard hello.wav ({len(clip)} bytes)"
    assert translated["text"].startswith("[whisper] openai/whisper-large-v3 heard hola.wav")
    first = whisper.received[0].json()
    assert whisper.received[0].path == "/v1/audio/transcriptions" and whisper.received[1].path.endswith("translations")
    assert first["file"][0] == "hello.wav" and first["file"][2] == len(clip) and first["language"][3] == "en"
    assert first["model"][3] == "openai/whisper-large-v3"


async def test_a_model_without_audio_is_a_400_and_a_redirect_goes_to_one_with_it(gateway_factory, both) -> None:
    whisper, texty = both
    gw = await gateway_factory(table(whisper, texty))
    async with gw.client() as client:
        with pytest.raises(openai.BadRequestError) as caught:
            await client.audio.transcriptions.create(model="texty", file=("a.wav", wav(0.1)))
        assert (error_body(caught.value)["code"], error_body(caught.value)["param"]) == ("unsupported_modality", "file")
        with pytest.raises(openai.BadRequestError) as caught:
            await client.audio.transcriptions.create(model="chatty", file=("a.wav", wav(0.1)))
        assert error_body(caught.value)["code"] == "unsupported_api"
        with pytest.raises(openai.BadRequestError) as caught:  # over media.max_audio_bytes: before any engine
            await client.audio.transcriptions.create(model="whisper", file=("long.wav", wav(5)))
        assert error_body(caught.value)["code"] == "media_refused"
    assert whisper.received == [] and texty.received == []
    assert gw.sample("gateway_modality_rejections_total", model="texty", modality="audio", reason="unsupported") == 1

    gw = await gateway_factory(table(whisper, texty, extra=", on_unsupported: {audio: {redirect: whisper}}"))
    async with gw.client() as client:
        raw = await client.audio.transcriptions.with_raw_response.create(model="texty", file=("a.wav", wav(0.1)))
    assert raw.headers["X-Gateway-Route"] == "redirect" and raw.headers["X-Gateway-Model"] == "whisper"
    assert whisper.received[-1].json()["model"][3] == "openai/whisper-large-v3"


async def test_a_streamed_transcription_is_relayed_event_by_event(gateway_factory, both) -> None:
    whisper, texty = both
    gw = await gateway_factory(table(whisper, texty))
    form = aiohttp.FormData()
    form.add_field("model", "whisper")
    form.add_field("stream", "true")
    form.add_field("file", wav(0.1), filename="a.wav", content_type="audio/wav")
    async with aiohttp.ClientSession() as session, session.post(f"{gw.url}/v1/audio/transcriptions", data=form) as resp:
        assert resp.status == 200 and resp.content_type == "text/event-stream"
        events = [e for e in (await resp.text()).split("\n\n") if e]
    assert events[-1] == "data: [DONE]" and all('"transcription.chunk"' in e for e in events[:-1])


@pytest.mark.parametrize(
    ("content_type", "body", "message"),
    [
        ("application/json", b"{}", "multipart/form-data"),
        ("multipart/form-data", b"x", "without a boundary"),
        ("multipart/form-data; boundary=zz", b"--zz\r\nContent-Disposition: form-data\r\n\r\nx\r\n--zz--", "no name"),
        ("multipart/form-data; boundary=zz", b'--zz\r\nContent-Disposition: form-data; name="model"\r\n\r\nwhisper',
         "cut short"),
        ("multipart/form-data; boundary=zz", b'--zz\r\nContent-Disposition: form-data; name="model"\r\n\r\nwhisper'
         b"\r\n--zz--", "no 'file' part"),
        # routed by the first, served by the last (starlette keeps the last): never both
        ("multipart/form-data; boundary=zz", b'--zz\r\nContent-Disposition: form-data; name="model"\r\n\r\nwhisper'
         b'\r\n--zz\r\nContent-Disposition: form-data; name="model"\r\n\r\nchatty\r\n--zz--',
         "more than one 'model' part"),
    ],
)  # fmt: skip
async def test_a_malformed_form_is_a_clear_400(
    gateway_factory, both, content_type: str, body: bytes, message: str
) -> None:
    whisper, texty = both
    gw = await gateway_factory(table(whisper, texty))
    async with (
        aiohttp.ClientSession() as session,
        session.post(f"{gw.url}/v1/audio/transcriptions", data=body, headers={"Content-Type": content_type}) as resp,
    ):
        assert resp.status == 400 and message in (await resp.json())["error"]["message"]
    assert whisper.received == []


async def test_a_second_file_is_refused_and_array_fields_may_repeat(gateway_factory, both) -> None:
    whisper, texty = both
    gw = await gateway_factory(table(whisper, texty))
    clip = wav(0.2)
    form = aiohttp.FormData()
    form.add_field("model", "whisper")
    form.add_field("file", clip, filename="a.wav", content_type="audio/wav")
    form.add_field("file", b"\0" * 200_000, filename="b.wav", content_type="audio/wav")  # past max_audio_bytes
    async with aiohttp.ClientSession() as session, session.post(f"{gw.url}/v1/audio/transcriptions", data=form) as resp:
        assert resp.status == 400 and (await resp.json())["error"]["param"] == "file"
    assert whisper.received == []
    async with gw.client() as client:  # the SDK sends timestamp_granularities[] once a value
        await client.audio.transcriptions.create(
            model="whisper",
            file=("a.wav", clip),
            response_format="verbose_json",
            timestamp_granularities=["word", "segment"],
        )
    assert len(whisper.received) == 1


async def test_a_keyed_upload_is_answered_with_its_keys_limits(gateway_factory, both, monkeypatch) -> None:
    """An upload's exchange holds its key's account as a JSON request's does (what it costs is
    spent of it): its answer carries the key's x-ratelimit-* headers."""
    whisper, _ = both
    monkeypatch.setenv("MODALITY_GATEWAY_TEST_UPLOAD_KEY", "sk-upload")
    keyed = routing(
        f"  - {{name: whisper, upstream_model: openai/whisper-large-v3, upstreams: [{whisper.url}], "
        f"accepts: [text, audio], {APIS}}}",
        extra="media: {max_audio_bytes: 100000}\nauth:\n  keys:\n    - {name: team-a, "
        "key_env: MODALITY_GATEWAY_TEST_UPLOAD_KEY, rate_limit: {requests_per_minute: 60, tokens_per_minute: 1000}}\n",
    )
    gw = await gateway_factory(keyed)
    async with openai.AsyncOpenAI(base_url=f"{gw.url}/v1", api_key="sk-upload", max_retries=0) as client:
        raw = await client.audio.transcriptions.with_raw_response.create(model="whisper", file=("a.wav", wav(0.3)))
    assert raw.headers["x-ratelimit-limit-requests"] == "60"
    assert raw.headers["x-ratelimit-limit-tokens"] == "1000"

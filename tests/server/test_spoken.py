"""gateway.server.spoken: a chat request for audio out of a model that answers in text alone,
its answer spoken by the model ``on_unsupported_output: {audio: {speak: MODEL}}`` names, with the
openai SDK as the client: the audio and its transcript as OpenAI's chat answers them; the text
model asked for text alone; a stream, a speaker the key may not use, a refusal of either model."""

from __future__ import annotations

import base64
import hashlib
from typing import Any

import openai
import pytest

from gateway.config import parse_config
from gateway.errors import ConfigError
from tests.conftest import Gateway, Upstream, error_body, routing

AUDIO: dict[str, Any] = {"modalities": ["text", "audio"], "audio": {"voice": "alloy", "format": "wav"}}
HI = [{"role": "user", "content": "say hello"}]


def table(upstream: str, extra: str = "") -> str:
    return routing(
        f"  - {{name: texty, upstream_model: llama, upstreams: [{upstream}], accepts: [text],\n"
        "     on_unsupported_output: {audio: {speak: tts}}}",
        f"  - {{name: tts, upstream_model: kokoro, upstreams: [{upstream}], accepts: [text], produces: [audio],"
        " apis: [speech]}",
        extra=extra,
    )


async def test_a_text_answer_is_spoken_as_openai_answers_audio(gateway_factory, upstream: Upstream) -> None:
    gw: Gateway = await gateway_factory(table(upstream.url))
    async with gw.client() as client:
        raw = await client.chat.completions.with_raw_response.create(model="texty", messages=HI, **AUDIO)
    answer = raw.parse()
    message = answer.choices[0].message
    assert message.audio is not None and message.content is None
    assert base64.b64decode(message.audio.data).startswith(b"RIFF")
    assert message.audio.transcript and message.audio.id.startswith("audio_")
    assert (raw.headers["X-Gateway-Model"], raw.headers["X-Gateway-Route"]) == ("texty", "speak")
    asked, spoke = upstream.received
    assert asked.path == "/v1/chat/completions" and "modalities" not in asked.json() and "audio" not in asked.json()
    assert asked.json()["model"] == "llama"
    assert spoke.path == "/v1/audio/speech"
    assert spoke.json() == {"model": "kokoro", "input": message.audio.transcript, "voice": "alloy",
                            "response_format": "wav"}  # fmt: skip
    assert gw.sample("gateway_outputs_spoken_total", model="texty", speaker="tts") == 1
    assert gw.sample("gateway_tokens_total", model="texty", key="-", kind="completion") > 0


async def test_what_cannot_be_spoken_is_said_before_any_engine(gateway_factory, upstream: Upstream) -> None:
    """A stream (a spoken answer comes once whole), and a key that may not use the speaker: 400s
    naming the param, the engines untouched; the text model's own refusal passes as it came."""
    keys = (
        "auth:\n  keys:\n"
        f"    - {{name: small, key_sha256: {hashlib.sha256(b'sk-small').hexdigest()}, models: [texty]}}\n"
    )
    gw: Gateway = await gateway_factory(table(upstream.url, keys))
    refusals = []
    async with openai.AsyncOpenAI(base_url=f"{gw.url}/v1", api_key="sk-small", max_retries=0) as client:
        for named in ({"stream": True}, {}):
            with pytest.raises(openai.BadRequestError) as refused:
                await client.chat.completions.create(model="texty", messages=HI, **AUDIO, **named)
            refusals.append(error_body(refused.value))
        assert upstream.received == []
    assert [(r["code"], r["param"]) for r in refusals] == [
        ("unsupported_output_modality", "modalities[1]"),  # the speaker is not the key's: no way to audio
        ("unsupported_output_modality", "modalities[1]"),
    ]
    open_gw: Gateway = await gateway_factory(table(upstream.url))
    upstream.standin.fail_status = 400  # the text model refuses what it is asked
    async with open_gw.client() as client:
        with pytest.raises(openai.BadRequestError) as streamed:
            await client.chat.completions.create(model="texty", messages=HI, stream=True, **AUDIO)
        with pytest.raises(openai.BadRequestError) as passed:  # the text model's own 400, as it came
            await client.chat.completions.create(model="texty", messages=HI, **AUDIO)
    assert (error_body(streamed.value)["code"], error_body(streamed.value)["param"]) == ("invalid_request", "stream")
    assert "does not stream" in error_body(streamed.value)["message"]
    assert passed.value.response.headers["X-Gateway-Route"] == "speak"


def test_check_holds_speak_to_a_speech_model_and_to_audio() -> None:
    with pytest.raises(ConfigError) as refused:
        parse_config(
            routing(
                "  - {name: a, upstreams: ['http://h:1'], accepts: [text],\n"
                "     on_unsupported_output: {audio: {speak: b}, image: {speak: c}}}",
                "  - {name: b, upstreams: ['http://h:1'], accepts: [text], produces: [text, audio]}",
                "  - {name: c, upstreams: ['http://h:1'], accepts: [text], produces: [text, image]}",
            ),
            filename="r.yaml",
        )
    said = str(refused.value)
    assert "models[0].on_unsupported_output.audio.speak: speaking model 'b' does not serve the speech API" in said
    assert "models[0].on_unsupported_output.image.speak: speak is for audio" in said


async def test_a_voice_or_format_no_speech_api_takes_is_refused_before_any_engine(
    gateway_factory, upstream: Upstream
) -> None:
    gw: Gateway = await gateway_factory(table(upstream.url))
    refusals = []
    async with gw.client() as client:
        for audio in ({"voice": {"id": "voice_1"}, "format": "wav"}, {"voice": "alloy", "format": "ogg"}, "alloy"):
            with pytest.raises(openai.BadRequestError) as refused:
                await client.chat.completions.create(
                    model="texty",
                    messages=HI,
                    modalities=["text", "audio"],
                    audio=audio,
                )
            refusals.append(error_body(refused.value))
        upstream.standin.fail_status = 429  # the text model busy: its 429 as it came, not tried again
        with pytest.raises(openai.RateLimitError):
            await client.chat.completions.create(model="texty", messages=HI, **AUDIO)
    assert [r["param"] for r in refusals] == ["audio.voice", "audio.format", "audio"]
    assert [r.path for r in upstream.received] == ["/v1/chat/completions"]


def test_the_model_an_input_redirect_ends_at_speaks_or_makes_the_audio() -> None:
    """An input redirect after the output was decided: the model the request ends at makes the
    audio itself (nobody speaks it), speaks it with its own speaker, or neither (400)."""
    from gateway.admission.plan import admit
    from gateway.errors import UnsupportedOutputModalityError

    config = parse_config(
        routing(
            "  - {name: texty, upstreams: ['http://h:1'], accepts: [text],\n"
            "     on_unsupported_output: {audio: {speak: tts}}, on_unsupported: {image: {redirect: omni}}}",
            "  - {name: plain, upstreams: ['http://h:1'], accepts: [text],\n"
            "     on_unsupported_output: {audio: {speak: tts}}, on_unsupported: {image: {redirect: vl}}}",
            "  - {name: omni, upstreams: ['http://h:1'], accepts: [text, image], produces: [text, audio]}",
            "  - {name: vl, upstreams: ['http://h:1'], accepts: [text, image]}",
            "  - {name: tts, upstreams: ['http://h:1'], accepts: [text], produces: [audio], apis: [speech]}",
        )
    )
    picture = {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}
    asked = {"messages": [{"role": "user", "content": [picture]}], **AUDIO}
    made = admit(config, {"model": "texty", **asked})
    assert (made.model.name, made.speaker, made.route) == ("omni", None, "redirect")
    assert admit(config, {"model": "texty", "messages": HI, **AUDIO}).speaker == "tts"
    with pytest.raises(UnsupportedOutputModalityError) as refused:
        admit(config, {"model": "plain", **asked})
    assert refused.value.param == "modalities[1]"
    assert refused.value.message.startswith("Model 'vl' (redirected from 'plain') does not produce audio output")

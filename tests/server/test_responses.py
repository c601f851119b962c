"""The Responses API (``POST /v1/responses``) through admission, with the real openai SDK as the
client and a stand-in that answers as vLLM does (its named events included)."""

from __future__ import annotations

from typing import Any

import aiohttp
import openai
import pytest

from tests.conftest import Gateway, Upstream, error_body, routing

pytestmark = pytest.mark.timeout(60)
PNG = "data:image/png;base64,iVBORw0KGgo="
PDF = "data:application/pdf;base64,JVBERi0xLjQK"


def table(texty: Upstream, vision: Upstream, *, texty_extra: str = "", vision_extra: str = "") -> str:
    return routing(
        f"  - {{name: texty, upstreams: [{texty.url}], accepts: [text]{texty_extra}}}",
        f"  - {{name: vision, upstreams: [{vision.url}], accepts: [text, image]{vision_extra}}}",
    )


def user(*parts: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"role": "user", "content": [{"type": "input_text", "text": "what is this?"}, *parts]}]


IMAGE = {"type": "input_image", "image_url": PNG, "detail": "auto"}  # as the SDK types it (vLLM requires detail)


@pytest.fixture
async def both(upstream_factory) -> tuple[Upstream, Upstream]:
    return await upstream_factory("texty"), await upstream_factory("vision")


async def test_an_image_to_a_text_only_model_is_a_400_naming_the_part_and_no_engine_is_asked(
    gateway_factory, both
) -> None:
    texty, vision = both
    gw = await gateway_factory(table(texty, vision))
    async with gw.client() as client:
        with pytest.raises(openai.BadRequestError) as caught:
            await client.responses.create(model="texty", input=user(IMAGE))
    error = error_body(caught.value)
    assert error["code"] == "unsupported_modality" and error["param"] == "input[0].content[1]"
    assert "does not accept image input: input[0].content[1] is 'input_image'" in error["message"]
    assert texty.received == [] and vision.received == []
    assert gw.sample("gateway_modality_rejections_total", model="texty", modality="image", reason="unsupported") == 1


async def test_an_accepted_request_reaches_the_engine_intact_and_its_answer_the_client(gateway_factory, both) -> None:
    texty, vision = both
    gw = await gateway_factory(table(texty, vision))
    items = user(IMAGE)
    async with gw.client() as client:
        response = await client.responses.create(model="vision", input=items, instructions="be brief")
    assert response.output_text == "[vision] model=vision messages=1 input_image=1 input_text=1"
    sent = vision.received[-1]
    assert sent.path == "/v1/responses" and sent.json()["input"] == items and sent.json()["instructions"] == "be brief"


async def test_a_stream_is_relayed_event_by_event_to_response_completed(gateway_factory, both) -> None:
    texty, vision = both
    gw = await gateway_factory(table(texty, vision))
    async with gw.client() as client:
        stream = await client.responses.create(model="vision", input=user(IMAGE), stream=True)
        kinds = [event.type async for event in stream]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]  # fmt: skip
    assert kinds[-1] == "response.completed" and kinds.count("response.output_text.delta") == 5


async def test_a_redirect_and_a_strip_work_on_responses_as_on_chat(gateway_factory, both) -> None:
    texty, vision = both
    gw = await gateway_factory(table(texty, vision, texty_extra=", on_unsupported: {image: {redirect: vision}}"))
    async with aiohttp.ClientSession() as session:
        body = {"model": "texty", "input": user(IMAGE)}
        async with session.post(f"{gw.url}/v1/responses", json=body) as resp:
            assert resp.status == 200 and resp.headers["X-Gateway-Route"] == "redirect"
    assert vision.received[-1].json()["model"] == "vision" and texty.received == []

    gw = await gateway_factory(table(texty, vision, texty_extra=", on_unsupported: {image: strip}"))
    async with gw.client() as client:
        await client.responses.create(model="texty", input=user(IMAGE))
    note = "[An image was removed here by the gateway: model 'texty' does not take image input]"
    assert texty.received[-1].json()["input"] == [
        {"role": "user", "content": [user()[0]["content"][0], {"type": "input_text", "text": note}]}
    ]


async def test_parts_in_a_tool_output_and_documents_are_classified(gateway_factory, both) -> None:
    texty, vision = both
    gw = await gateway_factory(table(texty, vision))
    screenshot = [
        *user(),
        {"type": "function_call", "call_id": "c1", "name": "screenshot", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": [IMAGE]},
    ]
    document = user({"type": "input_file", "file_data": PDF, "filename": "a.pdf"})
    async with gw.client() as client:
        with pytest.raises(openai.BadRequestError) as caught:
            await client.responses.create(model="texty", input=screenshot)
        assert error_body(caught.value)["param"] == "input[2].output[0]"
        # a custom tool's output too (vLLM and SGLang make it a tool message, its images read)
        custom = [*user(), {"type": "custom_tool_call_output", "call_id": "c1", "output": [IMAGE]}]
        with pytest.raises(openai.BadRequestError) as caught:
            await client.responses.create(model="texty", input=custom)
        assert error_body(caught.value)["param"] == "input[1].output[0]"
        with pytest.raises(openai.BadRequestError) as caught:
            await client.responses.create(model="vision", input=document)
        assert error_body(caught.value)["param"] == "input[0].content[1]"
        assert "does not accept file input" in error_body(caught.value)["message"]
        # a string input is text
        response = await client.responses.create(model="texty", input="hello")
    assert response.output_text.endswith("messages=1 text=1")
    assert texty.received[-1].json()["input"] == "hello"


async def test_a_model_not_served_on_responses_and_conversions_chat_alone_makes_are_clear_400s(
    gateway_factory, both
) -> None:
    texty, vision = both
    config = table(texty, vision, texty_extra=", apis: [chat], on_unsupported: {audio: {transcribe: vision}}")
    gw = await gateway_factory(config.replace("accepts: [text, image]}", "accepts: [text, image, audio]}"))
    audio = {"type": "input_audio", "input_audio": {"data": "UklGRg==", "format": "wav"}}
    async with gw.client() as client:
        with pytest.raises(openai.BadRequestError) as caught:
            await client.responses.create(model="texty", input="hi")
        assert error_body(caught.value)["code"] == "unsupported_api"
        assert "is not served on the responses API here (it serves: chat)" in error_body(caught.value)["message"]
    assert texty.received == []

    # an API that cannot carry a transcript (embeddings' chat-style messages): refused, saying where it is made
    transcribing = table(
        texty, vision, texty_extra=", apis: [embeddings], on_unsupported: {audio: {transcribe: vision}}"
    )
    gw = await gateway_factory(transcribing.replace("accepts: [text, image]}", "accepts: [text, image, audio]}"))
    async with gw.client() as client:
        with pytest.raises(openai.BadRequestError) as caught:
            await client.embeddings.create(model="texty", input="", extra_body={"messages": user(audio)})
    error = error_body(caught.value)
    assert error["code"] == "unsupported_modality" and error["param"] == "messages[0].content[1]"
    assert (
        "which the gateway makes on the chat, Responses and Messages APIs, not on the embeddings API"
        in error["message"]
    )
    assert texty.received == [] and vision.received == []


async def test_a_stream_that_breaks_ends_with_the_responses_error_event(gateway_factory, both) -> None:
    texty, vision = both
    gw: Gateway = await gateway_factory(table(texty, vision))
    async with aiohttp.ClientSession() as session:
        body = {"model": "texty", "input": "hi", "stream": True}
        async with session.post(f"{gw.url}/v1/responses", json=body, headers={"X-Standin-Break-After": "2"}) as resp:
            text = await resp.text()
    assert text.count("event: response.output_text.delta\n") == 2
    error, failed = text.strip().split("\n\n")[-2:]
    assert error.startswith("event: error\ndata: ") and '"type":"error","code":"upstream_error"' in error
    assert failed.startswith("event: response.failed\ndata: ")
    # as the openai SDK reads them (and Codex, which reads response.failed alone): the error, and
    # the response that failed, the stream's own, with the gateway's message
    async with gw.client() as client:
        stream = await client.responses.create(
            model="texty", input="hi", stream=True, extra_headers={"X-Standin-Break-After": "2"}
        )
        events = [event async for event in stream]
    created, *_, error_event, failed_event = events
    assert created.type == "response.created" and error_event.type == "error"
    assert failed_event.type == "response.failed" and failed_event.response.id == created.response.id
    assert failed_event.response.status == "failed" and failed_event.response.error is not None
    assert str(failed_event.response.error.code) == "upstream_error"  # the gateway's code, outside the SDK's Literal
    assert failed_event.response.error.message == error_event.message and "broke off" in error_event.message


async def test_a_follow_up_goes_to_the_replica_that_holds_its_stored_response(
    gateway_factory, upstream_factory
) -> None:
    a, b = await upstream_factory("a"), await upstream_factory("b")
    gw = await gateway_factory(routing(f"  - {{name: m, upstreams: [{a.url}, {b.url}], accepts: [text]}}"))
    async with gw.client() as client:
        first = await client.responses.create(model="m", input="hi")  # streamed or not, the id is learned
        async for event in await client.responses.create(model="m", input="and you?", stream=True):
            if event.type == "response.completed":
                streamed = event.response.id
        previous = first.id
        for i in range(20):
            reply = await client.responses.create(model="m", input=f"turn {i}", previous_response_id=previous)
            previous = reply.id
        follow = await client.responses.create(model="m", input="more", previous_response_id=streamed)
    continued = [
        (replica.standin.name, r.json()["previous_response_id"])
        for replica in (a, b)
        for r in replica.received
        if r.json().get("previous_response_id")
    ]
    assert len(continued) == 21
    assert all(previous.startswith(f"resp_{name}_") for name, previous in continued)  # each on its holder
    assert follow.id.split("_")[1] == streamed.split("_")[1]  # the stream's holder served its follow-up too
    assert gw.sample("gateway_stored_response_routes_total", model="m", result="holder") == 21


async def test_a_holder_gone_leaves_the_engines_own_answer_never_a_hang(gateway_factory, upstream_factory) -> None:
    a, b = await upstream_factory("a"), await upstream_factory("b")
    gw = await gateway_factory(routing(f"  - {{name: m, upstreams: [{a.url}, {b.url}], accepts: [text]}}"))
    async with gw.client() as client:
        first = await client.responses.create(model="m", input="hi")
        holder, other = (a, b) if first.id.startswith("resp_a") else (b, a)
        await holder.server.close()  # its stored responses are gone with it
        with pytest.raises(openai.NotFoundError) as caught:
            await client.responses.create(model="m", input="again", previous_response_id=first.id)
        unknown = await client.responses.create(model="m", input="fresh")  # a new conversation: served
    assert f"Response with id '{first.id}' not found." in str(caught.value)  # the other replica's own 404
    assert other.received[-2].json()["previous_response_id"] == first.id and unknown.id.startswith("resp_")
    assert gw.sample("gateway_stored_response_routes_total", model="m", result="holder") == 1


async def test_audio_is_served_as_its_transcript_on_responses_too(gateway_factory, upstream_factory) -> None:
    texty, whisper = await upstream_factory("texty"), await upstream_factory("whisper")
    gw = await gateway_factory(
        routing(
            f"  - {{name: texty, upstreams: [{texty.url}], accepts: [text], "
            "on_unsupported: {audio: {transcribe: whisper}}}",
            f"  - {{name: whisper, upstreams: [{whisper.url}], accepts: [text, audio]}}",
        )
    )
    nested = {"type": "input_audio", "input_audio": {"data": "UklGRg==", "format": "wav"}}
    flat = {"type": "input_audio", "data": "UklGRiQ=", "format": "wav"}  # as older SDKs sent it
    async with gw.client() as client:
        raw = await client.responses.with_raw_response.create(model="texty", input=user(nested, flat))
    assert raw.headers["X-Gateway-Route"] == "transcribe"
    parts = texty.received[-1].json()["input"][0]["content"]
    assert [p["type"] for p in parts] == ["input_text", "input_text", "input_text"]
    assert parts[1]["text"].startswith("[Transcript of the user's audio] [whisper]") and len(whisper.received) == 2


async def test_parts_of_the_same_meaning_go_in_the_shape_the_engine_reads(gateway_factory, both) -> None:
    texty, vision = both
    gw = await gateway_factory(table(texty, vision))
    as_chat = {"type": "input_image", "image_url": {"url": PNG}, "detail": "low"}
    async with gw.client() as client:
        raw = await client.responses.with_raw_response.create(model="vision", input=user(as_chat, IMAGE))
        plain = await client.responses.with_raw_response.create(model="vision", input=user(IMAGE))
    assert (raw.headers["X-Gateway-Route"], plain.headers["X-Gateway-Route"]) == ("normalize", "direct")
    sent = vision.received[0].json()["input"][0]["content"]
    assert sent[1] == {"type": "input_image", "image_url": PNG, "detail": "low"} and sent[2] == IMAGE
    assert vision.received[1].json()["input"] == user(IMAGE)
    without_detail = {"type": "input_image", "image_url": PNG}  # vLLM refuses it: OpenAI's default, auto, is said
    async with gw.client() as client:
        raw = await client.responses.with_raw_response.create(model="vision", input=user(without_detail))
    assert raw.headers["X-Gateway-Route"] == "normalize"
    assert vision.received[2].json()["input"] == user(IMAGE)


async def test_audio_on_a_vllm_models_responses_api_goes_as_its_policy_says(gateway_factory, upstream_factory) -> None:
    """vLLM's Responses API has no audio part (issue 38): a model that takes audio on chat takes
    it there as its on_unsupported policy says, by default a 400 that says why; SGLang's has one."""
    omni, whisper, sglang = [await upstream_factory(n) for n in ("omni", "whisper", "sglang")]
    gw = await gateway_factory(
        routing(
            f"  - {{name: omni, upstreams: [{omni.url}], accepts: [text, audio]}}",
            f"  - {{name: heard, upstreams: [{omni.url}], accepts: [text, audio], "
            "on_unsupported: {audio: {transcribe: whisper}}}",
            f"  - {{name: sg, upstreams: [{sglang.url}], engine: sglang, accepts: [text, audio]}}",
            f"  - {{name: whisper, upstreams: [{whisper.url}], apis: [transcriptions], accepts: [text, audio]}}",
        )
    )
    audio = {"type": "input_audio", "input_audio": {"data": "UklGRg==", "format": "wav"}}
    async with gw.client() as client:
        with pytest.raises(openai.BadRequestError) as caught:
            await client.responses.create(model="omni", input=user(audio))
        error = error_body(caught.value)
        assert error["code"] == "unsupported_modality" and error["param"] == "input[0].content[1]"
        assert "on the responses API: vLLM's responses API has no audio part (engine: vllm)" in error["message"]
        assert omni.received == []
        raw = await client.responses.with_raw_response.create(model="heard", input=user(audio))
        assert raw.headers["X-Gateway-Route"] == "transcribe"
        assert [p["type"] for p in omni.received[-1].json()["input"][0]["content"]] == ["input_text", "input_text"]
        await client.chat.completions.create(  # on chat, as it came
            model="omni", messages=[{"role": "user", "content": [audio]}]
        )
        assert omni.received[-1].json()["messages"][0]["content"] == [audio]
        raw = await client.responses.with_raw_response.create(model="sg", input=user(audio))
        assert raw.headers["X-Gateway-Route"] == "direct" and sglang.received[-1].json()["input"] == user(audio)


async def test_a_responses_part_with_a_uuid_is_read_by_its_media_key_as_vllm_reads_it(gateway_factory, both) -> None:
    texty, vision = both
    gw = await gateway_factory(table(texty, vision))
    smuggled = {"type": "input_text", "text": "hi", "image_url": PNG, "uuid": "x"}
    async with gw.client() as client:
        with pytest.raises(openai.BadRequestError) as caught:
            await client.responses.create(model="texty", input=user(smuggled))
    assert error_body(caught.value)["code"] == "unsupported_modality" and texty.received == []


async def test_a_stored_response_is_continued_by_the_key_that_made_it_alone(
    gateway_factory, upstream_factory, monkeypatch
) -> None:
    """Another key naming its id gets the engine's own answer to an id it does not hold (404),
    from the gateway: the other key's conversation never reaches the engine."""
    up = await upstream_factory("up")
    monkeypatch.setenv("MG_TEST_KEY_A", "sk-team-a")
    monkeypatch.setenv("MG_TEST_KEY_B", "sk-team-b")
    keys = "auth:\n  keys:\n    - {name: a, key_env: MG_TEST_KEY_A}\n    - {name: b, key_env: MG_TEST_KEY_B}\n"
    gw = await gateway_factory(routing(f"  - {{name: m, upstreams: [{up.url}], accepts: [text]}}", extra=keys))
    async with openai.AsyncOpenAI(base_url=f"{gw.url}/v1", api_key="sk-team-a", max_retries=0) as a:
        first = await a.responses.create(model="m", input="hi")
        await a.responses.create(model="m", input="and?", previous_response_id=first.id)
    async with openai.AsyncOpenAI(base_url=f"{gw.url}/v1", api_key="sk-team-b", max_retries=0) as b:
        with pytest.raises(openai.NotFoundError) as caught:
            await b.responses.create(model="m", input="mine now", previous_response_id=first.id)
    body = error_body(caught.value)
    assert body["param"] == "previous_response_id" and f"'{first.id}' not found" in body["message"]
    assert len(up.received) == 2  # b's never went upstream

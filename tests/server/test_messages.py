"""The Anthropic Messages API (``POST /v1/messages``) through admission, with the real anthropic
SDK as the client (as Claude Code and agents call it) and a stand-in that answers as vLLM does."""

from __future__ import annotations

from typing import Any

import aiohttp
import anthropic
import pytest

from tests.conftest import Gateway, Upstream, routing

pytestmark = pytest.mark.timeout(60)
PNG_B64 = "iVBORw0KGgo="
IMAGE = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": PNG_B64}}
DOCUMENT = {"type": "document", "source": {"type": "base64", "media_type": "application/pdf", "data": "JVBERi0="}}
KEY_ENV = "MODALITY_GATEWAY_TEST_CLIENT_KEY"


def table(texty: Upstream, vision: Upstream, *, extra: str = "") -> str:
    return routing(
        f"  - {{name: texty, upstreams: [{texty.url}], accepts: [text]}}",
        f"  - {{name: vision, upstreams: [{vision.url}], accepts: [text, image]}}",
        extra=extra,
    )


def client(gw: Gateway, key: str = "sk-test") -> anthropic.AsyncAnthropic:
    return anthropic.AsyncAnthropic(base_url=gw.url, api_key=key, max_retries=0)


def text_of(reply: anthropic.types.Message) -> str:
    block = reply.content[0]
    assert isinstance(block, anthropic.types.TextBlock)
    return block.text


def ask(*blocks: dict[str, Any]) -> list[Any]:
    return [{"role": "user", "content": [{"type": "text", "text": "what is this?"}, *blocks]}]


@pytest.fixture
async def both(upstream_factory) -> tuple[Upstream, Upstream]:
    return await upstream_factory("texty"), await upstream_factory("vision")


async def test_an_image_to_a_text_only_model_is_anthropics_400_naming_the_block(gateway_factory, both) -> None:
    texty, vision = both
    gw = await gateway_factory(table(texty, vision))
    async with client(gw) as c:
        with pytest.raises(anthropic.BadRequestError) as caught:
            await c.messages.create(model="texty", max_tokens=16, messages=ask(IMAGE))
    body = caught.value.body
    assert isinstance(body, dict) and body["type"] == "error"
    assert body["error"]["type"] == "invalid_request_error"
    assert "does not accept image input: messages[0].content[1] is 'image'" in body["error"]["message"]
    assert caught.value.response.headers["X-Request-Id"]
    assert texty.received == [] and vision.received == []
    assert gw.sample("gateway_modality_rejections_total", model="texty", modality="image", reason="unsupported") == 1


async def test_images_inside_tool_results_and_documents_are_classified(gateway_factory, both) -> None:
    texty, vision = both
    gw = await gateway_factory(table(texty, vision))
    screenshot = [
        *ask(),
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "screenshot", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1",
                                      "content": [{"type": "text", "text": "here"}, IMAGE]}]},
    ]  # fmt: skip
    async with client(gw) as c:
        with pytest.raises(anthropic.BadRequestError) as caught:
            await c.messages.create(model="texty", max_tokens=16, messages=screenshot)
        assert "messages[2].content[0].content[1] is 'image'" in str(caught.value)
        with pytest.raises(anthropic.BadRequestError) as caught:
            await c.messages.create(model="vision", max_tokens=16, messages=ask(DOCUMENT))
        assert "does not accept file input: messages[0].content[1] is 'document'" in str(caught.value)
        # the same screenshot to the model that takes images: through, the tool result intact
        reply = await c.messages.create(model="vision", max_tokens=16, messages=screenshot)
    assert text_of(reply) == "[vision] model=vision messages=3 image=1 text=2 tool_result=1 tool_use=1"
    assert vision.received[-1].json()["messages"] == screenshot
    assert texty.received == []


async def test_a_stream_is_read_through_text_stream(gateway_factory, both) -> None:
    texty, vision = both
    gw = await gateway_factory(table(texty, vision))
    async with client(gw) as c:
        async with c.messages.stream(model="vision", max_tokens=16, messages=ask(IMAGE)) as stream:
            text = "".join([piece async for piece in stream.text_stream])
            final = await stream.get_final_message()
    assert text == "[vision] model=vision messages=1 image=1 text=1"
    assert final.stop_reason == "end_turn" and final.usage.output_tokens == 5


async def test_a_stream_that_breaks_ends_with_anthropics_error_event(gateway_factory, both) -> None:
    texty, vision = both
    gw = await gateway_factory(table(texty, vision))
    async with client(gw) as c:
        with pytest.raises(anthropic.APIStatusError) as caught:
            async with c.messages.stream(
                model="texty", max_tokens=16, messages=ask(), extra_headers={"X-Standin-Break-After": "2"}
            ) as stream:
                async for _ in stream.text_stream:
                    pass
    assert isinstance(caught.value.body, dict) and caught.value.body["error"]["type"] == "api_error"
    assert "broke off the stream" in caught.value.body["error"]["message"]


async def test_an_unknown_model_and_a_missing_key_answer_in_anthropics_shape(
    gateway_factory, both, monkeypatch
) -> None:
    texty, vision = both
    monkeypatch.setenv(KEY_ENV, "sk-right")
    gw = await gateway_factory(
        table(texty, vision, extra=f"auth:\n  keys:\n    - {{name: team, key_env: {KEY_ENV}}}\n")
    )
    async with client(gw, "sk-wrong") as c:
        with pytest.raises(anthropic.AuthenticationError) as caught:
            await c.messages.create(model="texty", max_tokens=16, messages=ask())
    assert caught.value.body == {
        "type": "error",
        "error": {"type": "authentication_error", "message": "Invalid API key"},
    }
    async with client(gw, "sk-right") as c:  # the anthropic SDK sends its key as x-api-key
        with pytest.raises(anthropic.NotFoundError) as missing:
            await c.messages.create(model="claude-nope", max_tokens=16, messages=ask())
        reply = await c.messages.create(model="texty", max_tokens=16, messages=ask())
    assert isinstance(missing.value.body, dict) and missing.value.body["error"]["type"] == "not_found_error"
    assert text_of(reply).startswith("[texty] model=texty")
    sent = texty.received[-1].headers
    assert "x-api-key" not in sent and "Authorization" not in sent  # the client's key stays at the gateway


async def test_a_bad_body_is_anthropics_400_and_the_gateway_keeps_serving(gateway_factory, both) -> None:
    texty, vision = both
    gw = await gateway_factory(table(texty, vision))
    async with aiohttp.ClientSession() as session:
        for body in (b"{not json", b'{"model": "texty", "messages": "hi"}', b'{"model": "texty", "messages": [5]}'):
            async with session.post(f"{gw.url}/v1/messages", data=body) as resp:
                assert resp.status == 400
                answer = await resp.json()
                assert answer["type"] == "error" and answer["error"]["type"] == "invalid_request_error"
    async with client(gw) as c:
        reply = await c.messages.create(model="texty", max_tokens=16, messages=ask())
    assert reply.stop_reason == "end_turn"


async def test_count_tokens_is_admitted_as_the_message_it_counts(gateway_factory, both) -> None:
    """Claude Code asks ``/v1/messages/count_tokens`` before it sends: the same table, the same
    Anthropic errors, the engine's own count."""
    texty, vision = both
    gw = await gateway_factory(table(texty, vision))
    async with client(gw) as c:
        with pytest.raises(anthropic.BadRequestError) as caught:
            await c.messages.count_tokens(model="texty", messages=ask(IMAGE))
        counted = await c.messages.count_tokens(model="vision", messages=ask(IMAGE))
    assert isinstance(caught.value.body, dict) and caught.value.body["type"] == "error"
    assert "does not accept image input: messages[0].content[1] is 'image'" in str(caught.value)
    assert texty.received == []  # refused before any engine
    assert counted.input_tokens == 12  # the stand-in's count: 10 and one a block
    assert [r.path for r in vision.received] == ["/v1/messages/count_tokens"]
    assert vision.received[0].json()["messages"] == ask(IMAGE)


async def test_a_wrong_key_is_final_for_the_sdks_and_every_answer_names_its_request(
    gateway_factory, both, monkeypatch
) -> None:
    """``x-should-retry: false`` on a 401 and a 400: the anthropic SDK (and Claude Code, which
    retries a 401 ten times otherwise) gives up at once, with retries on; the request id comes as
    Anthropic's ``request-id`` too (the SDK's ``request_id``), and a rejection names its model."""
    texty, vision = both
    monkeypatch.setenv(KEY_ENV, "sk-right")
    gw = await gateway_factory(
        table(texty, vision, extra=f"auth:\n  keys:\n    - {{name: team, key_env: {KEY_ENV}}}\n")
    )
    sent: list[str] = []

    async def count(request: Any) -> None:
        sent.append(request.url.path)

    import httpx2

    hooks = httpx2.AsyncClient(event_hooks={"request": [count]})
    async with anthropic.AsyncAnthropic(base_url=gw.url, api_key="sk-wrong", max_retries=3, http_client=hooks) as c:
        with pytest.raises(anthropic.AuthenticationError) as wrong:
            await c.messages.create(model="texty", max_tokens=16, messages=ask())
    assert sent == ["/v1/messages"]  # one request: no retry
    assert wrong.value.response.headers["x-should-retry"] == "false"
    assert wrong.value.request_id == wrong.value.response.headers["X-Request-Id"]
    hooks = httpx2.AsyncClient(event_hooks={"request": [count]})
    async with anthropic.AsyncAnthropic(base_url=gw.url, api_key="sk-right", max_retries=3, http_client=hooks) as c:
        with pytest.raises(anthropic.BadRequestError) as refused:
            await c.messages.create(model="texty", max_tokens=16, messages=ask(IMAGE))
        reply = await c.messages.with_raw_response.create(model="texty", max_tokens=16, messages=ask())
    assert sent == ["/v1/messages"] * 3
    assert refused.value.response.headers["X-Gateway-Model"] == "texty"
    assert refused.value.request_id == refused.value.response.headers["X-Request-Id"]
    assert reply.request_id == reply.headers["X-Request-Id"] and "x-should-retry" not in reply.headers


async def test_a_conversation_begun_on_anthropics_api_continues_here(gateway_factory, both) -> None:
    """Plain-text documents are text (sent as text blocks, which vLLM reads); the server tools'
    result blocks and a container upload pass as their web-search siblings do."""
    texty, vision = both
    gw = await gateway_factory(table(texty, vision))
    notes = {"type": "document", "source": {"type": "text", "media_type": "text/plain", "data": "the notes"}}
    server_blocks = [
        {"type": "server_tool_use", "id": "s1", "name": "code_execution", "input": {"code": "1+1"}},
        {"type": "code_execution_tool_result", "tool_use_id": "s1", "content": {"type": "code_execution_result",
         "stdout": "2", "stderr": "", "return_code": 0, "content": []}},
        {"type": "bash_code_execution_tool_result", "tool_use_id": "s2", "content": {}},
        {"type": "text_editor_code_execution_tool_result", "tool_use_id": "s3", "content": {}},
        {"type": "tool_search_tool_result", "tool_use_id": "s4", "content": {}},
        {"type": "text", "text": "done"},
    ]  # fmt: skip
    messages = [
        {
            "role": "user",
            "content": [{"type": "text", "text": "read"}, notes, {"type": "container_upload", "file_id": "f"}],
        },
        {"role": "assistant", "content": server_blocks},
        {"role": "user", "content": "and now?"},
    ]
    async with client(gw) as c:
        reply = await c.messages.create(model="texty", max_tokens=16, messages=messages)
    assert text_of(reply).startswith("[texty] model=texty messages=3")
    sent = texty.received[-1].json()["messages"]
    assert sent[0]["content"][1] == {"type": "text", "text": "the notes"}
    assert sent[1]["content"] == server_blocks
    # a text document is text: held to server.max_text_chars as a text block is
    gw = await gateway_factory(
        "version: 1\nserver: {max_text_chars: 8}\n" + table(texty, vision).removeprefix("version: 1\n")
    )
    async with client(gw) as c:
        with pytest.raises(anthropic.BadRequestError, match=r"messages\[0\]\.content\[1\] is a text of 9 characters"):
            await c.messages.create(model="texty", max_tokens=16, messages=messages)


@pytest.mark.parametrize("forward", [True, False])
async def test_without_auth_a_clients_key_goes_upstream_only_if_the_table_says_so(
    gateway_factory, both, forward: bool
) -> None:
    """A developer's real vendor key, sent by an SDK pointed here: with
    server.forward_client_credentials: false (the shipped routing.yaml) it stays at the gateway."""
    texty, vision = both
    gw = await gateway_factory(
        "version: 1\n"
        f"server: {{forward_client_credentials: {str(forward).lower()}}}\n"
        + table(texty, vision).removeprefix("version: 1\n")
    )
    async with client(gw, "sk-ant-real") as c:  # as Authorization: Bearer (anthropic 2.x)
        await c.messages.create(model="texty", max_tokens=16, messages=ask())
    keys = {"x-api-key": "sk-ant-key", "api-key": "azure-key", "x-goog-api-key": "google-key"}
    async with aiohttp.ClientSession() as session:  # as x-api-key, as Claude Code sends it, and others'
        body = {"model": "texty", "max_tokens": 16, "messages": ask()}
        async with session.post(f"{gw.url}/v1/messages", json=body, headers=keys) as resp:
            assert resp.status == 200
    bearer, key = (r.headers for r in texty.received[-2:])
    assert (bearer.get("Authorization") == "Bearer sk-ant-real") is forward
    assert all((key.get(name) == value) is forward for name, value in keys.items())
    if not forward:
        assert not {"authorization", *keys} & {k.lower() for k in (*bearer.keys(), *key.keys())}


async def test_an_agent_session_that_read_an_image_goes_on_under_history_strip(gateway_factory, both) -> None:
    """Claude Code's flow with a text-only model: its Read of an image comes back in a
    tool_result (stripped, a note in its place: 200), the next prompt merged into that message
    (200 again); an image the user sends now is refused, naming it."""
    texty, _ = both
    policy = "on_unsupported: {image: {history: strip}}"
    gw = await gateway_factory(routing(f"  - {{name: texty, upstreams: [{texty.url}], accepts: [text], {policy}}}"))
    read: list[dict[str, Any]] = [
        {"role": "user", "content": "look at x.png"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "Read", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": [IMAGE]}]},
    ]
    merged = [*read[:2], {"role": "user", "content": [*read[2]["content"], {"type": "text", "text": "and now?"}]}]
    async with client(gw) as c:
        first = await c.messages.with_raw_response.create(model="texty", max_tokens=16, messages=read)
        second = await c.messages.create(model="texty", max_tokens=16, messages=merged)
        with pytest.raises(anthropic.BadRequestError) as refused:
            await c.messages.create(
                model="texty", max_tokens=16, messages=[*merged[:2], {"role": "user", "content": [IMAGE]}]
            )
    assert first.headers["X-Gateway-Route"] == "strip" and text_of(second).startswith("[texty]")
    note = "[An image was removed here by the gateway: model 'texty' does not take image input]"
    assert [r.json()["messages"][2]["content"][0]["content"] for r in texty.received] == [
        [{"type": "text", "text": note}]
    ] * 2
    assert "messages[2].content[0] is 'image'" in str(refused.value)
    assert gw.sample("gateway_modality_stripped_parts_total", model="texty", modality="image") == 2

"""gateway.admission.apis: where each API keeps its parts, how they classify, and how a plan is
written back into the API's own body (a strip, a rename)."""

from __future__ import annotations

import copy
from typing import Any

import orjson
import pytest

from gateway.admission.apis import CHAT
from gateway.admission.apis.messages import MESSAGES
from gateway.admission.apis.responses import RESPONSES
from gateway.admission.plan import admit
from gateway.admission.rewrite import rewrite
from gateway.config import parse_config
from gateway.config.types import DEFAULT_BOUNDS, ContentBounds
from gateway.errors import (
    ConfigError,
    InvalidContentPartError,
    InvalidRequestError,
    UnsupportedApiError,
    UnsupportedModalityError,
)
from gateway.modalities import Modality
from tests.conftest import routing

PNG = "data:image/png;base64,iVBORw0KGgo="
IMAGE = {"type": "input_image", "image_url": PNG, "detail": "auto"}
BLOCK = {"type": "image", "source": {"type": "url", "url": "https://example.com/cat.png"}}


def where(api: Any, body: dict[str, Any]) -> list[tuple[str, str, tuple[str, ...]]]:
    parts = api.classify(body, model="m", bounds=DEFAULT_BOUNDS).parts
    return [(p.location, p.type, tuple(m.value for m in p.modalities)) for p in parts]


def test_a_responses_body_is_read_wherever_it_keeps_parts() -> None:
    body = {
        "model": "m",
        "instructions": "be brief",
        "input": [
            {"role": "user", "content": "hi"},  # an easy message: no type
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "look"}, IMAGE]},
            {"type": "function_call", "call_id": "c", "name": "shot", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c", "output": [{"type": "input_file", "file_id": "f"}]},
            {"type": "function_call_output", "call_id": "d", "output": "done"},
            {"type": "reasoning", "summary": []},
            {"role": "user", "content": [{"type": "input_audio", "data": "UklGRg==", "format": "wav"}]},  # flat
        ],
    }
    assert where(RESPONSES, body) == [
        ("instructions", "string", ("text",)),
        ("input[0].content", "string", ("text",)),
        ("input[1].content[0]", "input_text", ("text",)),
        ("input[1].content[1]", "input_image", ("image",)),
        ("input[3].output[0]", "input_file", ("file",)),
        ("input[4].output", "string", ("text",)),
        ("input[6].content[0]", "input_audio", ("audio",)),
    ]
    assert where(RESPONSES, {"model": "m", "input": "hello"}) == [("input", "string", ("text",))]


def test_a_messages_body_is_read_in_system_messages_and_tool_results() -> None:
    body = {
        "model": "m",
        "system": [{"type": "text", "text": "be brief"}],
        "messages": [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "shot", "input": {}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": [BLOCK]},
                                         {"type": "document", "source": {"type": "text", "media_type": "text/plain",
                                                                         "data": "a text"}}]},
        ],
    }  # fmt: skip
    assert where(MESSAGES, body) == [
        ("system[0]", "text", ("text",)),
        ("messages[0].content", "string", ("text",)),
        ("messages[1].content[0]", "tool_use", ("text",)),
        ("messages[2].content[0]", "tool_result", ("text",)),
        ("messages[2].content[1]", "document", ("text",)),  # plain text is text (a PDF is a file)
        ("messages[2].content[0].content[0]", "image", ("image",)),
    ]
    pdf = {"type": "document", "source": {"type": "base64", "media_type": "application/pdf", "data": "JVBERi0="}}
    mixed = {"type": "document", "source": {"type": "content", "content": [{"type": "text", "text": "a"}, BLOCK]}}
    texts = {"type": "document", "source": {"type": "content", "content": "a text"}}
    body = {"model": "m", "messages": [{"role": "user", "content": [pdf, mixed, texts]}]}
    assert [m for _, _, m in where(MESSAGES, body)] == [("file",), ("file",), ("text",)]


@pytest.mark.parametrize(
    ("api", "body", "param", "message"),
    [
        (RESPONSES, {"model": "m", "input": 5}, "input", "'input' must be a string or an array of input items"),
        (RESPONSES, {"model": "m", "input": [5]}, "input[0]", "input[0] must be an object"),
        (RESPONSES, {"model": "m", "input": [{"role": "user", "content": ["hi"]}]}, "input[0].content[0]",
         "a content part must be an object"),
        (RESPONSES, {"model": "m", "input": [{"role": "user", "content": [{"type": "input_image"}]}]},
         "input[0].content[0]", "'image_url' must be a non-empty string"),
        (MESSAGES, {"model": "m", "messages": []}, "messages", "must be a non-empty array"),
        (MESSAGES, {"model": "m", "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
         "messages[0].content[0]", "'source' must be an object of type 'base64' or 'url' or 'file'"),
        (MESSAGES, {"model": "m", "messages": [{"role": "user", "content": [{"type": "video"}]}]},
         "messages[0].content[0]", "unknown content part type 'video'"),
    ],
)  # fmt: skip
def test_a_malformed_body_is_a_400_at_the_place(api: Any, body: dict[str, Any], param: str, message: str) -> None:
    with pytest.raises((InvalidRequestError, InvalidContentPartError)) as caught:
        api.classify(body, model="m", bounds=DEFAULT_BOUNDS)
    assert caught.value.param == param and message in caught.value.message


def test_the_bounds_hold_on_every_api() -> None:
    bounds = ContentBounds(messages=2, parts=3, text_chars=10)
    with pytest.raises(InvalidRequestError, match="3 input, over the limit of 2"):
        RESPONSES.classify({"input": ["a", "b", "c"]}, model="m", bounds=bounds)
    with pytest.raises(InvalidRequestError, match="over the limit of 10"):
        MESSAGES.classify({"messages": [{"role": "user", "content": "x" * 11}]}, model="m", bounds=bounds)
    many = {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}] * 4}]}
    with pytest.raises(InvalidRequestError, match="more than 3 content parts"):
        MESSAGES.classify(many, model="m", bounds=bounds)


TABLE = parse_config(
    routing(
        "  - {name: texty, upstreams: ['http://127.0.0.1:9'], accepts: [text], on_unsupported: {image: strip}}",
        "  - {name: chatty, upstreams: ['http://127.0.0.1:9'], accepts: [text], apis: [chat]}",
    )
)


def test_a_strip_is_written_into_each_apis_own_body() -> None:
    responses = {"model": "texty", "input": [{"role": "user", "content": [IMAGE]}, {"type": "function_call_output",
                 "call_id": "c", "output": [{"type": "input_text", "text": "ok"}, IMAGE]}]}  # fmt: skip
    plan = admit(TABLE, responses, api=RESPONSES)
    assert plan.route == "strip"
    # each stripped part leaves a note in the API's own text part, inside a tool's output too
    note = "[An image was removed here by the gateway: model 'texty' does not take image input]"
    assert orjson.loads(rewrite(plan, responses))["input"] == [
        {"role": "user", "content": [{"type": "input_text", "text": note}]},
        {"type": "function_call_output", "call_id": "c", "output": [
            {"type": "input_text", "text": "ok"}, {"type": "input_text", "text": note}]},
    ]  # fmt: skip
    messages = {"model": "texty", "messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {
        "type": "tool_result", "tool_use_id": "t", "content": [BLOCK]}]}]}  # fmt: skip
    plan = admit(TABLE, messages, api=MESSAGES)
    assert orjson.loads(rewrite(plan, messages))["messages"][0]["content"] == [
        {"type": "text", "text": "a"},
        {"type": "tool_result", "tool_use_id": "t", "content": [{"type": "text", "text": note}]},
    ]


def test_a_model_serves_the_apis_it_lists() -> None:
    chat = {"model": "chatty", "messages": [{"role": "user", "content": "hi"}]}
    assert admit(TABLE, chat, api=CHAT).model.name == "chatty"
    with pytest.raises(UnsupportedApiError, match="not served on the messages API here"):
        admit(TABLE, chat, api=MESSAGES)
    assert TABLE.model("texty").apis == ("chat", "completions", "responses", "messages")  # type: ignore[union-attr]


def test_check_refuses_a_redirect_to_a_model_that_does_not_serve_its_apis() -> None:
    def problems(*models: str) -> list[str]:
        with pytest.raises(ConfigError) as caught:
            parse_config(routing(*models), filename="r.yaml")
        return [str(p) for p in caught.value.problems]

    assert problems(
        "  - {name: a, upstreams: ['http://127.0.0.1:9'], accepts: [text], on_unsupported: {image: {redirect: b}}}",
        "  - {name: b, upstreams: ['http://127.0.0.1:9'], accepts: [text, image], apis: [chat, completions]}",
    ) == [
        "r.yaml:3:102: models[0].on_unsupported.image.redirect: redirect target 'b' does not serve responses, "
        "messages (its apis: chat, completions), which 'a' does: add them to its apis or remove them from this "
        "model's"
    ]
    found = problems("  - {name: c, upstreams: ['http://127.0.0.1:9'], accepts: [text], apis: [chat, chat, nope]}")
    assert [p.split(": ", 2)[2] for p in found] == [
        "API 'chat' is listed twice",
        "unknown API 'nope' (expected one of: chat, completions, responses, messages, embeddings, score, rerank, "
        "transcriptions, translations, images, edits, speech, realtime)",
    ]
    assert Modality.FILE.value == "file"


def test_responses_parts_are_normalized_only_where_the_meaning_is_the_same() -> None:
    from gateway.admission.apis.responses import normalize

    assert normalize({"type": "input_image", "image_url": {"url": PNG}}) == IMAGE  # detail: OpenAI's default
    assert normalize({"type": "input_image", "image_url": PNG}) == IMAGE  # vLLM requires detail
    assert normalize({"type": "input_audio", "data": "UklGRg==", "format": "wav", "id": "a"}) == {
        "type": "input_audio", "id": "a", "input_audio": {"data": "UklGRg==", "format": "wav"}
    }  # fmt: skip
    for same in (IMAGE, {"type": "input_audio", "input_audio": {"data": "x"}}, {"type": "input_text", "text": "t"}):
        assert normalize(same) is None


# --- {history: strip}: an agent's session goes on -------------------------------------------------

AGENT = parse_config(
    routing(
        "  - {name: agent, upstreams: ['http://127.0.0.1:9'], accepts: [text], "
        "on_unsupported: {image: {history: strip}}}"
    )
)
NOTE = "[An image was removed here by the gateway: model 'agent' does not take image input]"


def test_history_strip_on_messages_strips_tool_results_and_earlier_turns_and_refuses_what_the_user_sent() -> None:
    """Claude Code's Read of an image comes back in a tool_result, and every later turn resends it
    (merged with the next prompt into one user message): stripped with a note, the session goes
    on. An image the user sent in the newest turn is refused, so that they know."""
    read: list[dict[str, Any]] = [
        {"role": "user", "content": "look at x.png"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "Read", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": [BLOCK]}]},
    ]
    body = {"model": "agent", "messages": copy.deepcopy(read)}  # rewritten in place below
    plan = admit(AGENT, body, api=MESSAGES)
    assert plan.route == "strip" and [p.location for p in plan.stripped_parts] == ["messages[2].content[0].content[0]"]
    sent = orjson.loads(rewrite(plan, body))["messages"]
    assert sent[2]["content"][0]["content"] == [{"type": "text", "text": NOTE}]
    # the next turn, as Claude Code sends it after any answer: merged with the new prompt
    merged = [*read[:2], {"role": "user", "content": [*read[2]["content"], {"type": "text", "text": "and now?"}]}]
    assert admit(AGENT, {"model": "agent", "messages": merged}, api=MESSAGES).route == "strip"
    # an earlier turn's image the user sent, to a model switched to mid-conversation: stripped
    earlier = [{"role": "user", "content": [BLOCK]}, {"role": "assistant", "content": "a cat"},
               {"role": "user", "content": "thanks"}]  # fmt: skip
    assert admit(AGENT, {"model": "agent", "messages": earlier}, api=MESSAGES).route == "strip"
    with pytest.raises(UnsupportedModalityError) as caught:  # the newest turn's own image: refused
        admit(AGENT, {"model": "agent", "messages": [*earlier, {"role": "user", "content": [BLOCK]}]}, api=MESSAGES)
    assert caught.value.param == "messages[3].content[0]"
    prefill = [*earlier, {"role": "user", "content": [BLOCK]}, {"role": "assistant", "content": "It is"}]
    with pytest.raises(UnsupportedModalityError) as caught:  # an assistant prefill is not the model's turn
        admit(AGENT, {"model": "agent", "messages": prefill}, api=MESSAGES)
    assert caught.value.param == "messages[3].content[0]"
    explained = admit(AGENT, {"model": "agent", "messages": merged}, api=MESSAGES).explain()
    assert explained["parts"][-2:] == [
        {"location": "messages[2].content[1]", "type": "text", "modalities": ["text"], "action": "accept"},
        {"location": "messages[2].content[0].content[0]", "type": "image", "modalities": ["image"], "action": "strip"},
    ]


def test_history_strip_on_responses_and_chat() -> None:
    """Codex's view_image returns its image in a function_call_output: stripped; a user message
    after the model's last item is the newest turn's."""
    body: dict[str, Any] = {"model": "agent", "input": [
        {"role": "user", "content": "look at x.png"},
        {"type": "function_call", "call_id": "c", "name": "view_image", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c", "output": [IMAGE]},
        {"role": "user", "content": "and now?"},
    ]}  # fmt: skip
    plan = admit(AGENT, body, api=RESPONSES)
    assert [p.location for p in plan.stripped_parts] == ["input[2].output[0]"]
    assert orjson.loads(rewrite(plan, body))["input"][2]["output"] == [{"type": "input_text", "text": NOTE}]
    body["input"][3]["content"] = [IMAGE]
    with pytest.raises(UnsupportedModalityError, match=r"input\[3\]\.content\[0\] is 'input_image'"):
        admit(AGENT, body, api=RESPONSES)
    image = {"type": "image_url", "image_url": {"url": PNG}}
    chat: dict[str, Any] = {"model": "agent", "messages": [
        {"role": "user", "content": [image]},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "c", "type": "function",
                                                              "function": {"name": "shot", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c", "content": [image]},
    ]}  # fmt: skip
    plan = admit(AGENT, chat, api=CHAT)
    assert [p.location for p in plan.stripped_parts] == ["messages[0].content[0]", "messages[2].content[0]"]
    chat["messages"].append({"role": "user", "content": [image]})
    with pytest.raises(UnsupportedModalityError) as caught:
        admit(AGENT, chat, api=CHAT)
    assert caught.value.param == "messages[3].content[0]"


def test_history_is_a_policy_of_its_own_in_the_table() -> None:
    from gateway.config import Policy, as_dict

    model = AGENT.model("agent")
    assert model is not None and model.policy(Modality.IMAGE) == Policy("reject", history="strip")
    assert as_dict(AGENT)["models"][0]["on_unsupported"] == {"image": {"history": "strip"}}
    with pytest.raises(ConfigError, match=r"on_unsupported\.image\.history: unknown action 'describe'"):
        parse_config(routing("  - {name: a, upstreams: ['http://h:1'], accepts: [text], "
                             "on_unsupported: {image: {history: describe}}}"))  # fmt: skip

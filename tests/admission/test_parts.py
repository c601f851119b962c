"""gateway.admission.parts.classify: every part shape, every message, and the exact errors."""

from __future__ import annotations

from typing import Any

import pytest

from gateway.admission.parts import PART_TYPES, UNTYPED_MEDIA_KEYS, Classification, Part, classify
from gateway.config.types import ContentBounds
from gateway.errors import InvalidContentPartError, InvalidRequestError, Rejection
from gateway.modalities import Modality

TEXT, IMAGE, VIDEO, AUDIO, FILE = Modality.TEXT, Modality.IMAGE, Modality.VIDEO, Modality.AUDIO, Modality.FILE

URL = "https://example.com/cat.png"
B64 = "AAAA"


def user(*parts: Any) -> dict[str, Any]:
    return {"role": "user", "content": list(parts)}


def body(*messages: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {"model": "m", "messages": list(messages), **extra}


def one(part: Any, **extra: Any) -> Part:
    result = classify(body(user(part), **extra), model="m")
    assert len(result.parts) == 1
    return result.parts[0]


# --- well-formed parts ------------------------------------------------------------------------

WELL_FORMED: list[tuple[str, dict[str, Any], Modality]] = [
    ("text", {"type": "text", "text": "hi"}, TEXT),
    ("text", {"type": "text", "text": ""}, TEXT),
    ("input_text", {"type": "input_text", "text": "hi"}, TEXT),
    ("output_text", {"type": "output_text", "text": "earlier answer"}, TEXT),
    ("refusal", {"type": "refusal", "refusal": "I can't"}, TEXT),
    ("thinking", {"type": "thinking", "thinking": "hmm", "signature": "s"}, TEXT),
    ("tool_reference", {"type": "tool_reference", "name": "search"}, TEXT),
    ("prompt_embeds", {"type": "prompt_embeds", "data": B64}, TEXT),
    ("image_url", {"type": "image_url", "image_url": {"url": URL, "detail": "low"}}, IMAGE),
    ("image_url", {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}, IMAGE),
    ("input_image", {"type": "input_image", "image_url": URL}, IMAGE),
    ("input_image", {"type": "input_image", "image_url": {"url": URL}}, IMAGE),
    ("input_image", {"type": "input_image", "file_id": "file-123"}, IMAGE),
    ("image_embeds", {"type": "image_embeds", "image_embeds": B64}, IMAGE),
    ("image_embeds", {"type": "image_embeds", "image_embeds": {"image_embeds": B64, "image_grid_thw": B64}}, IMAGE),
    ("image_pil", {"type": "image_pil", "image_pil": "<a PIL image, offline>"}, IMAGE),
    ("video_url", {"type": "video_url", "video_url": {"url": "https://example.com/v.mp4"}}, VIDEO),
    ("video_embeds", {"type": "video_embeds", "video_embeds": B64}, VIDEO),
    ("input_audio", {"type": "input_audio", "input_audio": {"data": B64, "format": "wav"}}, AUDIO),
    ("input_audio", {"type": "input_audio", "input_audio": {"data": B64}}, AUDIO),
    ("audio_url", {"type": "audio_url", "audio_url": {"url": "https://example.com/a.wav"}}, AUDIO),
    ("audio_embeds", {"type": "audio_embeds", "audio_embeds": B64}, AUDIO),
    ("audio_embeds", {"type": "audio_embeds", "audio_embeds": {"audio_embeds": B64}}, AUDIO),
    (
        "file",
        {"type": "file", "file": {"file_data": "data:application/pdf;base64,JVBERi0=", "filename": "a.pdf"}},
        FILE,
    ),
    ("file", {"type": "file", "file": {"file_id": "file-123"}}, FILE),
]


@pytest.mark.parametrize(("part_type", "part", "modality"), WELL_FORMED)
def test_classifies_part(part_type: str, part: dict[str, Any], modality: Modality) -> None:
    assert one(part) == Part(0, 0, part_type, (modality,))


def test_table_covers_every_part_type() -> None:
    assert {t for t, _, _ in WELL_FORMED} == set(PART_TYPES)


@pytest.mark.parametrize(
    ("part", "part_type", "modalities"),
    [
        # vLLM's chat parser reads a part with a uuid by its media key, not its type (issue 38)
        ({"type": "text", "text": "", "image_url": {"url": URL}, "uuid": "u"}, "image_url", (IMAGE,)),
        ({"type": "image_url", "image_url": None, "video_url": {"url": URL}, "uuid": "u"}, None, None),
        ({"type": "input_audio", "input_audio": {"data": B64}, "uuid": "u"}, "input_audio", (AUDIO,)),
        ({"type": "image_url", "image_url": None, "uuid": "u"}, "image_url", (IMAGE,)),  # a cached image
        ({"type": "text", "text": "hi", "uuid": "u"}, None, None),  # vLLM: "Missing 'type' field"
        (
            {"type": "video_embeds", "video_embeds": B64, "audio_embeds": B64, "uuid": "u"},
            "video_embeds",
            (VIDEO, AUDIO),
        ),
        ({"type": "video_embeds", "video_embeds": B64, "audio_embeds": B64}, "video_embeds", (VIDEO, AUDIO)),
    ],
)
def test_a_part_with_a_uuid_is_read_by_its_media_key_as_vllm_reads_it(
    part: dict[str, Any], part_type: str | None, modalities: tuple[Modality, ...] | None
) -> None:
    if part_type is None:
        with pytest.raises(InvalidContentPartError, match="with a 'uuid'"):
            one(part)
    else:
        assert one(part) == Part(0, 0, part_type, modalities)


@pytest.mark.parametrize(
    ("part", "part_type", "modality"),
    [
        ({"image_url": {"url": URL}}, "image_url", IMAGE),
        ({"image_url": URL}, "image_url", IMAGE),
        ({"image_embeds": B64}, "image_embeds", IMAGE),
        ({"video_url": {"url": URL}}, "video_url", VIDEO),
        ({"input_audio": {"data": B64, "format": "mp3"}}, "input_audio", AUDIO),
        ({"audio_url": {"url": URL}}, "audio_url", AUDIO),
        ({"audio_embeds": B64}, "audio_embeds", AUDIO),
        ({"video_embeds": B64}, "video_embeds", VIDEO),
        ({"image_pil": "<offline>"}, "image_pil", IMAGE),
        ({"type": None, "image_url": URL}, "image_url", IMAGE),
    ],
)
def test_part_without_type_is_named_by_its_media_key(part: dict[str, Any], part_type: str, modality: Modality) -> None:
    assert one(part) == Part(0, 0, part_type, (modality,))


def test_untyped_table_covers_every_media_key() -> None:
    assert set(UNTYPED_MEDIA_KEYS) == {
        "image_url",
        "image_pil",
        "image_embeds",
        "video_embeds",
        "video_url",
        "input_audio",
        "audio_url",
        "audio_embeds",
    }


@pytest.mark.parametrize(
    ("part", "modality"),
    [
        ({"type": "image_url", "image_url": None, "uuid": "sha-1"}, IMAGE),
        ({"type": "input_image", "image_url": None, "uuid": "sha-1"}, IMAGE),
        ({"type": "image_embeds", "image_embeds": None, "uuid": "sha-1"}, IMAGE),
        ({"type": "video_url", "video_url": None, "uuid": "sha-1"}, VIDEO),
        ({"type": "input_audio", "input_audio": None, "uuid": "sha-1"}, AUDIO),
        ({"type": "audio_url", "audio_url": None, "uuid": "sha-1"}, AUDIO),
        ({"type": "audio_embeds", "audio_embeds": None, "uuid": "sha-1"}, AUDIO),
        ({"image_url": None, "uuid": "sha-1"}, IMAGE),
    ],
)
def test_null_media_with_uuid_is_a_cached_reference(part: dict[str, Any], modality: Modality) -> None:
    assert one(part).modalities == (modality,)


def test_plain_strings_in_a_content_array_are_text() -> None:
    result = classify(body(user("hello", {"type": "image_url", "image_url": {"url": URL}}, "bye")), model="m")
    assert result.parts == (
        Part(0, 0, "string", (TEXT,)),
        Part(0, 1, "image_url", (IMAGE,)),
        Part(0, 2, "string", (TEXT,)),
    )
    assert result.counts == {TEXT: 2, IMAGE: 1}


def test_string_content_is_one_text_part() -> None:
    result = classify(body({"role": "system", "content": "be brief"}), model="m")
    assert result.parts == (Part(0, None, "string", (TEXT,)),)
    assert result.counts == {TEXT: 1}
    assert result.present == (TEXT,)


def test_empty_string_content_is_still_a_text_part() -> None:
    assert classify(body({"role": "user", "content": ""}), model="m").parts == (Part(0, None, "string", (TEXT,)),)


def test_empty_content_array_has_no_parts() -> None:
    result = classify(body(user()), model="m")
    assert result.parts == ()
    assert result.counts == {}
    assert result.present == ()


def test_null_or_missing_content_has_no_parts() -> None:
    messages: list[dict[str, Any]] = [
        {"role": "user", "content": "weather?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "w", "arguments": "{}"}}],
        },
        {"role": "assistant", "tool_calls": []},
    ]
    result = classify(body(*messages), model="m")
    assert result.parts == (Part(0, None, "string", (TEXT,)),)


def test_tool_messages_are_classified_like_any_other() -> None:
    messages: list[dict[str, Any]] = [
        {"role": "user", "content": "weather?"},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "c2", "content": [{"type": "text", "text": "cloudy"}]},
        {"role": "tool", "tool_call_id": "c3", "content": [{"type": "image_url", "image_url": {"url": URL}}]},
    ]
    result = classify(body(*messages), model="m")
    assert result.parts == (
        Part(0, None, "string", (TEXT,)),
        Part(1, None, "string", (TEXT,)),
        Part(2, 0, "text", (TEXT,)),
        Part(3, 0, "image_url", (IMAGE,)),
    )


# --- use_audio_in_video ----------------------------------------------------------------------

VIDEO_PART = {"type": "video_url", "video_url": {"url": "https://example.com/v.mp4"}}


def test_audio_in_video_makes_video_parts_carry_audio() -> None:
    result = classify(
        body(
            user({"type": "text", "text": "what is said?"}, VIDEO_PART),
            mm_processor_kwargs={"use_audio_in_video": True},
        ),
        model="m",
    )
    assert result.audio_in_video is True
    assert result.parts[1] == Part(0, 1, "video_url", (VIDEO, AUDIO))
    assert result.parts[1].modality is VIDEO
    assert result.counts == {TEXT: 1, VIDEO: 1, AUDIO: 1}
    assert result.present == (TEXT, VIDEO, AUDIO)
    assert result.parts_with(AUDIO) == [result.parts[1]]


def test_audio_in_video_counts_each_video_and_each_audio_part() -> None:
    audio = {"type": "input_audio", "input_audio": {"data": B64, "format": "wav"}}
    result = classify(
        body(user(VIDEO_PART, audio), user(VIDEO_PART), mm_processor_kwargs={"use_audio_in_video": True}), model="m"
    )
    assert result.counts == {VIDEO: 2, AUDIO: 3}
    assert [p.location for p in result.parts_with(AUDIO)] == [
        "messages[0].content[0]",
        "messages[0].content[1]",
        "messages[1].content[0]",
    ]


def test_audio_in_video_does_not_touch_other_parts() -> None:
    part = one({"type": "image_url", "image_url": {"url": URL}}, mm_processor_kwargs={"use_audio_in_video": True})
    assert part.modalities == (IMAGE,)


@pytest.mark.parametrize(
    "extra",
    [
        {},
        {"mm_processor_kwargs": {}},
        {"mm_processor_kwargs": {"use_audio_in_video": False}},
        {"mm_processor_kwargs": {"use_audio_in_video": "true"}},
        {"mm_processor_kwargs": {"use_audio_in_video": 1}},
        {"mm_processor_kwargs": None},
        {"mm_processor_kwargs": [["use_audio_in_video", True]]},
    ],
)
def test_video_without_audio_in_video_is_video_only(extra: dict[str, Any]) -> None:
    result = classify(body(user(VIDEO_PART), **extra), model="m")
    assert result.audio_in_video is False
    assert result.parts == (Part(0, 0, "video_url", (VIDEO,)),)
    assert result.counts == {VIDEO: 1}


# --- every message, and locations ------------------------------------------------------------


def test_counts_every_message_not_only_the_last() -> None:
    image = {"type": "image_url", "image_url": {"url": URL}}
    audio = {"type": "audio_url", "audio_url": {"url": URL}}
    messages = [
        {"role": "system", "content": "be brief"},
        user({"type": "text", "text": "compare"}, image, image),
        {"role": "assistant", "content": "they differ"},
        user(audio, {"type": "text", "text": "and this?"}),
        user({"type": "text", "text": "thanks"}),
    ]
    result = classify(body(*messages), model="m")
    assert result.counts == {TEXT: 5, IMAGE: 2, AUDIO: 1}
    assert result.present == (TEXT, IMAGE, AUDIO)
    assert [p.location for p in result.parts] == [
        "messages[0].content",
        "messages[1].content[0]",
        "messages[1].content[1]",
        "messages[1].content[2]",
        "messages[2].content",
        "messages[3].content[0]",
        "messages[3].content[1]",
        "messages[4].content[0]",
    ]
    assert [p.location for p in result.parts_with(IMAGE)] == ["messages[1].content[1]", "messages[1].content[2]"]
    assert result.parts_with(VIDEO) == []


@pytest.mark.parametrize(
    ("part", "location"),
    [
        (Part(0, None, "string", (TEXT,)), "messages[0].content"),
        (Part(3, None, "string", (TEXT,)), "messages[3].content"),
        (Part(0, 0, "text", (TEXT,)), "messages[0].content[0]"),
        (Part(12, 7, "image_url", (IMAGE,)), "messages[12].content[7]"),
    ],
)
def test_part_location(part: Part, location: str) -> None:
    assert part.location == location


def test_present_follows_modality_order_not_part_order() -> None:
    result = classify(
        body(
            user(
                {"type": "audio_url", "audio_url": {"url": URL}},
                VIDEO_PART,
                {"type": "image_url", "image_url": {"url": URL}},
            )
        ),
        model="m",
    )
    assert result.present == (IMAGE, VIDEO, AUDIO)


def test_classification_ignores_the_model_when_valid() -> None:
    request = body(user({"type": "image_url", "image_url": {"url": URL}}))
    assert classify(request, model="a") == classify(request, model="b")
    assert isinstance(classify(request, model="a"), Classification)


# --- errors: the request shape ---------------------------------------------------------------

NOT_A_LIST = "'messages' must be a non-empty array of message objects"


@pytest.mark.parametrize(
    ("request_body", "param", "message"),
    [
        ({"model": "m"}, "messages", NOT_A_LIST),
        ({"model": "m", "messages": None}, "messages", NOT_A_LIST),
        ({"model": "m", "messages": []}, "messages", NOT_A_LIST),
        ({"model": "m", "messages": "hello"}, "messages", NOT_A_LIST),
        ({"model": "m", "messages": {"role": "user", "content": "hi"}}, "messages", NOT_A_LIST),
        ({"model": "m", "messages": ["hello"]}, "messages[0]", "messages[0] must be an object"),
        ({"model": "m", "messages": [user("ok"), None]}, "messages[1]", "messages[1] must be an object"),
        ({"model": "m", "messages": [user("ok"), [1]]}, "messages[1]", "messages[1] must be an object"),
        (body({"content": "hi"}), "messages[0].role", "messages[0].role must be a string"),
        (body(user("ok"), {"role": None, "content": "hi"}), "messages[1].role", "messages[1].role must be a string"),
        (body({"role": 1, "content": "hi"}), "messages[0].role", "messages[0].role must be a string"),
    ],
)
def test_malformed_messages(request_body: dict[str, Any], param: str, message: str) -> None:
    with pytest.raises(InvalidRequestError) as info:
        classify(request_body, model="m")
    error = info.value
    assert type(error) is InvalidRequestError
    assert error.code == "invalid_request"
    assert error.status == 400
    assert error.param == param
    assert error.message == message
    assert error.rejection is None


@pytest.mark.parametrize("content", [5, 1.5, True, {"type": "text", "text": "hi"}])
def test_content_of_a_wrong_type(content: Any) -> None:
    request_body = body(user("ok"), {"role": "user", "content": content})
    with pytest.raises(InvalidContentPartError) as info:
        classify(request_body, model="kimi")
    error = info.value
    assert error.code == "invalid_content_part"
    assert error.param == "messages[1].content"
    assert error.message == "messages[1].content must be a string, an array of content parts, or null"
    assert error.rejection == Rejection("kimi", "unknown", "invalid_content")


# --- errors: one content part ----------------------------------------------------------------

ALL_TYPES = ", ".join(PART_TYPES)
KEYS = "image_url, image_embeds, image_pil, video_url, video_embeds, input_audio, audio_url, audio_embeds"


@pytest.mark.parametrize(
    ("part", "problem"),
    [
        (5, "a content part must be an object or a string"),
        (None, "a content part must be an object or a string"),
        (["text", "hi"], "a content part must be an object or a string"),
        (
            {"type": "document", "file": {"file_id": "f"}},
            f"unknown content part type 'document' (expected one of: {ALL_TYPES})",
        ),
        (  # a typo: the type it is closest to
            {"type": "Text", "text": "hi"},
            f"unknown content part type 'Text' (expected one of: {ALL_TYPES}); did you mean 'text'?",
        ),
        (
            {"type": "imag_url", "imag_url": {"url": "x"}},
            f"unknown content part type 'imag_url' (expected one of: {ALL_TYPES}); did you mean 'image_url'?",
        ),
        ({"type": "", "text": "hi"}, f"unknown content part type '' (expected one of: {ALL_TYPES})"),
        ({"type": 3}, "'type' must be a string"),
        ({"type": ["text"], "text": "hi"}, "'type' must be a string"),
        ({"type": True}, "'type' must be a string"),
        ({"text": "hi"}, f"a content part without 'type' must carry exactly one of {KEYS} (it carries no media key)"),
        ({}, f"a content part without 'type' must carry exactly one of {KEYS} (it carries no media key)"),
        (
            {"image_url": URL, "video_url": URL},
            f"a content part without 'type' must carry exactly one of {KEYS} (it carries image_url, video_url)",
        ),
        (
            {"audio_embeds": B64, "input_audio": {"data": B64}, "image_embeds": B64},
            f"a content part without 'type' must carry exactly one of {KEYS} "
            "(it carries image_embeds, input_audio, audio_embeds)",
        ),
    ],
)
def test_unclassifiable_part(part: Any, problem: str) -> None:
    request_body = body({"role": "system", "content": "hi"}, user({"type": "text", "text": "see"}, part))
    with pytest.raises(InvalidContentPartError) as info:
        classify(request_body, model="kimi")
    error = info.value
    assert error.code == "invalid_content_part"
    assert error.status == 400
    assert error.param == "messages[1].content[1]"
    assert error.message == f"messages[1].content[1]: {problem}"
    assert error.rejection == Rejection("kimi", "unknown", "invalid_content")


def _url(key: str) -> str:
    """The problem with a typed URL part: OpenAI, vLLM and SGLang take only {"url": ...} there."""
    return f"'{key}' must be an object with a non-empty string 'url'"


def _bare_url(key: str) -> str:
    """The problem with an untyped URL part or input_image, which may carry a bare string."""
    return f"'{key}' must be a non-empty string or an object with a non-empty string 'url'"


def _embeds(key: str) -> str:
    return f"'{key}' must be a base64 string or an object of base64 strings"


AUDIO_SHAPE = "'input_audio' must be an object with a base64 string 'data' and a 'format'"


@pytest.mark.parametrize(
    ("part", "part_type", "modality", "problem"),
    [
        ({"type": "text"}, "text", "text", "'text' must be a string"),
        ({"type": "text", "text": None}, "text", "text", "'text' must be a string"),
        ({"type": "text", "text": ["a"]}, "text", "text", "'text' must be a string"),
        ({"type": "input_text", "text": 1}, "input_text", "text", "'text' must be a string"),
        ({"type": "output_text", "content": "x"}, "output_text", "text", "'text' must be a string"),
        ({"type": "refusal", "text": "no"}, "refusal", "text", "'refusal' must be a string"),
        ({"type": "thinking", "text": "hmm"}, "thinking", "text", "'thinking' must be a string"),
        ({"type": "tool_reference", "tool": "search"}, "tool_reference", "text", "'name' must be a string"),
        ({"type": "prompt_embeds", "data": [1.0]}, "prompt_embeds", "text", "'data' must be a string"),
        ({"type": "image_url"}, "image_url", "image", _url("image_url")),
        ({"type": "image_url", "image_url": None}, "image_url", "image", _url("image_url")),
        ({"type": "image_url", "image_url": ""}, "image_url", "image", _url("image_url")),
        ({"type": "image_url", "image_url": 5}, "image_url", "image", _url("image_url")),
        ({"type": "image_url", "image_url": {}}, "image_url", "image", _url("image_url")),
        ({"type": "image_url", "image_url": {"url": ""}}, "image_url", "image", _url("image_url")),
        # with a uuid, read by its key as vLLM reads it (a bare string allowed there too)
        ({"type": "image_url", "image_url": {"url": None}, "uuid": "u"}, "image_url", "image", _bare_url("image_url")),
        ({"type": "image_url", "image_url": [URL]}, "image_url", "image", _url("image_url")),
        # a typed part with a bare string: OpenAI and SGLang refuse it (the untyped form is vLLM's)
        ({"type": "image_url", "image_url": URL}, "image_url", "image", _url("image_url")),
        (
            {"type": "image_url", "image_url": "data:image/png;base64,iVBORw0KGgo="},
            "image_url",
            "image",
            _url("image_url"),
        ),
        ({"type": "video_url", "video_url": URL}, "video_url", "video", _url("video_url")),
        ({"type": "audio_url", "audio_url": URL}, "audio_url", "audio", _url("audio_url")),
        ({"type": "input_image"}, "input_image", "image", _bare_url("image_url")),
        ({"type": "input_image", "file_id": 5}, "input_image", "image", _bare_url("image_url")),
        ({"type": "input_image", "file_id": "f", "image_url": None}, "input_image", "image", _bare_url("image_url")),
        ({"type": "input_image", "image_url": {"url": 1}}, "input_image", "image", _bare_url("image_url")),
        ({"type": "image_embeds"}, "image_embeds", "image", _embeds("image_embeds")),
        ({"type": "image_embeds", "image_embeds": ""}, "image_embeds", "image", _embeds("image_embeds")),
        ({"type": "image_embeds", "image_embeds": {}}, "image_embeds", "image", _embeds("image_embeds")),
        ({"type": "image_embeds", "image_embeds": {"a": 1}}, "image_embeds", "image", _embeds("image_embeds")),
        ({"type": "image_embeds", "image_embeds": [B64]}, "image_embeds", "image", _embeds("image_embeds")),
        ({"type": "video_url"}, "video_url", "video", _url("video_url")),
        ({"type": "video_url", "video_url": {"uri": URL}}, "video_url", "video", _url("video_url")),
        ({"type": "input_audio"}, "input_audio", "audio", AUDIO_SHAPE),
        ({"type": "input_audio", "input_audio": B64}, "input_audio", "audio", AUDIO_SHAPE),
        ({"type": "input_audio", "input_audio": {"format": "wav"}}, "input_audio", "audio", AUDIO_SHAPE),
        ({"type": "input_audio", "input_audio": {"data": 1, "format": "wav"}}, "input_audio", "audio", AUDIO_SHAPE),
        (
            {"type": "input_audio", "input_audio": {"data": B64, "format": None}},
            "input_audio",
            "audio",
            "'input_audio.format' must be a string",
        ),
        ({"type": "audio_url", "audio_url": ""}, "audio_url", "audio", _url("audio_url")),
        ({"type": "audio_embeds", "audio_embeds": 3}, "audio_embeds", "audio", _embeds("audio_embeds")),
        ({"image_url": ""}, "image_url", "image", _bare_url("image_url")),
        ({"video_url": None}, "video_url", "video", _bare_url("video_url")),
        ({"input_audio": {"data": None}}, "input_audio", "audio", AUDIO_SHAPE),
        ({"audio_embeds": {}}, "audio_embeds", "audio", _embeds("audio_embeds")),
    ],
)
def test_malformed_part(part: dict[str, Any], part_type: str, modality: str, problem: str) -> None:
    request_body = body({"role": "system", "content": "hi"}, user({"type": "text", "text": "see"}, part))
    with pytest.raises(InvalidContentPartError) as info:
        classify(request_body, model="kimi")
    error = info.value
    assert error.code == "invalid_content_part"
    assert error.param == "messages[1].content[1]"
    assert error.message == f"messages[1].content[1]: malformed '{part_type}' part: {problem}"
    assert error.rejection == Rejection("kimi", modality, "invalid_content")


@pytest.mark.parametrize("media_key", ["image_url", "image_embeds", "video_url", "audio_url", "audio_embeds"])
def test_null_media_without_uuid_is_malformed(media_key: str) -> None:
    with pytest.raises(InvalidContentPartError) as info:
        classify(body(user({"type": media_key, media_key: None})), model="m")
    assert info.value.param == "messages[0].content[0]"
    assert info.value.message.startswith(f"messages[0].content[0]: malformed '{media_key}' part: '{media_key}' must be")


def test_null_uuid_does_not_excuse_null_media() -> None:
    with pytest.raises(InvalidContentPartError):
        classify(body(user({"type": "image_url", "image_url": None, "uuid": None})), model="m")


def test_first_bad_part_wins_across_messages() -> None:
    request_body = body(
        user({"type": "text", "text": "ok"}),
        user({"type": "image_url", "image_url": {"url": URL}}, {"type": "document"}),
        user({"type": "image_url"}),
    )
    with pytest.raises(InvalidContentPartError) as info:
        classify(request_body, model="m")
    assert info.value.param == "messages[1].content[1]"


def test_bad_message_after_good_parts_is_reported() -> None:
    request_body = body(
        user({"type": "image_url", "image_url": {"url": URL}}), {"role": "user"}, {"content": "no role"}
    )
    with pytest.raises(InvalidRequestError) as info:
        classify(request_body, model="m")
    assert info.value.param == "messages[2].role"


# --- bounds -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("request_body", "bounds", "param", "message"),
    [
        (
            body(*[user("hi")] * 3),
            ContentBounds(messages=2),
            "messages",
            "Request has 3 messages, over the limit of 2 (server.max_messages)",
        ),
        (
            body(user("a", "b"), user("c", "d")),
            ContentBounds(parts=3),
            "messages[1].content",
            "Request has more than 3 content parts in all (server.max_content_parts); "
            "the limit is passed in messages[1]",
        ),
        (
            body({"role": "user", "content": "abcd"}, {"role": "user", "content": "x"}, user("y", "z")),
            ContentBounds(parts=3),
            "messages[2].content",
            "Request has more than 3 content parts in all (server.max_content_parts); "
            "the limit is passed in messages[2]",
        ),
        (
            body(user({"type": "input_text", "text": "abcd"})),
            ContentBounds(text_chars=3),
            "messages[0].content[0]",
            "messages[0].content[0] is a text of 4 characters, over the limit of 3 (server.max_text_chars)",
        ),
    ],
)
def test_bounds_are_checked_with_the_param_that_passes_them(request_body, bounds, param, message) -> None:
    with pytest.raises(InvalidRequestError) as info:
        classify(request_body, model="m", bounds=bounds)
    assert (info.value.param, info.value.message) == (param, message)


def test_parts_are_counted_before_any_is_classified() -> None:
    # the bad part comes first, but the count is over: the count is what is reported
    request_body = body(user({"type": "bogus"}, *["x"] * 10))
    with pytest.raises(InvalidRequestError, match=r"server\.max_content_parts"):
        classify(request_body, model="m", bounds=ContentBounds(parts=10))


def test_embeddings_are_not_texts() -> None:
    part = {"type": "prompt_embeds", "data": "A" * 100}
    assert classify(body(user(part)), model="m", bounds=ContentBounds(text_chars=10)).parts[0].type == "prompt_embeds"

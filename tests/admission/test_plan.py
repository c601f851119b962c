"""gateway.admission.plan: the decision (admit) and the body it produces (rewrite)."""

from __future__ import annotations

from types import MappingProxyType
from typing import Any

import orjson
import pytest

from gateway.admission.plan import admit, removed_note
from gateway.admission.rewrite import rewrite
from gateway.admission.route import Redirect
from gateway.config import GatewayConfig, ModelConfig, Policy, parse_config
from gateway.errors import (
    GatewayError,
    InvalidContentPartError,
    InvalidRequestError,
    ModelNotFoundError,
    Rejection,
    TooManyItemsError,
    UnsupportedModalityError,
)
from gateway.modalities import Modality

TEXT, IMAGE, VIDEO, AUDIO = Modality.TEXT, Modality.IMAGE, Modality.VIDEO, Modality.AUDIO

IMG = {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}
VID = {"type": "video_url", "video_url": {"url": "https://example.com/v.mp4"}}
AUD = {"type": "input_audio", "input_audio": {"data": "UklGRg==", "format": "wav"}}


def txt(text: str = "look") -> dict[str, Any]:
    return {"type": "text", "text": text}


def user(*parts: Any) -> dict[str, Any]:
    return {"role": "user", "content": list(parts)}


def request(model: str, *messages: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {"model": model, "messages": list(messages), **extra}


def routing(*models: str) -> GatewayConfig:
    """A validated config from model blocks (YAML list items indented by two spaces)."""
    return parse_config("version: 1\nmodels:\n" + "\n".join(models))


def model(name: str, accepts: str, *lines: str, port: int = 30000) -> str:
    head = f"  - name: {name}\n    upstreams: [http://127.0.0.1:{port}]\n    accepts: [{accepts}]"
    return "\n".join([head, *(f"    {line}" for line in lines)])


# vision: text+image, renamed upstream, 2 images at most; video goes to omni, audio is stripped.
# omni: everything, 1 video at most, two replicas. texty: text only, rejects the rest.
TABLE = routing(
    model(
        "vision",
        "text, image",
        "upstream_model: org/Vision-7B",
        "limits: {image: 2}",
        "on_unsupported: {video: {redirect: omni}, audio: strip}",
    ),
    "  - name: omni\n    upstreams: [http://127.0.0.1:30001, http://127.0.0.1:30002]\n"
    "    accepts: [text, image, video, audio]\n    limits: {video: 1}",
    model("texty", "text", port=30003),
)


# --- lookup ----------------------------------------------------------------------------------


def test_accept_direct() -> None:
    plan = admit(TABLE, request("texty", {"role": "system", "content": "hi"}, user(txt())))
    assert plan.route == "direct"
    assert plan.requested == "texty"
    assert plan.model is TABLE.model("texty")
    assert plan.redirects == ()
    assert plan.stripped == frozenset()
    assert plan.stripped_parts == ()


def test_accept_an_accepted_modality() -> None:
    plan = admit(TABLE, request("vision", user(txt(), IMG)))
    assert plan.route == "direct"
    assert plan.model.name == "vision"
    assert plan.classification.counts == {TEXT: 1, IMAGE: 1}


@pytest.mark.parametrize(
    "body",
    [
        {"messages": [user(txt())]},
        {"model": None, "messages": [user(txt())]},
        {"model": "", "messages": [user(txt())]},
        {"model": 7, "messages": [user(txt())]},
        {"model": ["texty"], "messages": [user(txt())]},
    ],
)
def test_model_missing_or_not_a_string(body: dict[str, Any]) -> None:
    with pytest.raises(InvalidRequestError) as info:
        admit(TABLE, body)
    error = info.value
    assert type(error) is InvalidRequestError
    assert error.code == "invalid_request"
    assert error.param == "model"
    assert error.message == "'model' is required and must be a non-empty string"


def test_unknown_model_lists_models() -> None:
    with pytest.raises(ModelNotFoundError) as info:
        admit(TABLE, request("gpt-4o", user(txt())))
    error = info.value
    assert error.code == "model_not_found"
    assert error.status == 404
    assert error.param == "model"
    assert error.message == "The model 'gpt-4o' does not exist (models: vision, omni, texty)"


def test_an_unknown_model_close_to_one_says_which_and_never_one_the_key_may_not_see() -> None:
    with pytest.raises(ModelNotFoundError) as info:
        admit(TABLE, request("vison", user(txt())))
    assert (
        info.value.message == "The model 'vison' does not exist (models: vision, omni, texty); did you mean 'vision'?"
    )
    with pytest.raises(ModelNotFoundError) as info:
        admit(TABLE, request("vison", user(txt())), visible=lambda name: name != "vision")
    assert info.value.message == "The model 'vison' does not exist (models: omni, texty)"


def test_model_is_looked_up_before_messages() -> None:
    with pytest.raises(ModelNotFoundError):
        admit(TABLE, {"model": "nope", "messages": "not a list"})


def test_classification_errors_carry_the_requested_model() -> None:
    with pytest.raises(InvalidContentPartError) as info:
        admit(TABLE, request("vision", user(txt(), {"type": "document"})))
    assert info.value.param == "messages[0].content[1]"
    assert info.value.rejection == Rejection("vision", "unknown", "invalid_content")


# --- reject ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("part", "part_type", "modality"),
    [
        (IMG, "image_url", "image"),
        ({"type": "input_image", "file_id": "file-1"}, "input_image", "image"),
        ({"image_embeds": "AAAA"}, "image_embeds", "image"),
        (VID, "video_url", "video"),
        (AUD, "input_audio", "audio"),
        ({"type": "audio_url", "audio_url": {"url": "https://example.com/a.wav"}}, "audio_url", "audio"),
        ({"type": "audio_embeds", "audio_embeds": None, "uuid": "u1"}, "audio_embeds", "audio"),
    ],
)
def test_reject_names_model_modality_part_and_accepts(part: dict[str, Any], part_type: str, modality: str) -> None:
    body = request("texty", {"role": "system", "content": "hi"}, user(txt(), part))
    with pytest.raises(UnsupportedModalityError) as info:
        admit(TABLE, body)
    error = info.value
    assert error.code == "unsupported_modality"
    assert error.status == 400
    assert error.param == "messages[1].content[1]"
    assert error.message == (
        f"Model 'texty' does not accept {modality} input: messages[1].content[1] is '{part_type}'. It accepts: text."
    )
    assert error.rejection == Rejection("texty", modality, "unsupported")


def test_reject_points_at_the_first_offending_part_across_messages() -> None:
    body = request(
        "texty",
        {"role": "system", "content": "hi"},
        user(txt("first")),
        user(txt(), IMG, IMG),
        {"role": "assistant", "content": "ok"},
        user(IMG),
    )
    with pytest.raises(UnsupportedModalityError) as info:
        admit(TABLE, body)
    assert info.value.param == "messages[2].content[1]"
    assert info.value.message == (
        "Model 'texty' does not accept image input: messages[2].content[1] is 'image_url'. It accepts: text."
    )


def test_reject_picks_the_earliest_part_whatever_its_modality() -> None:
    # image comes first in Modality order, but the audio part comes first in the request
    body = request("texty", user(txt(), AUD), user(IMG))
    with pytest.raises(UnsupportedModalityError) as info:
        admit(TABLE, body)
    assert info.value.param == "messages[0].content[1]"
    assert info.value.rejection == Rejection("texty", "audio", "unsupported")


def test_reject_audio_carried_by_a_video() -> None:
    config = routing(model("watcher", "text, video"))
    body = request("watcher", user(txt(), VID), mm_processor_kwargs={"use_audio_in_video": True})
    with pytest.raises(UnsupportedModalityError) as info:
        admit(config, body)
    assert info.value.param == "messages[0].content[1]"
    assert info.value.message == (
        "Model 'watcher' does not accept audio input: messages[0].content[1] is 'video_url' "
        "(video_url with use_audio_in_video). It accepts: text, video."
    )
    assert info.value.rejection == Rejection("watcher", "audio", "unsupported")


def test_reject_wins_over_strip_in_the_same_request() -> None:
    config = routing(model("m", "text", "on_unsupported: {image: strip}"))
    with pytest.raises(UnsupportedModalityError) as info:
        admit(config, request("m", user(IMG, AUD)))
    assert info.value.rejection == Rejection("m", "audio", "unsupported")
    assert info.value.param == "messages[0].content[1]"


# --- redirect --------------------------------------------------------------------------------


def test_redirect() -> None:
    body = request("vision", user(txt(), IMG, VID))
    plan = admit(TABLE, body)
    assert plan.route == "redirect"
    assert plan.requested == "vision"
    assert plan.model is TABLE.model("omni")
    assert plan.redirects == (Redirect("vision", VIDEO, "omni"),)
    assert plan.stripped == frozenset()
    assert plan.needs_rewrite(body)
    assert orjson.loads(rewrite(plan, body))["model"] == "omni"


CHAIN = routing(
    model("a", "text", "on_unsupported: {video: {redirect: b}}"),
    model("b", "text, video", "on_unsupported: {audio: {redirect: c}}"),
    model("c", "text, video, audio"),
)


def test_chained_redirect() -> None:
    plan = admit(CHAIN, request("a", user(VID), user(AUD)))
    assert plan.model.name == "c"
    assert plan.redirects == (Redirect("a", VIDEO, "b"), Redirect("b", AUDIO, "c"))
    assert plan.route == "redirect"


def test_chain_stops_where_the_request_is_accepted() -> None:
    plan = admit(CHAIN, request("a", user(VID)))
    assert plan.model.name == "b"
    assert plan.redirects == (Redirect("a", VIDEO, "b"),)


def test_redirect_target_rejects_another_modality() -> None:
    config = routing(
        model("a", "text", "on_unsupported: {video: {redirect: b}}"),
        model("b", "text, video"),
    )
    with pytest.raises(UnsupportedModalityError) as info:
        admit(config, request("a", user(txt(), VID), user(AUD)))
    error = info.value
    assert error.param == "messages[1].content[0]"
    assert error.message == (
        "Model 'b' (redirected from 'a' for video input) does not accept audio input: "
        "messages[1].content[0] is 'input_audio'. It accepts: text, video."
    )
    assert error.rejection == Rejection("b", "audio", "unsupported")


def test_redirect_target_applies_its_own_strip_policy() -> None:
    config = routing(
        model("a", "text", "on_unsupported: {video: {redirect: b}}"),
        model("b", "text, video", "on_unsupported: {audio: strip}"),
    )
    body = request("a", user(txt(), VID, AUD))
    plan = admit(config, body)
    assert plan.model.name == "b"
    assert plan.route == "redirect, strip"
    assert [p.location for p in plan.stripped_parts] == ["messages[0].content[2]"]
    assert orjson.loads(rewrite(plan, body)) == request("b", user(txt(), VID, gone(AUDIO, "b")))


def test_redirect_prefers_a_target_that_accepts_every_modality() -> None:
    config = routing(
        model("a", "text", "on_unsupported: {image: {redirect: b}, video: {redirect: c}}"),
        model("b", "text, image"),
        model("c", "text, image, video"),
    )
    plan = admit(config, request("a", user(IMG, VID)))
    assert plan.redirects == (Redirect("a", VIDEO, "c"),)
    assert plan.model.name == "c"


def test_redirect_takes_the_first_candidate_when_none_accepts_everything() -> None:
    config = routing(
        model("a", "text", "on_unsupported: {image: {redirect: b}, audio: {redirect: c}}"),
        model("b", "text, image", "on_unsupported: {audio: strip}"),
        model("c", "text, audio"),
    )
    # the audio part comes first, but candidates follow Modality order: image before audio
    plan = admit(config, request("a", user(AUD, IMG)))
    assert plan.redirects == (Redirect("a", IMAGE, "b"),)
    assert plan.model.name == "b"
    assert plan.route == "redirect, strip"


def test_no_redirect_when_the_modality_is_absent() -> None:
    plan = admit(TABLE, request("vision", user(txt(), IMG)))
    assert plan.redirects == ()
    assert plan.model.name == "vision"


# --- strip -----------------------------------------------------------------------------------

STRIPPER = routing(model("s", "text", "on_unsupported: {image: strip, audio: strip}"))


def gone(modality: Modality, model: str) -> dict[str, str]:
    """The text part a stripped part leaves."""
    return {"type": "text", "text": removed_note(modality, model)}


def test_strip_removes_parts_across_messages() -> None:
    body = request(
        "s",
        {"role": "system", "content": "be brief"},
        user(txt("a"), IMG, txt("b"), AUD),
        {"role": "assistant", "content": "ok"},
        user(IMG),
        user(IMG, txt("c"), IMG),
    )
    plan = admit(STRIPPER, body)
    assert plan.route == "strip"
    assert plan.stripped == frozenset({IMAGE, AUDIO})
    assert [p.location for p in plan.stripped_parts] == [
        "messages[1].content[1]",
        "messages[1].content[3]",
        "messages[3].content[0]",
        "messages[4].content[0]",
        "messages[4].content[2]",
    ]
    assert plan.needs_rewrite(body)
    data = rewrite(plan, body)
    assert orjson.loads(data) == body  # rewritten in place
    image, audio = gone(IMAGE, "s"), gone(AUDIO, "s")  # each part leaves a note saying so
    assert body == request(
        "s",
        {"role": "system", "content": "be brief"},
        user(txt("a"), image, txt("b"), audio),
        {"role": "assistant", "content": "ok"},
        user(image),
        user(image, txt("c"), image),
    )


def test_strip_keeps_other_fields() -> None:
    body = request("s", user(IMG, txt()), temperature=0.5, stream=True)
    plan = admit(STRIPPER, body)
    assert orjson.loads(rewrite(plan, body)) == {
        "model": "s",
        "messages": [user(gone(IMAGE, "s"), txt())],
        "temperature": 0.5,
        "stream": True,
    }


def test_strip_of_audio_keeps_video_and_mutes_its_audio() -> None:
    config = routing(model("v", "text, video", "on_unsupported: {audio: strip}"))
    body = request(
        "v", user(txt(), VID, AUD), mm_processor_kwargs={"use_audio_in_video": True, "fps": 2}, temperature=0
    )
    plan = admit(config, body)
    assert plan.stripped == frozenset({AUDIO})
    assert [p.location for p in plan.stripped_parts] == ["messages[0].content[2]"]
    assert plan.mutes_audio_in_video
    assert plan.needs_rewrite(body)
    assert plan.route == "strip"
    assert orjson.loads(rewrite(plan, body)) == request(
        "v",
        user(txt(), VID, gone(AUDIO, "v")),
        mm_processor_kwargs={"use_audio_in_video": False, "fps": 2},
        temperature=0,
    )


def test_strip_of_audio_in_video_only_needs_a_rewrite() -> None:
    config = routing(model("v", "text, video", "on_unsupported: {audio: strip}"))
    body = request("v", user(VID), mm_processor_kwargs={"use_audio_in_video": True})
    plan = admit(config, body)
    assert plan.stripped_parts == ()
    assert plan.needs_rewrite(body)
    assert orjson.loads(rewrite(plan, body)) == request(
        "v", user(VID), mm_processor_kwargs={"use_audio_in_video": False}
    )


def test_strip_of_audio_in_video_only_says_strip() -> None:
    config = routing(model("v", "text, video", "on_unsupported: {audio: strip}"))
    plan = admit(config, request("v", user(VID), mm_processor_kwargs={"use_audio_in_video": True}))
    assert plan.route == "strip"


def test_stripped_video_does_not_count_against_the_audio_limit() -> None:
    config = routing(model("l", "text, audio", "limits: {audio: 1}", "on_unsupported: {video: strip}"))
    body = request("l", user(VID, AUD), mm_processor_kwargs={"use_audio_in_video": True})
    plan = admit(config, body)
    assert [p.location for p in plan.stripped_parts] == ["messages[0].content[0]"]
    assert orjson.loads(rewrite(plan, body))["messages"] == [user(gone(VIDEO, "l"), AUD)]


# --- limits ----------------------------------------------------------------------------------


def test_limit_reached_is_accepted() -> None:
    plan = admit(TABLE, request("vision", user(IMG), user(txt(), IMG)))
    assert plan.classification.counts[IMAGE] == 2


def test_limit_counts_every_message() -> None:
    body = request("vision", user(txt(), IMG), {"role": "assistant", "content": "ok"}, user(txt(), txt(), IMG, IMG))
    with pytest.raises(TooManyItemsError) as info:
        admit(TABLE, body)
    error = info.value
    assert error.code == "too_many_items"
    assert error.status == 400
    assert error.param == "messages[2].content[3]"
    assert error.message == (
        "Model 'vision' accepts at most 2 image item(s) per request; this request has 3 "
        "(the first over the limit is messages[2].content[3])."
    )
    assert error.rejection == Rejection("vision", "image", "too_many_items")


def test_limit_zero() -> None:
    config = routing(model("z", "text, image", "limits: {image: 0}"))
    assert admit(config, request("z", user(txt()))).model.name == "z"
    with pytest.raises(TooManyItemsError) as info:
        admit(config, request("z", user(txt()), user(txt(), IMG)))
    assert info.value.param == "messages[1].content[1]"
    assert info.value.message == (
        "Model 'z' accepts at most 0 image item(s) per request; this request has 1 "
        "(the first over the limit is messages[1].content[1])."
    )


def test_limit_counts_audio_carried_by_videos() -> None:
    config = routing(model("o", "text, video, audio", "limits: {audio: 1}"))
    body = request("o", user(VID), user(AUD), mm_processor_kwargs={"use_audio_in_video": True})
    with pytest.raises(TooManyItemsError) as info:
        admit(config, body)
    assert info.value.param == "messages[1].content[0]"
    assert info.value.rejection == Rejection("o", "audio", "too_many_items")
    body["mm_processor_kwargs"] = {"use_audio_in_video": False}
    assert admit(config, body).model.name == "o"


def test_limits_after_redirect_are_the_targets() -> None:
    config = routing(
        model("a", "text, image", "limits: {image: 1}", "on_unsupported: {video: {redirect: b}}"),
        model("b", "text, image, video", "limits: {image: 3}"),
    )
    assert admit(config, request("a", user(IMG, IMG, IMG, VID))).model.name == "b"
    with pytest.raises(TooManyItemsError) as info:
        admit(config, request("a", user(IMG, IMG), user(IMG, IMG, VID)))
    assert info.value.param == "messages[1].content[1]"
    assert info.value.rejection == Rejection("b", "image", "too_many_items")
    with pytest.raises(TooManyItemsError):
        admit(config, request("a", user(IMG, IMG)))  # no redirect: a's own limit


def test_redirect_target_limit_applies() -> None:
    with pytest.raises(TooManyItemsError) as info:
        admit(TABLE, request("vision", user(VID, VID)))
    assert info.value.message == (
        "Model 'omni' accepts at most 1 video item(s) per request; this request has 2 "
        "(the first over the limit is messages[0].content[1])."
    )


# --- needs_rewrite and rewrite ---------------------------------------------------------------


def test_no_rewrite_when_nothing_changes() -> None:
    body = request("texty", user(txt()))
    plan = admit(TABLE, body)
    assert plan.model.upstream_name == "texty"
    assert not plan.needs_rewrite(body)


def test_rewrite_needed_when_upstream_model_differs() -> None:
    body = request("vision", user(txt(), IMG))
    plan = admit(TABLE, body)
    assert plan.route == "direct"
    assert plan.needs_rewrite(body)
    assert orjson.loads(rewrite(plan, body)) == request("org/Vision-7B", user(txt(), IMG))
    assert body["model"] == "org/Vision-7B"
    assert not plan.needs_rewrite(body)


def test_rewrite_needed_after_redirect() -> None:
    body = request("vision", user(VID))
    plan = admit(TABLE, body)
    assert plan.model.upstream_name == "omni"
    assert plan.needs_rewrite(body)


def test_rewrite_serializes_the_body() -> None:
    body = request("vision", user(txt("é"), IMG), max_tokens=5)
    data = rewrite(admit(TABLE, body), body)
    assert isinstance(data, bytes)
    assert data == orjson.dumps(request("org/Vision-7B", user(txt("é"), IMG), max_tokens=5))


# --- explain ---------------------------------------------------------------------------------


def test_explain_redirect_and_strip() -> None:
    config = routing(
        model("a", "text", "on_unsupported: {video: {redirect: b}}"),
        "  - name: b\n    upstreams: [http://127.0.0.1:30001, http://127.0.0.1:30002]\n"
        "    upstream_model: org/B\n    accepts: [text, video]\n    on_unsupported: {audio: strip}",
    )
    body = request("a", {"role": "system", "content": "hi"}, user(txt(), VID, AUD))
    assert admit(config, body).explain() == {
        "decision": "accept",
        "requested_model": "a",
        "model": "b",
        "upstream_model": "org/B",
        "upstreams": ["http://127.0.0.1:30001", "http://127.0.0.1:30002"],
        "route": "redirect, strip",
        "encoder": None,
        "encode_decision": None,
        "redirects": [{"from": "a", "modality": "video", "to": "b", "for": "input"}],
        "counts": {"text": 2, "video": 1, "audio": 1},
        "parts": [
            {"location": "messages[0].content", "type": "string", "modalities": ["text"], "action": "accept"},
            {"location": "messages[1].content[0]", "type": "text", "modalities": ["text"], "action": "accept"},
            {"location": "messages[1].content[1]", "type": "video_url", "modalities": ["video"], "action": "accept"},
            {"location": "messages[1].content[2]", "type": "input_audio", "modalities": ["audio"], "action": "strip"},
        ],
    }


def test_explain_direct_is_json() -> None:
    explained = admit(TABLE, request("texty", user(txt())))
    assert orjson.loads(orjson.dumps(explained.explain())) == {
        "decision": "accept",
        "requested_model": "texty",
        "model": "texty",
        "upstream_model": "texty",
        "upstreams": ["http://127.0.0.1:30003"],
        "route": "direct",
        "encoder": None,
        "encode_decision": None,
        "redirects": [],
        "counts": {"text": 1},
        "parts": [{"location": "messages[0].content[0]", "type": "text", "modalities": ["text"], "action": "accept"}],
    }


def test_explain_video_carrying_audio() -> None:
    config = routing(model("o", "text, video, audio"))
    body = request("o", user(VID), mm_processor_kwargs={"use_audio_in_video": True})
    explained = admit(config, body).explain()
    assert explained["counts"] == {"video": 1, "audio": 1}
    assert explained["parts"] == [
        {
            "location": "messages[0].content[0]",
            "type": "video_url",
            "modalities": ["video", "audio"],
            "action": "accept",
        }
    ]


# --- the runtime redirect-loop guard (a config built in code skips validation) ---------------


def in_code(name: str, **redirects: str) -> ModelConfig:
    policies = {Modality(m): Policy("redirect", target) for m, target in redirects.items()}
    return ModelConfig(name, ("http://127.0.0.1:1",), (TEXT,), on_unsupported=MappingProxyType(policies))


@pytest.mark.parametrize(
    ("models", "looping_at"),
    [
        ((in_code("a", image="a"),), "a"),
        ((in_code("a", image="b"), in_code("b", image="a")), "b"),
        ((in_code("a", image="b"), in_code("b", image="b")), "b"),
        ((in_code("a", image="b"), in_code("b", image="c"), in_code("c", image="b")), "c"),
    ],
)
def test_redirect_loop_guard(models: tuple[ModelConfig, ...], looping_at: str) -> None:
    with pytest.raises(GatewayError) as info:
        admit(GatewayConfig(models), request("a", user(IMG)))
    error = info.value
    assert type(error) is GatewayError
    assert error.code == "internal_error"
    assert error.status == 500
    assert error.message == f"redirect loop at model '{looping_at}'"


def test_config_built_in_code_target_can_still_reject() -> None:
    config = GatewayConfig((in_code("a", image="b"), in_code("b")))
    with pytest.raises(UnsupportedModalityError) as info:
        admit(config, request("a", user(IMG)))
    assert info.value.message == (
        "Model 'b' (redirected from 'a' for image input) does not accept image input: "
        "messages[0].content[0] is 'image_url'. It accepts: text."
    )


def test_a_stripped_video_takes_its_audio_track_with_it() -> None:
    config = routing(model("t", "text", "on_unsupported: {video: strip}"))
    body = request("t", user(VID), mm_processor_kwargs={"use_audio_in_video": True})
    plan = admit(config, body)
    assert plan.route == "strip"
    assert [p.location for p in plan.stripped_parts] == ["messages[0].content[0]"]


def test_the_reject_message_names_every_redirect_hop() -> None:
    config = routing(
        model("a", "text, image", "on_unsupported: {video: {redirect: b}}"),
        model("b", "text, image, video", "on_unsupported: {audio: {redirect: c}}"),
        model("c", "text, audio, video"),
    )
    with pytest.raises(UnsupportedModalityError) as caught:
        admit(config, request("a", user(IMG, VID, AUD)))
    assert caught.value.message.startswith(
        "Model 'c' (redirected from 'a' for video input, then from 'b' for audio input) does not accept image input"
    )


def test_min_images_keeps_image_light_requests_off_the_encoder_whatever_its_kind() -> None:
    for kind in ("local", "http: urls: [http://127.0.0.1:9001]", "vllm: urls: [http://127.0.0.1:9001]"):
        name, _, more = kind.partition(": ")
        spec = f"{{kind: {name}{', ' + more if more else ''}}}"
        config = parse_config(
            f"version: 1\nencoders:\n  enc: {spec}\nmodels:\n"
            + model("m", "text, image", "encode: {image: enc, min_images: 2}")
        )
        one = admit(config, request("m", user(txt(), IMG)))
        two = admit(config, request("m", user(txt(), IMG, IMG)))
        text_only = admit(config, request("m", user(txt())))
        assert (one.encoder, one.encode_parts, one.encode_decision) == (None, (), "direct"), kind
        assert (two.encoder, len(two.encode_parts), two.encode_decision) == ("enc", 2, "encoded"), kind
        assert text_only.encode_decision is None
        assert [p["action"] for p in one.explain()["parts"]] == ["accept", "accept"]

"""The OpenAI Responses API (``POST /v1/responses``) as admission sees it.

Content lives in ``input``: a string (text), or a list of items. A message item
(``{"type": "message", "role", "content"}``, ``type`` optional) keeps its parts in ``content``; a
``function_call_output`` or ``custom_tool_call_output`` in ``output`` (a string, or parts: a tool
that returns a screenshot). Other items (function calls, reasoning, shell and patch calls and
their string outputs, references to stored items) carry no media and are not looked into, nor are
computer-use items, which vLLM and SGLang do not take. ``instructions`` is
text.

Parts: ``input_text``, ``output_text`` and ``refusal`` (text); ``input_image`` (``image_url``: a
URL or a data URL; or a ``file_id``); ``input_file`` (a document: ``file_data``, ``file_url`` or
``file_id``); ``input_audio`` (``{"input_audio": {"data", "format"}}`` as the SDK sends it now,
``{"data", "format"}`` as older ones did).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ...config.types import ContentBounds
from ...errors import InvalidRequestError, responses_stream_error
from ...modalities import Modality
from ..affinity import responses_key
from ..outputs import responses_outputs
from ..parts import CHAT_PARTS, TEXT_FIELDS, Content, PartTable, check_messages, str_field
from . import Api, after_last


def _image(part: Mapping[str, Any]) -> str | None:
    url = part.get("image_url")
    if isinstance(url, dict):  # the chat shape, {"url": ...}
        url = url.get("url")
    if isinstance(url, str) and url:
        return None
    if url is None and isinstance(part.get("file_id"), str):
        return None
    return "'image_url' must be a non-empty string (a URL or a data URL), or 'file_id' a string"


def _file(part: Mapping[str, Any]) -> str | None:
    if any(isinstance(part.get(k), str) for k in ("file_data", "file_url", "file_id")):
        return None
    return "one of 'file_data', 'file_url' or 'file_id' must be a string"


def _audio(part: Mapping[str, Any]) -> str | None:
    value = part.get("input_audio", part)  # nested (the SDK now), or flat (older SDKs)
    if not isinstance(value, dict) or not isinstance(value.get("data"), str):
        return "'input_audio' must be an object with a base64 string 'data' and a 'format'"
    if "format" in value and not isinstance(value["format"], str):
        return "'format' must be a string"
    return None


PARTS = PartTable(
    {
        "input_text": (Modality.TEXT, str_field("text")),
        "output_text": (Modality.TEXT, str_field("text")),
        "refusal": (Modality.TEXT, str_field("refusal")),
        "input_image": (Modality.IMAGE, _image),
        "input_file": (Modality.FILE, _file),
        "input_audio": (Modality.AUDIO, _audio),
    },
    TEXT_FIELDS,
    # vLLM hands a Responses message's parts to its chat parser, which reads a part with a uuid by
    # its media key whatever its type: so does the gateway (gateway.admission.parts)
    CHAT_PARTS.untyped,
    strings=False,
    by_uuid=True,
)


# the items whose ``output`` may be parts: a function's, or a custom tool's (Codex's apply_patch
# and the like), a string or input_text, input_image and input_file parts
TOOL_OUTPUTS = ("function_call_output", "custom_tool_call_output")


def contents(body: dict[str, Any], bounds: ContentBounds) -> list[Content]:
    """A Responses request's view: ``instructions``, then ``input`` (a string, or its items' parts)."""
    view = []
    if isinstance(body.get("instructions"), str):
        view.append(Content(body, "instructions", "instructions"))
    items = body.get("input")
    if items is None or isinstance(items, str):
        if items is not None:
            view.append(Content(body, "input", "input"))
        return view
    if not isinstance(items, list):
        raise InvalidRequestError("'input' must be a string or an array of input items", param="input")
    check_messages(items, bounds, "input")
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            raise InvalidRequestError(f"input[{i}] must be an object", param=f"input[{i}]")
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            if not isinstance(item.get("role"), str):
                raise InvalidRequestError(f"input[{i}].role must be a string", param=f"input[{i}].role")
            view.append(Content(item, "content", f"input[{i}].content"))
        elif kind in TOOL_OUTPUTS and item.get("output") is not None:
            view.append(Content(item, "output", f"input[{i}].output"))
    return view


def _models(item: Mapping[str, Any]) -> bool:
    """An item the model wrote: an assistant message, a reasoning item, any tool call (``*_call``)."""
    kind = item.get("type")
    return item.get("role") == "assistant" or kind == "reasoning" or (isinstance(kind, str) and kind.endswith("_call"))


def newest(body: Mapping[str, Any]) -> frozenset[int]:
    """The messages after the model's last item (not the tool outputs it asked for)."""
    return frozenset(
        id(item)
        for item in after_last(body.get("input"), _models)
        if isinstance(item, dict) and item.get("type", "message") == "message"
    )


def normalize(part: Mapping[str, Any]) -> dict[str, Any] | None:
    """The part as vLLM's Responses serving reads it, where the client sent the same meaning in
    another shape: an ``input_image`` whose ``image_url`` is the chat API's ``{"url": ...}`` (vLLM
    reads a string) or without ``detail`` (vLLM requires it; OpenAI's default is ``auto``), a flat
    ``input_audio`` (``{"data", "format"}``, older SDKs: vLLM reads the
    nested form). None: the part goes as sent."""
    kind = part.get("type")
    if kind == "input_image" and (isinstance(part.get("image_url"), dict) or "detail" not in part):
        # vLLM's ResponseInputImageParam requires ``detail`` (OpenAI's default: auto)
        image = {**part, "detail": part.get("detail", "auto")}
        if isinstance(part.get("image_url"), dict):
            image["image_url"] = part["image_url"]["url"]  # classification checked the url
        return image
    if kind == "input_audio" and "input_audio" not in part and isinstance(part.get("data"), str):
        audio = {k: part[k] for k in ("data", "format") if k in part}
        return {**{k: v for k, v in part.items() if k not in audio}, "input_audio": audio}
    return None


def image(media_type: str, data: str) -> dict[str, Any]:
    """An ``input_image`` of base64 ``data``, its URL a string as vLLM reads it."""
    return {"type": "input_image", "image_url": f"data:{media_type};base64,{data}", "detail": "auto"}


RESPONSES = Api(
    "responses",
    "/v1/responses",
    PARTS,
    contents,
    operation="chat",
    affinity=responses_key,
    stores=True,
    stream_error=responses_stream_error,
    transcribes=True,
    leaves_notes=True,
    text_part="input_text",
    normalize=normalize,
    normalizes=frozenset({"input_image", "input_audio"}),
    image_part=image,
    newest=newest,
    outputs=responses_outputs,
)

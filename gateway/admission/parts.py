"""The classification of every content part of a chat request.

``classify(body)`` walks every message (not only the last) and every content part, and returns
one :class:`Part` per part with the modalities it carries. It accepts every part shape that
OpenAI, vLLM and SGLang clients send:

* text-like: ``text``, ``input_text``, ``output_text``, ``refusal``, ``thinking``,
  ``tool_reference``, ``prompt_embeds`` (embeddings of text), and plain strings in a content array;
* image: ``image_url``, ``input_image`` (Responses-API style), ``image_embeds``;
* video: ``video_url`` (also audio when ``mm_processor_kwargs.use_audio_in_video`` is true);
* audio: ``input_audio``, ``audio_url``, ``audio_embeds``;
* parts without ``type`` that carry exactly one media key (``{"image_url": ...}``), as vLLM allows.

Media may be ``null`` when the part carries a ``uuid`` (vLLM's reference to cached media).
Anything else is an :class:`~gateway.errors.InvalidContentPartError` naming the part.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from ..config.types import DEFAULT_BOUNDS, ContentBounds
from ..errors import InvalidContentPartError, InvalidRequestError, Rejection, clip
from ..modalities import MODALITIES, Modality


@dataclass(frozen=True, slots=True)
class Part:
    """One content part: where it is, what it was sent as, and what it carries."""

    message: int
    index: int | None  # None when the message content is a plain string
    type: str
    modalities: tuple[Modality, ...]

    @property
    def location(self) -> str:
        if self.index is None:
            return f"messages[{self.message}].content"
        return f"messages[{self.message}].content[{self.index}]"

    @property
    def modality(self) -> Modality:
        """The primary modality (a video that also carries its audio track is a video)."""
        return self.modalities[0]


@dataclass(frozen=True, slots=True)
class Classification:
    parts: tuple[Part, ...]
    counts: Mapping[Modality, int]
    audio_in_video: bool

    @property
    def present(self) -> tuple[Modality, ...]:
        """The modalities the request carries, in Modality order."""
        counts = self.counts
        return tuple(m for m in MODALITIES if counts.get(m))

    def parts_with(self, modality: Modality) -> list[Part]:
        return [p for p in self.parts if modality in p.modalities]


# --- part validators: return an error message, or None when the part is well formed -----------


def _str_field(key: str) -> Callable[[Mapping[str, Any]], str | None]:
    def check(part: Mapping[str, Any]) -> str | None:
        if not isinstance(part.get(key), str):
            return f"'{key}' must be a string"
        return None

    return check


def _cached(value: object, part: Mapping[str, Any]) -> bool:
    """Media may be null when the part names media the engine has cached under a uuid."""
    uuid = part.get("uuid")
    return value is None and isinstance(uuid, str) and bool(uuid)


def _url_field(key: str, *, bare: bool) -> Callable[[Mapping[str, Any]], str | None]:
    """``{key: {"url": ...}}``; with ``bare``, also ``{key: "..."}`` (vLLM's untyped parts).

    A typed part with a bare string is refused, as OpenAI, vLLM and SGLang refuse it.
    """
    expected = "a non-empty string or an object" if bare else "an object"
    message = f"'{key}' must be {expected} with a non-empty string 'url'"

    def check(part: Mapping[str, Any]) -> str | None:
        value = part.get(key)
        if _cached(value, part):
            return None
        if isinstance(value, dict):
            value = value.get("url")
        elif not bare:
            return message
        if not isinstance(value, str) or not value:
            return message
        return None

    return check


def _embeds_field(key: str) -> Callable[[Mapping[str, Any]], str | None]:
    def check(part: Mapping[str, Any]) -> str | None:
        value = part.get(key)
        if _cached(value, part):
            return None
        if isinstance(value, str) and value:
            return None
        if isinstance(value, dict) and value and all(isinstance(v, str) for v in value.values()):
            return None
        return f"'{key}' must be a base64 string or an object of base64 strings"

    return check


def _input_image(part: Mapping[str, Any]) -> str | None:
    if isinstance(part.get("file_id"), str) and "image_url" not in part:
        return None
    return _BARE_URL["image_url"](part)


def _input_audio(part: Mapping[str, Any]) -> str | None:
    value = part.get("input_audio")
    if _cached(value, part):
        return None
    if not isinstance(value, dict) or not isinstance(value.get("data"), str):
        return "'input_audio' must be an object with a base64 string 'data' and a 'format'"
    if "format" in value and not isinstance(value["format"], str):
        return "'input_audio.format' must be a string"
    return None


_Check = Callable[[Mapping[str, Any]], str | None]
# URL parts that may carry a bare string: untyped ones (vLLM), and input_image (the Responses API).
_BARE_URL: Mapping[str, _Check] = {key: _url_field(key, bare=True) for key in ("image_url", "video_url", "audio_url")}

# part type -> (modality, validator)
PART_TYPES: Mapping[str, tuple[Modality, _Check]] = {
    "text": (Modality.TEXT, _str_field("text")),
    "input_text": (Modality.TEXT, _str_field("text")),
    "output_text": (Modality.TEXT, _str_field("text")),
    "refusal": (Modality.TEXT, _str_field("refusal")),
    "thinking": (Modality.TEXT, _str_field("thinking")),
    "tool_reference": (Modality.TEXT, _str_field("name")),
    "prompt_embeds": (Modality.TEXT, _str_field("data")),
    "image_url": (Modality.IMAGE, _url_field("image_url", bare=False)),
    "input_image": (Modality.IMAGE, _input_image),
    "image_embeds": (Modality.IMAGE, _embeds_field("image_embeds")),
    "video_url": (Modality.VIDEO, _url_field("video_url", bare=False)),
    "input_audio": (Modality.AUDIO, _input_audio),
    "audio_url": (Modality.AUDIO, _url_field("audio_url", bare=False)),
    "audio_embeds": (Modality.AUDIO, _embeds_field("audio_embeds")),
}

# The text of text parts, bounded by server.max_text_chars (prompt_embeds are embeddings, not text).
TEXT_FIELDS: Mapping[str, str] = {
    "text": "text",
    "input_text": "text",
    "output_text": "text",
    "refusal": "refusal",
    "thinking": "thinking",
}

# Keys that identify a part sent without "type" (vLLM accepts these, its URLs also as bare strings).
UNTYPED_MEDIA_KEYS = ("image_url", "image_embeds", "video_url", "input_audio", "audio_url", "audio_embeds")
_UNTYPED_CHECKS: Mapping[str, _Check] = {
    **{key: check for key, (_, check) in PART_TYPES.items() if key in UNTYPED_MEDIA_KEYS},
    **_BARE_URL,
}


def classify(body: Mapping[str, Any], *, model: str, bounds: ContentBounds = DEFAULT_BOUNDS) -> Classification:
    """Classify every content part of every message of a chat completions body.

    ``model`` only labels the rejection that a malformed part is counted as. The numbers of
    messages and parts are bounded before any part is looked at (cheaply: one ``len`` a message).
    Raises InvalidRequestError for a malformed or oversized ``messages`` and InvalidContentPartError
    for a part.
    """
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise InvalidRequestError("'messages' must be a non-empty array of message objects", param="messages")
    _check_counts(messages, bounds)
    audio_in_video = _audio_in_video(body)
    parts: list[Part] = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise InvalidRequestError(f"messages[{i}] must be an object", param=f"messages[{i}]")
        if not isinstance(message.get("role"), str):
            raise InvalidRequestError(f"messages[{i}].role must be a string", param=f"messages[{i}].role")
        content = message.get("content")
        if content is None:
            continue
        if isinstance(content, str):
            _check_text(content, f"messages[{i}].content", bounds.text_chars)
            parts.append(Part(i, None, "string", (Modality.TEXT,)))
        elif isinstance(content, list):
            parts.extend(
                _classify_part(i, j, p, audio_in_video, model, bounds.text_chars) for j, p in enumerate(content)
            )
        else:
            raise InvalidContentPartError(
                f"messages[{i}].content must be a string, an array of content parts, or null",
                param=f"messages[{i}].content",
                rejection=Rejection(model, "unknown", "invalid_content"),
            )
    counts: dict[Modality, int] = {}
    for part in parts:
        for m in part.modalities:
            counts[m] = counts.get(m, 0) + 1
    return Classification(tuple(parts), counts, audio_in_video)


def _check_counts(messages: list[Any], bounds: ContentBounds) -> None:
    if len(messages) > bounds.messages:
        raise InvalidRequestError(
            f"Request has {len(messages)} messages, over the limit of {bounds.messages} (server.max_messages)",
            param="messages",
        )
    total = 0
    for i, message in enumerate(messages):
        content = message.get("content") if isinstance(message, dict) else None
        total += len(content) if isinstance(content, list) else 1
        if total > bounds.parts:
            raise InvalidRequestError(
                f"Request has more than {bounds.parts} content parts in all (server.max_content_parts); "
                f"the limit is passed in messages[{i}]",
                param=f"messages[{i}].content",
            )


def _check_text(text: str, location: str, limit: int) -> None:
    if len(text) > limit:
        raise InvalidRequestError(
            f"{location} is a text of {len(text)} characters, over the limit of {limit} (server.max_text_chars)",
            param=location,
        )


def _audio_in_video(body: Mapping[str, Any]) -> bool:
    kwargs = body.get("mm_processor_kwargs")
    return isinstance(kwargs, dict) and kwargs.get("use_audio_in_video") is True


def _classify_part(i: int, j: int, part: object, audio_in_video: bool, model: str, max_text: int) -> Part:
    location = f"messages[{i}].content[{j}]"

    def invalid(message: str, modality: str = "unknown") -> InvalidContentPartError:
        return InvalidContentPartError(
            f"{location}: {message}", param=location, rejection=Rejection(model, modality, "invalid_content")
        )

    if isinstance(part, str):
        _check_text(part, location, max_text)
        return Part(i, j, "string", (Modality.TEXT,))
    if not isinstance(part, dict):
        raise invalid("a content part must be an object or a string")
    part_type = part.get("type")
    if part_type is None:
        keys = [k for k in UNTYPED_MEDIA_KEYS if k in part]
        if len(keys) != 1:
            found = f"it carries {', '.join(keys)}" if keys else "it carries no media key"
            raise invalid(
                f"a content part without 'type' must carry exactly one of {', '.join(UNTYPED_MEDIA_KEYS)} ({found})"
            )
        part_type = keys[0]
        modality, check = PART_TYPES[part_type][0], _UNTYPED_CHECKS[part_type]
    elif not isinstance(part_type, str):
        raise invalid("'type' must be a string")
    elif (entry := PART_TYPES.get(part_type)) is None:
        raise invalid(f"unknown content part type '{clip(part_type)}' (expected one of: {', '.join(PART_TYPES)})")
    else:
        modality, check = entry
    problem = check(part)
    if problem is not None:
        raise invalid(f"malformed '{part_type}' part: {problem}", modality.value)
    if (field := TEXT_FIELDS.get(part_type)) is not None:
        _check_text(part[field], location, max_text)
    if modality is Modality.VIDEO and audio_in_video:
        return Part(i, j, part_type, (Modality.VIDEO, Modality.AUDIO))
    return Part(i, j, part_type, (modality,))

"""The classification of every content part of a request, whatever its API.

An API's request keeps its content in lists of parts (or strings): a chat request in each
message's ``content``, a Responses request in its ``input`` items, an Anthropic one in its
messages and their ``tool_result`` blocks. The API's view of a body (gateway.admission.apis)
is the sequence of those :class:`Content` places; :func:`classify_contents` walks every one (not
only the last message) and every part, with the API's table of part types, and returns one
:class:`Part` per part with the modalities it carries. :func:`classify` is the chat API's.

The chat table accepts every part shape that OpenAI, vLLM and SGLang clients send:

* text-like: ``text``, ``input_text``, ``output_text``, ``refusal``, ``thinking``,
  ``tool_reference``, ``prompt_embeds`` (embeddings of text), and plain strings in a content array;
* image: ``image_url``, ``input_image`` (Responses-API style), ``image_embeds``, ``image_pil``;
* video: ``video_url`` (also audio when ``mm_processor_kwargs.use_audio_in_video`` is true),
  ``video_embeds`` (also audio when it carries ``audio_embeds``);
* audio: ``input_audio``, ``audio_url``, ``audio_embeds``;
* file: ``file`` (a document: ``file_data`` or ``file_id``);
* parts without ``type`` that carry exactly one media key (``{"image_url": ...}``), as vLLM allows;
  and, as vLLM reads them (``_parse_chat_message_content_mm_part``), **every part with a**
  ``uuid`` **is read by its media key, whatever its ``type`` says**: ``{"type": "text", "text": "",
  "image_url": ..., "uuid": "x"}`` is an image to vLLM, and so to the gateway.

Media may be ``null`` when the part carries a ``uuid`` (vLLM's reference to cached media).
Anything else is an :class:`~gateway.errors.InvalidContentPartError` naming the part.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..config.types import DEFAULT_BOUNDS, ContentBounds
from ..errors import InvalidContentPartError, InvalidRequestError, Rejection, clip, did_you_mean
from ..modalities import MODALITIES, Modality
from ..values import record


@record
class Content:
    """One place of a request that holds content: ``holder[key]``, a list of parts or a string.
    The holder is an object (its key a field's name), or an array (its key an index: SGLang's
    rerank documents, each a list of parts)."""

    holder: Any  # dict[str, Any] with a str key, or list[Any] with an int key
    key: str | int
    where: str = ""  # its location as errors say it; "" for a chat message (messages[i].content)
    table: PartTable | None = None  # its own part types, where they are not its API's (SGLang's items)
    engine: str | None = None  # the one engine whose shape it is (routing.yaml's engine:); None: every one's

    @property
    def value(self) -> Any:
        return self.holder[self.key]

    @property
    def found(self) -> Any:
        """The value, or None where an object's field is absent."""
        return self.holder.get(self.key) if isinstance(self.holder, dict) else self.holder[self.key]


@record
class Part:
    """One content part: where it is, what it was sent as, and what it carries."""

    message: int  # the place of its content in the API's view (a chat request: the message)
    index: int | None  # None when the content is a plain string
    type: str
    modalities: tuple[Modality, ...]
    where: str = field(default="", compare=False)  # its content's location ("": messages[message].content)

    @property
    def location(self) -> str:
        where = self.where or f"messages[{self.message}].content"
        return where if self.index is None else f"{where}[{self.index}]"

    @property
    def modality(self) -> Modality:
        """The primary modality (a video that also carries its audio track is a video)."""
        return self.modalities[0]


@record
class Classification:
    parts: tuple[Part, ...]
    counts: Mapping[Modality, int]
    audio_in_video: bool
    # (place, index) of the parts its API's engines read in another shape of the same meaning
    normalized: frozenset[tuple[int, int]] = frozenset()
    media: bool = True  # whether any part carries more than text (False: nothing to count, convert or encode)

    @property
    def present(self) -> tuple[Modality, ...]:
        """The modalities the request carries, in Modality order."""
        counts = self.counts
        return tuple(m for m in MODALITIES if counts.get(m))

    def parts_with(self, modality: Modality) -> list[Part]:
        return [p for p in self.parts if modality in p.modalities]


# --- part validators: return an error message, or None when the part is well formed -----------


def str_field(key: str) -> Callable[[Mapping[str, Any]], str | None]:
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


def _present(key: str) -> Callable[[Mapping[str, Any]], str | None]:
    def check(part: Mapping[str, Any]) -> str | None:
        return None if part.get(key) is not None or _cached(part.get(key), part) else f"'{key}' must be given"

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


def _file(part: Mapping[str, Any]) -> str | None:
    value = part.get("file")
    if not isinstance(value, dict) or not any(isinstance(value.get(k), str) for k in ("file_data", "file_id")):
        return "'file' must be an object with a string 'file_data' or 'file_id'"
    return None


_Check = Callable[[Mapping[str, Any]], str | None]
# URL parts that may carry a bare string: untyped ones (vLLM), and input_image (the Responses API).
_BARE_URL: Mapping[str, _Check] = {key: _url_field(key, bare=True) for key in ("image_url", "video_url", "audio_url")}


@dataclass(frozen=True, slots=True)
class PartTable:
    """An API's part types: each one's modality and check, the field of those that are text
    (bounded by server.max_text_chars), and how a part without ``type`` is read (chat: by its one
    media key, as vLLM reads it; ``untyped`` empty: refused)."""

    types: Mapping[str, tuple[Modality, _Check]]
    text_fields: Mapping[str, str]
    untyped: Mapping[str, _Check] = field(default_factory=dict)
    strings: bool = True  # a plain string may stand among the parts (text)
    combined: bool = False  # an untyped part may carry several keys, and is every modality it carries
    by_uuid: bool = False  # a part with a uuid is read by its media key, as an untyped one (vLLM's chat parser)
    # a type whose modality its fields decide (a checked part): Anthropic's document of plain text is
    # text; the refiner gives the modality and, for text, the text (held to server.max_text_chars)
    refine: Mapping[str, Callable[[Mapping[str, Any]], tuple[Modality, str | None]]] = field(default_factory=dict)


# part type -> (modality, validator)
PART_TYPES: Mapping[str, tuple[Modality, _Check]] = {
    "text": (Modality.TEXT, str_field("text")),
    "input_text": (Modality.TEXT, str_field("text")),
    "output_text": (Modality.TEXT, str_field("text")),
    "refusal": (Modality.TEXT, str_field("refusal")),
    "thinking": (Modality.TEXT, str_field("thinking")),
    "tool_reference": (Modality.TEXT, str_field("name")),
    "prompt_embeds": (Modality.TEXT, str_field("data")),
    "image_url": (Modality.IMAGE, _url_field("image_url", bare=False)),
    "input_image": (Modality.IMAGE, _input_image),
    "image_embeds": (Modality.IMAGE, _embeds_field("image_embeds")),
    "image_pil": (Modality.IMAGE, _present("image_pil")),  # vLLM's offline API; counted where sent
    "video_url": (Modality.VIDEO, _url_field("video_url", bare=False)),
    "video_embeds": (Modality.VIDEO, _embeds_field("video_embeds")),
    "input_audio": (Modality.AUDIO, _input_audio),
    "audio_url": (Modality.AUDIO, _url_field("audio_url", bare=False)),
    "audio_embeds": (Modality.AUDIO, _embeds_field("audio_embeds")),
    "file": (Modality.FILE, _file),
}

# The text of text parts, bounded by server.max_text_chars (prompt_embeds are embeddings, not text).
TEXT_FIELDS: Mapping[str, str] = {
    "text": "text",
    "input_text": "text",
    "output_text": "text",
    "refusal": "refusal",
    "thinking": "thinking",
}

# Keys that identify a part sent without "type", or with a "uuid" (vLLM reads such a part by these,
# its URLs also as bare strings).
UNTYPED_MEDIA_KEYS = (
    "image_url",
    "image_pil",
    "image_embeds",
    "audio_embeds",
    "video_embeds",
    "audio_url",
    "input_audio",
    "video_url",
)
CHAT_PARTS = PartTable(
    PART_TYPES,
    TEXT_FIELDS,
    {**{key: check for key, (_, check) in PART_TYPES.items() if key in UNTYPED_MEDIA_KEYS}, **_BARE_URL},
    by_uuid=True,
)


def classify(body: dict[str, Any], *, model: str, bounds: ContentBounds = DEFAULT_BOUNDS) -> Classification:
    """Classify every content part of every message of a chat completions body.

    ``model`` only labels the rejection that a malformed part is counted as. The numbers of
    messages and parts are bounded before any part is looked at (cheaply: one ``len`` a message).
    Raises InvalidRequestError for a malformed or oversized ``messages`` and InvalidContentPartError
    for a part.
    """
    contents = chat_contents(body, bounds)
    return classify_contents(contents, CHAT_PARTS, model=model, bounds=bounds, audio_in_video=audio_in_video(body))


def chat_contents(body: dict[str, Any], bounds: ContentBounds) -> list[Content]:
    """A chat request's view: each message's ``content``, in order (a message's place is its index)."""
    return [Content(message, "content") for message in messages_of(body, bounds)]


def messages_of(body: Mapping[str, Any], bounds: ContentBounds) -> list[dict[str, Any]]:
    """The body's ``messages``, checked: a non-empty array, within server.max_messages, of objects
    each with a string ``role`` (the chat and Anthropic Messages APIs keep them alike)."""
    return check_conversation(body.get("messages"), bounds, "messages")


def check_conversation(messages: Any, bounds: ContentBounds, name: str) -> list[dict[str, Any]]:
    """``messages`` (found at ``name``) checked as a conversation: a non-empty array, within
    server.max_messages, of objects each with a string ``role``."""
    if not isinstance(messages, list) or not messages:
        raise InvalidRequestError(f"'{name}' must be a non-empty array of message objects", param=name)
    check_messages(messages, bounds, name)
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise InvalidRequestError(f"{name}[{i}] must be an object", param=f"{name}[{i}]")
        if not isinstance(message.get("role"), str):
            raise InvalidRequestError(f"{name}[{i}].role must be a string", param=f"{name}[{i}].role")
    return messages


def classify_contents(
    contents: Sequence[Content], table: PartTable, *, model: str, bounds: ContentBounds, audio_in_video: bool = False
) -> Classification:
    """Classify every part of every place of an API's view, with the API's table of parts."""
    _check_parts(contents, bounds)
    walk = _Walk(table, model, bounds.text_chars, audio_in_video)
    parts: list[Part] = []
    for i, content in enumerate(contents):
        value = content.found
        where = content.where
        if value is None:
            continue
        if isinstance(value, str):
            _check_text(value, where or f"messages[{i}].content", bounds.text_chars)
            parts.append(Part(i, None, "string", (Modality.TEXT,), where))
        elif isinstance(value, list):
            own = walk if content.table is None else _Walk(content.table, model, bounds.text_chars, audio_in_video)
            parts.extend(_classify_part(own, i, j, where, p) for j, p in enumerate(value))
        else:
            location = where or f"messages[{i}].content"
            raise InvalidContentPartError(
                f"{location} must be a string, an array of content parts, or null",
                param=location,
                rejection=Rejection(model, "unknown", "invalid_content"),
            )
    counts: dict[Modality, int] = {}
    for part in parts:
        for m in part.modalities:
            counts[m] = counts.get(m, 0) + 1
    return Classification(tuple(parts), counts, audio_in_video, media=len(counts) > (Modality.TEXT in counts))


def check_messages(messages: list[Any], bounds: ContentBounds, name: str = "messages") -> None:
    """400 when a request has more messages (or input items) than server.max_messages."""
    if len(messages) > bounds.messages:
        raise InvalidRequestError(
            f"Request has {len(messages)} {name}, over the limit of {bounds.messages} (server.max_messages)",
            param=name,
        )


def _check_parts(contents: Sequence[Content], bounds: ContentBounds) -> None:
    total = 0
    for i, content in enumerate(contents):
        value = content.found
        total += len(value) if isinstance(value, list) else 1
        if total > bounds.parts:
            raise InvalidRequestError(
                f"Request has more than {bounds.parts} content parts in all (server.max_content_parts); "
                f"the limit is passed in {content.where or f'messages[{i}]'}",
                param=content.where or f"messages[{i}].content",
            )


def _check_text(text: str, location: str, limit: int) -> None:
    if len(text) > limit:
        raise InvalidRequestError(
            f"{location} is a text of {len(text)} characters, over the limit of {limit} (server.max_text_chars)",
            param=location,
        )


def audio_in_video(body: Mapping[str, Any]) -> bool:
    kwargs = body.get("mm_processor_kwargs")
    return isinstance(kwargs, dict) and kwargs.get("use_audio_in_video") is True


@record
class _Walk:
    """What classifying one request's parts goes by."""

    table: PartTable
    model: str  # labels the rejection a malformed part counts as
    max_text: int
    audio_in_video: bool


def _classify_part(walk: _Walk, i: int, j: int, where: str, part: object) -> Part:
    table = walk.table
    if isinstance(part, str) and table.strings:
        if len(part) > walk.max_text:
            _check_text(part, _location(i, j, where), walk.max_text)
        return Part(i, j, "string", _TEXT, where)
    if not isinstance(part, dict):
        raise _invalid(
            walk, (i, j, where), "a content part must be an object" + (" or a string" if table.strings else "")
        )
    part_type = part.get("type")
    if part_type is None and table.combined:
        return _combined(walk, (i, j, where), part)
    by_key = part_type is None or (table.by_uuid and part.get("uuid") is not None)
    if by_key and table.untyped:
        keys = [k for k in table.untyped if k in part]
        if part_type == "video_embeds" and set(keys) == {"audio_embeds", "video_embeds"}:
            keys = ["video_embeds"]  # its audio, read with it (below)
        if len(keys) != 1:
            found = f"it carries {', '.join(keys)}" if keys else "it carries no media key"
            which = "without 'type'" if part_type is None else "with a 'uuid' (read by its media key, as vLLM reads it)"
            raise _invalid(
                walk,
                (i, j, where),
                f"a content part {which} must carry exactly one of {', '.join(table.untyped)} ({found})",
            )
        part_type = keys[0]
        modality, check = (table.types.get(part_type) or PART_TYPES[part_type])[0], table.untyped[part_type]
    elif not isinstance(part_type, str):
        raise _invalid(walk, (i, j, where), "'type' must be a string")
    elif (entry := table.types.get(part_type)) is None:
        raise _invalid(
            walk,
            (i, j, where),
            f"unknown content part type '{clip(part_type)}' (expected one of: {', '.join(table.types)})"
            + did_you_mean(part_type, table.types),
        )
    else:
        modality, check = entry
    problem = check(part)
    if problem is not None:
        raise _invalid(walk, (i, j, where), f"malformed '{part_type}' part: {problem}", modality.value)
    if table.refine and (refine := table.refine.get(part_type)) is not None:
        modality, text = refine(part)
        if text is not None and len(text) > walk.max_text:
            _check_text(text, _location(i, j, where), walk.max_text)
    if (text_field := table.text_fields.get(part_type)) is not None and len(part[text_field]) > walk.max_text:
        _check_text(part[text_field], _location(i, j, where), walk.max_text)
    if modality is Modality.VIDEO and (walk.audio_in_video or (part_type == "video_embeds" and "audio_embeds" in part)):
        return Part(i, j, part_type, (Modality.VIDEO, Modality.AUDIO), where)
    return Part(i, j, part_type, _ALONE[modality], where)


_TEXT = (Modality.TEXT,)
_ALONE = {m: (m,) for m in MODALITIES}  # each modality as a part's only one


def _location(i: int, j: int, where: str) -> str:
    """A part's location as errors say it (built only for one)."""
    return f"{where or f'messages[{i}].content'}[{j}]"


def _invalid(walk: _Walk, at: tuple[int, int, str], message: str, modality: str = "unknown") -> InvalidContentPartError:
    """The 400 of a malformed part at ``at`` (its content's place, its index, where that is)."""
    location = _location(*at)
    return InvalidContentPartError(
        f"{location}: {message}", param=location, rejection=Rejection(walk.model, modality, "invalid_content")
    )


def _combined(walk: _Walk, at: tuple[int, int, str], part: dict[str, Any]) -> Part:
    """An item that carries several keys (SGLang's ``{"text", "image"}``): every modality it has."""
    table = walk.table
    keys = [k for k in table.untyped if k in part]
    if not keys:
        raise _invalid(walk, at, f"an item must carry one of {', '.join(table.untyped)}")
    for key in keys:
        problem = table.untyped[key](part)
        if problem is not None:
            raise _invalid(walk, at, f"malformed item: {problem}", table.types[key][0].value)
    if "text" in keys and isinstance(part.get("text"), str):
        _check_text(part["text"], f"{at[2]}[{at[1]}]", walk.max_text)
    found = {table.types[k][0] for k in keys}
    modalities = tuple(m for m in (*MODALITIES[1:], Modality.TEXT) if m in found)  # media first
    return Part(at[0], at[1], "+".join(keys), modalities, at[2])

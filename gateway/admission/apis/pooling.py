"""The pooling APIs of vLLM and SGLang (embedding, scoring and reranking models) as admission sees them.

Every shape the engines' own request models accept that can carry media is read (vLLM 0.33's
``entrypoints/pooling/{embed,scoring}/protocol.py``, SGLang 0.5.23's ``EmbeddingRequest`` and
``V1RerankReqInput``); a list of mixed kinds, or an object two engines would read two ways, is a
400 naming it:

- **embeddings** (``POST /v1/embeddings``): text ``input`` (a string, strings, token ids, lists of
  token ids) carries no parts. vLLM's multimodal embedding models take conversations: one in
  ``messages`` or in ``input`` (a list of chat messages, each with a ``role``), or a batch of them
  in either (a list of such lists); every message's content is read as on the chat API. SGLang's
  take ``input`` items such as ``{"text", "image"}``, each carrying every modality it has keys for
  (a part with ``text`` and ``image`` is both).
- **score** (``POST /v1/score``, ``/score``): two sides, each a string, strings, or
  ``{"content": [parts]}`` (images of documents), under any of vLLM's names for them:
  ``queries``/``documents``, ``queries``/``items``, ``data_1``/``data_2`` and ``text_1``/``text_2``;
  **rerank** (``/v1/rerank``, ``/rerank``, ``/v2/rerank``): ``query`` and ``documents`` alike.
  SGLang's sides are lists of parts instead: a query as one list, documents each one (beside
  strings), and its score ``items`` may be token ids. Parts are the chat API's.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ...config.types import ContentBounds
from ...errors import InvalidRequestError
from ...modalities import Modality
from ..parts import CHAT_PARTS, Content, PartTable, check_conversation, check_messages, str_field
from . import Api


def _url_or_data(key: str) -> Any:
    def check(part: Mapping[str, Any]) -> str | None:
        value = part.get(key)
        return None if isinstance(value, str) and value else f"'{key}' must be a non-empty string (a URL or data)"

    return check


# SGLang's multimodal embedding items: {"text": ..., "image": ..., "video": ...}, any of them
ITEMS = PartTable(
    {
        "text": (Modality.TEXT, str_field("text")),
        "image": (Modality.IMAGE, _url_or_data("image")),
        "video": (Modality.VIDEO, _url_or_data("video")),
    },
    {"text": "text"},
    {"text": str_field("text"), "image": _url_or_data("image"), "video": _url_or_data("video")},
    combined=True,
)


def embedding_contents(body: dict[str, Any], bounds: ContentBounds) -> list[Content]:
    """An embeddings request's view: its conversations' contents, and SGLang's items (text: none).
    Both ``messages`` and ``input`` are read where both are sent: vLLM reads the one, SGLang the
    other."""
    messages = body.get("messages")
    view = [] if messages is None else _conversations(messages, "messages", bounds)  # vLLM
    items = body.get("input")
    if not isinstance(items, list) or not items:
        return view  # a string (or what the engine refuses as it would anyway: no parts to read)
    if all(isinstance(item, str) or _token(item) for item in items):
        return view  # strings, or token ids
    if all(isinstance(item, list) for item in items):
        if all(all(_token(token) for token in item) for item in items):
            return view  # lists of token ids
        return view + _conversations(items, "input", bounds)  # vLLM: a batch of conversations in input
    if all(isinstance(item, dict) and "role" in item for item in items):
        for i, item in enumerate(items):
            if any(key in item for key in ITEMS.untyped):  # SGLang reads it as an item, vLLM as a message
                raise InvalidRequestError(
                    f"input[{i}] is both a chat message (it has a 'role') and an SGLang item (it has "
                    f"{', '.join(k for k in ITEMS.untyped if k in item)}): send one or the other",
                    param=f"input[{i}]",
                )
        return view + _conversations(items, "input", bounds)  # vLLM: one conversation in input
    if all(isinstance(item, dict) and "role" not in item for item in items):
        check_messages(items, bounds, "input")
        return [*view, Content(body, "input", "input", ITEMS, "sglang")]  # SGLang's items
    raise InvalidRequestError(
        "'input' must be a string, strings, token ids, chat messages (each with a 'role'), lists of chat "
        "messages, or multimodal items ({'text', 'image', 'video'}), one kind throughout",
        param="input",
    )


def _one_reading(item: dict[str, Any], where: str) -> None:
    """400 for an object that is both vLLM's ``{"content": [parts]}`` and a part (a ``type``, or
    a media key): vLLM would read its content, SGLang the part."""
    if "content" in item and ("type" in item or any(key in item for key in CHAT_PARTS.untyped)):
        raise InvalidRequestError(
            f"{where} is both an object with 'content' (vLLM's) and a content part (SGLang's): send one or the other",
            param=where,
        )


def _token(value: Any) -> bool:
    """A token id: an integer (JSON's ``2.0`` too, which the engines' models take as 2)."""
    return (type(value) is int) or (type(value) is float and value.is_integer())


def _conversations(value: Any, key: str, bounds: ContentBounds) -> list[Content]:
    """The contents of one conversation (a list of messages) or of a batch of them (a list of
    such lists) under ``key``, each message checked as on the chat API."""
    if not isinstance(value, list) or not value:
        raise InvalidRequestError(
            f"'{key}' must be a non-empty array of chat messages, or of arrays of chat messages", param=key
        )
    if not all(isinstance(item, list) for item in value):
        messages = check_conversation(value, bounds, key)
        return [Content(m, "content", f"{key}[{i}].content", engine="vllm") for i, m in enumerate(messages)]
    check_messages([m for conversation in value for m in conversation], bounds, key)
    view = []
    for i, conversation in enumerate(value):
        for j, message in enumerate(check_conversation(conversation, bounds, f"{key}[{i}]")):
            view.append(Content(message, "content", f"{key}[{i}][{j}].content", engine="vllm"))
    return view


def _sides(keys: tuple[str, ...]) -> Any:
    """The view of a score or rerank request: each of ``keys`` that is sent (:func:`_side`)."""

    def contents(body: dict[str, Any], bounds: ContentBounds) -> list[Content]:
        return [content for key in keys for content in _side(body, key, bounds)]

    return contents


def _side(body: dict[str, Any], key: str, bounds: ContentBounds) -> list[Content]:
    """One side of a score or rerank request: a string or token ids (text); vLLM's
    ``{"content": [parts]}`` or a list of them and of strings; SGLang's list of parts (one input),
    or a list of such lists and of strings (documents)."""
    value = body.get(key)
    if value is None or isinstance(value, str):
        return []
    if isinstance(value, dict):
        _one_reading(value, key)
        if "content" not in value:
            raise InvalidRequestError(f"'{key}' must be a string, an array, or an object with 'content'", param=key)
        return [Content(value, "content", f"{key}.content", engine="vllm")]
    if not isinstance(value, list):
        raise InvalidRequestError(f"'{key}' must be a string, an array, or an object with 'content'", param=key)
    check_messages(value, bounds, key)
    if all(_token(item) for item in value):
        return []  # token ids
    if all(isinstance(item, dict) and "content" not in item for item in value):
        return [Content(body, key, key, engine="sglang")]  # SGLang: one input as a list of parts
    view = []
    for i, item in enumerate(value):
        if isinstance(item, str):
            continue
        if isinstance(item, dict):
            _one_reading(item, f"{key}[{i}]")
        if isinstance(item, dict) and "content" in item:
            view.append(Content(item, "content", f"{key}[{i}].content", engine="vllm"))
        elif isinstance(item, list) and all(_token(token) for token in item):
            continue  # token ids
        elif isinstance(item, list):
            view.append(Content(value, i, f"{key}[{i}]", engine="sglang"))  # SGLang: a document of parts
        else:
            raise InvalidRequestError(
                f"{key}[{i}] must be a string, token ids, an object with 'content', or an array of content parts",
                param=f"{key}[{i}]",
            )
    return view


EMBEDDINGS = Api("embeddings", "/v1/embeddings", CHAT_PARTS, embedding_contents, engine_shapes=True)
# vLLM's four pairs of names for a score request's two sides, read whichever are sent
# (vLLM serves each pooling route under both names)
SCORE = Api(
    "score",
    "/v1/score",
    CHAT_PARTS,
    _sides(("queries", "documents", "items", "data_1", "data_2", "text_1", "text_2")),
    aliases=("/score",),
    engine_shapes=True,
)
RERANK = Api(
    "rerank",
    "/v1/rerank",
    CHAT_PARTS,
    _sides(("query", "documents")),
    aliases=("/rerank", "/v2/rerank"),
    engine_shapes=True,
)

"""The pooling APIs of vLLM and SGLang (embedding, scoring and reranking models) as admission sees them.

Every shape the engines' own request models accept is read (vLLM 0.33's
``entrypoints/pooling/{embed,scoring}/protocol.py``, SGLang 0.5.23's ``EmbeddingRequest``); a
shape that is none of them is a 400 naming it, never forwarded unread:

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
  Parts are the chat API's.
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
    """An embeddings request's view: its conversations' contents, or SGLang's items (text: none)."""
    messages = body.get("messages")
    if messages is not None:  # vLLM: one conversation, or a batch of them
        return _conversations(messages, "messages", bounds)
    items = body.get("input")
    if not isinstance(items, list) or not items:
        return []  # a string (or what the engine refuses as it would anyway: no parts to read)
    if all(isinstance(item, str | int) for item in items):
        return []  # strings, or token ids
    if all(isinstance(item, list) for item in items):
        if all(all(type(token) is int for token in item) for item in items):
            return []  # lists of token ids
        return _conversations(items, "input", bounds)  # vLLM: a batch of conversations in input
    if all(isinstance(item, dict) and "role" in item for item in items):
        return _conversations(items, "input", bounds)  # vLLM: one conversation in input
    if all(isinstance(item, dict) and "role" not in item for item in items):
        check_messages(items, bounds, "input")
        return [Content(body, "input", "input", ITEMS)]  # SGLang's items
    raise InvalidRequestError(
        "'input' must be a string, strings, token ids, chat messages (each with a 'role'), lists of chat "
        "messages, or multimodal items ({'text', 'image', 'video'}), one kind throughout",
        param="input",
    )


def _conversations(value: Any, key: str, bounds: ContentBounds) -> list[Content]:
    """The contents of one conversation (a list of messages) or of a batch of them (a list of
    such lists) under ``key``, each message checked as on the chat API."""
    if not isinstance(value, list) or not value:
        raise InvalidRequestError(
            f"'{key}' must be a non-empty array of chat messages, or of arrays of chat messages", param=key
        )
    if not all(isinstance(item, list) for item in value):
        messages = check_conversation(value, bounds, key)
        return [Content(m, "content", f"{key}[{i}].content") for i, m in enumerate(messages)]
    check_messages([m for conversation in value for m in conversation], bounds, key)
    view = []
    for i, conversation in enumerate(value):
        for j, message in enumerate(check_conversation(conversation, bounds, f"{key}[{i}]")):
            view.append(Content(message, "content", f"{key}[{i}][{j}].content"))
    return view


def _places(keys: tuple[str, ...]) -> Any:
    def contents(body: dict[str, Any], bounds: ContentBounds) -> list[Content]:
        view = []
        for key in keys:
            value = body.get(key)
            if value is None or isinstance(value, str):
                continue
            if isinstance(value, dict):
                view.append(Content(value, "content", f"{key}.content"))
            elif isinstance(value, list):
                check_messages(value, bounds, key)
                for i, item in enumerate(value):
                    if isinstance(item, dict):
                        view.append(Content(item, "content", f"{key}[{i}].content"))
                    elif not isinstance(item, str):
                        raise InvalidRequestError(
                            f"{key}[{i}] must be a string or an object with 'content'", param=f"{key}[{i}]"
                        )
            else:
                raise InvalidRequestError(f"'{key}' must be a string, an array, or an object with 'content'", param=key)
        return view

    return contents


EMBEDDINGS = Api("embeddings", "/v1/embeddings", CHAT_PARTS, embedding_contents)
# vLLM's four pairs of names for a score request's two sides, read whichever are sent
SCORE = Api(
    "score", "/v1/score", CHAT_PARTS, _places(("queries", "documents", "items", "data_1", "data_2", "text_1", "text_2"))
)
RERANK = Api("rerank", "/v1/rerank", CHAT_PARTS, _places(("query", "documents")))

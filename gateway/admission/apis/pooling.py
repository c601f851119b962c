"""The pooling APIs of vLLM and SGLang (embedding, scoring and reranking models) as admission sees them.

- **embeddings** (``POST /v1/embeddings``): text ``input`` (a string, strings, token ids) carries
  no parts; vLLM's multimodal embedding models take chat ``messages`` instead (every message's
  content, as on the chat API); SGLang's take ``input`` items such as ``{"text", "image"}``, each
  carrying every modality it has keys for (a part with ``text`` and ``image`` is both).
- **score** (``POST /v1/score``, ``/score``): ``text_1`` and ``text_2``, each a string, strings,
  or ``{"content": [parts]}`` (images of documents); **rerank** (``/v1/rerank``, ``/rerank``,
  ``/v2/rerank``): ``query`` and ``documents`` alike. Parts are the chat API's.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ...config.types import ContentBounds
from ...errors import InvalidRequestError
from ...modalities import Modality
from ..parts import CHAT_PARTS, Content, PartTable, chat_contents, check_messages, str_field
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
    if body.get("messages") is not None:  # vLLM's chat-style embedding request
        return chat_contents(body, bounds)
    items = body.get("input")
    if isinstance(items, list) and any(isinstance(item, dict) for item in items):
        check_messages(items, bounds, "input")
        return [Content(body, "input", "input", ITEMS)]
    return []  # text: a string, strings, or token ids


def _places(keys: tuple[str, str]) -> Any:
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
SCORE = Api("score", "/v1/score", CHAT_PARTS, _places(("text_1", "text_2")))
RERANK = Api("rerank", "/v1/rerank", CHAT_PARTS, _places(("query", "documents")))

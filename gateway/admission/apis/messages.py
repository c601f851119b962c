"""The Anthropic Messages API (``POST /v1/messages``) as admission sees it.

Content lives in ``system`` (a string, or text blocks), in each message's ``content`` (a
string, or blocks) and in the ``content`` of every ``tool_result`` block (a string, or blocks:
an agent's screenshot tool returns its image there). Blocks: ``text``, ``image`` (``source``:
``base64`` with ``media_type`` and ``data``, ``url``, or ``file``), ``document`` (a PDF, a file or
a URL: the ``file`` modality, which vLLM and SGLang do not take; plain text, ``source.type``
``text`` or ``content`` of text: text, sent as a text block), ``tool_use``, ``tool_result``,
``tool_reference``, ``thinking``, ``redacted_thinking``, ``search_result``, ``container_upload``
and the server tools' blocks (text to the model, as a conversation begun on Anthropic's API
carries them: web search and fetch, code execution, bash and text editor code execution, tool
search, MCP).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from ...config.types import ContentBounds
from ...errors import anthropic_stream_error
from ...modalities import Modality
from ..affinity import chat_key
from ..parts import Content, PartTable, messages_of, str_field
from . import Api, after_last, assistants

SOURCES = {"base64": "data", "url": "url", "file": "file_id", "text": "data", "content": "content"}


def _source(*kinds: str) -> Any:
    allowed = " or ".join(repr(k) for k in kinds)

    def check(part: Mapping[str, Any]) -> str | None:
        source = part.get("source")
        if not isinstance(source, dict) or source.get("type") not in kinds:
            return f"'source' must be an object of type {allowed}"
        key = SOURCES[source["type"]]
        value = source.get(key)
        if key == "content" and isinstance(value, str | list):
            return None
        if not isinstance(value, str) or not value:
            return f"'source.{key}' must be a non-empty string"
        return None

    return check


def _tool_result(part: Mapping[str, Any]) -> str | None:
    if not isinstance(part.get("tool_use_id"), str):
        return "'tool_use_id' must be a string"
    content = part.get("content")
    if content is not None and not isinstance(content, str | list):
        return "'content' must be a string or an array of blocks"
    return None


def _any(part: Mapping[str, Any]) -> str | None:
    return None


def _document_text(part: Mapping[str, Any]) -> str | None:
    """A document's text, where it is plain text: ``source.type`` ``text`` (its ``data``), or
    ``content`` that is a string or text blocks only; None for a PDF, a file, a URL or images."""
    source = part["source"]  # checked
    if source["type"] == "text":
        text: str = source["data"]
        return text
    if source["type"] != "content":
        return None
    content = source["content"]
    if isinstance(content, str):
        return content
    if all(isinstance(b, dict) and b.get("type") == "text" and isinstance(b.get("text"), str) for b in content):
        return "\n".join(b["text"] for b in content)
    return None


def _document(part: Mapping[str, Any]) -> tuple[Modality, str | None]:
    text = _document_text(part)
    return (Modality.FILE, None) if text is None else (Modality.TEXT, text)


def normalize(part: Mapping[str, Any]) -> dict[str, Any] | None:
    """A plain-text document as a text block (its title first): vLLM's and SGLang's Messages APIs
    have no document block, and text is what it is. None: the block goes as sent."""
    if part.get("type") != "document" or (text := _document_text(part)) is None:
        return None
    title = part.get("title")
    return {"type": "text", "text": f"{title}\n\n{text}" if isinstance(title, str) and title else text}


TEXT = Modality.TEXT
PARTS = PartTable(
    {
        "text": (TEXT, str_field("text")),
        "image": (Modality.IMAGE, _source("base64", "url", "file")),
        "document": (Modality.FILE, _source("base64", "url", "file", "text", "content")),
        "tool_use": (TEXT, str_field("name")),
        "tool_result": (TEXT, _tool_result),  # its content: a place of its own in the view
        "tool_reference": (TEXT, _any),
        "thinking": (TEXT, str_field("thinking")),
        "redacted_thinking": (TEXT, str_field("data")),
        "search_result": (TEXT, _any),
        "server_tool_use": (TEXT, _any),
        "web_search_tool_result": (TEXT, _any),
        "web_fetch_tool_result": (TEXT, _any),
        "code_execution_tool_result": (TEXT, _any),
        "bash_code_execution_tool_result": (TEXT, _any),
        "text_editor_code_execution_tool_result": (TEXT, _any),
        "tool_search_tool_result": (TEXT, _any),
        "container_upload": (TEXT, _any),
        "mcp_tool_use": (TEXT, _any),
        "mcp_tool_result": (TEXT, _any),
    },
    {"text": "text", "thinking": "thinking"},
    strings=False,
    refine={"document": _document},
)


def contents(body: dict[str, Any], bounds: ContentBounds) -> list[Content]:
    """A Messages request's view: ``system``, then each message's ``content``, each followed by
    the ``content`` of its ``tool_result`` blocks."""
    view = []
    if body.get("system") is not None:
        view.append(Content(body, "system", "system"))
    for i, message in enumerate(messages_of(body, bounds)):
        view.append(Content(message, "content", f"messages[{i}].content"))
        content = message.get("content")
        if isinstance(content, list):
            view.extend(
                Content(block, "content", f"messages[{i}].content[{j}].content")
                for j, block in enumerate(content)
                if isinstance(block, dict) and block.get("type") == "tool_result" and block.get("content") is not None
            )
    return view


def newest(body: Mapping[str, Any]) -> frozenset[int]:
    """The messages after the last assistant one; not their tool_result blocks (an agent's tool
    results: Claude Code's Read of an image), whose contents are places of their own."""
    return frozenset(id(m) for m in after_last(body.get("messages"), assistants))


def image(media_type: str, data: str) -> dict[str, Any]:
    """An image block of base64 ``data``."""
    return {"type": "image", "source": {"type": "base64", "media_type": media_type, "data": data}}


# transcribes: an image described is a text block (Anthropic's API carries no audio)
MESSAGES = Api(
    "messages",
    "/v1/messages",
    PARTS,
    contents,
    operation="chat",
    affinity=chat_key,  # an Anthropic conversation opens as a chat one does
    errors="anthropic",
    stream_error=anthropic_stream_error,
    transcribes=True,
    leaves_notes=True,
    image_part=image,
    normalize=normalize,
    normalizes=frozenset({"document"}),
    newest=newest,
)

# the input tokens of a message, admitted as the message would be (interactive clients ask it
# first; its images described then are in the conversions cache when the message itself comes)
COUNT_TOKENS = dataclasses.replace(MESSAGES, path="/v1/messages/count_tokens", spends=False, operation="count_tokens")

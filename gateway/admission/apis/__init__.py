"""The APIs whose requests carry content parts, each as the one admission core sees it.

An :class:`Api` says where a request of that API keeps its content (its view: the
:class:`~gateway.admission.parts.Content` places, in order), which part types it has (its
:class:`~gateway.admission.parts.PartTable`), which of the table's actions it can carry, and how
its errors look to its clients. Classification, limits and actions are the same for all
(gateway.admission.plan); what differs is said here, one module an API:

======================  ===========  =================  =====================================
API                     ``apis:``    errors             actions on its parts
======================  ===========  =================  =====================================
/v1/chat/completions    chat         OpenAI             every one
/v1/responses           responses    OpenAI             reject, redirect, strip, transcribe, describe, extract
/v1/messages            messages     Anthropic          reject, redirect, strip, describe, extract
/v1/embeddings          embeddings   OpenAI             reject, redirect, strip
/v1/score, /score       score        OpenAI             reject, redirect, strip
/v1/rerank, ...         rerank       OpenAI             reject, redirect, strip
/v1/audio/...           transcr.     OpenAI             the model takes audio, or redirect
======================  ===========  =================  =====================================

An action an API cannot carry is never silently skipped: audio to transcribe and images to
describe (but on the Responses and Messages APIs, which take the text as their own text part)
and video to sample into frames are refused (400 ``unsupported_modality``, saying where they are served);
images of a model with ``encode:`` go to the engine as sent, which encodes them itself
(docs/routing.md).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from ...config.types import ContentBounds
from ..parts import CHAT_PARTS, Classification, Content, PartTable, audio_in_video, chat_contents, classify_contents

ErrorShape = Literal["openai", "anthropic"]


def chat_image(media_type: str, data: str) -> dict[str, Any]:
    """A chat image part of base64 ``data``."""
    return {"type": "image_url", "image_url": {"url": f"data:{media_type};base64,{data}"}}


@dataclass(frozen=True, slots=True)
class Api:
    """One API whose requests carry content parts."""

    name: str  # as routing.yaml's `apis:` names it
    path: str  # the gateway's route, and the engine's
    table: PartTable
    contents: Callable[[dict[str, Any], ContentBounds], list[Content]]  # the view of a body, checked
    converts: bool = False  # video sampled, images encoded: the chat API only
    transcribes: bool = False  # media served as text, audio's transcript or an image's description (its text part)
    # a stripped part leaves a note, a text part of its own (a generative API; a pooling one's would
    # change its vectors)
    leaves_notes: bool = False
    errors: ErrorShape = "openai"
    text_part: str = "text"  # the type of a text part, for a part the gateway writes
    image_part: Callable[[str, str], dict[str, Any]] = chat_image  # an image part it writes: (media type, base64)
    # a part in the shape the engines read, where clients may send another of the same meaning; None: as sent
    normalize: Callable[[Mapping[str, Any]], dict[str, Any] | None] | None = None
    normalizes: frozenset[str] = frozenset()  # the part types normalize may change (the others are not asked)
    # what a request costs its key and the gateway's counts: False for one that only asks what it
    # would cost (Anthropic's count_tokens): its visual tokens neither spent nor counted as admitted
    spends: bool = True
    # its places may be one engine's shape alone (Content.engine: vLLM's conversations, SGLang's
    # items): a place the model's engine does not read is a 400, never media it silently drops
    engine_shapes: bool = False
    # what the user attached in the conversation's newest turn: the ids of the holders of the places
    # after the model's last turn, but tool results (what an agent's tools read, not what the user
    # sent); None: an API without turns (pooling, transcriptions). {history: strip} refuses these
    # parts alone and strips the rest (gateway.admission.plan)
    newest: Callable[[Mapping[str, Any]], frozenset[int]] | None = None

    def classify(
        self, body: dict[str, Any], *, model: str, bounds: ContentBounds, contents: list[Content] | None = None
    ) -> Classification:
        """Every part of the body's view (``contents``, when the caller has built it), classified
        with the API's table (see gateway.admission.parts)."""
        if contents is None:
            contents = self.contents(body, bounds)
        with_audio = self.converts and audio_in_video(body)  # vLLM's flag, of a chat request
        found = classify_contents(contents, self.table, model=model, bounds=bounds, audio_in_video=with_audio)
        normalize = self.normalize
        if normalize is None:
            return found
        types = self.normalizes
        normalized = frozenset(
            (p.message, p.index)
            for p in found.parts
            if p.type in types and p.index is not None and normalize(contents[p.message].value[p.index]) is not None
        )
        return dataclasses.replace(found, normalized=normalized) if normalized else found


def after_last(items: Any, is_models: Callable[[Any], bool]) -> list[Any]:
    """The items after the last one ``is_models`` says is the model's own (all, when none is),
    before the model's own at the end, if any (a prefill: an assistant message the model is to go
    on from, Anthropic's or chat's ``continue_final_message``)."""
    if not isinstance(items, list):
        return []

    def models(item: Any) -> bool:
        return isinstance(item, dict) and is_models(item)

    end = len(items)
    while end and models(items[end - 1]):
        end -= 1
    last = next((i for i in range(end - 1, -1, -1) if models(items[i])), -1)
    return items[last + 1 : end]


def assistants(message: Mapping[str, Any]) -> bool:
    """A message of the model's own (chat's and Anthropic's)."""
    return message.get("role") == "assistant"


def chat_newest(body: Mapping[str, Any]) -> frozenset[int]:
    """The messages after the last assistant message, but tool messages (its calls' results)."""
    return frozenset(
        id(m) for m in after_last(body.get("messages"), assistants) if isinstance(m, dict) and m.get("role") != "tool"
    )


CHAT = Api(
    "chat",
    "/v1/chat/completions",
    CHAT_PARTS,
    chat_contents,
    converts=True,
    transcribes=True,
    leaves_notes=True,
    newest=chat_newest,
)

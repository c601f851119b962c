"""Every API the gateway serves, each one :class:`Api`: the one table of what differs between them.

An :class:`Api` says its routes (its path and the aliases the engines serve it under), the door
that takes its requests (``parts``: content parts admitted; ``text``: the text-only completions;
``upload``: a multipart audio upload), its name in routing.yaml (``apis:``; the ``api`` label of
the metrics), how its errors look to its clients and how a stream of it that breaks ends, its
trace operation, the request fields that keep a conversation on one replica (its affinity key),
whether its engine stores responses (the Responses API), and, for an API whose requests carry
content parts, where a request keeps its content (its view: the
:class:`~gateway.admission.parts.Content` places, in order), which part types it has (its
:class:`~gateway.admission.parts.PartTable`) and which of the table's actions it can carry.
Classification, limits and actions are the same for all (gateway.admission.plan); what differs is
said here, one module an API; gateway.admission.apis.catalog lists them all (the server's routes
are made from it):

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
from ...errors import StreamError, openai_stream_error
from ...modalities import Modality
from ..affinity import chat_key, prompt_key
from ..outputs import chat_outputs
from ..parts import CHAT_PARTS, Classification, Content, PartTable, audio_in_video, chat_contents, classify_contents

ErrorShape = Literal["openai", "anthropic"]
Door = Literal["parts", "text", "upload", "output", "realtime"]  # how its requests are taken (gateway.server.doors)
AffinityKey = Callable[[Mapping[str, Any]], bytes | None]  # gateway.admission.affinity


def no_affinity(body: Mapping[str, Any]) -> None:
    """A request with no conversation to keep on one replica (pooling, uploads)."""
    return None


def chat_image(media_type: str, data: str) -> dict[str, Any]:
    """A chat image part of base64 ``data``."""
    return {"type": "image_url", "image_url": {"url": f"data:{media_type};base64,{data}"}}


@dataclass(frozen=True, slots=True)
class Api:
    """One API whose requests carry content parts."""

    name: str  # as routing.yaml's `apis:` names it; the metrics' `api` label
    path: str  # the gateway's route, and the engine's
    table: PartTable
    contents: Callable[[dict[str, Any], ContentBounds], list[Content]]  # the view of a body, checked
    aliases: tuple[str, ...] = ()  # other routes of it (vLLM serves its pooling APIs outside /v1/ too)
    door: Door = "parts"
    method: str = "POST"  # its route's (GET: the realtime API's WebSocket upgrade)
    operation: str = ""  # the GenAI semantic conventions' gen_ai.operation.name ("": its name)
    affinity: AffinityKey = no_affinity  # what keeps a conversation on one replica (balance: affinity)
    stores: bool = False  # its engine keeps the responses it makes (previous_response_id names one)
    stream_error: StreamError = openai_stream_error  # how a stream of it broken after its first byte ends
    asks_usage: bool = False  # its streams say their usage only when asked (stream_options.include_usage)
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
    # the outputs a request asks for beside text, each with the param that asks (gateway.admission.outputs);
    # None: an API that answers in text alone
    outputs: Callable[[Mapping[str, Any]], list[tuple[Modality, str]]] | None = None
    makes: Modality | None = None  # its answer, for an API that answers in one output (images, speech)

    @property
    def paths(self) -> tuple[str, ...]:
        return (self.path, *self.aliases)

    @property
    def traced_as(self) -> str:
        return self.operation or self.name

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
    affinity=chat_key,
    asks_usage=True,
    converts=True,
    transcribes=True,
    leaves_notes=True,
    newest=chat_newest,
    outputs=chat_outputs,
)


def _no_view(body: dict[str, Any], bounds: ContentBounds) -> list[Content]:
    return []  # no content parts: its body passes through (completions), or is a form (uploads)


# an output of its own (door "output"): the model must produce it; the body passes through, renamed
IMAGES = Api(
    "images", "/v1/images/generations", CHAT_PARTS, _no_view, door="output", operation="image_generation",
    makes=Modality.IMAGE,
)  # fmt: skip
SPEECH = Api(
    "speech", "/v1/audio/speech", CHAT_PARTS, _no_view, door="output", operation="speech", makes=Modality.AUDIO
)
# a WebSocket session (GET, upgraded): admitted before the upgrade, each event checked as it passes
REALTIME = Api("realtime", "/v1/realtime", CHAT_PARTS, _no_view, door="realtime", method="GET", operation="realtime")

# text only: the model must exist; the body passes through, renamed for its upstream
COMPLETIONS = Api(
    "completions", "/v1/completions", CHAT_PARTS, _no_view, door="text", operation="text_completion",
    affinity=prompt_key, asks_usage=True,
)  # fmt: skip

"""The engines' dialects (routing.yaml ``models[].engine``): what each engine's own request models
and parsers take, API by API, as data.

Read from the engines' code, and held to it by the conformance suite (tests/conformance/,
``make conformance``; docs/engines.md has the table):

- **vllm** (vLLM 0.33): takes ``image_embeds`` (``--enable-mm-embeds``) and the Encode/Prefill/
  Decode priming of its EC connector. Its chat parser has no document part (``file``: "Unsupported
  chat content part type"); its Responses API has ``input_text``, ``input_image`` and
  ``input_file`` only, and its chat parser then refuses the file, so no audio, video or file
  there; its Anthropic request model has no ``document``; score and rerank take text, images and
  video (``ScoreContentPartParam``).
- **sglang** (SGLang 0.5.23): no embeddings parts, no priming; no request model has a document
  part; its score API is text only (``ScoringRequest``).
- **openai**: an OpenAI-compatible server that takes what OpenAI's API takes (files included), and
  no embeddings parts.

A modality a model accepts but its engine has no part for on an API is, on that API, one the
model does not take: its ``on_unsupported`` policy applies (reject, by default, saying why), and
``modality-gateway check`` refuses a table whose model accepts a modality that its engine takes
on none of the APIs it serves, or encodes images for an engine that takes no embeddings.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

from ..modalities import Modality

ENGINES = ("vllm", "sglang", "openai")
DEFAULT_ENGINE = "vllm"

_NONE: frozenset[Modality] = frozenset()
_FILE = frozenset({Modality.FILE})


@dataclass(frozen=True, slots=True)
class Dialect:
    """One engine's dialect: what it takes beyond the parts every engine reads."""

    name: str  # as routing.yaml's `engine:` names it
    title: str  # as messages name it
    embeds: bool  # takes image_embeds parts and EC priming (encode:)
    lacks: Mapping[str, frozenset[Modality]]  # per API: the modalities it has no part for
    # it reads its own pooling shapes alone (vLLM's conversations, SGLang's items): another's is a 400
    own_shapes: bool = True

    def lacking(self, api: str) -> frozenset[Modality]:
        """The modalities this engine has no part for on ``api``."""
        return self.lacks.get(api, _NONE)

    def why(self, api: str, modality: Modality) -> str:
        """Why a model on this engine does not take ``modality`` on ``api``, as errors say it."""
        return f"{self.title}'s {api} API has no {modality} part (engine: {self.name})"


DIALECTS: Mapping[str, Dialect] = MappingProxyType(
    {
        "vllm": Dialect(
            "vllm",
            "vLLM",
            embeds=True,
            lacks=MappingProxyType(
                {
                    "chat": _FILE,
                    "responses": frozenset({Modality.AUDIO, Modality.VIDEO, Modality.FILE}),
                    "messages": _FILE,
                    "embeddings": _FILE,
                    "score": frozenset({Modality.AUDIO, Modality.FILE}),
                    "rerank": frozenset({Modality.AUDIO, Modality.FILE}),
                }
            ),
        ),
        "sglang": Dialect(
            "sglang",
            "SGLang",
            embeds=False,
            lacks=MappingProxyType(
                {
                    "chat": _FILE,
                    "responses": _FILE,
                    "messages": _FILE,
                    "embeddings": frozenset({Modality.AUDIO, Modality.FILE}),
                    "score": frozenset({Modality.IMAGE, Modality.VIDEO, Modality.AUDIO, Modality.FILE}),
                    "rerank": frozenset({Modality.AUDIO, Modality.FILE}),
                }
            ),
        ),
        "openai": Dialect(
            "openai", "The OpenAI-compatible engine", embeds=False, lacks=MappingProxyType({}), own_shapes=False
        ),
    }
)

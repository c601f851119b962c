"""What vLLM 0.33.0's own code says of a request body or a reply: the vLLM side of the conformance suite.

Every check here defers to vLLM's code, imported from the installed ``vllm`` package (0.33.0), and
never re-implements it: the request is validated with vLLM's own pydantic request model, converted
to chat messages by vLLM's own conversion where the API has one (Anthropic Messages, Responses),
its messages parsed by vLLM's own chat parser with the media **really decoded** (images to PIL,
videos to frames, audio to waveforms, ``image_embeds`` to tensors), and the multimodal data then
parsed by the model's own vLLM data parser, as the renderer does before the HF processor runs
(``vllm/renderers/base.py: BaseRenderer._process_multimodal``). Anything vLLM's code raises on the
way comes back as :class:`Refused`, with the message, status and error type vLLM's server would
answer (``vllm/entrypoints/serve/exception_handling/error_response.py: create_error_response``).
What is not run: the chat template, tokenization and the HF processor itself (they need the
checkpoint's files), and whatever needs an engine (the processor cache behind a uuid-only item).

The model a request is checked against is an :class:`Engine`: Qwen2.5-Omni (image, video and audio;
the default), Qwen2.5-VL or Qwen2-VL, the models ``routing.yaml`` sends vLLM, or LLaVA-1.5 (image),
whose ``image_embeds`` the LLaVA tower makes. Its ``ModelConfig`` is
vLLM's own, built from a local directory written here (the ``transformers`` config class's
defaults with the 7B checkpoints' sizes, and a tiny local tokenizer, which vLLM's multimodal
processors require to exist): nothing is downloaded. One thing is not the checkpoint's: the HF
processor of Qwen2.5-Omni needs torchvision, which does not load with this torch, so its
processing info takes the Whisper feature extractor (all the data parser reads of it is the 16 kHz
sampling rate) from :func:`_whisper_feature_extractor` instead of from the checkpoint's processor.

Importing this module imports nothing of vLLM; the first check does (a few seconds). vLLM imports
a few packages this environment lacks (``torchvision`` for transformers' Qwen2-VL image processor,
``xgrammar`` and ``llguidance`` through ``vllm.v1``); empty stand-ins take their place while vLLM's
modules import, and only then (:func:`_stand_ins`). vLLM's log records of WARNING and above during
a check are kept in the result (``warnings``) instead of being printed. The checks are synchronous
and hold a lock: call them from one thread at a time (an async test may call them directly).
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import importlib
import importlib.machinery
import importlib.util
import io
import json
import logging
import os
import shutil
import sys
import tempfile
import threading
import types
import warnings
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, TypeVar

if TYPE_CHECKING:  # vLLM, FastAPI and starlette are not in the gateway's own venv: Any stands in there
    import numpy as np
    import torch
    from PIL.Image import Image
    from pydantic import BaseModel

__all__ = [
    "LLAVA_1_5",
    "OMNI",
    "QWEN2_5_VL",
    "QWEN2_VL",
    "Engine",
    "Found",
    "Heard",
    "Refused",
    "SetupError",
    "chat",
    "chat_chunk",
    "chat_response",
    "embeddings",
    "error_response",
    "image_embeds",
    "messages",
    "messages_count_tokens",
    "messages_error",
    "messages_event",
    "messages_response",
    "realtime",
    "realtime_event",
    "rerank",
    "responses",
    "responses_event",
    "responses_response",
    "score",
    "transcription",
    "translation",
]

_T = TypeVar("_T")
ModelName = Literal["qwen2.5-omni", "qwen2.5-vl", "qwen2-vl", "llava-1.5"]
Stage = Literal["request", "convert", "parse", "processor", "audio", "reply"]


# --- results -----------------------------------------------------------------------------------


class Refused(Exception):
    """vLLM's code refused what it was given.

    ``str(refused)`` is the message vLLM's server would answer with (``error.message``);
    ``status``, ``error_type`` and ``param`` are that answer's: for a body the request model
    refuses, what vLLM's ``validation_exception_handler`` makes of FastAPI's
    ``RequestValidationError`` (400, ``param`` such as ``body.messages``); otherwise
    ``create_error_response``'s: 400 for vLLM's validation errors and any ``ValueError`` or
    ``TypeError``, 500 for a crash inside vLLM's code (an ``AttributeError``, say), which is a
    refusal all the same. ``warnings`` are vLLM's log records of the check.
    ``stage`` says which check refused: ``request`` (the pydantic request model), ``convert`` (an
    API's conversion to chat messages), ``parse`` (the chat parser and its media decoding),
    ``processor`` (the model's data parser), ``audio`` (the transcription's audio decoding) or
    ``reply`` (a response model). ``cause`` is vLLM's exception itself.
    """

    def __init__(
        self,
        message: str,
        *,
        stage: Stage,
        status: int = 400,
        error_type: str = "BadRequestError",
        param: str | None = None,
        cause: BaseException | None = None,
        warnings: tuple[str, ...] = (),
    ) -> None:
        super().__init__(message)
        self.message = message
        self.stage = stage
        self.status = status
        self.error_type = error_type
        self.param = param
        self.cause = cause
        self.warnings = warnings

    def __repr__(self) -> str:
        return f"Refused({self.message!r}, stage={self.stage!r}, status={self.status})"


class SetupError(RuntimeError):
    """This module could not import vLLM or build an :class:`Engine`'s model config: a fault of
    the environment, never a verdict on a body."""


@dataclass(frozen=True)
class Found:
    """What vLLM's code found in an accepted request.

    ``counts`` are per modality (``image``, ``video``, ``audio``) as the model's vLLM data parser
    counts the items (``MultiModalDataItems.get_all_counts``): ``image_embeds`` parts count as
    images, one per part in Qwen's dict form (vLLM merges a request's parts into one batch and
    splits it again by the grids), uuid-only parts (media ``null`` and a ``uuid``) count too. ``embeds`` is how many of
    those came as ``*_embeds``, ``uuid_only`` how many carried no media.

    The decoded media, in vLLM's order (per modality, in the order of the parts): ``images`` as
    PIL images, ``videos`` as ``(frames, metadata)`` (frames an ``(n, h, w, 3)`` uint8 array),
    ``audios`` as ``(waveform, sample_rate)`` as the media connector decoded them; ``None`` for a
    uuid-only item. ``embeddings`` holds, per modality, each embedding item as the data parser
    split it (for Qwen's dict form a mapping such as ``{"image_embeds": (tokens, hidden),
    "image_grid_thw": (3,)}``). ``messages`` are the chat messages given to the parser (after an
    API's conversion), ``conversation`` what the parser made of them, ``request`` vLLM's validated
    request model, ``warnings`` vLLM's log records of WARNING and above during the check.

    Several prompts in one request (an embeddings batch, score pairs) add up: counts are summed,
    media follow one another. Not hashable (its fields are dicts).
    """

    counts: dict[str, int]
    embeds: dict[str, int] = field(default_factory=dict)
    uuid_only: int = 0
    images: tuple[Image | None, ...] = ()
    videos: tuple[tuple[np.ndarray, dict[str, Any]] | None, ...] = ()
    audios: tuple[tuple[np.ndarray, float] | None, ...] = ()
    embeddings: dict[str, tuple[Any, ...]] = field(default_factory=dict)
    uuids: dict[str, tuple[str | None, ...]] = field(default_factory=dict)
    messages: tuple[Mapping[str, Any], ...] = ()
    conversation: tuple[Mapping[str, Any], ...] = ()
    request: Any = None
    warnings: tuple[str, ...] = ()

    def count(self, modality: str) -> int:
        """The items of ``modality`` vLLM found (0 if none)."""
        return self.counts.get(modality, 0)

    @property
    def total(self) -> int:
        """Every multimodal item vLLM found."""
        return sum(self.counts.values())


@dataclass(frozen=True)
class Heard:
    """What vLLM's code made of an accepted transcription request: the validated request, and
    the uploaded file decoded as the speech-to-text server decodes it (mono, resampled to
    ``sample_rate``)."""

    request: Any
    samples: np.ndarray
    sample_rate: float
    duration_s: float
    warnings: tuple[str, ...] = ()


@dataclass(frozen=True)
class Engine:
    """The vLLM deployment a body is checked against (what its ``vllm serve`` flags would say).

    ``model``: ``qwen2.5-omni`` (image, video, audio), ``qwen2.5-vl`` or ``qwen2-vl`` (image,
    video), ``llava-1.5`` (image: LLaVA-1.5-7B's config, a CLIP ViT-L/14-336 and a 4096-wide
    language model). ``limits``: ``--limit-mm-per-prompt`` as ``(("image", 8), ("video", 2))`` (vLLM's
    default is 999 each). ``hidden_size``: the LLM's hidden size, which an embedding's last
    dimension must equal (default: the 7B checkpoint's, 3584 for Qwen, 4096 for LLaVA). ``enable_mm_embeds``:
    ``--enable-mm-embeds``. ``ec_consumer``: the instance is an EC-connector consumer
    (``--ec-transfer-config`` with ``ec_role: ec_consumer``), where vLLM derives
    ``allow_missing_mm_embeddings`` and takes metadata-only embedding parts.
    ``trust_request_mm_kwargs`` / ``trust_request_chat_template``: the ``--trust-request-*`` flags
    (off by default, so a request's ``media_io_kwargs``, ``mm_processor_kwargs`` or
    ``chat_template`` is refused). ``content_format``: the chat template's content format as
    vLLM detects it (``openai`` for the Qwen templates).
    """

    model: ModelName = "qwen2.5-omni"
    limits: tuple[tuple[str, int], ...] | Mapping[str, int] = ()
    hidden_size: int | None = None
    enable_mm_embeds: bool = True
    ec_consumer: bool = False
    trust_request_mm_kwargs: bool = False
    trust_request_chat_template: bool = False
    content_format: Literal["openai", "string"] = "openai"

    def __post_init__(self) -> None:
        if isinstance(self.limits, Mapping):  # hashable, so that an Engine keys a cache
            object.__setattr__(self, "limits", tuple(sorted(self.limits.items())))


OMNI = Engine()
QWEN2_5_VL = Engine(model="qwen2.5-vl")
QWEN2_VL = Engine(model="qwen2-vl")
LLAVA_1_5 = Engine(model="llava-1.5")


# --- requests ----------------------------------------------------------------------------------


def chat(body: Mapping[str, Any], engine: Engine = OMNI) -> Found:
    """A ``/v1/chat/completions`` body, as vLLM's chat server takes it.

    Validated with ``vllm.entrypoints.openai.chat_completion.protocol.ChatCompletionRequest``
    (``model_validate``); its request-level multimodal kwargs and chat template checked as the
    online renderer checks them (``vllm.entrypoints.generate.base.protocol
    .validate_request_mm_kwargs``, ``vllm.renderers.online_renderer.OnlineRenderer
    .validate_chat_template``); its messages parsed by
    ``vllm.renderers.chat_utils.chat_message.parse_chat_messages`` (content parts, media fetched
    and decoded by vLLM's media connector, per-prompt limits, embedding merging); the resulting
    multimodal data parsed by the model's ``BaseProcessingInfo.parse_mm_data`` and its uuids
    checked by ``vllm.renderers.base.BaseRenderer._validate_mm_uuids``.
    """
    with _checking() as log:
        request = _validated("ChatCompletionRequest", body)
        _request_kwargs(request, engine)
        found = _parse([request.messages], engine, request, log)
    return found


def responses(body: Mapping[str, Any], engine: Engine = OMNI) -> Found:
    """A ``/v1/responses`` body, as vLLM's Responses server takes it (not gpt-oss's Harmony path).

    Validated with ``vllm.entrypoints.openai.responses.protocol.ResponsesRequest``; converted to
    chat messages with ``vllm.entrypoints.openai.responses.utils.construct_input_messages``
    (``instructions`` and ``input``; a ``previous_response_id`` cannot be resolved here and is
    left out), which is what ``OnlineRenderer.render_responses`` does; then parsed as in
    :func:`chat`. A message's content parts are the OpenAI SDK's ``input_text``, ``input_image``
    and ``input_file`` (``ResponseInputContentParam``): there is no audio part in a Responses
    message, so an ``input_audio`` part is refused by the request model, as are the chat API's
    ``image_url``, ``video_url`` and ``image_embeds``; an ``input_file`` passes the request model
    and is refused by the chat parser ("Unsupported chat content part type: 'input_file'").
    """
    with _checking() as log:
        request = _validated("ResponsesRequest", body)
        _request_kwargs(request, engine)
        utils = _vllm("vllm.entrypoints.openai.responses.utils")
        with _stage("convert"):
            chat_messages = utils.construct_input_messages(
                request_instructions=request.instructions,
                request_input=request.input,
            )
        found = _parse([chat_messages], engine, request, log)
    return found


def messages(body: Mapping[str, Any], engine: Engine = OMNI) -> Found:
    """A ``/v1/messages`` (Anthropic Messages) body, as vLLM's Anthropic server takes it.

    Validated with ``vllm.entrypoints.anthropic.protocol.AnthropicMessagesRequest``; converted
    with vLLM's own ``AnthropicServingMessages.to_chat_completion_request`` (a classmethod of
    ``vllm.entrypoints.anthropic.serving``; ``merge_inline_system=False``,
    ``disabled_thinking_effort="none"``, the server's choices for a template that takes inline
    system messages), which yields a ``ChatCompletionRequest``; its messages then parsed as in
    :func:`chat`, so an ``image`` block's base64 or URL source is decoded as vLLM decodes it
    (and a ``tool_result``'s images, which the conversion moves to a user message of their own).
    The request model knows no ``document`` block: a PDF is refused there.
    """
    return _anthropic("AnthropicMessagesRequest", body, engine)


def messages_count_tokens(body: Mapping[str, Any], engine: Engine = OMNI) -> Found:
    """A ``/v1/messages/count_tokens`` body: validated with
    ``vllm.entrypoints.anthropic.protocol.AnthropicCountTokensRequest`` (no ``max_tokens``), then
    converted and parsed as :func:`messages` (``AnthropicServingMessages.count_tokens`` renders it
    as the chat request it converts to)."""
    return _anthropic("AnthropicCountTokensRequest", body, engine)


def _anthropic(model: str, body: Mapping[str, Any], engine: Engine) -> Found:
    """An Anthropic body validated with ``model``, converted to chat by vLLM's own conversion, parsed."""
    with _checking() as log:
        request = _validated(model, body)
        serving = _vllm("vllm.entrypoints.anthropic.serving")
        with _stage("convert"):
            chat_request = serving.AnthropicServingMessages.to_chat_completion_request(
                request, merge_inline_system=False, disabled_thinking_effort="none"
            )
        _request_kwargs(chat_request, engine)
        found = _parse([chat_request.messages], engine, request, log)
    return found


def embeddings(body: Mapping[str, Any], engine: Engine = OMNI) -> Found:
    """A ``/v1/embeddings`` body, as vLLM's embedding server takes it.

    Validated with ``vllm.entrypoints.pooling.embed.protocol.EmbeddingRequest``, the union the
    route declares: ``EmbeddingCompletionRequest`` (text or token ``input``),
    ``EmbeddingChatRequest`` (one conversation in ``messages``), ``EmbeddingBatchChatRequest``
    (several in ``messages``), ``EmbeddingChatInputRequest`` and ``EmbeddingBatchChatInputRequest``
    (the same in ``input``). Each conversation is then parsed as in :func:`chat` (the embed IO
    processor renders each one on its own); a text request finds no media.
    """
    with _checking() as log:
        request = _validated("EmbeddingRequest", body)
        _request_kwargs(request, engine)
        protocol = _vllm("vllm.entrypoints.pooling.embed.protocol")
        batched = (protocol.EmbeddingBatchChatRequest, protocol.EmbeddingBatchChatInputRequest)
        if isinstance(request, batched):
            conversations = list(request.messages)
        elif isinstance(request, protocol.EmbeddingChatRequest):
            conversations = [request.messages]
        else:
            conversations = []
        found = _parse(conversations, engine, request, log)
    return found


def score(body: Mapping[str, Any], engine: Engine = OMNI) -> Found:
    """A ``/v1/score`` (or ``/score``) body, as vLLM's scoring server takes it.

    Validated with ``vllm.entrypoints.pooling.scoring.protocol.ScoreRequest``, the union of
    ``ScoreQueriesDocumentsRequest`` (``queries``/``documents``), ``ScoreQueriesItemsRequest``
    (``queries``/``items``), ``ScoreDataRequest`` (``data_1``/``data_2``) and ``ScoreTextRequest``
    (``text_1``/``text_2``). Then, from ``vllm.entrypoints.pooling.scoring.utils``:
    ``validate_score_input`` (1:1, 1:N or N:N), ``parse_score_data_single`` on every side's item
    (the media found, as a late-interaction model encodes each alone) and ``parse_score_data`` on
    every pair (what a cross-encoder renders as one prompt); each prompt's multimodal data parsed
    by the model's data parser.
    """
    with _checking() as log:
        request = _validated("ScoreRequest", body)
        _request_kwargs(request, engine)
        found = _score(request.data_1, request.data_2, engine, request, log)
    return found


def rerank(body: Mapping[str, Any], engine: Engine = OMNI) -> Found:
    """A ``/v1/rerank`` (``/rerank``, ``/v2/rerank``) body: validated with
    ``vllm.entrypoints.pooling.scoring.protocol.RerankRequest`` (``query`` and ``documents``),
    then checked as :func:`score` checks its two sides."""
    with _checking() as log:
        request = _validated("RerankRequest", body)
        _request_kwargs(request, engine)
        found = _score(request.query, request.documents, engine, request, log)
    return found


def transcription(fields: Mapping[str, Any], engine: Engine | None = None) -> Heard:
    """A ``/v1/audio/transcriptions`` multipart form, as vLLM's transcription server takes it.

    ``fields`` are the form's fields: ``file`` as the file's bytes, a ``(filename, bytes)`` or
    ``(filename, bytes, content_type)`` tuple, or a starlette ``UploadFile``; the others as the
    form carries them (strings; a list for ``timestamp_granularities[]``). Validated with
    ``vllm.entrypoints.speech_to_text.transcription.protocol.TranscriptionRequest``; the file read
    with ``vllm.entrypoints.speech_to_text.base.utils.read_upload_with_limit``
    (``VLLM_MAX_AUDIO_CLIP_FILESIZE_MB``); ``language`` checked by Whisper's ``validate_language``
    (``vllm.model_executor.models.whisper``), as ``_preprocess_speech_to_text`` does; the audio
    decoded with ``vllm.multimodal.media.audio.load_audio`` as ``_decode_and_chunk_speech`` calls
    it (16 kHz mono, Whisper's rate, within ``VLLM_MAX_AUDIO_DECODE_*``). ``engine`` is accepted
    for a uniform call and not used: the model is Whisper.
    """
    return _speech("TranscriptionRequest", fields)


# a realtime session's client events, by type: vLLM's model of each (RealtimeConnection.handle_event)
REALTIME_CLIENT = {
    "session.update": "SessionUpdate",
    "input_audio_buffer.append": "InputAudioBufferAppend",
    "input_audio_buffer.commit": "InputAudioBufferCommit",
}
REALTIME_SERVER = {
    "session.created": "SessionCreated",
    "transcription.delta": "TranscriptionDelta",
    "transcription.done": "TranscriptionDone",
    "error": "ErrorEvent",
}
_REALTIME = "vllm.entrypoints.speech_to_text.realtime.protocol"


def realtime(event: Any, engine: Engine | None = None) -> Found:
    """A realtime session's client event (one WebSocket text frame, parsed), as vLLM's
    ``RealtimeConnection.handle_event`` (``vllm/entrypoints/speech_to_text/realtime/connection.py``)
    takes it: its type one of the three vLLM reads, validated with vLLM's model of it
    (``.../realtime/protocol.py``); a ``session.update`` naming its model; an append's audio
    base64 of PCM16 samples, not empty. What vLLM answers with an ``error`` event is
    :class:`Refused` with its message. ``engine`` is accepted for a uniform call and not used."""
    import base64
    import binascii

    kind = event.get("type") if isinstance(event, dict) else None
    name = REALTIME_CLIENT.get(kind) if isinstance(kind, str) else None
    if name is None:
        raise Refused(f"Unknown event type: {kind}", stage="request")
    if kind == "session.update" and event.get("model") is None:
        raise Refused("Missing required field: model", stage="request")
    with _checking(), _stage("request"):
        validated = getattr(_vllm(_REALTIME), name).model_validate(event)
    if kind == "input_audio_buffer.append":
        try:
            audio = base64.b64decode(validated.audio)
        except (binascii.Error, ValueError):
            raise Refused("Invalid audio data", stage="audio") from None
        if not audio or len(audio) % 2:
            raise Refused("Invalid audio data", stage="audio")
    return Found({"audio": 1} if kind == "input_audio_buffer.append" else {}, request=validated)


def realtime_event(obj: Mapping[str, Any]) -> BaseModel:
    """An event the engine sends a realtime client, as vLLM's model of its type."""
    name = REALTIME_SERVER.get(str(obj.get("type")))
    if name is None:
        raise Refused(f"vLLM sends no realtime event of type {obj.get('type')!r}", stage="reply")
    return _reply(_REALTIME, name, obj)


def translation(fields: Mapping[str, Any], engine: Engine | None = None) -> Heard:
    """A ``/v1/audio/translations`` multipart form: as :func:`transcription`, validated with
    ``vllm.entrypoints.speech_to_text.translation.protocol.TranslationRequest`` (whose
    ``to_language`` Whisper's ``validate_language`` checks too)."""
    return _speech("TranslationRequest", fields)


def image_embeds(
    value: str | Mapping[str, Any],
    *more: str | Mapping[str, Any],
    engine: Engine = QWEN2_VL,
) -> tuple[Mapping[str, torch.Tensor] | torch.Tensor, ...]:
    """``image_embeds`` values (each as it appears in one chat part: base64 of ``torch.save``, or
    the dict of them with ``image_grid_thw``) through the model's vLLM embedding path; one item per
    value, as the model will get them.

    For LLaVA (``engine`` ``llava-1.5``): the values go through vLLM's default data parser, which
    holds each tensor's last dimension to the language model's hidden size
    (``MultiModalDataParser(expected_hidden_size=...)``), and the items, stacked as the
    ``batched("image")`` field makes them, through the model's own input schema
    (``vllm.model_executor.models.llava.LlavaImageEmbeddingInputs``: ``(images, feature size,
    hidden)``); each item's rows are its placeholder tokens
    (``BaseLlavaMultiModalProcessor._get_prompt_updates``: ``get_feature_size``).

    For the Qwen2-VL family (the rest of this docstring):

    Each value is decoded as the chat parser decodes it
    (``vllm.renderers.chat_utils.content_parser.MultiModalContentParser.parse_image_embeds``, the
    connector's ``fetch_image_embedding``); the values are combined as one request's parts are
    (``vllm.renderers.chat_utils.item_tracker._merge_embeds``: stacked or concatenated per key,
    then re-reduced with the fields the processor declares, so the grids become one ``(n, 3)``
    tensor and the embeddings one ``(sum of tokens, hidden)`` tensor); the result parsed by
    ``vllm.model_executor.models.qwen2_vl.Qwen2VLMultiModalDataParser``, i.e. a
    ``vllm.multimodal.parse.DictEmbeddingItems`` with
    ``_create_qwen2vl_field_factory(spatial_merge_size)``: ``image_embeds`` flat from the sizes
    ``grid.prod(-1) // merge**2``, ``image_grid_thw`` batched, which makes the
    ``MultiModalKwargsItems`` and splits them back into one item per image. A grid of shape
    ``(1, 3)`` is refused there ("size_per_item should be a 1-D tensor"; the tracker first logs
    the same error and falls back, see ``Refused.warnings``); ``(3,)`` is one image's.

    What vLLM does not check here, and so neither does this: that the tokens equal
    ``t*h*w / merge**2`` (more are cut off by the flat slice, fewer pass as they are),
    and the dict form's hidden size (only a bare tensor's is checked against ``engine``'s). A bare
    tensor has no grid: Qwen2-VL's field config makes each of its rows an item.
    """
    with _checking():
        engine_ = engine if engine.enable_mm_embeds else _replace(engine, enable_mm_embeds=True)
        model_config = _model_config(engine_)
        chat_utils = _vllm("vllm.renderers.chat_utils")
        with _stage("parse"):
            tracker = chat_utils.MultiModalItemTracker(model_config)
            parser = tracker.create_parser()
            for item in (value, *more):
                parser.parse_image_embeds(item)
            mm_data, _ = tracker.resolve_items()
        info = _processor(engine_).info
        with _stage("processor"):
            # the model's own data parser: Qwen2VLMultiModalDataParser for the Qwen2-VL family,
            # vLLM's default (hidden size checked) for LLaVA
            items = info.get_data_parser().parse_mm_data({"image": mm_data["image"]})["image"]
            split = tuple(items.get(i) for i in range(items.get_count()))
            if engine.model == "llava-1.5":
                llava = _vllm("vllm.model_executor.models.llava")
                # the model's embed_multimodal: its schema of the stacked items
                llava.LlavaImageEmbeddingInputs(type="image_embeds", data=_stacked(split))
    return split


def _stacked(tensors: Sequence[Any]) -> Any:
    """The items as vLLM's ``batched`` field stacks them (the same shape each, else a list)."""
    import torch

    if len({tuple(t.shape) for t in tensors}) == 1:
        return torch.stack(list(tensors))
    return list(tensors)


# --- replies -----------------------------------------------------------------------------------


def chat_response(obj: Mapping[str, Any]) -> BaseModel:
    """A chat completion: ``vllm.entrypoints.openai.chat_completion.protocol
    .ChatCompletionResponse`` (its vLLM fields: ``kv_transfer_params`` and ``ec_transfer_params``,
    each ``dict[str, Any] | None``)."""
    return _reply("vllm.entrypoints.openai.chat_completion.protocol", "ChatCompletionResponse", obj)


def chat_chunk(obj: Mapping[str, Any]) -> BaseModel:
    """One streamed chat chunk: ``vllm.entrypoints.openai.chat_completion.protocol
    .ChatCompletionStreamResponse`` (``kv_transfer_params`` on the last; no ``ec_transfer_params``)."""
    return _reply("vllm.entrypoints.openai.chat_completion.protocol", "ChatCompletionStreamResponse", obj)


def responses_response(obj: Mapping[str, Any]) -> BaseModel:
    """A Responses object: ``vllm.entrypoints.openai.responses.protocol.ResponsesResponse``."""
    return _reply("vllm.entrypoints.openai.responses.protocol", "ResponsesResponse", obj)


def responses_event(obj: Mapping[str, Any]) -> BaseModel:
    """One Responses stream event, by its ``type``, with the class vLLM emits for it: the members
    of ``vllm.entrypoints.openai.responses.protocol.StreamingResponsesResponse`` (vLLM's own
    created / in_progress / completed / incomplete events, whose ``response`` is vLLM's
    ``ResponsesResponse``) and the OpenAI SDK event classes ``vllm.entrypoints.openai.responses
    .streaming_events`` emits besides (``response.output_text.delta``, ``...done``,
    function-call arguments, which the union leaves out). An unknown ``type`` is refused."""
    with _checking():
        classes = _responses_event_classes()
        kind = obj.get("type") if isinstance(obj, Mapping) else None
        if kind not in classes:
            raise Refused(
                f"no Responses stream event of type {kind!r} in vLLM (known: {', '.join(sorted(classes))})",
                stage="reply",
            )
        with _stage("reply"):
            event: BaseModel = classes[kind].model_validate(obj)
    return event


def messages_response(obj: Mapping[str, Any]) -> BaseModel:
    """An Anthropic Messages reply: ``vllm.entrypoints.anthropic.protocol.AnthropicMessagesResponse``."""
    return _reply("vllm.entrypoints.anthropic.protocol", "AnthropicMessagesResponse", obj)


def messages_event(obj: Mapping[str, Any]) -> BaseModel:
    """One Anthropic stream event: ``vllm.entrypoints.anthropic.protocol.AnthropicStreamEvent``."""
    return _reply("vllm.entrypoints.anthropic.protocol", "AnthropicStreamEvent", obj)


def error_response(obj: Mapping[str, Any]) -> BaseModel:
    """An OpenAI-API error body as vLLM writes it: ``vllm.entrypoints.serve.engine.protocol
    .ErrorResponse`` (``{"error": {"message", "type", "param", "code"}}``, ``code`` the HTTP status
    as an integer)."""
    return _reply("vllm.entrypoints.serve.engine.protocol", "ErrorResponse", obj)


def messages_error(obj: Mapping[str, Any]) -> BaseModel:
    """An Anthropic-API error body as vLLM writes it:
    ``vllm.entrypoints.anthropic.protocol.AnthropicErrorResponse``."""
    return _reply("vllm.entrypoints.anthropic.protocol", "AnthropicErrorResponse", obj)


# --- checking: vLLM's exceptions as Refused, vLLM's log records kept -----------------------------

_LOCK = threading.RLock()


# What vLLM says of this environment (a CPU-only install), not of any body: not kept.
_ENVIRONMENT_NOTES = ("Failed to import from vllm._C", "torchcodec unavailable")


class _Log(logging.Handler):
    """Keeps vLLM's log records of WARNING and above during one check, and the Python warnings
    raised meanwhile (but deprecations: the libraries' hygiene, not the body's)."""

    def __init__(self, caught: list[warnings.WarningMessage]) -> None:
        super().__init__(logging.WARNING)
        self.kept: list[str] = []
        self.caught = caught  # filled by warnings.catch_warnings(record=True) as they come

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if message.startswith(_ENVIRONMENT_NOTES):
            return
        if record.exc_info and record.exc_info[1] is not None:
            message += f" [{type(record.exc_info[1]).__name__}: {record.exc_info[1]}]"
        self.kept.append(f"{record.levelname} {record.name}: {message}")

    def records(self) -> tuple[str, ...]:
        hygiene = (DeprecationWarning, PendingDeprecationWarning, FutureWarning)
        python = [f"{w.category.__name__}: {w.message}" for w in self.caught if not issubclass(w.category, hygiene)]
        return (*self.kept, *python)


@contextlib.contextmanager
def _checking() -> Iterator[_Log]:
    """One check: under the lock, vLLM's records kept instead of printed, and anything raised that
    is not already a :class:`Refused` made one (stage ``request`` unless :func:`_stage` says)."""
    with _LOCK, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _vllm("vllm.logger")  # vLLM configures its logger when this imports: kept from here on
        vllm_logger = logging.getLogger("vllm")
        log = _Log(caught)
        saved = vllm_logger.handlers[:], vllm_logger.level, vllm_logger.propagate
        vllm_logger.handlers[:] = [log]
        vllm_logger.setLevel(logging.WARNING)
        vllm_logger.propagate = False
        try:
            yield log
        except Refused as refused:
            refused.warnings = log.records()
            raise
        except SetupError:
            raise
        except Exception as exc:
            raise _refusal(exc, "request", log.records()) from exc
        finally:
            vllm_logger.handlers[:], level, vllm_logger.propagate = saved
            vllm_logger.setLevel(level)


@contextlib.contextmanager
def _stage(stage: Stage) -> Iterator[None]:
    """Anything vLLM's code raises inside is a :class:`Refused` of ``stage``."""
    try:
        yield
    except Refused:
        raise
    except Exception as exc:
        raise _refusal(exc, stage, ()) from exc


def _refusal(exc: Exception, stage: Stage, kept: tuple[str, ...]) -> Refused:
    """``exc`` answered as vLLM's server answers it: a request model's ``ValidationError`` as
    FastAPI's ``RequestValidationError`` through vLLM's ``validation_exception_handler``, an
    ``HTTPException`` (raised by ``TranscriptionRequest``'s validator) with its own status, any
    other exception through ``create_error_response``."""
    status, error_type, param = 400, "BadRequestError", None
    message = str(exc)
    from pydantic import ValidationError

    if isinstance(exc, _module("fastapi").HTTPException):
        return Refused(str(exc.detail), stage=stage, status=exc.status_code, cause=exc, warnings=kept)
    if isinstance(exc, ValidationError) and stage == "request":
        with contextlib.suppress(Exception):
            answer = _validation_answer(exc)
            return Refused(
                answer["message"],
                stage=stage,
                status=answer["code"],
                error_type=answer["type"],
                param=answer.get("param"),
                cause=exc,
                warnings=kept,
            )
    with contextlib.suppress(Exception):
        create = _vllm("vllm.entrypoints.serve.exception_handling.error_response").create_error_response
        answer = create(exc).error
        message, status, error_type, param = answer.message, answer.code, answer.type, answer.param
    return Refused(message, stage=stage, status=status, error_type=error_type, param=param, cause=exc, warnings=kept)


def _validation_answer(exc: Any) -> dict[str, Any]:
    """vLLM's error body for a request body its route's model refused: FastAPI raises
    ``RequestValidationError`` with the errors' locations under ``body``, which
    ``vllm.entrypoints.serve.exception_handling.handlers.validation.validation_exception_handler``
    answers (400, the first errors summarized, ``param`` the first error's location)."""
    request_validation_error = _module("fastapi.exceptions").RequestValidationError
    handlers = _vllm("vllm.entrypoints.serve.exception_handling.handlers.validation")
    errors = [{**error, "loc": ("body", *error["loc"])} for error in exc.errors(include_url=False)]
    # the handler reads of its request only whether to log the stack
    request = types.SimpleNamespace(
        app=types.SimpleNamespace(state=types.SimpleNamespace(args=types.SimpleNamespace(log_error_stack=False))),
        state=types.SimpleNamespace(),
    )
    response = _run_coroutine(handlers.validation_exception_handler(request, request_validation_error(errors)))
    return dict(json.loads(response.body)["error"])


# --- request models, kwargs, parsing ------------------------------------------------------------

_REQUEST_MODELS: dict[str, tuple[str, bool]] = {  # name: (module, is a TypeAdapter union)
    "ChatCompletionRequest": ("vllm.entrypoints.openai.chat_completion.protocol", False),
    "ResponsesRequest": ("vllm.entrypoints.openai.responses.protocol", False),
    "AnthropicMessagesRequest": ("vllm.entrypoints.anthropic.protocol", False),
    "EmbeddingRequest": ("vllm.entrypoints.pooling.embed.protocol", True),
    "ScoreRequest": ("vllm.entrypoints.pooling.scoring.protocol", True),
    "RerankRequest": ("vllm.entrypoints.pooling.scoring.protocol", False),
    "AnthropicCountTokensRequest": ("vllm.entrypoints.anthropic.protocol", False),
    "TranscriptionRequest": ("vllm.entrypoints.speech_to_text.transcription.protocol", False),
    "TranslationRequest": ("vllm.entrypoints.speech_to_text.translation.protocol", False),
}


def _validated(name: str, body: Mapping[str, Any]) -> Any:
    """``body`` validated with vLLM's request model ``name`` (a copy: vLLM's validators may write)."""
    module, union = _REQUEST_MODELS[name]
    model = getattr(_vllm(module), name)
    data = dict(body) if isinstance(body, Mapping) else body
    with _stage("request"):
        if union:
            return _type_adapter(model).validate_python(data)
        return model.model_validate(data)


@functools.cache
def _type_adapter(model: Any) -> Any:
    from pydantic import TypeAdapter

    return TypeAdapter(model)


def _request_kwargs(request: Any, engine: Engine) -> None:
    """The request-level checks every route makes before rendering (``OnlineRenderer
    .preprocess_chat`` and ``render_responses``, ``PoolingServing._init_ctx`` and the pooling IO
    processors' ``_validate_chat_template``): no per-request multimodal kwargs and no chat
    template from the request, unless the engine trusts them."""
    protocol = _vllm("vllm.entrypoints.generate.base.protocol")
    online = _vllm("vllm.renderers.online_renderer")
    create = _vllm("vllm.entrypoints.serve.exception_handling.error_response").create_error_response
    with _stage("request"):
        protocol.validate_request_mm_kwargs(
            mm_processor_kwargs=getattr(request, "mm_processor_kwargs", None),
            media_io_kwargs=getattr(request, "media_io_kwargs", None),
            trust_request_mm_kwargs=engine.trust_request_mm_kwargs,
        )
        # validate_chat_template uses nothing of its renderer but create_error_response
        error = online.OnlineRenderer.validate_chat_template(
            types.SimpleNamespace(create_error_response=create),
            request_chat_template=getattr(request, "chat_template", None),
            chat_template_kwargs=getattr(request, "chat_template_kwargs", None),
            trust_request_chat_template=engine.trust_request_chat_template,
        )
    if error is not None:
        raise Refused(error.error.message, stage="request", status=error.error.code, error_type=error.error.type)


def _parse(conversations: Sequence[Sequence[Any]], engine: Engine, request: Any, log: _Log) -> Found:
    """Each conversation through ``parse_chat_messages`` and the model's data parser, added up."""
    chat_message = _vllm("vllm.renderers.chat_utils.chat_message")
    model_config = _model_config(engine) if conversations else None
    media_io_kwargs = getattr(request, "media_io_kwargs", None)
    mm_processor_kwargs = getattr(request, "mm_processor_kwargs", None)
    parts: list[Found] = []
    for conversation in conversations:
        chat_messages = list(conversation)
        with _stage("parse"):
            parsed, mm_data, mm_uuids = chat_message.parse_chat_messages(
                chat_messages,
                model_config,
                engine.content_format,
                media_io_kwargs=media_io_kwargs,
                mm_processor_kwargs=mm_processor_kwargs,
            )
        found = _found(mm_data, mm_uuids, engine)
        parts.append(_replace(found, messages=tuple(chat_messages), conversation=tuple(parsed)))
    return _replace(_added(parts), request=request, warnings=log.records())


def _speech(model: str, fields: Mapping[str, Any]) -> Heard:
    with _checking() as log:
        form = dict(fields)
        form["file"] = _upload(form.get("file"))
        request = _validated(model, form)
        utils = _vllm("vllm.entrypoints.speech_to_text.base.utils")
        whisper = _vllm("vllm.model_executor.models.whisper").WhisperForConditionalGeneration
        audio = _vllm("vllm.multimodal.media.audio")
        envs = _vllm("vllm.envs")
        with _stage("audio"):
            data = _run_coroutine(utils.read_upload_with_limit(request.file))
            request.language = whisper.validate_language(request.language)
            if getattr(request, "to_language", None):
                request.to_language = whisper.validate_language(request.to_language)
            try:
                with io.BytesIO(data) as buffer:
                    samples, rate = audio.load_audio(
                        buffer,
                        sr=_WHISPER_SAMPLE_RATE,
                        mono=True,
                        max_duration_s=envs.VLLM_MAX_AUDIO_DECODE_DURATION_S,
                        max_decode_bytes=envs.VLLM_MAX_AUDIO_DECODE_BYTES,
                    )
            except ValueError:
                raise
            except Exception as exc:  # as _decode_and_chunk_speech words it
                raise ValueError("Invalid or unsupported audio file.") from exc
        heard = Heard(request, samples, float(rate), len(samples) / float(rate), log.records())
    return heard


def _score(data_1: Any, data_2: Any, engine: Engine, request: Any, log: _Log) -> Found:
    utils = _vllm("vllm.entrypoints.pooling.scoring.utils")
    model_config = _model_config(engine)
    with _stage("request"):
        scoring = utils.validate_score_input(
            data_1,
            data_2,
            is_multimodal_model=model_config.is_multimodal_model,
            architecture=model_config.architecture,
        )
    parts: list[Found] = []
    for role, side in (("query", scoring.data_1), ("document", scoring.data_2)):
        for data in side:
            if isinstance(data, str):
                continue
            with _stage("parse"):
                _, mm_data, mm_uuids = utils.parse_score_data_single(data, role, model_config)
            parts.append(_found(mm_data, mm_uuids, engine))
    firsts = scoring.data_1 * len(scoring.data_2) if len(scoring.data_1) == 1 else scoring.data_1
    for first, second in zip(firsts, scoring.data_2, strict=True):
        with _stage("parse"):
            _, _, mm_data, mm_uuids = utils.parse_score_data(first, second, model_config)
        _found(mm_data, mm_uuids, engine)  # a cross-encoder's one prompt: checked, not counted again
    return _replace(_added(parts), request=request, warnings=log.records())


def _found(mm_data: Mapping[str, Any] | None, mm_uuids: Mapping[str, Any] | None, engine: Engine) -> Found:
    """One prompt's multimodal data through the processor's ``parse_mm_data`` (and the uuid check
    of ``BaseRenderer._process_multimodal``), read back."""
    if not mm_data:
        return Found(counts={})
    mm_data = {key: value for key, value in mm_data.items() if key != "prompt_embeds"}
    parse = _vllm("vllm.multimodal.parse")
    renderers_base = _vllm("vllm.renderers.base")
    with _stage("processor"):
        items = _processor(engine).info.parse_mm_data(mm_data)
        uuid_items = parse.parse_mm_uuids(mm_uuids)
        # _validate_mm_uuids reads nothing of its renderer
        renderers_base.BaseRenderer._validate_mm_uuids(None, mm_data, items, uuid_items)
    embedded = (parse.EmbeddingItems, parse.DictEmbeddingItems)
    counts = dict(items.get_all_counts())
    embeds = {m: len(items[m]) for m in items if isinstance(items[m], embedded)}
    embeddings = {m: tuple(items[m].get(i) for i in range(len(items[m]))) for m in embeds}
    media = {m: [] if isinstance(items[m], embedded) else _media(mm_data.get(m)) for m in counts}
    uuid_only = sum(1 for m, data in mm_data.items() if isinstance(data, list) for d in data if d is None)
    return Found(
        counts=counts,
        embeds=embeds,
        uuid_only=uuid_only,
        images=tuple(media.get("image", ())),
        videos=tuple(media.get("video", ())),
        audios=tuple(media.get("audio", ())),
        embeddings=embeddings,
        uuids={m: tuple(u) for m, u in uuid_items.items()},
    )


def _media(data: Any) -> list[Any]:
    """A modality's decoded items, unwrapped from vLLM's ``MediaWithBytes``."""
    values = data if isinstance(data, list) else [data]
    return [getattr(value, "media", value) for value in values]


def _added(parts: Sequence[Found]) -> Found:
    """Several prompts' findings as one."""
    counts: dict[str, int] = {}
    embeds: dict[str, int] = {}
    embeddings: dict[str, tuple[Any, ...]] = {}
    uuids: dict[str, tuple[str | None, ...]] = {}
    for part in parts:
        for target, source in ((counts, part.counts), (embeds, part.embeds)):
            for key, value in source.items():
                target[key] = target.get(key, 0) + value
        for key, values in part.embeddings.items():
            embeddings[key] = embeddings.get(key, ()) + values
        for key, names in part.uuids.items():
            uuids[key] = uuids.get(key, ()) + names
    return Found(
        counts=counts,
        embeds=embeds,
        uuid_only=sum(part.uuid_only for part in parts),
        images=tuple(image for part in parts for image in part.images),
        videos=tuple(video for part in parts for video in part.videos),
        audios=tuple(audio for part in parts for audio in part.audios),
        embeddings=embeddings,
        uuids=uuids,
        messages=tuple(message for part in parts for message in part.messages),
        conversation=tuple(message for part in parts for message in part.conversation),
    )


def _replace(obj: _T, **changes: Any) -> _T:
    import dataclasses

    return dataclasses.replace(obj, **changes)  # type: ignore[type-var]


def _reply(module: str, name: str, obj: Mapping[str, Any]) -> BaseModel:
    with _checking():
        model = getattr(_vllm(module), name)
        with _stage("reply"):
            validated: BaseModel = model.model_validate(obj)
    return validated


@functools.cache
def _responses_event_classes() -> dict[str, Any]:
    """Responses stream event ``type`` -> the class vLLM emits for it."""
    from typing import get_args

    from pydantic import BaseModel

    protocol = _vllm("vllm.entrypoints.openai.responses.protocol")
    streaming = _vllm("vllm.entrypoints.openai.responses.streaming_events")
    candidates = list(get_args(protocol.StreamingResponsesResponse))
    candidates += [
        value
        for name, value in vars(streaming).items()
        if name.endswith("Event") and isinstance(value, type) and issubclass(value, BaseModel)
    ]
    classes: dict[str, Any] = {}
    for cls in candidates:  # the union's members first: vLLM's subclasses win
        annotation = cls.model_fields["type"].annotation if "type" in cls.model_fields else None
        for kind in get_args(annotation):
            classes.setdefault(kind, cls)
    return classes


def _upload(file: Any) -> Any:
    """A form's ``file`` as the ``UploadFile`` FastAPI makes of it."""
    datastructures = _module("starlette.datastructures")
    upload_file, headers = datastructures.UploadFile, datastructures.Headers
    if file is None or isinstance(file, (str, upload_file)):
        return file
    filename, content_type = "audio", "application/octet-stream"
    if isinstance(file, tuple):
        filename, file, *rest = file
        content_type = rest[0] if rest else content_type
    data = bytes(file)
    return upload_file(
        io.BytesIO(data),
        size=len(data),
        filename=filename,
        headers=headers({"content-type": content_type}),
    )


def _run_coroutine(coroutine: Any) -> Any:
    """Run one of vLLM's coroutines to its end, from sync code or from within a running loop."""
    import asyncio

    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coroutine)
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            outcome["value"] = asyncio.run(coroutine)
        except BaseException as exc:  # handed over to the caller's thread
            outcome["error"] = exc

    thread = threading.Thread(target=run, name="vllm-side")
    thread.start()
    thread.join()
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


# --- vLLM itself: imports, the model config, the processor ---------------------------------------

_WHISPER_SAMPLE_RATE = 16_000
_BOOTED = False


def _boot() -> None:
    """Quiet vLLM's import (its logging level is read once, when ``vllm.logger`` imports) and keep
    transformers and vLLM off the Hub."""
    global _BOOTED
    if _BOOTED:
        return
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    os.environ.setdefault("OPENCV_LOG_LEVEL", "ERROR")  # OpenCV's own notes on an unreadable video
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    logging.getLogger("torch._library.triton").setLevel(logging.ERROR)  # "Triton not available"
    _BOOTED = True


def _module(name: str) -> Any:
    """A module vLLM depends on (FastAPI, starlette), imported by name: they are vLLM's
    dependencies, in the conformance venv only."""
    return importlib.import_module(name)


def _vllm(module: str) -> Any:
    """``module`` of vLLM, imported with the stand-ins the first time."""
    loaded = sys.modules.get(module)
    if loaded is not None:
        return loaded
    with _LOCK:
        _boot()
        try:
            with _stand_ins(), _quiet_transformers(), warnings.catch_warnings():
                warnings.simplefilter("ignore")  # the deprecations of torch, pydantic, transformers
                return importlib.import_module(module)
        except Exception as exc:
            raise SetupError(f"could not import {module}: {exc}") from exc


# Packages vLLM imports that this environment lacks, and the submodules imported of them.
_MISSING = {
    "torchvision": ("torchvision.transforms", "torchvision.transforms.v2", "torchvision.transforms.v2.functional"),
    "xgrammar": ("xgrammar.structural_tag", "xgrammar.openai_tool_call_schema"),
    "llguidance": (),
}


class _StandIn:
    """A name a stand-in package hands out: takes any arguments, does nothing (used only where
    vLLM's modules define constants and annotations at import, never by a check here)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __class_getitem__(cls, item: Any) -> type[_StandIn]:
        return cls


def _stand_in_module(name: str) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__path__ = []  # a package, so that its submodules import
    # importlib.util.find_spec of a module in sys.modules reads its spec (mistral_common asks
    # whether llguidance is installed as vLLM's LLaVA module imports it)
    module.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)
    handed_out: dict[str, type[_StandIn]] = {}

    def __getattr__(attribute: str) -> type[_StandIn]:
        if attribute.startswith("__"):
            raise AttributeError(attribute)
        return handed_out.setdefault(attribute, type(attribute, (_StandIn,), {"__module__": name}))

    module.__getattr__ = __getattr__  # type: ignore[method-assign]
    return module


@contextlib.contextmanager
def _stand_ins() -> Iterator[None]:
    """Empty stand-ins for the packages of :data:`_MISSING` that are not installed, while vLLM's
    modules import, and only then: what the import brought in stays imported, the stand-ins go.
    transformers is imported first, so that its ``is_torchvision_available()`` (cached) stays
    False: it never tries the stand-in."""
    import transformers.utils.import_utils as transformers_imports

    transformers_imports.is_torchvision_available()
    added: dict[str, types.ModuleType] = {}
    for root, submodules in _MISSING.items():
        if root in sys.modules or importlib.util.find_spec(root) is not None:
            continue
        for name in (root, *submodules):
            added[name] = _stand_in_module(name)
        for name in submodules:  # parent.child, as an import would set it
            parent, _, child = name.rpartition(".")
            setattr(added[parent], child, added[name])
    sys.modules.update(added)
    try:
        yield
    finally:
        for name, module in added.items():
            if sys.modules.get(name) is module:
                del sys.modules[name]


@dataclass(frozen=True)
class _Checkpoint:
    """What the local model directory of a :class:`Engine` model is written from."""

    config_class: str  # in transformers
    architecture: str  # vLLM's
    model_module: str  # vLLM's, of the model class
    model_class: str
    text_sizes: Mapping[str, int]  # the 7B checkpoint's text_config sizes
    omni: bool = False


_TEXT_7B = {
    "hidden_size": 3584,
    "intermediate_size": 18944,
    "num_attention_heads": 28,
    "num_key_value_heads": 4,
    "vocab_size": 152064,
}
_CHECKPOINTS: dict[str, _Checkpoint] = {
    "qwen2.5-omni": _Checkpoint(
        "Qwen2_5OmniConfig",
        "Qwen2_5OmniModel",
        "vllm.model_executor.models.qwen2_5_omni_thinker",
        "Qwen2_5OmniThinkerForConditionalGeneration",
        _TEXT_7B,
        omni=True,
    ),
    "qwen2.5-vl": _Checkpoint(
        "Qwen2_5_VLConfig",
        "Qwen2_5_VLForConditionalGeneration",
        "vllm.model_executor.models.qwen2_5_vl",
        "Qwen2_5_VLForConditionalGeneration",
        _TEXT_7B,
    ),
    "qwen2-vl": _Checkpoint(
        "Qwen2VLConfig",
        "Qwen2VLForConditionalGeneration",
        "vllm.model_executor.models.qwen2_vl",
        "Qwen2VLForConditionalGeneration",
        _TEXT_7B,
    ),
    # llava-hf/llava-1.5-7b-hf: LlavaConfig's defaults are its vision tower (CLIP ViT-L/14 at 336)
    # and feature selection (penultimate layer, CLS dropped); the text sizes are Vicuna-7B's
    "llava-1.5": _Checkpoint(
        "LlavaConfig",
        "LlavaForConditionalGeneration",
        "vllm.model_executor.models.llava",
        "LlavaForConditionalGeneration",
        {
            "hidden_size": 4096,
            "intermediate_size": 11008,
            "num_attention_heads": 32,
            "num_key_value_heads": 32,
            "vocab_size": 32064,
        },
    ),
}
_ARCHITECTURE_PREFIX = "ConformanceLocal"  # registered beside vLLM's own names, never over them


def _model_config(engine: Engine) -> Any:
    """:func:`_build_model_config`, its failure a :class:`SetupError`."""
    try:
        return _build_model_config(engine)
    except SetupError:
        raise
    except Exception as exc:
        raise SetupError(f"could not build vLLM's ModelConfig for {engine}: {exc}") from exc


@functools.cache
def _build_model_config(engine: Engine) -> Any:
    """vLLM's ``vllm.config.ModelConfig`` for ``engine``, from a local directory (config.json and a tiny
    tokenizer), with the model class registered in-process under a private architecture name
    (``ModelRegistry.register_model``), so that vLLM neither inspects it in a subprocess (where
    the stand-ins are not) nor reaches the Hub."""
    checkpoint = _CHECKPOINTS[engine.model]
    architecture = _ARCHITECTURE_PREFIX + checkpoint.architecture
    registry = _vllm("vllm.model_executor.models.registry").ModelRegistry
    model_class = getattr(_vllm(checkpoint.model_module), checkpoint.model_class)
    if checkpoint.omni:
        model_class = _omni_thinker(model_class)
    registry.register_model(architecture, model_class)
    directory = _model_directory(checkpoint, architecture, engine.hidden_size)
    config_module = _vllm("vllm.config")
    with _quiet_transformers():
        model_config = config_module.ModelConfig(
            model=directory,
            tokenizer=directory,
            enable_mm_embeds=engine.enable_mm_embeds,
            limit_mm_per_prompt=dict(engine.limits) or None,
            # --allowed-media-domains: loopback only, so a check never reaches another address
            # (vLLM refuses a URL elsewhere before it connects)
            allowed_media_domains=list(ALLOWED_MEDIA_DOMAINS),
        )
    mm_config = model_config.multimodal_config
    if engine.ec_consumer and mm_config is not None:
        # as VllmConfig derives it for an EC consumer (config/vllm.py)
        mm_config.allow_missing_mm_embeddings = True
        mm_config.enable_mm_embeds = True
    return model_config


ALLOWED_MEDIA_DOMAINS = ("127.0.0.1", "localhost", "::1")
_PROCESSORS: dict[Engine, Any] = {}


def _processor(engine: Engine) -> Any:
    """The model's vLLM multimodal processor (a ``BaseMultiModalProcessor``), as the renderer
    creates it (once, and keeps)."""
    if engine not in _PROCESSORS:
        registry = _vllm("vllm.multimodal").MULTIMODAL_REGISTRY
        model_config = _model_config(engine)
        try:
            _PROCESSORS[engine] = registry.create_processor(model_config)
        except Exception as exc:
            raise SetupError(f"could not create vLLM's multimodal processor for {engine}: {exc}") from exc
    return _PROCESSORS[engine]


def _model_directory(checkpoint: _Checkpoint, architecture: str, hidden_size: int | None) -> str:
    import transformers

    text = dict(checkpoint.text_sizes)
    if hidden_size is not None:
        text["hidden_size"] = hidden_size
        if hidden_size % text["num_attention_heads"]:
            text["num_attention_heads"] = text["num_key_value_heads"] = 1
    directory = tempfile.mkdtemp(prefix="vllm-side-")
    atexit.register(shutil.rmtree, directory, True)
    with _quiet_transformers():
        config = getattr(transformers, checkpoint.config_class)(architectures=[architecture])
        language = config.thinker_config if checkpoint.omni else config
        for key, value in text.items():
            setattr(language.text_config, key, value)
        if checkpoint.config_class != "LlavaConfig":  # Qwen's merger makes the LLM's width itself
            language.vision_config.out_hidden_size = text["hidden_size"]
        if not checkpoint.omni and checkpoint.config_class == "Qwen2VLConfig":
            language.vision_config.hidden_size = text["hidden_size"]
        config.save_pretrained(directory)
    _write_tokenizer(directory)
    return directory


def _write_tokenizer(directory: str) -> None:
    """A word-level tokenizer of a few tokens: vLLM's multimodal processors require a tokenizer
    to exist; nothing here tokenizes."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocabulary = {"<unk>": 0, "<|im_start|>": 1, "<|im_end|>": 2, "<|endoftext|>": 3}
    tokenizer = Tokenizer(models.WordLevel(vocabulary, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(os.path.join(directory, "tokenizer.json"))
    settings = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": "<unk>",
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "model_max_length": 32768,
    }
    with open(os.path.join(directory, "tokenizer_config.json"), "w") as file:
        json.dump(settings, file)


@contextlib.contextmanager
def _quiet_transformers() -> Iterator[None]:
    """transformers' warnings about the local stand-in files (token ids outside the tiny
    vocabulary and the like), silenced while they are written and read."""
    transformers_logging: Any = importlib.import_module("transformers.utils.logging")
    level = transformers_logging.get_verbosity()
    transformers_logging.set_verbosity_error()
    try:
        yield
    finally:
        transformers_logging.set_verbosity(level)


def _whisper_feature_extractor() -> Any:
    """Qwen2.5-Omni-7B's feature extractor, as its ``preprocessor_config.json`` describes it."""
    transformers: Any = importlib.import_module("transformers")
    return transformers.WhisperFeatureExtractor(
        feature_size=128,
        sampling_rate=_WHISPER_SAMPLE_RATE,
        hop_length=160,
        chunk_length=300,
        n_fft=400,
        padding_value=0.0,
        return_attention_mask=True,
    )


def _omni_thinker(model_class: type[_T]) -> type[_T]:
    """vLLM's Qwen2.5-Omni thinker with its own processor, processing info and dummy inputs, but
    for where the info gets the Whisper feature extractor from (the HF processor, which needs
    torchvision, on the real checkpoint)."""
    thinker = _vllm("vllm.model_executor.models.qwen2_5_omni_thinker")
    registry = _vllm("vllm.multimodal").MULTIMODAL_REGISTRY
    extractor = _whisper_feature_extractor()

    class ProcessingInfo(thinker.Qwen2_5OmniThinkerProcessingInfo):  # type: ignore[name-defined]
        def get_feature_extractor(self, **kwargs: object) -> Any:
            return extractor

    decorate = registry.register_processor(
        thinker.Qwen2_5OmniThinkerMultiModalProcessor,
        info=ProcessingInfo,
        dummy_inputs=thinker.Qwen2_5OmniThinkerDummyInputsBuilder,
    )
    local = type(model_class.__name__, (model_class,), {"__module__": __name__})
    return decorate(local)

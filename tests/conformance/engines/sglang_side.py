"""What SGLang 0.5.23 itself makes of a request body: its own pydantic request models decide.

Each function validates a body with the model SGLang's HTTP server binds to that route
(``sglang/srt/entrypoints/http_server.py``) and walks the validated objects, returning the media
SGLang's model would be handed as a :class:`Found`, or raises :class:`Refused` with SGLang's message
where SGLang answers 400. Where the server converts one API into chat before it renders (Responses,
Anthropic Messages), the conversion's media-relevant steps are restated here, each naming the lines
of SGLang it restates, and the result is validated as SGLang validates it: as a
``ChatCompletionRequest``.

============================  ========================================  ==========================
function                      route                                     SGLang model
============================  ========================================  ==========================
:func:`chat`                  /v1/chat/completions, /invocations        ChatCompletionRequest
:func:`responses`             /v1/responses                             ResponsesRequest -> chat
:func:`messages`              /v1/messages                              AnthropicMessagesRequest
:func:`embeddings`            /v1/embeddings                            EmbeddingRequest
:func:`score`                 /v1/score                                 ScoringRequest
:func:`rerank`                /v1/rerank (POST, PUT)                    V1RerankReqInput
:func:`transcription`         /v1/audio/transcriptions (multipart)      form fields, then
                                                                        TranscriptionRequest
:func:`image_generation`      /v1/images/generations (its diffusion     ImageGenerationsRequest
                              server, ``sglang.multimodal_gen``)
============================  ========================================  ==========================

:func:`image_response` holds an answer of the diffusion server's images API to its
``ImageResponse``.

SGLang serves no ``/score``, ``/rerank`` or ``/v2/rerank`` (those are vLLM's), no ``/pooling``
and no translations route.

What the request models cannot see, and these functions therefore do not count: media a chat
template with ``content_format == "string"`` drops when it renders (``parser/jinja_template_utils.py``
``process_content_for_template_format``, the ``"string"`` branch), and LLaVA's reading of
``image_url`` parts with ``modalities: "video"`` as video frames (``multimodal/processors/llava.py``):
both depend on the served model, not the request. They are counted as sent (the latter as images).

Importing SGLang on a CPU machine: see :func:`_sglang`.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import sys
import types
import warnings
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

__all__ = [
    "Found",
    "Refused",
    "chat",
    "embeddings",
    "image_generation",
    "image_response",
    "messages",
    "rerank",
    "responses",
    "score",
    "transcription",
]


@dataclass(frozen=True, slots=True)
class Found:
    """The media SGLang's model is handed, per modality (the gateway's Modality names).

    ``file`` is always 0: no SGLang request model has a document part. ``audio_in_video`` is the
    chat request's ``use_audio_in_video`` flag as validated (only SGLang's Nemotron Nano VL reads
    it; its videos' audio is not counted in ``audio``).
    """

    image: int = 0
    video: int = 0
    audio: int = 0
    file: int = 0
    audio_in_video: bool = False

    def counts(self) -> dict[str, int]:
        """The modalities present, each with its count (none: ``{}``)."""
        found = {"image": self.image, "video": self.video, "audio": self.audio, "file": self.file}
        return {name: n for name, n in found.items() if n}


class Refused(Exception):
    """SGLang answers 400: the request model or SGLang's conversion refused the body.

    ``message`` is SGLang's (pydantic's ``str(ValidationError)``, which SGLang's handler puts
    first in its error message, http_server.py ``validation_exception_handler``; or the
    ``ValueError`` text its serving layer answers with); ``errors`` pydantic's error list, when
    pydantic refused.
    """

    def __init__(self, message: str, errors: tuple[Mapping[str, Any], ...] = ()) -> None:
        super().__init__(message)
        self.message = message
        self.errors = errors


# --- importing SGLang's protocol modules on a CPU machine -------------------------------------


def _sglang(module: str) -> types.ModuleType:
    """``sglang.<module>``, imported without running ``sglang/__init__.py`` where it cannot run.

    The protocol modules (``sglang/srt/entrypoints/openai/protocol.py``,
    ``sglang/srt/entrypoints/anthropic/protocol.py``) need only pydantic, msgspec, openai and
    ``sglang.utils``. But importing any ``sglang.*`` module first runs ``sglang/__init__.py``, which
    imports ``sglang.srt.utils.common`` (torch, and ``import triton`` at line 91: a GPU-only
    package, absent here) and the frontend language runtime, none of which the request models use.

    Two stand-ins, installed only when needed and nowhere else:

    * ``sys.modules["sglang"]``: a bare package whose ``__path__`` is the installed sglang
      directory, so its submodules import from the real files without the package's
      ``__init__``. Installed only when triton is not importable and no ``sglang`` is imported
      yet; it stays, since SGLang's validators import further submodules lazily (an image's
      ``content_hash`` imports ``sglang.srt.multimodal.cache``, which imports torch: CPU torch is
      enough).
    * ``IPython.display`` (``HTML``, ``display``): ``sglang/utils.py:25`` imports it at the top
      for its notebook helpers, which the protocol modules never call. Present only while the
      protocol modules import, and only when IPython is not installed; removed afterwards.
    """
    name = f"sglang.{module}"
    if name in sys.modules:
        return sys.modules[name]
    if "sglang" not in sys.modules and importlib.util.find_spec("triton") is None:
        spec = importlib.util.find_spec("sglang")
        if spec is None or spec.submodule_search_locations is None:
            raise ModuleNotFoundError("sglang is not installed", name="sglang")
        package = types.ModuleType("sglang", "SGLang without its __init__ (tests/conformance/engines/sglang_side.py)")
        package.__path__ = list(spec.submodule_search_locations)
        package.__spec__ = importlib.machinery.ModuleSpec("sglang", None, is_package=True)
        package.__spec__.submodule_search_locations = package.__path__
        sys.modules["sglang"] = package
    with _without_ipython(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # SGLang's own deprecations are not the suite's
        return importlib.import_module(name)


@contextmanager
def _without_ipython() -> Iterator[None]:
    if "IPython" in sys.modules or importlib.util.find_spec("IPython") is not None:
        yield
        return
    ipython = types.ModuleType("IPython")
    display = types.ModuleType("IPython.display")
    display.HTML = object  # type: ignore[attr-defined]
    display.display = print  # type: ignore[attr-defined]
    ipython.display = display  # type: ignore[attr-defined]
    sys.modules["IPython"], sys.modules["IPython.display"] = ipython, display
    try:
        yield
    finally:
        for stand_in in ("IPython.display", "IPython"):
            sys.modules.pop(stand_in, None)


def _openai() -> Any:
    return _sglang("srt.entrypoints.openai.protocol")


def _validate(model: Any, data: Any) -> Any:
    """``model.model_validate(data)``, a ValidationError (or a validator's ValueError) as Refused."""
    import pydantic

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return model.model_validate(data)
    except pydantic.ValidationError as e:
        raise Refused(str(e), tuple(e.errors(include_url=False))) from e


# --- walking validated chat content ---------------------------------------------------------


def _count_parts(parts: Iterable[Any], proto: Any, tally: dict[str, int]) -> None:
    """Count SGLang's validated chat parts: ``ChatCompletionMessageContentImagePart``,
    ``...VideoPart`` and ``...AudioURLPart`` (an ``input_audio`` part is already one:
    ``ChatCompletionMessageContentAudioPart``'s ``AfterValidator(_to_audio_url_part)``)."""
    for part in parts:
        if isinstance(part, proto.ChatCompletionMessageContentImagePart):
            tally["image"] += 1
        elif isinstance(part, proto.ChatCompletionMessageContentVideoPart):
            tally["video"] += 1
        elif isinstance(
            part, proto.ChatCompletionMessageContentAudioURLPart | proto.ChatCompletionMessageContentAudioInlinePart
        ):
            tally["audio"] += 1


def _found_in_chat(request: Any, proto: Any) -> Found:
    tally = {"image": 0, "video": 0, "audio": 0}
    for message in request.messages:
        if isinstance(message.content, list):
            _count_parts(message.content, proto, tally)
    return Found(**tally, audio_in_video=bool(request.use_audio_in_video))


def chat(body: Mapping[str, Any]) -> Found:
    """A chat completions body, as SGLang's ``ChatCompletionRequest``
    (``srt/entrypoints/openai/protocol.py``) validates it: every message's content, any role
    (``ChatCompletionMessageUserParam`` and ``ChatCompletionMessageGenericParam`` take the same
    ``ChatCompletionMessageContentPart`` union: text, thinking, image_url, video_url, audio_url,
    input_audio, tool_reference)."""
    proto = _openai()
    return _found_in_chat(_validate(proto.ChatCompletionRequest, body), proto)


# --- Responses ----------------------------------------------------------------------------


def _responses_part(part: Any) -> Any:
    """``OpenAIServingResponses._normalize_response_content_part_for_chat``
    (serving_responses.py:1487): input_text/output_text -> text, input_image -> image_url (its
    ``image_url`` a string or an object), anything else as sent, for chat's model to judge."""
    if not isinstance(part, dict):
        return part
    kind = part.get("type")
    if kind in ("input_text", "output_text"):
        return {"type": "text", "text": part.get("text", "")}
    if kind == "input_image":
        image_url = part.get("image_url")
        url = dict(image_url) if isinstance(image_url, dict) else {"url": image_url}
        if not url.get("detail"):
            url["detail"] = part.get("detail") or "auto"
        for key in ("min_dynamic_patch", "max_dynamic_patch", "max_long_side_pixel"):
            if key in part and key not in url:
                url[key] = part[key]
        return {"type": "image_url", "image_url": url}
    if kind == "image_url" and isinstance(part.get("image_url"), str):
        return {**part, "image_url": {"url": part["image_url"], "detail": part.get("detail", "auto")}}
    return part


def _label_developer(content: Any) -> Any:
    """``responses_adapters.label_developer_content`` (responses_adapters.py:199): parts kept."""
    label = "Developer instructions:"
    if isinstance(content, str):
        return f"{label}\n{content}"
    if isinstance(content, list):
        for i, part in enumerate(content):
            if isinstance(part, dict) and isinstance(part.get("text"), str):
                return [*content[:i], {**part, "text": f"{label}\n{part['text']}"}, *content[i + 1 :]]
        return [{"type": "input_text", "text": label}, *content]
    return content


def _responses_item(item: Any) -> dict[str, Any] | None:
    """One input item as a chat message, as ``_normalize_response_message_for_chat``
    (serving_responses.py:1556) makes it, so far as media go: tool calls and reasoning carry
    none; a function_call_output's ``output`` parts are flattened to their text (its images
    dropped, serving_responses.py:1535); an item of another ``type`` is refused."""
    if not isinstance(item, dict):
        return item  # chat's model refuses it
    if item.get("role") == "developer":
        item = {**item, "role": "system", "content": _label_developer(item.get("content"))}
    kind = item.get("type")
    if kind in ("function_call", "custom_tool_call"):  # its arguments coerced to JSON text
        call = {"name": item.get("name"), "arguments": "{}"}
        return {"role": "assistant", "tool_calls": [{"id": item.get("call_id") or item.get("id"), "function": call}]}
    if kind in ("function_call_output", "custom_tool_call_output"):
        output = item.get("output", "")
        if isinstance(output, list):
            output = "".join(p.get("text", "") for p in output if isinstance(p, dict))
        return {"role": "tool", "tool_call_id": item.get("call_id"), "content": output}
    if kind == "reasoning":
        return None  # text at most (serving_responses.py:1601-1625)
    if kind not in (None, "message"):
        raise Refused(f"Unsupported Responses API input item type: {kind!r}")
    content = item.get("content")
    if isinstance(content, list):
        item = {**item, "content": [_responses_part(p) for p in content]}
    return {k: v for k, v in item.items() if v is not None and k not in ("id", "status", "type")}


def _system_texts(content: Any) -> list[str]:
    """What a system message keeps where the template takes no inline system message
    (serving_responses.py:1769-1783): its text, nothing else."""
    if isinstance(content, str):
        return [content]
    if isinstance(content, list):
        return [p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str)]
    return []


def responses(body: Mapping[str, Any], *, inline_system: bool = True) -> Found:
    """A Responses body, as SGLang's ``ResponsesRequest`` (protocol.py:1924) validates it, then
    turned into chat messages as ``OpenAIServingResponses._construct_input_messages``
    (serving_responses.py:1733) does and validated, as ``_make_request`` does
    (serving_responses.py:746), as a ``ChatCompletionRequest``.

    ``ResponsesRequest.input`` is ``str | list[dict] | list[item]`` (left to right), so its
    parts are judged only by chat's model: ``input_text``, ``input_image``, ``text``,
    ``image_url``, ``video_url``, ``audio_url`` and ``input_audio`` pass; ``input_file`` is
    refused. ``inline_system=False`` is a model whose chat template takes no inline system
    message: the system and developer messages then keep only their text (their media dropped).
    ``previous_response_id`` (stored history) and the gpt-oss (harmony) path are not modelled.
    """
    proto = _openai()
    request = _validate(proto.ResponsesRequest, body)
    chat_messages: list[Any] = []
    if request.instructions:
        chat_messages.append({"role": "system", "content": request.instructions})
    items = [{"role": "user", "content": request.input}] if isinstance(request.input, str) else request.input
    for item in items:
        if hasattr(item, "model_dump"):
            item = item.model_dump(exclude_none=True)
        message = _responses_item(item)
        if message is not None:
            chat_messages.append(message)
    if not inline_system:
        chunks = [
            chunk
            for m in chat_messages
            if isinstance(m, dict) and m.get("role") == "system"
            for chunk in _system_texts(m.get("content"))
        ]
        others = [m for m in chat_messages if not (isinstance(m, dict) and m.get("role") == "system")]
        chat_messages = ([{"role": "system", "content": "\n\n".join(chunks)}] if chunks else []) + others
    chat_body: dict[str, Any] = {"messages": chat_messages}
    if request.model is not None:
        chat_body["model"] = request.model
    return _found_in_chat(_validate(proto.ChatCompletionRequest, chat_body), proto)


# --- Anthropic Messages ----------------------------------------------------------------------


def _anthropic_image(source: Any) -> bool:
    """Whether ``_convert_anthropic_image_source_to_openai_part`` (anthropic/serving.py:224)
    makes an image of a source: a dict, base64 with non-empty ``data`` or with a ``url``."""
    if hasattr(source, "model_dump"):
        source = source.model_dump(exclude_none=True)
    if not isinstance(source, dict):
        return False
    if source.get("type") == "base64":
        return bool(source.get("data", ""))
    return bool(source.get("url"))


def _anthropic_message(errors: Iterable[Mapping[str, Any]]) -> str:
    """``_anthropic_validation_message`` (http_server.py:542): ``loc: msg``, joined by ``; ``."""
    parts = []
    for error in errors:
        loc = ".".join(str(p) for p in error.get("loc") or () if p != "body")
        msg = (error.get("msg") or "").strip()
        if msg:
            parts.append(f"{loc}: {msg}" if loc else msg)
    text = "; ".join(parts) or "Invalid request"
    return text[:500] + "…" if len(text) > 500 else text


def messages(body: Mapping[str, Any], *, inline_system: bool = True) -> Found:
    """An Anthropic Messages body, as SGLang's ``AnthropicMessagesRequest``
    (``srt/entrypoints/anthropic/protocol.py``) validates it, its images counted as
    ``AnthropicServing._convert_to_chat_completion_request`` (anthropic/serving.py:218) carries
    them into chat.

    Content blocks are a discriminated union (text, image, tool_use, tool_result,
    tool_reference, search_result, thinking, redacted_thinking): ``document`` is refused. Images
    reach the model from ``image`` blocks of user and assistant messages and from the ``image``
    items of a user message's ``tool_result``; dropped silently are those in ``system`` (its text
    only, serving.py:401-409), in an assistant's ``tool_result`` (its text only, serving.py:535),
    in a ``system``-role message where the template takes no inline system message
    (``inline_system=False``, serving.py:411-416), and any whose source has neither base64
    ``data`` nor a ``url``. A ``redacted_thinking`` block in an assistant message is refused
    (serving.py:371).
    """
    proto = _sglang("srt.entrypoints.anthropic.protocol")
    try:
        request = _validate(proto.AnthropicMessagesRequest, body)
    except Refused as e:  # its message as /v1/messages renders it (http_server.py:542)
        raise Refused(_anthropic_message(e.errors), e.errors) from e
    images = 0
    for message in request.messages:
        if isinstance(message.content, str) or (message.role == "system" and not inline_system):
            continue
        if message.role == "assistant" and any(b.type == "redacted_thinking" for b in message.content):
            raise Refused("Anthropic redacted_thinking history is not supported")
        for block in message.content:
            if block.type == "image" and block.source:
                images += _anthropic_image(block.source)
            elif block.type == "tool_result" and message.role == "user" and isinstance(block.content, list):
                images += sum(
                    _anthropic_image(item.source) for item in block.content if getattr(item, "type", None) == "image"
                )
    return Found(image=images)


# --- pooling ---------------------------------------------------------------------------------


def _embedding_refusal(request: Any) -> str | None:
    """``OpenAIServingEmbedding._validate_request`` (serving_embedding.py:44)."""
    if request.encoding_format not in ("float", "base64"):
        return f"encoding_format must be either 'float' or 'base64', got {request.encoding_format!r}"
    items = request.input
    if not items:
        return "Input cannot be empty"
    if isinstance(items, str):
        return "Input cannot be empty or whitespace only" if not items.strip() else None
    if isinstance(items[0], str):
        for i, item in enumerate(items):
            if not item.strip():
                return f"Input at index {i} cannot be empty or whitespace only"
    elif isinstance(items[0], int):
        for i, item in enumerate(items):
            if item < 0:
                return f"Token ID at index {i} must be non-negative"
    return None


def embeddings(body: Mapping[str, Any]) -> Found:
    """An embeddings body, as SGLang's ``EmbeddingRequest`` (protocol.py:1416) validates it.

    ``input`` is ``list[int] | list[list[int]] | str | list[str] | list[MultimodalEmbeddingInput]``;
    each ``MultimodalEmbeddingInput`` (protocol.py:1405) is ``{"text", "image", "video"}``, all
    optional strings, unknown keys ignored (an ``"audio"`` key is dropped, not refused): its
    ``image`` and ``video`` each reach the model (serving_embedding.py:99-141). No ``messages``
    (unknown, ignored: a body with only ``messages`` is refused for want of ``input``). Then
    ``OpenAIServingEmbedding._validate_request``'s checks (empty or blank input, negative ids).
    """
    proto = _openai()
    request = _validate(proto.EmbeddingRequest, body)
    refusal = _embedding_refusal(request)
    if refusal is not None:
        raise Refused(refusal)
    tally = {"image": 0, "video": 0}
    if isinstance(request.input, list):
        for item in request.input:
            if isinstance(item, proto.MultimodalEmbeddingInput):
                tally["image"] += item.image is not None
                tally["video"] += item.video is not None
    return Found(**tally)


def score(body: Mapping[str, Any]) -> Found:
    """A score body, as SGLang's ``ScoringRequest`` (protocol.py:1482) validates it: ``query``
    (text or token ids) and ``items`` (text, texts or token ids) carry no media, ever; there is
    no ``text_1``/``text_2``, ``queries``/``documents`` or ``data_1``/``data_2`` (unknown keys are
    ignored and no field is required, so such a body passes the model; SGLang's
    ``TokenizerManager.score_request`` fails on the missing ``query``/``items`` later)."""
    _validate(_openai().ScoringRequest, body)
    return Found()


def _rerank_refusal(request: Any) -> str | None:
    """``OpenAIServingRerank._validate_request`` (serving_rerank.py:225)."""
    if not request.query:
        return "Query cannot be empty"
    if isinstance(request.query, str) and not request.query.strip():
        return "Query cannot be empty or whitespace only"
    if not request.documents:
        return "Documents cannot be empty"
    for doc in request.documents:
        if not doc:
            return "Each document must be a non-empty string"
        if isinstance(doc, str) and not doc.strip():
            return "Each document cannot be empty or whitespace only"
    return None


def rerank(body: Mapping[str, Any]) -> Found:
    """A rerank body, as SGLang's ``V1RerankReqInput`` (protocol.py:1687) and
    ``OpenAIServingRerank._validate_request`` take it: ``query`` and each of ``documents`` are a
    non-blank string or a non-empty list of ``RerankContentPart`` (text, image_url, video_url; no
    audio, no ``{"content": [...]}`` object). Counted as sent: a cross-encoder reranker (no Qwen3
    reranker template or Qwen3-VL model) keeps only the parts' text, dropping the media silently
    (serving_rerank.py:268-276)."""
    proto = _openai()
    request = _validate(proto.V1RerankReqInput, body)
    refusal = _rerank_refusal(request)
    if refusal is not None:
        raise Refused(refusal)
    tally = {"image": 0, "video": 0, "audio": 0}
    for content in (request.query, *request.documents):
        if isinstance(content, list):
            _count_parts(content, proto, tally)
    return Found(**tally)


# --- transcription ---------------------------------------------------------------------------

_RESPONSE_FORMATS = ("json", "text", "verbose_json")


def transcription(fields: Mapping[str, Any]) -> Found:
    """A multipart transcription request's fields, as SGLang's route
    ``openai_v1_audio_transcriptions`` (http_server.py:1942) takes them, then its
    ``TranscriptionRequest`` (protocol.py:2487).

    ``fields`` maps a form field's name to its value: ``bytes`` for an uploaded file (or a
    ``(filename, bytes[, content_type])`` tuple), ``str`` for a plain field, a list for a repeated
    one (``timestamp_granularities[]``). ``file`` is the only media (required, a file upload);
    ``model``, ``language``, ``response_format`` (json, text or verbose_json), ``temperature``,
    ``stream`` and ``timestamp_granularities[]`` are plain fields, read as FastAPI reads them.
    Other fields are ignored (no audio URL field).
    """
    import pydantic

    proto = _openai()
    upload = fields.get("file")
    if isinstance(upload, tuple):
        upload = upload[1]
    if not isinstance(upload, bytes | bytearray):
        what = "Field required" if upload is None else "Expected UploadFile, received: str"
        raise Refused(f"1 validation error:\n  body.file\n    {what}", ({"loc": ("body", "file"), "msg": what},))

    def form(name: str, kind: Any, default: Any) -> Any:
        value = fields.get(name, default)
        if isinstance(value, list) and name != "timestamp_granularities[]":
            value = value[-1]  # a repeated field: FastAPI reads the last
        elif isinstance(value, str) and name == "timestamp_granularities[]":
            value = [value]
        try:
            return pydantic.TypeAdapter(kind).validate_python(value)
        except pydantic.ValidationError as e:
            raise Refused(str(e), tuple(e.errors(include_url=False))) from e

    response_format = form("response_format", str, "json")
    values = {
        "model": form("model", str, "default"),
        "language": form("language", str | None, None),
        "temperature": form("temperature", float, 0.0),
        "stream": form("stream", bool, False),
        "timestamp_granularities": form("timestamp_granularities[]", list[str] | None, None),
    }
    if response_format not in _RESPONSE_FORMATS:
        raise Refused("Only 'json', 'text', and 'verbose_json' formats supported")
    _validate(proto.TranscriptionRequest, {**values, "response_format": response_format, "audio_data": bytes(upload)})
    return Found(audio=1)


# --- image generation (SGLang's diffusion server) -------------------------------------------------


def _multimodal_gen() -> types.ModuleType:
    """The diffusion server's OpenAI models, ``sglang/multimodal_gen/runtime/entrypoints/openai/protocol.py``:
    the standard library and pydantic alone, loaded from its file (the packages above it import
    the diffusion runtime: torch, triton)."""
    name = "sglang_multimodal_gen_openai_protocol"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.find_spec("sglang")
    if spec is None or spec.submodule_search_locations is None:
        raise ModuleNotFoundError("sglang is not installed", name="sglang")
    root = next(iter(spec.submodule_search_locations))
    path = f"{root}/multimodal_gen/runtime/entrypoints/openai/protocol.py"
    loaded = importlib.util.spec_from_file_location(name, path)
    assert loaded is not None and loaded.loader is not None
    module = importlib.util.module_from_spec(loaded)
    sys.modules[name] = module
    loaded.loader.exec_module(module)
    return module


def _size(size: str) -> tuple[int, int] | None:
    """``sglang/multimodal_gen/runtime/utils/common.py`` ``parse_size``, with ``_parse_size_or_raise``'s
    positive sides (``entrypoints/openai/utils.py:71``)."""
    parts = size.lower().replace(" ", "").split("x")
    try:
        width, height = (int(p) for p in parts) if len(parts) == 2 else (0, 0)
    except ValueError:
        return None
    return (width, height) if width > 0 and height > 0 else None


def image_generation(body: Mapping[str, Any]) -> Found:
    """``POST /v1/images/generations`` (``entrypoints/openai/image_api.py`` ``generations``): the
    body validated as ``ImageGenerationsRequest`` (extra fields kept), then the handler's own
    refusals: a ``response_format`` that is neither ``url`` nor ``b64_json`` (its default, where
    the request names none, is ``url``), a ``size`` that is not a positive WIDTHxHEIGHT. ``n`` is
    clamped to 1-10, never refused."""
    request = _validate(_multimodal_gen().ImageGenerationsRequest, body)
    fmt = (request.response_format or "b64_json").lower()
    if fmt not in ("url", "b64_json"):
        raise Refused(f"response_format={fmt} is not supported")
    if request.size and _size(request.size) is None:
        raise Refused("size must be formatted as positive WIDTHxHEIGHT")
    return Found()


def image_response(answer: Mapping[str, Any]) -> Any:
    """An images answer as the diffusion server's ``ImageResponse`` (its FastAPI response model)."""
    return _validate(_multimodal_gen().ImageResponse, answer)

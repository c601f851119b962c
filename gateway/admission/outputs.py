"""What a request asks a model to produce beside text, and what becomes of an output the model
does not produce (routing.yaml ``produces:`` and ``on_unsupported_output:``).

Each API says where its requests ask for an output (:attr:`gateway.admission.apis.Api.outputs`):
chat in ``modalities`` (``["text", "audio"]``) and ``audio`` (``{voice, format}``), the Responses
API in its ``tools`` (``{"type": "image_generation"}``). Asked of a model that does not produce
it, the request is redirected where ``on_unsupported_output`` says to a model that does (and that
the key may use, on this API), or refused: 400 ``unsupported_output_modality`` naming the param
that asked, before any engine is touched (engines fail late here: vLLM-Omni answered 200 with no
choices to an output it could not make). A request that asks for text alone pays one look a place.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ..config import GatewayConfig, ModelConfig
from ..config.keys import OUTPUT_MODALITIES, PRODUCING_APIS
from ..config.outputs import parse_size
from ..config.types import OutputLimits
from ..errors import (
    InvalidRequestError,
    Rejection,
    TooManyItemsError,
    UnsupportedOutputModalityError,
    clip,
    did_you_mean,
)
from ..modalities import Modality

Asked = list[tuple[Modality, str]]  # each output asked beside text, with the param that asks for it
Moved = tuple[str, Modality, str]  # a redirect: from the model, for the output, to the model


def chat_outputs(body: Mapping[str, Any]) -> Asked:
    """Chat's: each of ``modalities`` but text; without ``modalities``, ``audio`` (its voice and
    format) asks for audio. With ``modalities``, it decides: ``audio`` only sets the voice of the
    audio it asks for (OpenAI's API: a client may always send its voice settings)."""
    modalities, audio = body.get("modalities"), body.get("audio")
    if modalities is None:
        return [] if audio is None else [(Modality.AUDIO, "audio")]
    if not isinstance(modalities, list):
        raise InvalidRequestError("'modalities' must be a list of strings", param="modalities")
    asked: Asked = []
    for i, name in enumerate(modalities):
        if name == "text":
            continue
        if not isinstance(name, str) or name not in OUTPUT_MODALITIES:
            shown = clip(name) if isinstance(name, str) else type(name).__name__
            raise InvalidRequestError(
                f"unknown output modality '{shown}' in 'modalities' (expected text, audio or image)"
                + (did_you_mean(name, OUTPUT_MODALITIES) if isinstance(name, str) else ""),
                param=f"modalities[{i}]",
            )
        asked.append((Modality(name), f"modalities[{i}]"))
    return asked


def responses_outputs(body: Mapping[str, Any]) -> Asked:
    """The Responses API's: an ``image_generation`` tool asks for images."""
    tools = body.get("tools")
    if not isinstance(tools, list):
        return []  # none, or not a list: the engine's own validation says so
    return [
        (Modality.IMAGE, f"tools[{i}]")
        for i, tool in enumerate(tools)
        if isinstance(tool, dict) and tool.get("type") == "image_generation"
    ]


def unproduced(model: ModelConfig, modality: Modality, param: str, via: str = "") -> UnsupportedOutputModalityError:
    """The refusal of an output ``model`` does not produce, at the ``param`` that asked for it."""
    return UnsupportedOutputModalityError(
        f"Model '{model.name}'{via} does not produce {modality} output (it produces: {', '.join(model.produces)})",
        param=param,
        rejection=Rejection(model.name, modality.value, "unsupported_output"),
    )


def check(model: ModelConfig, asked: Asked, redirects: Sequence[Any]) -> None:
    """The model a request ends at (after its input redirects) produces what it asks, or
    :class:`UnsupportedOutputModalityError` naming the first output it does not."""
    for m, param in asked:
        if m not in model.produces:
            via = " (redirected " + ", then ".join(f"from '{r.source}'" for r in redirects) + ")" if redirects else ""
            raise unproduced(model, m, param, via)


def decide(
    config: GatewayConfig,
    model: ModelConfig,
    asked: Asked,
    may_use: Callable[[str], bool],
    *,
    may_speak: Callable[[str], bool] = lambda name: False,
    streams: bool = False,
) -> tuple[ModelConfig, Moved | None, str | None]:
    """The model that serves a request asking for ``asked``, the redirect that led there (None:
    the model asked), and the model that speaks its answer (``speak``; None: none); or
    :class:`UnsupportedOutputModalityError` for the first output it does not produce and may not
    be sent for. A redirect's target produces every output asked, so one is the most a request
    takes. ``may_use``: whether the caller may send the request to a model (its key's list, and
    the API); ``may_speak``: whether it may have a model speak the answer (its key's list).
    ``streams``: the request asks for a stream, which a spoken answer is not (400)."""
    for m, param in asked:
        if m in model.produces:
            continue
        policy = model.output_policy(m)
        if policy.action == "speak" and policy.target is not None and may_speak(policy.target):
            if any(o not in model.produces and o is not Modality.AUDIO for o, _ in asked):
                continue  # another output it does not make: that one decides
            if streams:
                raise InvalidRequestError(
                    f"Model '{model.name}' answers in text, spoken by '{policy.target}' once whole: a spoken answer "
                    "does not stream (ask without stream, or for text alone)",
                    param="stream",
                )
            return model, None, policy.target
        target = config.model(policy.target or "") if policy.action == "redirect" else None
        if target is None or not may_use(target.name) or any(o not in target.produces for o, _ in asked):
            raise unproduced(model, m, param)
        return target, (model.name, m, target.name), None
    for m, param in asked:
        if m not in model.produces and m is not Modality.AUDIO:
            raise unproduced(model, m, param)
    return model, None, None


def serving(config: GatewayConfig, model: ModelConfig, api: str, may_use: Callable[[str], bool]) -> ModelConfig:
    """The model that serves a request of an API whose answer is an output (images, edits,
    speech): the one it names, which produces it, or the one its ``on_unsupported_output``
    redirects the output to (that the caller may use, that produces it and serves ``api``); else
    400 ``unsupported_output_modality`` at ``model``."""
    made = Modality(PRODUCING_APIS[api])
    if made in model.produces:
        return model
    policy = model.output_policy(made)
    target = config.model(policy.target or "") if policy.action == "redirect" else None
    if target is None or made not in target.produces or api not in target.apis or not may_use(target.name):
        raise unproduced(model, made, "model")
    return target


def spoken(
    model: ModelConfig, decided: str, audio: Any, asked: Asked, redirects: Sequence[Any], speaker: str | None
) -> str | None:
    """The model that speaks the answer of ``model`` (the one the request ends at): the speaker
    :func:`decide` chose for ``decided``, or, where an input redirect moved the request on, the
    model's own (none where it makes audio itself; 400 where it neither makes nor speaks it); and
    the request's ``audio`` (its voice and format) one a speech API takes: 400 at ``audio.*``."""
    if speaker is not None and model.name != decided:
        policy = model.output_policy(Modality.AUDIO)
        if Modality.AUDIO in model.produces:
            return None
        if policy.action != "speak" or policy.target is None:
            param = next(p for m, p in asked if m is Modality.AUDIO)
            via = " (redirected " + ", then ".join(f"from '{r.source}'" for r in redirects) + ")"
            raise unproduced(model, Modality.AUDIO, param, via)
        speaker = policy.target
    if speaker is None:
        return None
    if audio is not None and not isinstance(audio, dict):
        raise InvalidRequestError("'audio' must be an object: {voice, format}", param="audio")
    settings = audio or {}
    voice, fmt = settings.get("voice"), settings.get("format")
    if voice is not None and not isinstance(voice, str):
        raise InvalidRequestError(
            f"Model '{model.name}' has its answer spoken by '{speaker}', whose voices are named: 'audio.voice' must "
            "be a string",
            param="audio.voice",
        )
    if fmt is not None and fmt not in SPOKEN_FORMATS:
        shown = clip(fmt) if isinstance(fmt, str) else type(fmt).__name__
        raise InvalidRequestError(
            f"unknown audio format '{shown}' (expected one of: {', '.join(SPOKEN_FORMATS)})", param="audio.format"
        )
    return speaker


# chat's audio.format -> the speech API's response_format (pcm16: raw PCM, at the speaking model's rate)
SPOKEN_FORMATS = {"wav": "wav", "mp3": "mp3", "flac": "flac", "opus": "opus", "aac": "aac", "pcm16": "pcm"}


Values = Callable[[str], Any]  # a request's field by name: a JSON body's value, or a form's text (None: absent)


def generation(model: ModelConfig, value: Values, form: bool = False) -> dict[str, str]:
    """An images or edits request (``value`` reads its fields; ``form``: an edit's multipart form,
    whose fields are text) held to the model's ``output_limits`` (its ``n``; its size), and the
    fields to set for it: ``response_format: b64_json`` where the model's images come back inline
    and the request names none (engines differ: SGLang answers a URL, vLLM-Omni base64), and the
    first of ``image_sizes`` where it names no size. A URL asked of such a model is refused: the
    URL an engine writes names a file on the replica that made it (SGLang's
    ``/v1/images/{id}/content``), which no other replica, and not the gateway, can serve."""
    setting: dict[str, str] = {}
    asked = value("response_format")
    if asked == "":  # as the engines read it (SGLang's `or`, FastAPI's empty form field): not given
        asked = None
    if asked is not None and (not isinstance(asked, str) or asked.lower() not in ("url", "b64_json")):
        shown = clip(asked) if isinstance(asked, str) else type(asked).__name__
        raise InvalidRequestError(  # what SGLang (lower-cased) and vLLM-Omni both refuse
            f"unknown response_format '{shown}' (expected b64_json or url)", param="response_format"
        )
    raw_size = value("size")
    if (
        raw_size is not None
        and raw_size not in ("", "auto")
        and (not isinstance(raw_size, str) or not parse_size(raw_size))
    ):
        raise InvalidRequestError(
            "'size' must be WIDTHxHEIGHT (1024x1024; each side at most 6 digits) or auto", param="size"
        )
    limits = model.output_limits
    if limits is not None and limits.of_images:
        if limits.images is not None and (n := _whole(value("n"), "n", form)) is not None and n > limits.images:
            raise TooManyItemsError(
                f"Model '{model.name}' makes at most {limits.images} image(s) per request; 'n' asks {n}",
                param="n",
                rejection=Rejection(model.name, "image", "output_limit"),
            )
        if limits.of_sizes:
            if limits.sizes and not any(value(f) is not None for f in ("size", "width", "height")):
                w, h = limits.sizes[0]
                setting["size"] = f"{w}x{h}"  # the engine's own default may be none the table lists
            else:
                # SGLang's generations read width and height over size, its edits size alone
                _sized(model, limits, value, form, sides=not form)
    if model.image_urls == "shared":
        return setting
    if asked is None:
        setting["response_format"] = "b64_json"
    elif isinstance(asked, str) and asked.lower() == "url":  # SGLang lower-cases it
        raise InvalidRequestError(
            f"Model '{model.name}' returns the images it makes inline: ask 'b64_json' (or no response_format). A URL "
            "would name a file on the replica that made it; the table says image_urls: shared where its replicas "
            "share storage every client reaches",
            param="response_format",
        )
    return setting


def speech(model: ModelConfig, value: Values) -> None:
    """A speech request's ``input`` within the model's ``output_limits.speech_input_chars``: what
    bounds the audio it makes (its seconds are the engine's to know, once made); 400 at ``input``."""
    limits = model.output_limits
    text = value("input")
    if limits is None or limits.speech_chars is None or not isinstance(text, str) or len(text) <= limits.speech_chars:
        return
    raise InvalidRequestError(
        f"Model '{model.name}' speaks at most {limits.speech_chars} characters a request; 'input' has {len(text)}"
        " (send it in parts)",
        param="input",
        rejection=Rejection(model.name, "audio", "output_limit"),
    )


def tool_sizes(model: ModelConfig, body: Mapping[str, Any]) -> None:
    """The ``size`` each Responses ``image_generation`` tool asks for, held to the serving
    model's ``output_limits`` (as an images request's is)."""
    limits, tools = model.output_limits, body.get("tools")
    if limits is None or not limits.of_sizes or not isinstance(tools, list):
        return
    for i, tool in enumerate(tools):
        if isinstance(tool, dict) and tool.get("type") == "image_generation":
            _sized(model, limits, tool.get, False, f"tools[{i}].", sides=False)


def _whole(raw: Any, param: str, form: bool) -> int | None:
    """A field that counts (``n``, ``width``): a whole number (a form's, its ASCII digits; a JSON
    number of no fraction, as pydantic takes it), None when absent."""
    if raw is None:
        return None
    if form and isinstance(raw, str) and (digits := raw.strip()).isascii() and digits.isdigit():
        return int(digits)
    if isinstance(raw, int) and not isinstance(raw, bool):
        return raw
    if isinstance(raw, float) and raw.is_integer():
        return int(raw)
    raise InvalidRequestError(f"'{param}' must be a whole number", param=param)


def _sized(
    model: ModelConfig, limits: OutputLimits, value: Values, form: bool, at: str = "", *, sides: bool = True
) -> None:
    """The size asked is one the model's ``output_limits`` list, within their ``image_pixels``:
    ``size``, and with ``sides`` (SGLang's generations) ``width`` and ``height``, each of which
    wins over its side of ``size``, a side not given taken from SGLang's default size
    (1024x1024) on SGLang. ``auto`` passes (the engine's choice; SGLang refuses it), and a
    request of no size, where SGLang makes its default. ``at``: where the fields lie
    (``tools[1].``: a Responses tool's)."""
    width = _whole(value("width"), f"{at}width", form) if sides else None
    height = _whole(value("height"), f"{at}height", form) if sides else None
    raw = value("size")
    default = SGLANG_SIZE if model.engine == "sglang" else (None, None)
    parts: tuple[int | None, int | None] = default
    if raw == "auto":
        if width is None and height is None:
            return
    elif raw is not None and raw != "":
        parsed = parse_size(raw) if isinstance(raw, str) else None
        if parsed is None:
            raise InvalidRequestError(f"'{at}size' must be WIDTHxHEIGHT (1024x1024) or auto", param=f"{at}size")
        parts = parsed
    elif width is None and height is None and model.engine != "sglang":
        return  # the engine's own default, unknown here
    w = width if width is not None else parts[0]
    h = height if height is not None else parts[1]
    if w is None or h is None:
        missing = f"{at}width" if w is None else f"{at}height"
        raise InvalidRequestError(
            f"'{missing}' is needed with the other side for model '{model.name}' (its output_limits hold the size)",
            param=missing,
        )
    size = (w, h)
    param = f"{at}width" if width is not None else f"{at}height" if height is not None else f"{at}size"
    shown = f"{w}x{h}"
    if limits.sizes and size not in limits.sizes:
        listed = ", ".join(f"{a}x{b}" for a, b in limits.sizes)
        raise InvalidRequestError(
            f"Model '{model.name}' makes images of the sizes {listed}; the request asks {shown}",
            param=param,
            rejection=Rejection(model.name, "image", "output_limit"),
        )
    if limits.pixels is not None and w * h > limits.pixels:
        raise InvalidRequestError(
            f"Model '{model.name}' makes images of at most {limits.pixels} pixels; the request asks {shown}",
            param=param,
            rejection=Rejection(model.name, "image", "output_limit"),
        )


SGLANG_SIZE = (1024, 1024)  # ImageGenerationsRequest.size's default

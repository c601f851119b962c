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
from ..config.keys import OUTPUT_MODALITIES
from ..errors import InvalidRequestError, Rejection, UnsupportedOutputModalityError, clip, did_you_mean
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
    config: GatewayConfig, model: ModelConfig, asked: Asked, may_use: Callable[[str], bool]
) -> tuple[ModelConfig, Moved | None]:
    """The model that serves a request asking for ``asked``, and the redirect that led there (None:
    the model asked); or :class:`UnsupportedOutputModalityError` for the first output it does not
    produce and may not be sent for. A redirect's target produces every output asked, so one is
    the most a request takes. ``may_use``: whether the caller may send this request to a model
    (its key's list, and the API)."""
    for m, param in asked:
        if m in model.produces:
            continue
        policy = model.output_policy(m)
        target = config.model(policy.target or "") if policy.action == "redirect" else None
        if target is None or not may_use(target.name) or any(o not in target.produces for o, _ in asked):
            raise unproduced(model, m, param)
        return target, (model.name, m, target.name)
    return model, None

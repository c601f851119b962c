"""Realtime sessions (``GET /v1/realtime``, a WebSocket in vLLM's realtime protocol): the session
admitted before the upgrade, and each client event checked as it passes.

vLLM's protocol (``vllm/entrypoints/speech_to_text/realtime``): the engine says
``session.created``; the client names its model in ``session.update`` (``{"model": M}``), sends
``input_audio_buffer.commit`` to start, then ``input_audio_buffer.append`` events (``audio``:
base64 PCM16, 16 kHz, mono), and a ``commit`` with ``final: true`` when its audio ends; the engine
answers ``transcription.delta`` events and a ``transcription.done`` with the text and its
``usage``; an ``error`` event (``{"error": message, "code": code}``) says what it refused.

Here (:class:`Session`), before an event passes:

* ``session.update`` may not switch the session to another model (``model``, and OpenAI's
  ``session.model`` and ``session.audio.input.transcription.model``) or ask for an output the model
  does not produce (``session.output_modalities``, ``session.modalities``); the model's name is
  renamed for its upstream;
* ``input_audio_buffer.append`` carries at most ``realtime.max_append_bytes`` of audio, and a
  session sends at most ``realtime.audio_burst_s`` seconds of audio at once, then
  ``realtime.audio_speed`` seconds a second (a client may stream a file faster than it plays, not
  without bound); its seconds are counted.

An event refused is not passed on: the client gets an error event in vLLM's shape naming the
field (``param``), and the session goes on. Anything else passes as sent: the engine's own checks
answer it.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping
from typing import Any

import orjson

from ..config import GatewayConfig, ModelConfig
from ..config.keys import AUDIO_BYTES_PER_S
from ..errors import InvalidRequestError, Rejection, UnsupportedModalityError, clip
from ..modalities import Modality
from .plan import lookup
from .route import Visible

MODEL_FIELDS = (("model",), ("session", "model"), ("session", "audio", "input", "transcription", "model"))
OUTPUT_FIELDS = ("output_modalities", "modalities")  # OpenAI's GA name, and its beta one


def admit_session(config: GatewayConfig, query: Mapping[str, str], visible: Visible) -> ModelConfig:
    """The model a session is for (``?model=M``, with or without OpenAI's ``intent=transcription``),
    as :func:`~gateway.admission.plan.lookup` finds it (400 without one; 404 unknown, or not the
    key's; 400 ``unsupported_api`` where it does not serve ``realtime``), and that takes audio."""
    name = query.get("model")
    if not name:
        raise InvalidRequestError(
            "A realtime session names its model in the URL: GET /v1/realtime?model=MODEL", param="model"
        )
    model = lookup(config, {"model": name}, visible, "realtime")
    if Modality.AUDIO not in model.accepts:  # (check says so of a table that serves it; a table built in code)
        raise UnsupportedModalityError(
            f"Model '{model.name}' does not accept audio input: a realtime session is audio",
            param="model",
            rejection=Rejection(model.name, "audio", "unsupported"),
        )
    return model


class Refusal(Exception):
    """A client event not passed on: the error event the client gets instead, and why (the
    ``reason`` label of gateway_realtime_events_refused_total)."""

    def __init__(self, message: str, code: str, param: str, reason: str) -> None:
        super().__init__(message)
        self.reason = reason
        # json, not orjson: a name the client sent may hold a lone surrogate (escaped here)
        self.event = json.dumps({"type": "error", "error": message, "code": code, "param": param})


class Session:
    """One session's checks of the client's events, and its audio so far."""

    def __init__(self, model: ModelConfig, clock: Callable[[], float] = time.monotonic) -> None:
        self.model, self._clock = model, clock
        bounds = model.realtime
        self._allowance, self._at = bounds.audio_burst_s, clock()  # the audio it may send now, in seconds
        self.audio_s = 0.0  # the audio it sent (its appends passed on), in seconds

    def client_event(self, text: str) -> tuple[str, float]:
        """What to pass on of a client's text frame (as sent, or with its model renamed for the
        upstream), and the seconds of audio it carries; :class:`Refusal` for one that may not pass."""
        try:
            event = orjson.loads(text)
        except orjson.JSONDecodeError:
            try:  # what vLLM reads (json.loads) takes NaN, Infinity and lone surrogates, which orjson does not
                event = json.loads(text)
            except ValueError:
                return text, 0.0  # not JSON to the engine either: it says so
        if not isinstance(event, dict):
            return text, 0.0
        kind = event.get("type")
        if kind == "input_audio_buffer.append":
            return text, self._append(event.get("audio"))
        if kind == "session.update":
            return self._update(event, text), 0.0
        return text, 0.0

    def _append(self, audio: Any) -> float:
        if not isinstance(audio, str):
            return 0.0  # the engine's own check refuses it
        size = max(0, len(audio) * 3 // 4 - (audio.endswith("=") + audio.endswith("==")))
        bounds = self.model.realtime
        if size > bounds.max_append_bytes:
            raise Refusal(
                f"input_audio_buffer.append carries {size} bytes of audio, over the {bounds.max_append_bytes} "
                f"this model takes in one event (realtime.max_append_bytes): send it in smaller appends",
                "audio_too_large",
                "audio",
                "too_large",
            )
        seconds = size / AUDIO_BYTES_PER_S
        now = self._clock()
        allowance = min(bounds.audio_burst_s, self._allowance + (now - self._at) * bounds.audio_speed)
        if seconds > allowance:
            wait = (seconds - allowance) / bounds.audio_speed
            raise Refusal(
                f"audio sent faster than this model takes it ({bounds.audio_speed:g} seconds of audio a second, "
                f"{bounds.audio_burst_s:g} at once): this append's {seconds:.2f}s fit in {wait:.2f}s",
                "audio_too_fast",
                "audio",
                "too_fast",
            )
        self._allowance, self._at = allowance - seconds, now
        self.audio_s += seconds
        return seconds

    def _update(self, event: dict[str, Any], text: str) -> str:
        model = self.model
        for path in MODEL_FIELDS:
            named: Any = event
            for step in path:
                named = named.get(step) if isinstance(named, dict) else None
            if named is not None and named not in (model.name, model.upstream_name):
                param = ".".join(path)
                shown = clip(named) if isinstance(named, str) else type(named).__name__
                raise Refusal(
                    f"This session is for model '{model.name}': '{param}' cannot switch it to '{shown}' "
                    "(open a session of that model)",
                    "model_not_allowed",
                    param,
                    "model",
                )
        session = event.get("session")
        for field in OUTPUT_FIELDS:
            asked = session.get(field) if isinstance(session, dict) else None
            for i, name in enumerate(asked if isinstance(asked, list) else ()):
                if isinstance(name, str) and name not in model.produces:
                    raise Refusal(
                        f"Model '{model.name}' does not produce {clip(name)} output (it produces: "
                        f"{', '.join(model.produces)})",
                        "unsupported_output_modality",
                        f"session.{field}[{i}]",
                        "output",
                    )
        if event.get("model") == model.name and model.upstream_name != model.name:
            return json.dumps({**event, "model": model.upstream_name})  # as vLLM's json reads it
        return text

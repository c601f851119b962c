"""A text model's answer, spoken (``on_unsupported_output: {audio: {speak: MODEL}}``): for a chat
request that asks for audio out of a model that answers in text alone.

The chat completion is asked of the text model as it came (its ``modalities`` and ``audio``
removed: the model makes no audio, and is not asked to), through its pool as a conversion's
requests go (gateway.media.asking: its replicas, breakers, retries and timeouts); then the text
of each choice is asked of the speaking model's speech API (``/v1/audio/speech``, the request's
``audio.voice`` and ``audio.format``), and the answer comes back as OpenAI's chat answers audio:
each message's ``audio`` (``id``, ``data``: the audio in base64, ``expires_at``, ``transcript``:
the text spoken), its ``content`` null. The text model's own refusals (4xx) pass to the client as
they came.
"""

from __future__ import annotations

import base64
import functools
import time
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson

from ..admission.outputs import SPOKEN_FORMATS
from ..config import ModelConfig
from ..config.generation import Generation
from ..errors import InvalidRequestError, UpstreamError, clip
from ..upstream.failures import ReplyTooLargeError, read_capped
from ..upstream.replicas import Pool
from .asking import Asker, Failed, GaveUp, ask, gave_up_error

MAX_REPLY_BYTES = 16 << 20  # a chat answer
MAX_AUDIO_BYTES = 64 << 20  # its text spoken: minutes of WAV
AUDIO_TTL_S = 3600  # what ``expires_at`` says (OpenAI's: the audio may be referred to in a later turn until then)


class Speaker(Asker):
    """Asks a text model for its answer, and a speaking model to say it, over one ClientSession."""

    async def answer(
        self, model: ModelConfig, live: Generation[Pool], data: bytes, request_id: str
    ) -> tuple[int, bytes]:
        """The text model's reply to the chat request ``data``: its status and body, as it came,
        but a status of its ``retries.on_status`` (5xx), tried on its next replica as the chat hop
        tries it; a try that timed out is not made again (a generation would be made twice)."""
        again = frozenset(s for s in model.retries.on_status if s >= 500)  # a 429 is the client's to see

        def judge(status: int, body: bytes) -> tuple[int, bytes] | Failed:
            return Failed(f"HTTP {status}") if status in again else (status, body)

        post = functools.partial(
            self._post, call=_Call(model, live, "/v1/chat/completions", data, request_id, MAX_REPLY_BYTES)
        )
        try:
            return await ask(model, live, self._retries, post, judge, again_after_timeout=False)
        except GaveUp as gave_up:
            raise gave_up_error(
                gave_up, "model", late=f"model '{model.name}' sent no answer in time",
                failed=f"no upstream of model '{model.name}' answered",
            ) from None  # fmt: skip

    async def speak(
        self, speaker: ModelConfig, live: Generation[Pool], text: str, audio: dict[str, Any], request_id: str
    ) -> bytes:
        """``text`` spoken by ``speaker`` (its speech API) in the voice and format the request's
        ``audio`` asks; a voice or format the speaking model refuses is the request's 400 at ``audio``."""
        fmt = SPOKEN_FORMATS[audio.get("format") or "wav"]  # (admission took no other)
        payload = {"model": speaker.upstream_name, "input": text, "response_format": fmt}
        if "voice" in audio:
            payload["voice"] = audio["voice"]

        def judge(status: int, body: bytes) -> bytes | Failed:
            if status == 200:
                return body
            if 400 <= status < 500 and status != 429:
                detail = clip(body.decode("utf-8", "replace"), 300)
                raise InvalidRequestError(
                    f"Speaking model '{speaker.name}' refused to speak the answer (HTTP {status}: {detail})",
                    param="audio",
                )
            return Failed(f"HTTP {status}")

        call = _Call(speaker, live, "/v1/audio/speech", orjson.dumps(payload), request_id, MAX_AUDIO_BYTES)
        post = functools.partial(self._post, call=call)
        try:
            return await ask(speaker, live, self._retries, post, judge)
        except GaveUp as gave_up:
            raise gave_up_error(
                gave_up, "audio", late=f"speaking model '{speaker.name}' sent no audio in time",
                failed=f"no upstream of speaking model '{speaker.name}' could speak the answer",
            ) from None  # fmt: skip

    async def _post(self, replica: str, left: float | None, *, call: _Call) -> tuple[int, bytes]:
        """One try of ``call`` on ``replica``: its status and body."""
        assert self._session is not None, "Speaker.start() was not called"
        headers = self.headers(call.target, call.live, call.request_id, **{"Content-Type": "application/json"})
        t = call.target.timeouts
        timeout = aiohttp.ClientTimeout(total=left, connect=t.connect_s, sock_read=t.first_byte_s)
        async with self._session.post(
            f"{replica}{call.path}", data=call.data, headers=headers, timeout=timeout
        ) as resp:
            try:
                return resp.status, await read_capped(resp, call.most)
            except ReplyTooLargeError:  # the request's size, not the replica's failing: not tried again
                raise UpstreamError(
                    f"Model '{call.target.name}' answered over {call.most} bytes: too large to speak"
                ) from None


@dataclass(frozen=True, slots=True)
class _Call:
    """One request a spoken answer makes of a model of the table: where, what, and its reply's bound."""

    target: ModelConfig
    live: Generation[Pool]
    path: str
    data: bytes
    request_id: str
    most: int


def spoken(message: dict[str, Any], audio: bytes, request_id: str, index: int) -> None:
    """``message`` answered in audio as OpenAI's chat answers it: its text the transcript."""
    message["audio"] = {
        "id": f"audio_{request_id}_{index}",
        "data": base64.b64encode(audio).decode(),
        "expires_at": int(time.time()) + AUDIO_TTL_S,
        "transcript": message.get("content") or "",
    }
    message["content"] = None

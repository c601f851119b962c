"""Audio a model cannot take, served as its transcript (``on_unsupported: {audio: {transcribe: M}}``).

Each audio part of the request (``input_audio``: base64 data with its format; ``audio_url``: a
data URL or an http(s) URL fetched under the ``media:`` rules) goes to one of model M's upstreams
as the OpenAI transcription request, ``POST /v1/audio/transcriptions`` with a multipart ``file``
and ``model`` (M's upstream name), as vLLM serves Whisper. The part is replaced by a text part
holding the transcript, marked as such. A replica that refuses, resets, times out or answers 5xx
is passed over to the next (M's pool: its choice, breakers and timeouts); a 4xx is the audio's
fault (400 ``invalid_audio``). When every replica failed: 502 ``upstream_error`` / 504
``upstream_timeout`` naming the part, or, with ``on_error: reject``, the 400 the model's
rejection would have been. What is lost: everything but the words (tone, speakers, music,
timing).
"""

from __future__ import annotations

import asyncio
import base64
import functools
import io
import logging
import math
import wave
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

import aiohttp

from ..admission.parts import Part
from ..admission.route import RoutePlan
from ..config import MediaConfig, ModelConfig
from ..config.generation import Generation
from ..errors import (
    GatewayError,
    InvalidAudioError,
    MediaRefusedError,
    Rejection,
    UnsupportedModalityError,
    UpstreamError,
    error_detail,
)
from ..modalities import Modality
from ..upstream.failures import read_capped
from ..upstream.replicas import Pool
from .asking import MEDIA_FAULTS, Asker, Failed, GaveUp, ask, gave_up_error, json_object
from .demux import AUDIO_FORMATS, UnreadableMediaError, open_media
from .fetch import DECODE_IN_THREAD_CHARS, sha256

log = logging.getLogger(__name__)
TRANSCRIPT = "[Transcript of the user's audio] "  # marks the text part that replaced an audio part
MAX_REPLY_BYTES = 4 << 20  # a transcript: words, a few KB
MIN_BITRATE = 6000  # bits a second: Opus's lowest; no clip holds more seconds than its bytes at this rate
FORMATS = {"wav": "audio/wav", "mp3": "audio/mpeg", "flac": "audio/flac", "ogg": "audio/ogg", "webm": "audio/webm",
           "m4a": "audio/mp4", "mp4": "audio/mp4", "mpeg": "audio/mpeg", "mpga": "audio/mpeg"}  # fmt: skip


class Transcriber(Asker):
    """Sends audio parts to a transcription model's upstreams over one ClientSession."""

    async def transcribe(
        self, plan: RoutePlan, body: dict[str, Any], live: Generation[Pool], *, request_id: str
    ) -> dict[tuple[int, int], dict[str, Any]]:
        """The text part that replaces each audio part of ``plan.transcribe_parts``."""
        policy = plan.model.policy(Modality.AUDIO)
        target = live.config.model(policy.target or "")
        if target is None:  # validation forbids it; a config built in code may not
            raise UpstreamError(f"Transcription model '{policy.target}' does not exist")
        job = _Job(plan, target, live, request_id)
        convert = functools.partial(self._one, job=job)
        return await self.each_part(plan, body, plan.transcribe_parts, convert, marked=TRANSCRIPT)

    async def _one(self, value: Mapping[str, Any], part: Part, *, job: _Job) -> str:
        audio, fmt = await self._audio(value, part, job.plan.model.name, job.live.config.media)
        clip = _Clip(audio, fmt, part)
        make = functools.partial(self._transcribe, clip, job)
        cache = self._cache
        if cache.enabled:  # the same clip again (a later turn, a parallel request): one transcription
            key = ("transcript", job.target.name, job.target.upstream_name, await sha256(audio), fmt)
            # an empty transcript is not kept: the next turn asks again
            try:
                text, seconds = await cache.get_or_make(
                    key,
                    make,
                    size_of=lambda v: len(v[0].encode()),
                    keep=lambda v: bool(v[0].strip()),
                    shared_errors=(InvalidAudioError,),  # refused by the transcription model: it would be again
                )
            except InvalidAudioError as exc:  # the clip's fault, maybe found by a request that carried it too
                raise exc.located_at(part.location) from None
        else:
            text, seconds = await make()
        self._metrics.audio_transcribed_seconds.labels(job.plan.model.name).inc(seconds)
        return text

    async def _transcribe(self, clip: _Clip, job: _Job) -> tuple[str, float]:
        """The clip's transcript and its seconds, from one of the transcription model's upstreams
        (gateway.media.asking: its pool, retries and budget, within ``timeouts.total_s``)."""
        assert self._session is not None, "Transcriber.start() was not called"
        target, part = job.target, clip.part
        replies: list[dict[str, Any]] = []

        def judge(status: int, data: bytes) -> str | Failed:
            if status in MEDIA_FAULTS:  # the audio's fault
                raise InvalidAudioError(
                    f"{part.location}: transcription model '{target.name}' could not transcribe the audio "
                    f"(HTTP {status}{error_detail(data)})",
                    param=part.location,
                    rejection=Rejection(job.plan.model.name, "audio", "media_refused"),
                )
            reply = json_object(data) if status == 200 else None
            text = reply.get("text") if reply is not None else None
            if reply is None or not isinstance(text, str):  # failing, busy, or not a transcription server
                return Failed(f"HTTP {status}" if status != 200 else "not a transcription reply")
            replies.append(reply)
            return text

        post = functools.partial(self._post, clip=clip, job=job)
        try:
            text = await ask(target, job.live, self._retries, post, judge)
        except GaveUp as gave_up:
            named = f"transcription model '{target.name}'"
            raise gave_up_error(
                gave_up,
                part.location,
                late=f"{named} sent no transcript in time",
                failed=f"no upstream of {named} could transcribe the audio",
            ) from None
        return text, await _seconds(replies[-1], clip.audio, clip.fmt)

    async def _post(self, url: str, left: float | None, *, clip: _Clip, job: _Job) -> tuple[int, bytes]:
        """One try: the transcription request, its reply's status and (small) body."""
        assert self._session is not None
        target = job.target
        headers = self.headers(target, job.live, job.request_id)
        t = target.timeouts
        timeout = aiohttp.ClientTimeout(total=left, connect=t.connect_s, sock_read=t.first_byte_s)
        form = aiohttp.FormData()
        form.add_field("model", target.upstream_name)
        form.add_field("response_format", "json")
        mime = FORMATS.get(clip.fmt, "application/octet-stream")
        form.add_field("file", clip.audio, filename=f"audio.{clip.fmt}", content_type=mime)
        async with self._session.post(
            f"{url}/v1/audio/transcriptions", data=form, headers=headers, timeout=timeout
        ) as resp:
            return resp.status, await read_capped(resp, MAX_REPLY_BYTES)

    async def _audio(self, value: Mapping[str, Any], part: Part, model: str, media: MediaConfig) -> tuple[bytes, str]:
        """The audio's bytes and format (wav, mp3, ...)."""
        flat = part.type == "input_audio" and isinstance(value.get("data"), str)  # older Responses SDKs' shape
        if part.type not in ("input_audio", "audio_url") or (value.get(part.type) is None and not flat):
            what = "embeddings" if part.type == "audio_embeds" else "a cached reference (no audio)"
            raise UnsupportedModalityError(
                f"Model '{model}' does not accept audio input, and {part.location} ('{part.type}') cannot be "
                f"transcribed: it carries {what}",
                param=part.location,
                rejection=Rejection(model, "audio", "unsupported"),
            )
        refused = Rejection(model, "audio", "media_refused")
        if part.type == "input_audio":
            inner = value if flat else value["input_audio"]  # classification checked its shape
            fmt = str(inner.get("format", "wav")).lower()
            encoded = inner["data"]
            limit = self._fetcher.max_bytes("audio", media)
            too_large = MediaRefusedError(
                f"{part.location}: Audio is larger than media.max_audio_bytes ({limit} bytes)",
                param=part.location,
                rejection=refused,
            )
            if len(encoded) // 4 * 3 > limit + 2:  # refused before decoding
                raise too_large
            try:
                if len(encoded) > DECODE_IN_THREAD_CHARS:  # 25 MB of base64 holds the loop for 30 ms
                    data = await asyncio.to_thread(base64.b64decode, encoded, validate=True)
                else:
                    data = base64.b64decode(encoded, validate=True)
            except ValueError:
                raise InvalidAudioError(
                    f"{part.location}: 'input_audio.data' is not base64", param=part.location, rejection=refused
                ) from None
            if len(data) > limit:
                raise too_large
            return data, fmt
        audio_url = value.get("audio_url")
        url = audio_url.get("url") if isinstance(audio_url, dict) else audio_url
        if not isinstance(url, str) or not url:
            raise InvalidAudioError(
                f"{part.location}: the audio part carries no URL", param=part.location, rejection=refused
            )
        try:
            data = await self._fetcher.load(url, "audio", media)
        except GatewayError as exc:
            kind = MediaRefusedError if isinstance(exc, MediaRefusedError) else InvalidAudioError
            raise kind(f"{part.location}: {exc.message}", param=part.location, rejection=refused) from None
        return data, _format_of(url)


@dataclass(frozen=True, slots=True)
class _Job:
    """What every clip of one request is transcribed for, and by whom."""

    plan: RoutePlan  # the requested model's
    target: ModelConfig  # the transcription model
    live: Generation[Pool]  # its pool and key, of the request's generation
    request_id: str


class _Clip(NamedTuple):
    audio: bytes
    fmt: str  # wav, mp3, ...
    part: Part  # the request's part, which errors name


def _format_of(url: str) -> str:
    if url.startswith("data:"):
        mime = url[5:].split(";", 1)[0].split(",", 1)[0].lower()
        sub = mime.split("/", 1)[-1] if "/" in mime else ""
        return {"mpeg": "mp3", "x-wav": "wav", "wave": "wav", "x-flac": "flac"}.get(sub, sub or "wav")
    path = url.split("?", 1)[0].rsplit("/", 1)[-1]
    ext = path.rsplit(".", 1)[-1].lower() if "." in path else ""
    return ext if ext in FORMATS else "wav"


async def _seconds(reply: Mapping[str, Any], audio: bytes, fmt: str) -> float:
    """:func:`_duration`, read off the loop. A counter never fails a request: what cannot be
    read counts 0."""
    try:
        return await asyncio.to_thread(_duration, reply, audio, fmt)
    except Exception as exc:  # one line, no traceback: a client's file could make many
        log.warning("the length of a %s clip could not be read; counted as 0 s: %r", fmt, exc)
        return 0.0


def _duration(reply: Mapping[str, Any], audio: bytes, fmt: str) -> float:
    """Seconds of audio, as read from the clip's own bytes: a WAV's samples that are there, or the
    length the container states (mp3, flac, ogg, ...: PyAV, where the video extra is installed);
    the reply's ``duration`` (verbose replies) only where neither says. Never more than the bytes
    could hold at :data:`MIN_BITRATE`: a header or a reply may claim anything."""
    most = len(audio) * 8 / MIN_BITRATE
    seconds = _wav_seconds(audio) if fmt == "wav" else None
    if seconds is None:
        seconds = _stated_seconds(audio)
    if seconds is None:
        duration = reply.get("duration")
        seconds = float(duration) if isinstance(duration, int | float) and duration >= 0 else 0.0
    return min(seconds, most) if math.isfinite(seconds) else 0.0


def _wav_seconds(audio: bytes) -> float | None:
    """A WAV's seconds: the frames its header states, at most those its bytes hold."""
    try:
        with wave.open(io.BytesIO(audio)) as w:
            frames, rate = int(w.getnframes()), int(w.getframerate())
            size = int(w.getnchannels()) * int(w.getsampwidth())
    except (wave.Error, EOFError, RuntimeError, ValueError, OverflowError):
        # a WAV the wave module cannot read (float samples, extensible headers: FFmpeg can), or a
        # header that lies about its chunks (the wave module's RuntimeError, seeking past the end)
        return None
    if not rate or not size:
        return 0.0
    return min(frames, len(audio) // size) / rate


def _stated_seconds(audio: bytes) -> float | None:
    try:
        container = open_media(audio, AUDIO_FORMATS)
    except (ImportError, UnreadableMediaError):  # no PyAV (the video extra), or not audio FFmpeg reads
        return None
    try:
        duration: int | None = container.duration  # microseconds (AV_TIME_BASE)
    except Exception:  # whatever FFmpeg makes of a file it cannot read: not counted, not an error
        return None
    finally:
        container.close()
    return duration / 1_000_000 if duration is not None and duration > 0 else None

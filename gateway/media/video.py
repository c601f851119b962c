"""A video as a few sampled frames (issue 13: video served to models that take images only).

:func:`sample_frames` decodes a video with PyAV (FFmpeg, shipped in the ``av`` wheel: the
``video`` extra) and returns N frames spread evenly over its duration (or ``fps`` a second,
capped by N), each scaled to fit ``max_side`` and encoded as JPEG, with its timestamp. It seeks
to each sample's time rather than decoding the whole file: a long video costs N seeks and the
frames between a keyframe and each sample. It is synchronous and CPU-bound: callers run it on the
process's decoding threads (gateway.media.decoders). Only container formats that read nothing but the
bytes given are opened (gateway.media.demux). Hostile input is bounded by the byte size the caller
allows, ``max_seconds``, ``max_pixels`` (one frame) and a :class:`Budget` of the work itself:
pixels decoded (a keyframe and hundreds of frames after it cost what they cost once, not once a
sample), a deadline, and a stop flag set when nobody waits any more. Undecodable, truncated or
oversized files are :class:`InvalidVideoError` (400 ``invalid_video``), never a crash.

What a model loses this way: motion between the samples, and the sound.
"""

from __future__ import annotations

import base64
import functools
import math
import threading
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from fractions import Fraction
from typing import TYPE_CHECKING, Any, TypeVar

from ..admission.parts import Part
from ..admission.plan import EXPAND
from ..admission.route import RoutePlan
from ..errors import DecodersBusyError, GatewayError, InvalidVideoError, MediaRefusedError, Rejection
from ..modalities import Modality
from .conversions import ConversionCache
from .decoders import DecoderPool
from .demux import VIDEO_FORMATS, VIDEO_NAMES, UnreadableMediaError, open_media, reason
from .fetch import sha256

if TYPE_CHECKING:
    from ..config import MediaConfig
    from ..metrics import GatewayMetrics
    from .fetch import MediaFetcher

T = TypeVar("T")

MAX_SECONDS = 3600.0  # a longer video is refused before any frame is decoded
MAX_PIXELS = 3840 * 2160  # one frame's width x height
# What sampling may decode, in pixels (frames decoded x their size, the frames between a keyframe
# and a sample included): one video at most VIDEO_PIXELS; a request starts no more decodes once its
# videos have spent REQUEST_PIXELS (so it spends at most REQUEST_PIXELS + VIDEO_PIXELS).
# 2 Gpx is 240 frames of 4K, 1,000 of 1080p, 2,200 of 720p: what 8 samples of a 1080p video take
# with libx264's default keyframe interval (250 frames). A video that needs more gets frames near
# its sample times rather than at them (each sample's share spent, the frame reached stands for
# it), never more work.
VIDEO_PIXELS = 2_000_000_000
REQUEST_PIXELS = 4_000_000_000
MIN_FRAME_PIXELS = 256 * 256  # what a frame costs at least (tiny frames cost their decoding's overhead)
DECODE_S = 30.0  # one video's decoding, and a request's before it starts no more (a wait for a thread apart)


@dataclass(frozen=True, slots=True)
class Frame:
    seconds: float  # its time in the video
    jpeg: bytes
    width: int
    height: int


@dataclass(slots=True)
class Budget:
    """What a decode may still spend: ``pixels`` decoded, until ``deadline`` (time.monotonic),
    and ``stop``, which the event loop sets when nobody waits for the decode any more (checked
    between two frames). :func:`sample_frames` takes what it spends from ``pixels``."""

    pixels: int = VIDEO_PIXELS
    deadline: float = math.inf
    stop: threading.Event = field(default_factory=threading.Event)

    def charge(self, pixels: int) -> None:
        if self.stop.is_set():
            raise DecodeStopped
        if time.monotonic() > self.deadline:
            raise InvalidVideoError(f"the video took over {DECODE_S:g}s to sample")
        self.pixels -= max(pixels, MIN_FRAME_PIXELS)


class DecodeStopped(Exception):
    """Nobody waits for the decode any more: it stopped between two frames."""


@dataclass(frozen=True, slots=True)
class Bounds:
    """What a video may be: ``max_seconds`` long, frames of ``max_pixels`` each."""

    max_seconds: float = MAX_SECONDS
    max_pixels: int = MAX_PIXELS


def sample_frames(
    data: bytes,
    *,
    frames: int,
    fps: float | None = None,
    max_side: int = 768,
    bounds: Bounds = Bounds(),
    budget: Budget | None = None,
) -> list[Frame]:
    """``frames`` frames of the video in ``data``, evenly spread (each in the middle of its
    share of the duration), or ``fps`` a second when that gives fewer; in time order. The
    decoding is bounded by ``budget`` (a video's allowance by default)."""
    try:
        import av
    except ImportError as exc:  # pragma: no cover - serve and reloads refuse a config that needs it
        raise RuntimeError("video sampling needs PyAV: pip install 'modality-gateway[video]'") from exc
    try:
        container = open_media(data, VIDEO_FORMATS)
    except UnreadableMediaError as exc:
        raise InvalidVideoError(f"the video cannot be decoded ({exc}; the gateway reads {VIDEO_NAMES})") from None
    try:
        wanted = _Wanted(frames, fps, max_side, bounds.max_seconds, bounds.max_pixels)
        return _sample(container, av, wanted, budget or Budget())
    except (InvalidVideoError, DecodeStopped):
        raise
    except Exception as exc:  # FFmpeg's errors, and what a hostile file makes of arithmetic (overflows)
        raise InvalidVideoError(f"the video cannot be decoded ({reason(exc)})") from None
    finally:
        container.close()


@dataclass(frozen=True, slots=True)
class _Wanted:
    frames: int
    fps: float | None
    max_side: int
    max_seconds: float
    max_pixels: int


def _sample(container: Any, av: Any, wanted: _Wanted, budget: Budget) -> list[Frame]:
    if not container.streams.video:
        raise InvalidVideoError("the file has no video stream")
    stream = container.streams.video[0]
    stream.codec_context.thread_count = 1  # a decode is one thread: the process bounds how many run
    width, height = stream.codec_context.width, stream.codec_context.height
    if width <= 0 or height <= 0 or width * height > wanted.max_pixels:
        raise InvalidVideoError(f"the video's frames are {width}x{height}, over the {wanted.max_pixels} pixels allowed")
    duration = _duration(container, stream)
    if duration > wanted.max_seconds:
        raise InvalidVideoError(f"the video lasts {duration:.0f}s, over the {wanted.max_seconds:g}s allowed")
    fps, count = wanted.fps, wanted.frames
    if fps is not None and duration > 0:
        count = max(1, min(count, math.floor(duration * fps)))
    times = [duration * (i + 0.5) / count for i in range(count)] if duration > 0 else [0.0]
    scale = min(1.0, wanted.max_side / max(width, height))
    out_w, out_h = max(2, round(width * scale) // 2 * 2), max(2, round(height * scale) // 2 * 2)
    encoder = av.CodecContext.create("mjpeg", "w")
    encoder.width, encoder.height, encoder.pix_fmt = out_w, out_h, "yuvj420p"
    encoder.time_base = Fraction(1, 1000)
    reader = _Reader(container, stream, wanted.max_pixels, budget)
    sampled: list[Frame] = []
    for n, t in enumerate(times):
        if budget.pixels < max(width * height, MIN_FRAME_PIXELS):  # not even one more frame: those it has
            if sampled:
                break
            raise InvalidVideoError("the video needs more decoding to sample than its budget allows")
        # this sample's share: twice an even one, for samples need unequal work (how far back their
        # keyframe is), never more than is left; what it leaves goes to the next ones
        frame = reader.frame_at(t, share=min(budget.pixels, 2 * budget.pixels // (count - n)))
        if frame is None:
            if sampled:  # a file that ends before its stated duration: the frames it had
                break
            raise InvalidVideoError("the video has no frame that decodes")
        seconds = (frame.time - reader.start) if frame.time is not None else t
        if sampled and seconds <= sampled[-1].seconds:  # the same frame again (past the end, a long GOP)
            continue
        image = frame.reformat(width=out_w, height=out_h, format="yuvj420p")
        packets = list(encoder.encode(image))
        jpeg = b"".join(bytes(p) for p in packets)
        if not jpeg:  # mjpeg emits one packet a frame; flush if it held one back
            jpeg = b"".join(bytes(p) for p in encoder.encode(None))
        sampled.append(Frame(max(0.0, seconds), jpeg, out_w, out_h))
    return sampled


class _Reader:
    """A video stream's frames at given times, each decoded from the keyframe before it, every
    frame charged to the budget."""

    def __init__(self, container: Any, stream: Any, max_pixels: int, budget: Budget) -> None:
        self._container, self._stream = container, stream
        self._max_pixels, self._budget = max_pixels, budget
        self._time_base = float(stream.time_base) if stream.time_base else 0.0
        known = stream.start_time is not None and self._time_base
        self.start = float(stream.start_time * stream.time_base) if known else 0.0

    def frame_at(self, t: float, *, share: int) -> Any:
        """The frame at ``t``, or the last one decoded when ``share`` pixels run out first; None
        when nothing decodes."""
        if self._time_base:
            target = int((self.start + t) / self._time_base)
            self._container.seek(target, stream=self._stream, backward=True, any_frame=False)
        frame = None
        spent = 0
        for candidate in self._container.decode(self._stream):
            pixels = candidate.width * candidate.height
            if pixels > self._max_pixels:  # a stream may change size mid-file
                raise InvalidVideoError(f"a frame is {candidate.width}x{candidate.height}, over the pixels allowed")
            self._budget.charge(pixels)
            spent += max(pixels, MIN_FRAME_PIXELS)
            frame = candidate
            if candidate.time is None or candidate.time - self.start >= t - 1e-6:
                break
            if spent + pixels > share or self._budget.pixels < pixels:  # spent: the frame reached stands for it
                break
        return frame


def _duration(container: Any, stream: Any) -> float:
    if stream.duration is not None and stream.time_base:
        return float(stream.duration * stream.time_base)
    if container.duration is not None:
        return float(container.duration) / 1_000_000
    if stream.frames and stream.average_rate:
        return float(stream.frames / stream.average_rate)
    return 0.0


@dataclass(slots=True)
class Account:
    """What a request's videos have left to spend decoding, all together (they are sampled one
    after another): ``pixels`` and ``seconds`` on the decoding threads. A request starts no decode
    once either is spent; each decode has a video's own budget (VIDEO_PIXELS, DECODE_S), so that
    what it makes is the video's alone, the same for every request that shares or finds it."""

    pixels: int = field(default_factory=lambda: REQUEST_PIXELS)
    seconds: float = field(default_factory=lambda: DECODE_S)

    @property
    def spent(self) -> bool:
        return self.pixels <= 0 or self.seconds <= 0


@dataclass(frozen=True, slots=True)
class Sampling:
    """What sampling a request's videos uses: the fetcher and the ``media:`` rules of the request's
    config generation, the metrics, the
    decoding threads, the cache of what was sampled before (gateway.media.conversions), and what the
    request may still spend decoding."""

    model: str  # the request's model, as metrics and rejections name it
    fetcher: MediaFetcher
    media: MediaConfig
    metrics: GatewayMetrics
    decoders: DecoderPool
    cache: ConversionCache
    account: Account = field(default_factory=Account)


async def frames_for(
    plan: RoutePlan, body: dict[str, Any], sampling: Sampling
) -> dict[tuple[int, int], dict[str, Any]]:
    """Each ``video_url`` part of ``plan.frame_parts`` as its sampled frames: image parts (JPEG
    data URLs), each after a text part with its time when the policy has ``timestamps``."""
    policy = plan.model.policy(Modality.VIDEO)
    shape = (plan.frames_per_video, policy.fps, policy.max_side, policy.timestamps)
    work = functools.partial(
        _frame_parts, frames=plan.frames_per_video, fps=policy.fps, max_side=policy.max_side,
        timestamps=policy.timestamps,
    )  # fmt: skip
    out: dict[tuple[int, int], dict[str, Any]] = {}
    for part in plan.frame_parts:
        position, _, (parts, jpegs) = await _sample_part(part, body, sampling, ("frames", *shape), work, _frames_size)
        # the JPEGs too, by their index in parts: an encoder takes them as they are. The parts are
        # copies: the cache keeps the originals
        out[position] = {"type": EXPAND, "parts": [dict(p) for p in parts], "frames": jpegs}
    return out


Frames = tuple[list[dict[str, Any]], dict[int, bytes]]


def _frame_parts(
    data: bytes, budget: Budget, *, frames: int, fps: float | None, max_side: int, timestamps: bool
) -> tuple[Frames, int]:
    """In a decoding thread: the frames as chat parts (base64 made here, not on the event loop),
    and each frame's JPEG by the index of its part."""
    parts: list[dict[str, Any]] = []
    jpegs: dict[int, bytes] = {}
    sampled = sample_frames(data, frames=frames, fps=fps, max_side=max_side, budget=budget)
    for frame in sampled:
        if timestamps:
            parts.append({"type": "text", "text": f"[Video frame at {frame.seconds:.1f}s]"})
        jpegs[len(parts)] = frame.jpeg
        url = "data:image/jpeg;base64," + base64.b64encode(frame.jpeg).decode()
        parts.append({"type": "image_url", "image_url": {"url": url}})
    return (parts, jpegs), len(sampled)


def _frames_size(frames: Frames) -> int:
    """Bytes a video's frames hold: each JPEG, its base64 in a data URL (4/3 of it), and the three
    dicts and strings of its parts (~700 bytes: tracemalloc)."""
    return sum(len(jpeg) * 7 // 3 + 700 for jpeg in frames[1].values())


async def presampled_for(
    plan: RoutePlan, body: dict[str, Any], sampling: Sampling
) -> dict[tuple[int, int], dict[str, Any]]:
    """For a model with ``video: {sample: ...}``: each ``video_url`` part with its URL replaced by
    vLLM's pre-sampled form, ``data:video/jpeg;base64,<frame>,<frame>,...`` (vLLM's VideoMediaIO
    reads it as the frames of one video), so the whole file never reaches the engine."""
    policy = plan.model.video_sample
    assert policy is not None
    work = functools.partial(_presampled_url, frames=policy.frames, fps=policy.fps, max_side=policy.max_side)
    key = ("presample", policy.frames, policy.fps, policy.max_side)
    out: dict[tuple[int, int], dict[str, Any]] = {}
    for part in plan.presample_parts:
        position, original, url = await _sample_part(part, body, sampling, key, work, len)
        value = original.get("video_url")
        kept = value if isinstance(value, dict) else {}
        out[position] = {**original, "video_url": {**kept, "url": url}}
    return out


def _presampled_url(data: bytes, budget: Budget, *, frames: int, fps: float | None, max_side: int) -> tuple[str, int]:
    sampled = sample_frames(data, frames=frames, fps=fps, max_side=max_side, budget=budget)
    return "data:video/jpeg;base64," + ",".join(base64.b64encode(f.jpeg).decode() for f in sampled), len(sampled)


async def _sample_part(
    part: Part,
    body: dict[str, Any],
    sampling: Sampling,
    shape: tuple[Hashable, ...],
    work: Callable[[bytes, Budget], tuple[T, int]],
    size_of: Callable[[T], int],
) -> tuple[tuple[int, int], dict[str, Any], T]:
    """A video part's position, the part, and what ``work`` (on the decoding threads) made of its
    bytes: fetched or decoded from its data URL, sampled (or found in the cache under ``shape``
    and the bytes' sha256), counted. A request that leaves gives up its place in the threads'
    queue, and stops its decode between two frames."""
    assert part.index is not None
    model = sampling.model
    original: dict[str, Any] = body["messages"][part.message]["content"][part.index]
    value = original.get("video_url")
    url = value.get("url") if isinstance(value, dict) else value
    refused = Rejection(model, Modality.VIDEO.value, "media_refused")
    if not isinstance(url, str) or not url:
        raise InvalidVideoError(
            f"{part.location}: the video part carries no URL", param=part.location, rejection=refused
        )
    data = await load_bytes(sampling, url, part.location, refused)
    metrics, cache = sampling.metrics, sampling.cache
    key = (*shape, await sha256(data)) if cache.enabled else None
    if sampling.account.spent and (key is None or key not in cache):  # a decode it may not start
        raise InvalidVideoError(
            f"{part.location}: the request's videos need more decoding than a request may spend "
            f"({REQUEST_PIXELS / 1e9:g} Gpx, {DECODE_S:g}s); send fewer or shorter videos",
            param=part.location,
            rejection=refused,
        )

    async def decode() -> tuple[T, int]:
        started = time.perf_counter()
        made = await _decode(sampling, functools.partial(work, data), part.location, refused)
        metrics.video_decode_seconds.labels(model).observe(time.perf_counter() - started)
        return made

    try:
        if key is None:
            result, count = await decode()
        else:  # the same video sampled the same way (a later turn, a parallel request): once
            # what the video made, or its fault, is the same for every request that carries it; so
            # is a full queue, which each would otherwise wait out again
            shared = (InvalidVideoError, DecodersBusyError)
            result, count = await cache.get_or_make(key, decode, lambda v: size_of(v[0]), shared_errors=shared)
    except InvalidVideoError as exc:  # this video's fault, maybe found by a request that carried it too
        raise exc.located_at(part.location) from None
    except DecodersBusyError as exc:
        metrics.video_decode_shed.labels(model, exc.reason).inc()
        raise
    metrics.video_frames.labels(model).inc(count)
    return (part.message, part.index), original, result


async def load_bytes(sampling: Sampling, url: str, location: str, refused: Rejection) -> bytes:
    """A video part's bytes: its data URL decoded, or fetched within the request's ``media:`` rules."""
    try:
        return await sampling.fetcher.load(url, "video", sampling.media)
    except GatewayError as exc:
        kind = MediaRefusedError if isinstance(exc, MediaRefusedError) else InvalidVideoError
        raise kind(f"{location}: {exc.message}", param=location, rejection=refused) from None


async def _decode(
    sampling: Sampling, work: Callable[[Budget], tuple[T, int]], location: str, refused: Rejection
) -> tuple[T, int]:
    """``work`` on a decoding thread, within a video's budget, what it spent taken from the
    request's account; its errors located at the part."""
    account = sampling.account

    def bounded(stop: threading.Event) -> tuple[T, int]:  # on the thread: the clock starts there
        began = time.monotonic()
        budget = Budget(VIDEO_PIXELS, began + DECODE_S, stop)
        try:
            return work(budget)
        finally:
            account.pixels -= VIDEO_PIXELS - budget.pixels
            account.seconds -= time.monotonic() - began

    try:
        return await sampling.decoders.run(bounded)
    except InvalidVideoError as exc:
        raise InvalidVideoError(f"{location}: {exc.message}", param=location, rejection=refused) from None

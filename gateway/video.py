"""A video as a few sampled frames (issue 13: video served to models that take images only).

:func:`sample_frames` decodes a video with PyAV (FFmpeg, shipped in the ``av`` wheel: the
``video`` extra) and returns N frames spread evenly over its duration (or ``fps`` a second,
capped by N), each scaled to fit ``max_side`` and encoded as JPEG, with its timestamp. It seeks
to each sample's time rather than decoding the whole file: a long video costs N seeks and the
frames between a keyframe and each sample. It is synchronous and CPU-bound (callers run it in a
thread, bounded); hostile input is bounded by the byte size the caller allows, ``max_seconds``,
``max_pixels`` (one frame) and the decode budget: undecodable, truncated or oversized files are
:class:`InvalidVideoError` (400 ``invalid_video``), never a crash.

What a model loses this way: motion between the samples, and the sound.
"""

from __future__ import annotations

import asyncio
import base64
import functools
import io
import math
import time
from collections.abc import Callable, Hashable
from concurrent.futures import Executor
from dataclasses import dataclass
from fractions import Fraction
from typing import TYPE_CHECKING, Any, TypeVar

from .admission import EXPAND, RoutePlan
from .conversions import ConversionCache
from .media import sha256
from .modality import Modality, Part

if TYPE_CHECKING:
    from .media import MediaFetcher
    from .metrics import GatewayMetrics

from .errors import GatewayError, InvalidRequestError, MediaRefusedError, Rejection

T = TypeVar("T")

MAX_SECONDS = 3600.0  # a longer video is refused before any frame is decoded
MAX_PIXELS = 3840 * 2160  # one frame's width x height
MAX_DECODED = 20_000  # frames decoded in all (between keyframes and samples), whatever the file says


class InvalidVideoError(InvalidRequestError, code="invalid_video"): ...


@dataclass(frozen=True, slots=True)
class Frame:
    seconds: float  # its time in the video
    jpeg: bytes
    width: int
    height: int


def sample_frames(
    data: bytes,
    *,
    frames: int,
    fps: float | None = None,
    max_side: int = 768,
    max_seconds: float = MAX_SECONDS,
    max_pixels: int = MAX_PIXELS,
) -> list[Frame]:
    """``frames`` frames of the video in ``data``, evenly spread (each in the middle of its
    share of the duration), or ``fps`` a second when that gives fewer; in time order."""
    try:
        import av
    except ImportError as exc:  # pragma: no cover - the video extra is installed with the gateway
        raise RuntimeError("video sampling needs PyAV: pip install 'modality-gateway[video]'") from exc
    try:
        container = av.open(io.BytesIO(data), mode="r", metadata_errors="ignore")
    except (av.FFmpegError, ValueError, OSError) as exc:
        raise InvalidVideoError(f"the video cannot be decoded ({_reason(exc)})") from None
    try:
        return _sample(container, av, frames, fps, max_side, max_seconds, max_pixels)
    except InvalidVideoError:
        raise
    except Exception as exc:  # FFmpeg's errors, and what a hostile file makes of arithmetic (overflows)
        raise InvalidVideoError(f"the video cannot be decoded ({_reason(exc)})") from None
    finally:
        container.close()


def _sample(
    container: Any, av: Any, frames: int, fps: float | None, max_side: int, max_seconds: float, max_pixels: int
) -> list[Frame]:
    if not container.streams.video:
        raise InvalidVideoError("the file has no video stream")
    stream = container.streams.video[0]
    stream.codec_context.thread_count = 1  # a decode is one thread: the process bounds how many run
    width, height = stream.codec_context.width, stream.codec_context.height
    if width <= 0 or height <= 0 or width * height > max_pixels:
        raise InvalidVideoError(f"the video's frames are {width}x{height}, over the {max_pixels} pixels allowed")
    duration = _duration(container, stream)
    if duration > max_seconds:
        raise InvalidVideoError(f"the video lasts {duration:.0f}s, over the {max_seconds:g}s allowed")
    count = frames if fps is None or duration <= 0 else max(1, min(frames, math.floor(duration * fps)))
    times = [duration * (i + 0.5) / count for i in range(count)] if duration > 0 else [0.0]
    scale = min(1.0, max_side / max(width, height))
    out_w, out_h = max(2, round(width * scale) // 2 * 2), max(2, round(height * scale) // 2 * 2)
    encoder = av.CodecContext.create("mjpeg", "w")
    encoder.width, encoder.height, encoder.pix_fmt = out_w, out_h, "yuvj420p"
    encoder.time_base = Fraction(1, 1000)
    time_base = float(stream.time_base) if stream.time_base else 0.0
    start = float(stream.start_time * stream.time_base) if stream.start_time is not None and time_base else 0.0
    sampled: list[Frame] = []
    decoded = 0
    for t in times:
        frame = None
        if time_base:
            container.seek(int((start + t) / time_base), stream=stream, backward=True, any_frame=False)
        for candidate in container.decode(stream):
            decoded += 1
            if decoded > MAX_DECODED:
                raise InvalidVideoError(f"the video needs more than {MAX_DECODED} frames decoded to sample")
            if candidate.width * candidate.height > max_pixels:  # a stream may change size mid-file
                raise InvalidVideoError(f"a frame is {candidate.width}x{candidate.height}, over the pixels allowed")
            frame = candidate
            if candidate.time is None or candidate.time - start >= t - 1e-6:
                break
        if frame is None:
            if sampled:  # a file that ends before its stated duration: the frames it had
                break
            raise InvalidVideoError("the video has no frame that decodes")
        seconds = (frame.time - start) if frame.time is not None else t
        if sampled and seconds <= sampled[-1].seconds:  # a stated duration longer than the file: no new frame
            break
        image = frame.reformat(width=out_w, height=out_h, format="yuvj420p")
        packets = list(encoder.encode(image))
        jpeg = b"".join(bytes(p) for p in packets)
        if not jpeg:  # mjpeg emits one packet a frame; flush if it held one back
            jpeg = b"".join(bytes(p) for p in encoder.encode(None))
        sampled.append(Frame(max(0.0, seconds), jpeg, out_w, out_h))
    return sampled


def _duration(container: Any, stream: Any) -> float:
    if stream.duration is not None and stream.time_base:
        return float(stream.duration * stream.time_base)
    if container.duration is not None:
        return float(container.duration) / 1_000_000
    if stream.frames and stream.average_rate:
        return float(stream.frames / stream.average_rate)
    return 0.0


def _reason(exc: BaseException) -> str:
    """FFmpeg's words, without its errno and the file name it never had."""
    text = getattr(exc, "strerror", None) or str(exc).strip() or type(exc).__name__
    return str(text)[:200]


DECODE_CONCURRENCY = 2  # videos decoded at once by a gateway process (threads): the cores stay for serving
DECODE_TIMEOUT_S = 30.0  # one video's sampling, its wait for a thread included


@dataclass(frozen=True, slots=True)
class Sampling:
    """What sampling a request's videos uses: the fetcher (``media:`` rules), the metrics, the
    decoding threads, and the cache of what was sampled before (gateway.conversions)."""

    fetcher: MediaFetcher
    metrics: GatewayMetrics
    threads: Executor
    cache: ConversionCache


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
        position, _, (parts, jpegs) = await _sample_part(
            part, body, sampling, plan.model.name, ("frames", *shape), work, _frames_size
        )
        # the JPEGs too, by their index in parts: an encoder takes them as they are. The parts are
        # copies: the cache keeps the originals
        out[position] = {"type": EXPAND, "parts": [dict(p) for p in parts], "frames": jpegs}
    return out


Frames = tuple[list[dict[str, Any]], dict[int, bytes]]


def _frame_parts(data: bytes, *, frames: int, fps: float | None, max_side: int, timestamps: bool) -> tuple[Frames, int]:
    """In a decoding thread: the frames as chat parts (base64 made here, not on the event loop),
    and each frame's JPEG by the index of its part."""
    parts: list[dict[str, Any]] = []
    jpegs: dict[int, bytes] = {}
    sampled = sample_frames(data, frames=frames, fps=fps, max_side=max_side)
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
        position, original, url = await _sample_part(part, body, sampling, plan.model.name, key, work, len)
        value = original.get("video_url")
        kept = value if isinstance(value, dict) else {}
        out[position] = {**original, "video_url": {**kept, "url": url}}
    return out


def _presampled_url(data: bytes, *, frames: int, fps: float | None, max_side: int) -> tuple[str, int]:
    sampled = sample_frames(data, frames=frames, fps=fps, max_side=max_side)
    return "data:video/jpeg;base64," + ",".join(base64.b64encode(f.jpeg).decode() for f in sampled), len(sampled)


async def _sample_part(
    part: Part,
    body: dict[str, Any],
    sampling: Sampling,
    model: str,
    shape: tuple[Hashable, ...],
    work: Callable[[bytes], tuple[T, int]],
    size_of: Callable[[T], int],
) -> tuple[tuple[int, int], dict[str, Any], T]:
    """A video part's position, the part, and what ``work`` (on the decoding threads) made of its
    bytes: fetched or decoded from its data URL, sampled (or found in the cache under ``shape``
    and the bytes' sha256), counted. A request that leaves gives up its place in the threads'
    queue; a decode already running ends by its own bounds."""
    assert part.index is not None
    original: dict[str, Any] = body["messages"][part.message]["content"][part.index]
    value = original.get("video_url")
    url = value.get("url") if isinstance(value, dict) else value
    refused = Rejection(model, Modality.VIDEO.value, "media_refused")
    if not isinstance(url, str) or not url:
        raise InvalidVideoError(
            f"{part.location}: the video part carries no URL", param=part.location, rejection=refused
        )
    data = await _load(sampling.fetcher, url, part.location, refused)
    metrics, cache = sampling.metrics, sampling.cache

    async def decode() -> tuple[T, int]:
        started = time.perf_counter()
        made = await _decode(sampling.threads, functools.partial(work, data), part.location, refused)
        metrics.video_decode_seconds.labels(model).observe(time.perf_counter() - started)
        return made

    if cache.enabled:  # the same video sampled the same way (a later turn, a parallel request): once
        key = (*shape, await sha256(data))
        try:
            result, count = await cache.get_or_make(
                key, decode, lambda v: size_of(v[0]), shared_errors=(InvalidVideoError,)
            )
        except InvalidVideoError as exc:  # this video's fault, maybe found by a request that carried it too
            raise exc.located_at(part.location) from None
    else:
        result, count = await decode()
    metrics.video_frames.labels(model).inc(count)
    return (part.message, part.index), original, result


async def _load(fetcher: MediaFetcher, url: str, location: str, refused: Rejection) -> bytes:
    try:
        return await fetcher.load(url, "video")
    except GatewayError as exc:
        kind = MediaRefusedError if isinstance(exc, MediaRefusedError) else InvalidVideoError
        raise kind(f"{location}: {exc.message}", param=location, rejection=refused) from None


async def _decode(
    pool: Executor, work: Callable[[], tuple[T, int]], location: str, refused: Rejection
) -> tuple[T, int]:
    """``work`` on the decoding threads, within DECODE_TIMEOUT_S; its errors located at the part."""
    try:
        async with asyncio.timeout(DECODE_TIMEOUT_S):
            return await asyncio.get_running_loop().run_in_executor(pool, work)
    except InvalidVideoError as exc:
        raise InvalidVideoError(f"{location}: {exc.message}", param=location, rejection=refused) from None
    except TimeoutError:
        raise InvalidVideoError(
            f"{location}: the video took over {DECODE_TIMEOUT_S:g}s to sample", param=location, rejection=refused
        ) from None

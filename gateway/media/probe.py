"""A video's container read for what its tokens cost (``visual_tokens: {video: ...}``).

Admission has no bytes of a video to read (a data URL is decoded, a remote one fetched, only
after it: gateway.server.exchange). Once the gateway has them, :func:`read_video` opens the
container with FFmpeg (PyAV, the demuxers of gateway.media.demux: nothing but the bytes given is
read) and takes what the model's video processor goes by, from the container's metadata, no frame
decoded: the frames in all (the container's count, else its duration at its rate), the rate, and
the frame size. gateway.admission.visual counts the video from them, and the plan is held to
``limits.visual_tokens`` before the engine is touched. A video the gateway samples for the engine
(``video: {sample: ...}``) is counted from the frames it sends instead (:func:`sampled_info`).

A rotated video (a phone's, its display matrix a quarter turn) costs the same: every count here is
the same with width and height swapped.
"""

from __future__ import annotations

import base64
import functools
import threading
from typing import TYPE_CHECKING, Any

from ..admission.dimensions import BadImage, NeedMore, encoded_dimensions
from ..admission.tokens import VideoInfo
from ..admission.visual import video_source
from ..errors import InvalidVideoError, Rejection
from ..modalities import Modality
from .demux import VIDEO_FORMATS, VIDEO_NAMES, UnreadableMediaError, open_media, reason
from .downscale import Replacements
from .video import MAX_SECONDS, load_bytes

if TYPE_CHECKING:
    from ..admission.route import RoutePlan
    from .video import Sampling

# FFmpeg's demuxer name (its first) -> the media type of a data URL of the file
_MEDIA_TYPES = {"mov": "video/mp4", "matroska": "video/webm", "avi": "video/x-msvideo", "flv": "video/x-flv",
                "mpegts": "video/mp2t", "mpeg": "video/mpeg", "ogg": "video/ogg", "asf": "video/x-ms-asf"}  # fmt: skip
MAX_FRAMES = 1 << 24  # a container claiming more (a day at 200 fps) says nothing a processor would take


def read_video(data: bytes) -> VideoInfo:
    """The frames, rate and size of the video in ``data``, from its container's metadata;
    :class:`InvalidVideoError` for bytes that are not a video the gateway reads, one with no video
    stream, no size, or a length past what sampling allows."""
    try:
        container = open_media(data, VIDEO_FORMATS)
    except UnreadableMediaError as exc:
        raise InvalidVideoError(f"the video cannot be read ({exc}; the gateway reads {VIDEO_NAMES})") from None
    try:
        return _info(container)
    except InvalidVideoError:
        raise
    except Exception as exc:  # FFmpeg's errors, and what a hostile header makes of arithmetic
        raise InvalidVideoError(f"the video cannot be read ({reason(exc)})") from None
    finally:
        container.close()


def _info(container: Any) -> VideoInfo:
    if not container.streams.video:
        raise InvalidVideoError("the file holds no video stream")
    stream = container.streams.video[0]
    width, height = int(stream.codec_context.width or 0), int(stream.codec_context.height or 0)
    if width <= 0 or height <= 0:
        raise InvalidVideoError(f"the video stream says its frames are {width}x{height}")
    rate = stream.average_rate or stream.guessed_rate or stream.base_rate
    fps = float(rate) if rate else 0.0
    seconds = _seconds(container, stream)
    if seconds > MAX_SECONDS:
        raise InvalidVideoError(f"the video is {seconds:.0f}s long, over the {MAX_SECONDS:g}s allowed")
    frames = int(stream.frames or 0)
    if frames <= 0 and seconds > 0 and fps > 0:  # no count in the container (WebM, MPEG-TS): its duration at its rate
        frames = round(seconds * fps)
    if frames > MAX_FRAMES:
        raise InvalidVideoError(f"the video's container claims {frames} frames")
    return VideoInfo(frames, fps, width, height, str(container.format.name))


def _seconds(container: Any, stream: Any) -> float:
    if stream.duration is not None and stream.time_base:
        return float(stream.duration * stream.time_base)
    if container.duration is not None:
        return float(container.duration) / 1_000_000
    return 0.0


async def probed(
    plan: RoutePlan, body: dict[str, Any], sampling: Sampling
) -> tuple[dict[tuple[int, int], VideoInfo], Replacements]:
    """Each video the plan left to probe (the gateway samples none of them), read from its bytes on
    the decoding threads, by (place, index); and the parts that replace those fetched (a remote
    video, ``remote: fetch``): its bytes inline, as for an image (gateway.media.remote), so that the
    engine gets the video the gateway counted, not what the server answers it next."""
    assert plan.visual is not None
    contents = plan.contents(body)
    refused = Rejection(plan.model.name, Modality.VIDEO.value, "media_refused")
    unreadable = Rejection(plan.model.name, Modality.VIDEO.value, "invalid_content")
    found: dict[tuple[int, int], VideoInfo] = {}
    inline: Replacements = {}
    for item in plan.visual.to_probe:
        part = item.part
        assert part.index is not None
        original = contents[part.message].value[part.index]
        url = video_source(original, part.type)
        assert url is not None  # admission left it to probe: it has one
        data = await load_bytes(sampling, url, part.location, refused)
        fetched = url[:5].lower() != "data:"
        try:
            info, inlined = await sampling.decoders.run(functools.partial(_read, data, fetched))
        except InvalidVideoError as exc:
            raise exc.located_at(part.location, rejection=unreadable) from None
        found[(part.message, part.index)] = info
        if inlined is not None:
            value = original.get("video_url")
            kept = value if isinstance(value, dict) else {}
            inline[(part.message, part.index)] = {**original, "video_url": {**kept, "url": inlined}}
    return found, inline


def _read(data: bytes, inline: bool, stop: threading.Event) -> tuple[VideoInfo, str | None]:
    """On a decoding thread: the video read (no frame decoded: nothing to stop between), and,
    when ``inline``, its bytes as a data URL (megabytes of base64: not on the event loop)."""
    info = read_video(data)
    if not inline:
        return info, None
    media_type = _MEDIA_TYPES.get(info.format.split(",")[0], "video/mp4")
    return info, f"data:{media_type};base64," + base64.b64encode(data).decode()


def sampled_info(url: str) -> VideoInfo:
    """What the engine takes of a video the gateway sampled: vLLM's pre-sampled form,
    ``data:video/jpeg;base64,<frame>,<frame>,...``, each frame its JPEG (gateway.media.video)."""
    comma = url.index(",")
    frames = url.count(",", comma)
    end = url.find(",", comma + 1)
    try:
        first = encoded_dimensions(url[comma + 1 : end if end != -1 else len(url)])
    except (BadImage, NeedMore):  # pragma: no cover - the gateway's own JPEGs
        return VideoInfo(frames, 0.0, 0, 0, "jpeg", sampled=True)
    return VideoInfo(frames, 0.0, first.width, first.height, "jpeg", sampled=True)

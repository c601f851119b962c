"""Client media opened with FFmpeg (PyAV): only demuxers that read nothing but the bytes given.

FFmpeg picks a demuxer by probing the bytes, and some demuxers open more than the bytes they are
given: ``concat`` (an ffconcat playlist: ``file 'clip.mp4'`` opens clip.mp4 relative to the
gateway's working directory, whose frames would reach the model), ``hls`` and ``dash`` (URLs),
``image2`` (numbered files), ``tee``, ``lavfi`` (filter graphs that open files). A video or an
audio clip from a client is therefore opened with ``format_whitelist`` set to the container formats
clients send, which read only the stream at hand, and ``protocol_whitelist`` set to none at all,
so that nothing a demuxer might open besides (MOV's external data references, which FFmpeg
leaves off, say) can be opened. Anything else is refused by FFmpeg at open, before any byte of it
is read as media: :func:`open_media` raises :class:`UnreadableMediaError`.
"""

from __future__ import annotations

import io
from typing import Any

# FFmpeg's demuxer names (``ffmpeg -demuxers``); a name matches a demuxer that lists it.
VIDEO_FORMATS = ("mov", "mp4", "matroska", "webm", "avi", "flv", "mpegts", "mpeg", "ogg", "asf")
AUDIO_FORMATS = ("wav", "mp3", "flac", "ogg", "mov", "mp4", "m4a", "matroska", "webm", "aac", "asf")
VIDEO_NAMES = "MP4/MOV, WebM/Matroska, AVI, FLV, MPEG-TS/PS, Ogg, ASF"
# no protocol at all for whatever a demuxer opens beyond the bytes (its name matches no protocol)
NO_PROTOCOL = "none"


class UnreadableMediaError(Exception):
    """The bytes are not media in one of the formats allowed, or FFmpeg cannot open them."""


def open_media(data: bytes, formats: tuple[str, ...]) -> Any:
    """An ``av`` input container over ``data``, demuxed only by one of ``formats``; the caller
    closes it. ImportError without PyAV."""
    import av

    options = {"format_whitelist": ",".join(formats), "protocol_whitelist": NO_PROTOCOL}
    try:
        return av.open(io.BytesIO(data), mode="r", metadata_errors="ignore", container_options=options)
    except (av.FFmpegError, ValueError, OSError) as exc:
        raise UnreadableMediaError(reason(exc)) from None


def reason(exc: BaseException) -> str:
    """FFmpeg's words, without its errno and the file name it never had."""
    text = getattr(exc, "strerror", None) or str(exc).strip() or type(exc).__name__
    return str(text)[:200]

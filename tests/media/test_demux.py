"""Client media opened with FFmpeg only by demuxers that read nothing but the bytes given
(gateway/media/demux.py): a playlist naming a file next to the gateway must not reach that file."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.media.demux import AUDIO_FORMATS, VIDEO_FORMATS, UnreadableMediaError, open_media
from tests.videos import playlist, video

pytest.importorskip("av")
pytest.importorskip("numpy")


@pytest.mark.parametrize(
    "name",
    ["clip.mp4", "sub/clip.mp4"],
    ids=["beside the gateway", "in a subdirectory"],
)
def test_an_ffconcat_playlist_opens_no_file(name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    target = tmp_path / name
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_bytes(video(seconds=1))
    monkeypatch.chdir(tmp_path)  # where FFmpeg looks for a relative name
    for formats in (VIDEO_FORMATS, AUDIO_FORMATS):
        with pytest.raises(UnreadableMediaError):
            open_media(playlist(name), formats)


@pytest.mark.parametrize(
    "data",
    [
        b"#EXTM3U\n#EXT-X-TARGETDURATION:1\n#EXTINF:1,\nclip.ts\n#EXT-X-ENDLIST\n",  # HLS
        b"file 'clip.mp4'\n",  # a concat list without its header
        b"\x89PNG\r\n\x1a\n" + b"\x00" * 64,  # an image (image2 reads numbered files)
    ],
    ids=["hls", "concat", "image"],
)
def test_formats_that_open_more_than_the_bytes_are_refused(data: bytes) -> None:
    with pytest.raises(UnreadableMediaError):
        open_media(data, VIDEO_FORMATS)


@pytest.mark.parametrize(("fmt", "codec"), [("mp4", "mpeg4"), ("matroska", "mpeg4"), ("webm", "libvpx"),
                                            ("avi", "mpeg4"), ("mpegts", "mpeg2video")])  # fmt: skip
def test_the_containers_clients_send_are_read(fmt: str, codec: str) -> None:
    import io

    av, np = pytest.importorskip("av"), pytest.importorskip("numpy")
    out = io.BytesIO()
    with av.open(out, "w", format=fmt) as container:
        stream = container.add_stream(codec, rate=10)
        stream.width, stream.height, stream.pix_fmt = 32, 32, "yuv420p"
        for _ in range(5):
            frame = av.VideoFrame.from_ndarray(np.zeros((32, 32, 3), dtype=np.uint8), format="rgb24")
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode(None):
            container.mux(packet)
    with open_media(out.getvalue(), VIDEO_FORMATS) as container:
        assert len(list(container.decode(video=0))) == 5

"""gateway.media.converters: the conversions as data, in one order; ``wanted`` (the text path's
one look) holds to the converters' own, for plans of every conversion and of none."""

from __future__ import annotations

import base64
import io
from typing import Any

import pytest

from gateway.admission.plan import admit
from gateway.config import parse_config
from gateway.media.converters import CONVERTERS, wanted
from tests.conftest import routing

Image = pytest.importorskip("PIL.Image")

U = "http://127.0.0.1:9"
CONFIG = parse_config(
    routing(
        f"  - {{name: texty, upstreams: [{U}], accepts: [text]}}",
        f"  - {{name: whisper, upstreams: [{U}], accepts: [text, audio], apis: [chat, transcriptions]}}",
        f"  - {{name: seer, upstreams: [{U}], accepts: [text, image]}}",
        f"  - {{name: down, upstreams: [{U}], accepts: [text, image], on_oversize: downscale, "
        "limits: {image_pixels: 100}}",
        f"  - {{name: fetcher, upstreams: [{U}], accepts: [text, image], "
        "visual_tokens: {preset: qwen2.5-vl, remote: fetch}}",
        f"  - {{name: hears, upstreams: [{U}], accepts: [text], on_unsupported: {{audio: {{transcribe: whisper}}}}}}",
        f"  - {{name: told, upstreams: [{U}], accepts: [text], on_unsupported: {{image: {{describe: seer}}}}}}",
        f"  - {{name: reads, upstreams: [{U}], accepts: [text], on_unsupported: {{file: {{extract: {{}}}}}}}}",
        f"  - {{name: frames, upstreams: [{U}], accepts: [text, image], on_unsupported: {{video: {{frames: 4}}}}}}",
    )
)


def png(side: int) -> str:
    out = io.BytesIO()
    Image.new("RGB", (side, side)).save(out, "PNG")
    return "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()


def ask(model: str, part: dict[str, Any] | None = None) -> dict[str, Any]:
    content: list[dict[str, Any]] = [{"type": "text", "text": "hi"}, *([part] if part else [])]
    return {"model": model, "messages": [{"role": "user", "content": content}]}


CASES = {
    "text": (ask("texty"), []),
    "image": (ask("seer", {"type": "image_url", "image_url": {"url": png(8)}}), []),
    "downscale": (ask("down", {"type": "image_url", "image_url": {"url": png(20)}}), ["Downscaled"]),
    "remote fetch": (ask("fetcher", {"type": "image_url", "image_url": {"url": "https://x.test/a.png"}}), ["Sized"]),
    "other format": (
        ask("down", {"type": "image_url", "image_url": {"url": "data:image/tiff;base64,SUkqAA=="}}),
        ["Sized"],
    ),
    "transcribe": (
        ask("hears", {"type": "input_audio", "input_audio": {"data": "UklGRg==", "format": "wav"}}),
        ["Transcribed"],
    ),
    "describe": (ask("told", {"type": "image_url", "image_url": {"url": png(8)}}), ["Described"]),
    "extract": (
        ask("reads", {"type": "file", "file": {"file_data": "data:application/pdf;base64,JVBERi0="}}),
        ["Extracted"],
    ),
    "frames": (ask("frames", {"type": "video_url", "video_url": {"url": "data:video/mp4;base64,AAAA"}}), ["Frames"]),
}


@pytest.mark.parametrize("case", CASES, ids=list(CASES))
def test_wanted_is_the_converters_own(case: str) -> None:
    body, expected = CASES[case]
    plan = admit(CONFIG, body)
    asked = [type(c).__name__ for c in CONVERTERS if c.wanted(plan)]
    assert asked == expected and wanted(plan) == bool(asked)


def test_the_order_is_sizes_first_then_each_conversion() -> None:
    assert [type(c).__name__ for c in CONVERTERS] == [
        "Sized", "Probed", "Downscaled", "Transcribed", "Described", "Extracted", "Frames", "Presampled"
    ]  # fmt: skip

"""gateway.admission.visual: each preset's count equals the Hugging Face processor's own, over a
grid of sizes and aspect ratios (processors built from the released checkpoints' configs, no
weights); then a request's images sized, counted and held to the model's limits."""

from __future__ import annotations

import base64
import dataclasses
import importlib.util
import inspect
import io
import random
import sys
import types
from typing import Any

import orjson
import pytest

from gateway.admission.plan import admit
from gateway.admission.strings import cut, parse
from gateway.admission.tokens import count, fit, resized
from gateway.config import parse_config
from gateway.config.types import VISUAL_PRESETS
from gateway.errors import GatewayError

# (width, height): square, 16:9 and 9:16, phone photos, panoramas, slivers, tiny and huge
GRID = [(w, h) for w in (1, 27, 28, 100, 333, 640, 1280, 1920, 4032, 8000) for h in (1, 29, 224, 720, 1080, 3024, 6000)]
GRID = [(w, h) for w, h in GRID if max(w, h) <= 200 * min(w, h)]  # Qwen's processors refuse more

# the tests that hold a preset to its processor need transformers (make test installs it); the
# rest run without it (make test-minimal)
needs_transformers = pytest.mark.skipif(
    importlib.util.find_spec("transformers") is None, reason="needs transformers (make test installs it)"
)
Image = pytest.importorskip("PIL.Image")


def qwen_processor(preset: str) -> Any:
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    spec = VISUAL_PRESETS[preset]
    size = {"shortest_edge": spec.min_pixels, "longest_edge": spec.max_pixels}
    return Qwen2VLImageProcessorPil(size=size, patch_size=spec.patch, merge_size=spec.merge)


@needs_transformers
@pytest.mark.parametrize("preset", ["qwen2-vl", "qwen2.5-vl", "qwen3-vl"])
def test_qwen_presets_count_what_the_processor_counts(preset: str) -> None:
    processor, spec = qwen_processor(preset), VISUAL_PRESETS[preset]
    for width, height in GRID:
        patches = processor.get_number_of_image_patches(height, width, {})
        assert count(spec, width, height) == patches // spec.merge**2, (preset, width, height)


@needs_transformers
@pytest.mark.parametrize("preset", ["qwen2.5-vl", "qwen3-vl"])
def test_qwen_presets_resize_as_the_processor_does_on_real_images(preset: str) -> None:
    """The processor's whole pipeline on real pixels: its image_grid_thw."""
    processor, spec = qwen_processor(preset), VISUAL_PRESETS[preset]
    for width, height in [(1280, 720), (333, 1001), (28, 28), (10, 1500), (2000, 64)]:
        grid = processor(images=[Image.new("RGB", (width, height))], return_tensors="np")["image_grid_thw"][0]
        assert count(spec, width, height) == int(grid[1] * grid[2]) // spec.merge**2
        assert resized(spec, width, height) == (int(grid[2]) * spec.patch, int(grid[1]) * spec.patch)


def test_the_issues_examples() -> None:
    assert count(VISUAL_PRESETS["qwen2.5-vl"], 1280, 720) == 1196
    assert count(VISUAL_PRESETS["qwen3-vl"], 1280, 720) == 880


@needs_transformers
@pytest.mark.parametrize("preset", ["pixtral", "mistral-small-3.1"])
def test_pixtral_presets_count_what_the_processor_counts(preset: str) -> None:
    import numpy as np
    from transformers.models.pixtral.image_processing_pil_pixtral import (
        PixtralImageProcessorPil,
        get_resize_output_image_size,
    )

    spec = VISUAL_PRESETS[preset]
    edge, patch = spec.longest_edge, spec.patch
    for width, height in GRID:  # PixtralProcessor._get_num_multimodal_tokens: (columns + 1) * rows
        # channels_last said, not guessed: the processor's own guess takes a 1- or 3-pixel-high image for channels
        h, w = get_resize_output_image_size(
            np.zeros((height, width, 3)),
            size=(edge, edge),
            patch_size=(patch, patch),
            input_data_format="channels_last",
        )
        assert count(spec, width, height) == (w // patch + 1) * (h // patch), (preset, width, height)
    processor = PixtralImageProcessorPil(size={"longest_edge": edge}, patch_size={"height": patch, "width": patch})
    for width, height in [(1280, 720), (333, 1001), (17, 5)]:
        h, w = processor(images=[Image.new("RGB", (width, height))], return_tensors="np")["image_sizes"][0]
        assert resized(spec, width, height) == (int(w), int(h))


@needs_transformers
def test_llava_and_gemma_presets_are_their_processors_fixed_counts() -> None:
    from tokenizers import Tokenizer, models
    from transformers import CLIPImageProcessor, Gemma3Processor, LlavaProcessor, PreTrainedTokenizerFast

    vocab = {"[UNK]": 0, "<image>": 1}
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="[UNK]")))  # type: ignore[no-untyped-call]
    clip = CLIPImageProcessor(crop_size={"height": 336, "width": 336}, size={"shortest_edge": 336})
    llava = LlavaProcessor(image_processor=clip, tokenizer=tokenizer, patch_size=14,  # type: ignore[no-untyped-call]
                           vision_feature_select_strategy="default", num_additional_image_tokens=1)  # fmt: skip
    tokens = llava._get_num_multimodal_tokens(image_sizes=GRID).num_image_tokens  # type: ignore[no-untyped-call]
    assert tokens == [count(VISUAL_PRESETS["llava-1.5"], w, h) for w, h in GRID] == [576] * len(GRID)
    # Gemma 3: image_seq_length tokens an image (pan-and-scan off), whatever its size
    default = inspect.signature(Gemma3Processor.__init__).parameters["image_seq_length"].default
    assert count(VISUAL_PRESETS["gemma-3"], 8000, 6000) == count(VISUAL_PRESETS["gemma-3"], 1, 1) == default == 256


@needs_transformers
def test_the_internvl_preset_counts_what_its_processor_counts() -> None:
    """InternVLProcessor._get_num_multimodal_tokens: 2 + image_seq_length (256) x its patches,
    the patches GOT-OCR2's image processor cuts (InternVL3's config: 448-pixel tiles, 1 to 12)."""
    from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import GotOcr2ImageProcessorPil

    processor = GotOcr2ImageProcessorPil(
        crop_to_patches=True, min_patches=1, max_patches=12, size={"height": 448, "width": 448}
    )
    spec = VISUAL_PRESETS["internvl3"]
    for width, height in GRID:
        patches = processor.get_number_of_image_patches(height, width, {})
        assert count(spec, width, height) == 2 + 256 * patches, (width, height)
    for width, height in [(1280, 720), (300, 2000), (448, 448)]:  # its pipeline on real pixels
        pixels = processor(images=[Image.new("RGB", (width, height))], return_tensors="np")["pixel_values"]
        assert count(spec, width, height) == 2 + 256 * len(pixels)


def test_fit_keeps_the_aspect_and_meets_both_targets() -> None:
    spec = VISUAL_PRESETS["qwen2.5-vl"]
    width, height = fit(spec, 8000, 6000, max_pixels=4_000_000, max_tokens=None)
    assert width * height <= 4_000_000 and abs(width / height - 8000 / 6000) < 0.01
    width, height = fit(spec, 8000, 6000, max_pixels=None, max_tokens=1000)
    assert 950 < count(spec, width, height) <= 1000 and abs(width / height - 4 / 3) < 0.01
    assert fit(spec, 640, 480, max_pixels=4_000_000, max_tokens=1000) == (640, 480)  # it fits already


# --- a request's images -----------------------------------------------------------------------

TABLE = """version: 1
models:
  - name: q
    upstreams: ['http://127.0.0.1:1']
    accepts: [text, image]
    apis: [chat, responses, messages]
    visual_tokens: {preset: qwen2.5-vl}
    limits: {visual_tokens: 3000, image_pixels: 4000000}
  - name: down
    upstreams: ['http://127.0.0.1:1']
    accepts: [text, image]
    visual_tokens: {preset: qwen2.5-vl}
    limits: {visual_tokens: 3000, image_pixels: 4000000}
    on_oversize: downscale
  - name: assumed
    upstreams: ['http://127.0.0.1:1']
    accepts: [text, image]
    visual_tokens: {preset: qwen2.5-vl, remote: [1280, 720]}
    limits: {visual_tokens: 3000}
  - name: pixels-only
    upstreams: ['http://127.0.0.1:1']
    accepts: [text, image]
    limits: {image_pixels: 1000000}
"""
CONFIG = parse_config(TABLE, filename="routing.yaml")


def png(width: int, height: int) -> str:
    out = io.BytesIO()
    Image.new("RGB", (width, height)).save(out, "PNG")
    return base64.b64encode(out.getvalue()).decode()


def chat(model: str, *images: str) -> dict[str, Any]:
    parts = [{"type": "image_url", "image_url": {"url": url}} for url in images]
    return {"model": model, "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}, *parts]}]}


def data(width: int, height: int) -> str:
    return "data:image/png;base64," + png(width, height)


def refused(body: dict[str, Any], api: Any = None) -> dict[str, Any]:
    with pytest.raises(GatewayError) as caught:
        admit(CONFIG, body) if api is None else admit(CONFIG, body, api=api)
    assert caught.value.status == 400
    return caught.value.to_dict()["error"]


def test_images_are_counted_and_the_plan_says_their_sizes() -> None:
    plan = admit(CONFIG, chat("q", data(1280, 720), data(640, 480)))
    assert plan.visual is not None and plan.visual.tokens == 1196 + 391
    assert plan.route == "direct"
    explained = plan.explain()
    assert explained["visual_tokens"] == 1587
    assert explained["parts"][1] | {} == explained["parts"][1] and explained["parts"][1]["width"] == 1280
    assert explained["parts"][2]["size_from"] == "header" and explained["parts"][2]["visual_tokens"] == 391


def test_over_the_token_limit_is_400_naming_the_part_the_estimate_and_the_limit() -> None:
    error = refused(chat("q", data(1280, 720), data(1280, 720), data(1280, 720)))
    assert error["code"] == "too_many_visual_tokens" and error["param"] == "messages[0].content[3]"
    assert "at most 3000 visual tokens" in error["message"] and "come to 3588" in error["message"]


def test_over_the_pixel_limit_is_400_image_too_large() -> None:
    error = refused(chat("q", data(3000, 2000)))
    assert error["code"] == "image_too_large" and error["param"] == "messages[0].content[1]"
    assert "3000x2000 = 6000000" in error["message"]
    assert refused(chat("pixels-only", data(1001, 1000)))["code"] == "image_too_large"  # without a formula too
    assert admit(CONFIG, chat("pixels-only", data(1000, 1000))).visual is not None


def test_downscale_sizes_each_image_to_fit_both_limits() -> None:
    plan = admit(CONFIG, chat("down", data(3000, 2000), data(1280, 720)))
    assert plan.visual is not None and plan.visual.tokens <= 3000
    assert plan.route == "downscale" and len(plan.downscale_parts) == 2
    first, second = plan.visual.images
    assert first.downscale is not None and first.downscale[0] * first.downscale[1] <= 4_000_000
    assert second.downscale is not None and second.downscale[0] / second.downscale[1] == pytest.approx(16 / 9, 0.01)
    assert plan.explain()["parts"][1]["action"] == "downscale"


def test_remote_images_are_assumed_or_counted_at_their_most() -> None:
    plan = admit(CONFIG, chat("assumed", "https://example.com/a.png"))
    assert plan.visual is not None and plan.visual.tokens == 1196
    assert plan.explain()["parts"][1]["size_from"] == "assumed"
    error = refused(chat("q", "https://example.com/a.png"))  # 12845056 / 784 = 16384 tokens at most
    assert error["code"] == "too_many_visual_tokens" and "counted at the most" in error["message"]


def test_an_image_that_cannot_be_read_is_400_invalid_image() -> None:
    error = refused(chat("q", "data:image/png;base64,@@@@"))
    assert error["code"] == "invalid_image" and error["param"] == "messages[0].content[1]"


@pytest.mark.parametrize("url", ["data:image/png;base64,AAAA", "data:application/pdf;base64,JVBERi0xLjcKJeLjz9MK"])
def test_an_image_of_no_format_the_header_reader_knows_is_left_to_pillow(url: str) -> None:
    """Perhaps a TIFF, an AVIF...: sized once admission is done, as Pillow opens it (the bytes
    here open as no image: 400 invalid_image then, tests/media/test_opened.py)."""
    plan = admit(CONFIG, chat("q", url))
    assert plan.visual is not None and plan.visual.waits
    assert plan.explain()["parts"][1]["size_from"] == "open"


def test_the_other_apis_are_counted_in_their_own_places() -> None:
    from gateway.admission.apis.messages import MESSAGES
    from gateway.admission.apis.responses import RESPONSES

    big = png(1280, 720)
    block = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": big}}
    messages = {"model": "q", "max_tokens": 8, "messages": [{"role": "user", "content": [block, block, block]}]}
    assert refused(messages, MESSAGES)["param"] == "messages[0].content[2]"
    item = {"type": "input_image", "image_url": "data:image/png;base64," + big}
    responses = {"model": "q", "input": [{"role": "user", "content": [item, item]}]}
    plan = admit(CONFIG, responses, api=RESPONSES)
    assert plan.visual is not None and plan.visual.tokens == 2392


def test_the_config_says_where_a_visual_key_is_wrong() -> None:
    from gateway.errors import ConfigError

    base = "version: 1\nmodels:\n  - {name: m, upstreams: ['http://h'], accepts: [text, image], %s}\n"
    cases = {
        "visual_tokens: {preset: qwen9}": "visual_tokens.preset: unknown preset 'qwen9'",
        "visual_tokens: {preset: qwen3-vl, patch: 3}": "'patch' does not go with a preset",
        "visual_tokens: {preset: qwen3-vl, remote: [1, 2, 3]}": "must be fetch (the gateway reads",
        "visual_tokens: {patch: 14, merge: 2, max_pixels: 100}": "and one token's 784 pixels",
        "limits: {visual_tokens: 10}": "a visual_tokens limit needs the model's visual_tokens: formula",
        "on_oversize: downscale": "downscale needs a target",
        "on_oversize: shrink": "must be reject, downscale or",
        "visual_tokens: {fixed: 576, merge: 2}": "'merge' does not go with fixed: N",
    }
    for extra, message in cases.items():
        with pytest.raises(ConfigError) as caught:
            parse_config(base % extra, filename="r.yaml")
        assert message in str(caught.value) and "r.yaml:3:" in str(caught.value), (extra, str(caught.value))
    spec = parse_config(
        base % "visual_tokens: {patch: 16, longest_edge: 1024, remote: [640, 480]}", filename="r"
    ).models[0]
    assert spec.visual_tokens is not None and (spec.visual_tokens.kind, spec.visual_tokens.remote) == (
        "longest_edge",
        (640, 480),
    )


def model_config(extra: str) -> Any:
    text = "version: 1\nmodels:\n  - {name: m, upstreams: ['http://h'], accepts: [text, image], %s}\n"
    return parse_config(text % extra, filename="r.yaml")


def test_a_tiling_model_over_its_budget_is_refused_not_shrunk_to_a_sliver() -> None:
    config = model_config("visual_tokens: {preset: internvl3}, limits: {visual_tokens: 1000}, on_oversize: downscale")
    with pytest.raises(GatewayError) as caught:
        admit(config, chat("m", data(4000, 1000)))
    assert caught.value.code == "too_many_visual_tokens"


def test_a_downscale_target_alone_is_its_trigger_and_within_a_limit_the_least_wins() -> None:
    alone = model_config("visual_tokens: {preset: qwen2.5-vl}, on_oversize: {downscale: {max_pixels: 1000000}}")
    plan = admit(alone, chat("m", data(2000, 1500)))
    assert plan.visual is not None and plan.visual.images[0].downscale is not None
    width, height = plan.visual.images[0].downscale
    assert width * height <= 1_000_000
    both = model_config(
        "visual_tokens: {preset: qwen2.5-vl}, limits: {visual_tokens: 1000, image_pixels: 1000000}, "
        "on_oversize: {downscale: {max_pixels: 8000000, max_tokens: 5000}}"
    )
    plan = admit(both, chat("m", data(4000, 3000)))
    assert plan.visual is not None and plan.visual.tokens <= 1000
    width, height = plan.visual.images[0].downscale or (0, 0)
    assert width * height <= 1_000_000


def test_a_downscale_keeps_slivers_within_the_aspect_qwen_takes() -> None:
    config = model_config("visual_tokens: {preset: qwen2.5-vl}, limits: {visual_tokens: 3000}, on_oversize: downscale")
    plan = admit(config, chat("m", *[data(4000, 20)] * 27))
    assert plan.visual is not None and plan.visual.tokens <= 3000
    for image in plan.visual.images:
        width, height = image.downscale or (image.width, image.height)
        assert max(width, height) <= 200 * min(width, height)


def test_a_downscaled_responses_image_goes_in_the_shape_the_engine_reads() -> None:
    from gateway.admission.apis.responses import RESPONSES
    from gateway.admission.rewrite import upstream_body

    config = model_config(
        "apis: [responses], visual_tokens: {preset: qwen2.5-vl}, limits: {image_pixels: 1000000}, "
        "on_oversize: downscale"
    )
    item = {"type": "input_image", "image_url": {"url": data(2000, 1500)}}
    body = {"model": "m", "input": [{"role": "user", "content": [item]}]}
    plan = admit(config, body, api=RESPONSES)
    assert plan.route == "normalize, downscale"
    new_url = data(1154, 866)
    smaller: dict[str, Any] = {"type": "input_image", "image_url": {"url": new_url}}
    sent = orjson_loads(upstream_body(plan, orjson_dumps(body), body, {(0, 0): smaller}))
    assert sent["input"][0]["content"][0]["image_url"] == new_url  # a string, as vLLM reads it


def orjson_loads(raw: bytes) -> Any:
    import orjson

    return orjson.loads(raw)


def orjson_dumps(value: Any) -> bytes:
    import orjson

    return orjson.dumps(value)


@needs_transformers
def test_the_llava_next_preset_counts_what_its_processor_counts() -> None:
    from tokenizers import Tokenizer, models
    from transformers import LlavaNextProcessor, PreTrainedTokenizerFast
    from transformers.models.llava_next.image_processing_pil_llava_next import LlavaNextImageProcessorPil

    vocab = {"[UNK]": 0, "<image>": 1}
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="[UNK]")))  # type: ignore[no-untyped-call]
    spec = VISUAL_PRESETS["llava-next"]
    images = LlavaNextImageProcessorPil(
        image_grid_pinpoints=[list(p) for p in spec.pinpoints], size={"shortest_edge": 336},
        crop_size={"height": 336, "width": 336},
    )  # fmt: skip
    processor = LlavaNextProcessor(image_processor=images, tokenizer=tokenizer, patch_size=14,  # type: ignore[no-untyped-call]
                                   vision_feature_select_strategy="default", num_additional_image_tokens=1)  # fmt: skip
    sizes = [(h, w) for w, h in GRID]
    expected = processor._get_num_multimodal_tokens(image_sizes=sizes).num_image_tokens  # type: ignore[no-untyped-call]
    assert [count(spec, w, h) for w, h in GRID] == expected
    hd = processor._get_num_multimodal_tokens(image_sizes=[(720, 1280)]).num_image_tokens  # type: ignore[no-untyped-call]
    assert [count(spec, 1280, 720)] == hd == [1948]


# --- videos (visual_tokens: {video: ...}) ----------------------------------------------------------

# (frames in the container, width, height): a clip of one frame to a long one, tiny to 4K, portrait
VIDEO_GRID = [
    (n, w, h)
    for n in (1, 2, 3, 4, 5, 9, 31, 32, 33, 100, 901)
    for w, h in ((16, 16), (64, 48), (320, 240), (640, 360), (1280, 720), (720, 1280), (1920, 1080), (3840, 2160))
]


def video_processor(preset: str) -> Any:
    """The family's video processor in transformers, configured as the preset says its checkpoints
    are. Its counting (get_num_of_video_patches, sample_frames) is plain Python and torch; Qwen2-VL's
    module imports torchvision for its resizing, which these tests never run: where torchvision is
    not installed, an empty module stands in for it while the module is imported, and only then."""
    pytest.importorskip("torch")
    from gateway.config.types import VIDEO_PRESETS

    spec = VIDEO_PRESETS[preset]
    size = {"shortest_edge": spec.min_pixels, "longest_edge": spec.max_pixels}
    kwargs = dict(size=size, patch_size=spec.patch, merge_size=spec.merge, temporal_patch_size=spec.temporal_patch)
    if spec.per == "video":
        from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

        return Qwen3VLVideoProcessor(**kwargs, cap_pixels_per_frame=False)
    stand_ins = {}
    if importlib.util.find_spec("torchvision") is None:
        names = (
            "torchvision",
            "torchvision.transforms",
            "torchvision.transforms.v2",
            "torchvision.transforms.v2.functional",
        )
        stand_ins = {name: types.ModuleType(name) for name in names}
    sys.modules.update(stand_ins)
    try:
        from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor
    finally:  # the stand-ins only: what the import brought in stays imported
        for name in stand_ins:
            del sys.modules[name]
    return Qwen2VLVideoProcessor(**kwargs, cap_pixels_per_frame=False)


@needs_transformers
@pytest.mark.parametrize("preset", ["qwen2-vl", "qwen2.5-vl", "qwen3-vl"])
def test_video_presets_count_what_the_video_processor_counts(preset: str) -> None:
    """The frames the model takes (the engine's `frames: N`, all of a shorter video) and each
    count equal to the processor's own (get_num_of_video_patches), over the grid."""
    from gateway.admission.tokens import VideoInfo, video_tokens
    from gateway.config.types import VIDEO_PRESETS

    processor, spec = video_processor(preset), VIDEO_PRESETS[preset]
    frames_spec = dataclasses.replace(spec, frames=32, fps=None)
    for total, width, height in VIDEO_GRID:
        info = VideoInfo(total, 25.0, width, height)
        tokens, frames = video_tokens(frames_spec, info)
        assert frames == min(32, total)
        if spec.per == "video" and frames < spec.temporal_patch:  # Qwen3-VL's refuses it; counted as padded
            with pytest.raises(ValueError):
                processor.get_num_of_video_patches(frames, height, width, {})
            assert tokens == video_tokens(frames_spec, VideoInfo(spec.temporal_patch, 25.0, width, height))[0]
            continue
        patches = processor.get_num_of_video_patches(frames, height, width, {})
        assert tokens == patches // spec.merge**2, (preset, total, width, height)


@needs_transformers
@pytest.mark.parametrize("preset", ["qwen2-vl", "qwen3-vl"])
def test_video_presets_sample_by_fps_as_the_processor_samples(preset: str) -> None:
    """``fps: F``: the frames the processor's own sample_frames takes, whatever the video's rate."""
    from transformers.video_utils import VideoMetadata

    from gateway.admission.tokens import VideoInfo, sampled_frames
    from gateway.config.types import VIDEO_PRESETS

    processor, spec = video_processor(preset), VIDEO_PRESETS[preset]
    for fps in (0.5, 1.0, 2.0):
        wanted = dataclasses.replace(spec, frames=None, fps=fps)
        for total in (4, 5, 7, 8, 30, 61, 300, 1799, 20000):
            for rate in (10.0, 24.0, 29.97, 60.0):
                metadata = VideoMetadata(total_num_frames=total, fps=rate, duration=total / rate)
                indices = processor.sample_frames(metadata, fps=fps)
                assert sampled_frames(wanted, VideoInfo(total, rate, 64, 48)) == len(indices), (fps, total, rate)


def test_a_video_is_counted_at_its_most_when_its_size_cannot_be_known() -> None:
    from gateway.admission.tokens import VideoInfo, video_tokens

    config = parse_config(
        "version: 1\nmodels:\n  - {name: q, upstreams: ['http://127.0.0.1:1'], accepts: [text, video], "
        "visual_tokens: {preset: qwen2.5-vl, video: {frames: 8}}}\n"
    )
    body = {"model": "q", "messages": [{"role": "user", "content": [
        {"type": "video_url", "video_url": {"url": "https://example.com/clip.mp4"}}]}]}  # fmt: skip
    plan = admit(config, body)
    model = config.model("q")
    assert plan.visual is not None and model is not None and model.visual_tokens is not None
    (sized,) = plan.visual.images
    spec = model.visual_tokens.video
    assert spec is not None
    assert (sized.source, sized.frames) == ("most", 8)
    assert sized.tokens >= video_tokens(spec, VideoInfo(8, 0.0, 8000, 8000))[0]  # no size costs more
    inline = {"type": "video_url", "video_url": {"url": "data:video/mp4;base64,AAAA"}}
    plan = admit(config, {**body, "messages": [{"role": "user", "content": [inline]}]})
    assert (
        plan.visual is not None and plan.visual.to_probe and plan.visual.tokens == 0
    )  # read once the gateway has its bytes
    assert plan.explain()["parts"][0]["size_from"] == "probe"


@pytest.mark.parametrize("preset", ["qwen2.5-vl", "qwen3-vl"])
def test_a_video_at_its_most_costs_no_less_than_any_video(preset: str) -> None:
    """Qwen3-VL's bounds hold all the frames: a short clip or a sliver can cost more than the
    most frames; the most is taken over every length and the costly sizes."""
    from gateway.admission.tokens import VideoInfo, most_video, video_tokens
    from gateway.config.types import VIDEO_PRESETS

    spec = dataclasses.replace(VIDEO_PRESETS[preset], frames=None, fps=2.0)
    most = most_video(spec)
    for frames in (1, 2, 3, 13, 64, 767, 768):
        for width, height in ((8000, 8000), (4000, 40), (1920, 1080), (200, 1), (640, 360)):
            tokens, _ = video_tokens(
                dataclasses.replace(spec, frames=768, fps=None), VideoInfo(frames, 25.0, width, height)
            )
            assert tokens <= most, (frames, width, height)
    assert (
        most_video(spec, (1920, 1080))
        >= video_tokens(dataclasses.replace(spec, frames=768, fps=None), VideoInfo(13, 25.0, 1920, 1080))[0]
    )


def _noise(width: int, height: int, fmt: str, **save: Any) -> str:
    """A data URL of an image of noise (its bytes do not compress: longer than strings.PREFIX)."""
    image = Image.frombytes("RGB", (width, height), random.Random(width).randbytes(width * height * 3))
    out = io.BytesIO()
    image.save(out, fmt, **save)
    return f"data:image/{fmt.lower()};base64," + base64.b64encode(out.getvalue()).decode()


def test_an_image_held_back_past_its_header_is_counted_from_its_first_characters() -> None:
    """A body read with its images' data URLs held back (gateway.admission.strings.Deferred):
    a PNG's header lies in the first characters, which are counted as the whole would be; a
    JPEG whose EXIF puts its header further in has the strings put back, and is counted whole."""
    png_url = _noise(640, 480, "PNG")
    exif = Image.Exif()
    exif[0x0112], exif[0x927C] = 6, b"\x00" * 40_000  # turned; a maker note before the frame header
    jpeg_url = _noise(300, 100, "JPEG", exif=exif.tobytes())
    expected = admit(CONFIG, chat("q", png_url, jpeg_url)).visual
    raw = orjson.dumps(chat("q", png_url))
    skeleton, spans = cut(raw)
    body, deferred = parse(skeleton, raw, spans, defer=True) or pytest.fail("not parsed")
    plan = admit(CONFIG, body, deferred=deferred)
    assert plan.visual is not None and plan.visual.tokens == 391 and deferred  # read from the first characters
    raw = orjson.dumps(chat("q", png_url, jpeg_url))
    skeleton, spans = cut(raw)
    body, deferred = parse(skeleton, raw, spans, defer=True) or pytest.fail("not parsed")
    plan = admit(CONFIG, body, deferred=deferred)
    assert plan.visual is not None and plan.visual == expected
    assert [(s.width, s.height) for s in plan.visual.images] == [(640, 480), (100, 300)]
    assert not deferred and body == orjson.loads(raw)  # put back whole, in their places


def test_a_percent_encoded_header_cut_by_the_held_back_end_is_read_whole() -> None:
    """A data URL that is not base64, whose first characters end inside a percent escape of its
    header: read from them it would decode two other bytes; it is read whole instead."""
    import struct

    sof = 183  # the frame header's place: its width at bytes 190-191, 0x4000 = 16384
    jpeg = b"\xff\xd8\xff\xfe" + struct.pack(">H", sof - 4) + b"x" * (sof - 6)
    jpeg += b"\xff\xc0" + struct.pack(">HBHH", 17, 8, 100, 0x4000) + b"\x03" + bytes(20000)
    head = "data:image/jpeg;p="
    url = head + "a" * (strings_prefix() - (190 * 3 + 2) - len(head) - 1) + "," + "".join(f"%{b:02X}" for b in jpeg)
    raw = orjson.dumps(chat("pixels-only", url))
    skeleton, spans = cut(raw)
    body, deferred = parse(skeleton, raw, spans, defer=True) or pytest.fail("not parsed")
    assert deferred  # held back
    with pytest.raises(GatewayError) as caught:  # 16384x100 is over the model's 1,000,000 pixels
        admit(CONFIG, body, deferred=deferred)
    assert caught.value.to_dict()["error"]["code"] == "image_too_large" and "16384x100" in str(caught.value)


def strings_prefix() -> int:
    from gateway.admission.strings import PREFIX

    return PREFIX


@pytest.mark.parametrize(
    "part",
    [
        {"image_url": {"url": data(3000, 2000)}},  # untyped: read by its key, as vLLM reads it
        {"image_url": data(3000, 2000)},
        {"type": "text", "text": "", "image_url": {"url": data(3000, 2000)}, "uuid": "x"},  # a uuid: by its key
    ],
)
def test_an_image_read_by_its_media_key_is_held_to_the_pixel_limit_too(part: dict[str, Any]) -> None:
    body = {"model": "pixels-only", "messages": [{"role": "user", "content": [part]}]}
    assert refused(body)["code"] == "image_too_large"

"""Vision towers against transformers itself: tiny random checkpoints saved by save_pretrained, then
load_tower, compared with the transformers model run on its own processor's pixel_values (CPU, fp32)."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from PIL import Image
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from backends.vision_encoder.towers import TowerError, VisionTower, hf_checkpoint, load_tower

CPU = torch.device("cpu")
F32 = torch.float32

# (width, height): square, landscape, portrait, small, thin, and for Qwen: several attention windows,
# under min_pixels (a side that rounds to 0), over max_pixels
SIZES = [(32, 32), (64, 40), (36, 60), (28, 29), (63, 17), (84, 70), (60, 10), (120, 100)]


def image(width: int, height: int, seed: int = 0) -> Image.Image:
    """A smooth gradient plus noise, so that the resampling filter shows in the pixels."""
    g = torch.Generator().manual_seed(seed)
    ys = torch.linspace(0, 255, height).view(height, 1, 1).expand(height, width, 1)
    xs = torch.linspace(0, 255, width).view(1, width, 1).expand(height, width, 1)
    base = torch.cat([ys, xs, (ys + xs) / 2], dim=2)
    noise = torch.randint(-40, 41, (height, width, 3), generator=g)
    pixels = (base + noise).clamp(0, 255).to(torch.uint8)
    return Image.frombytes("RGB", (width, height), pixels.numpy().tobytes())


def images() -> list[Image.Image]:
    return [image(w, h, seed=i) for i, (w, h) in enumerate(SIZES)]


def load(path: Path, dtype: torch.dtype = F32) -> VisionTower:
    return load_tower(str(path), device=CPU, dtype=dtype)


def encode(tower: VisionTower, pictures: list[Image.Image]) -> list[Any]:
    with torch.inference_mode():
        return tower.forward([tower.prepare(p) for p in pictures])


def assert_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(actual, expected.to(actual.dtype), atol=2e-5, rtol=1e-4)


def rewrite_weights(path: Path, change: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]) -> None:
    file = path / "model.safetensors"
    tensors = load_file(file)
    save_file(change(tensors), file, metadata={"format": "pt"})


def copy(source: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(source, tmp_path / "model"))


# --- tiny checkpoints, made once per module -------------------------------------------------------

VISION: dict[str, Any] = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2}
TEXT: dict[str, Any] = {**VISION, "vocab_size": 64, "max_position_embeddings": 16, "bos_token_id": 0, "eos_token_id": 1}


def save_siglip(path: Path, *, full: bool = True) -> Any:
    from transformers import SiglipConfig, SiglipImageProcessorPil, SiglipModel, SiglipVisionConfig, SiglipVisionModel

    torch.manual_seed(0)
    vision = {**VISION, "image_size": 32, "patch_size": 8}
    model: Any
    if full:
        model = SiglipModel(SiglipConfig(vision_config=vision, text_config={**TEXT, "pad_token_id": 2}))
    else:
        model = SiglipVisionModel(SiglipVisionConfig(**vision))
    model.eval().save_pretrained(path, safe_serialization=True)
    SiglipImageProcessorPil(size={"height": 32, "width": 32}).save_pretrained(path)
    return model


def save_clip(path: Path, processor: dict[str, Any] | None = None, *, full: bool = True) -> Any:
    from transformers import CLIPConfig, CLIPImageProcessorPil, CLIPModel, CLIPVisionConfig, CLIPVisionModel

    torch.manual_seed(0)
    vision = {**VISION, "image_size": 32, "patch_size": 8}
    model: Any
    if full:
        model = CLIPModel(CLIPConfig(vision_config=vision, text_config=TEXT, projection_dim=16))
    else:
        model = CLIPVisionModel(CLIPVisionConfig(**vision))
    model.eval().save_pretrained(path, safe_serialization=True)
    options = processor or {"size": {"shortest_edge": 32}, "crop_size": {"height": 32, "width": 32}}
    CLIPImageProcessorPil(**options).save_pretrained(path)
    return model


QWEN_VISION: dict[str, Any] = {
    "depth": 2,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_heads": 2,
    "out_hidden_size": 48,
    "patch_size": 14,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
    "window_size": 56,  # 2x2 merged tokens per window, so windowing shows on 4x4 grids and up
    "fullatt_block_indexes": [1],
}
QWEN_TEXT: dict[str, Any] = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "vocab_size": 64,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
}
QWEN_PIXELS = {"shortest_edge": 28 * 28, "longest_edge": 56 * 84}


def save_qwen(path: Path) -> Any:
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen2VLImageProcessorPil

    torch.manual_seed(0)
    config = Qwen2_5_VLConfig(text_config=QWEN_TEXT, vision_config=QWEN_VISION, image_token_id=60, video_token_id=61)
    model: Any = Qwen2_5_VLForConditionalGeneration(config)
    model.eval().save_pretrained(path, safe_serialization=True)
    Qwen2VLImageProcessorPil(size=QWEN_PIXELS).save_pretrained(path)
    return model


LLAVA_TEXT: dict[str, Any] = {
    "model_type": "llama",
    "hidden_size": 48,
    "intermediate_size": 64,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "vocab_size": 64,
}
LLAVA_CLIP_PROCESSOR = {"size": {"shortest_edge": 32}, "crop_size": {"height": 32, "width": 32}}


def save_llava(path: Path, *, vision: str = "clip", processor: dict[str, Any] | None = None, **options: Any) -> Any:
    """A LLaVA checkpoint (a 3-layer vision tower, so that LLaVA-1.5's penultimate layer is not
    the last) as transformers 5 saves it; ``options`` go to ``LlavaConfig`` (vision_feature_layer,
    vision_feature_select_strategy)."""
    from transformers import CLIPImageProcessorPil, LlavaConfig, LlavaForConditionalGeneration, LlavaImageProcessorPil

    torch.manual_seed(0)
    vision_config = {**VISION, "num_hidden_layers": 3, "image_size": 32, "patch_size": 8}
    vision_config["model_type"] = "clip_vision_model" if vision == "clip" else "siglip_vision_model"
    config = LlavaConfig(vision_config=vision_config, text_config=LLAVA_TEXT, image_token_index=60, **options)
    model: Any = LlavaForConditionalGeneration(config)
    model.eval().save_pretrained(path, safe_serialization=True)
    if vision == "clip":
        settings = {**LLAVA_CLIP_PROCESSOR, **(processor or {})}
        (LlavaImageProcessorPil if "do_pad" in settings else CLIPImageProcessorPil)(**settings).save_pretrained(path)
    else:
        from transformers import SiglipImageProcessorPil

        SiglipImageProcessorPil(size={"height": 32, "width": 32}, **(processor or {})).save_pretrained(path)
    return model


def llava_features(model: Any, pixel_values: torch.Tensor) -> list[torch.Tensor]:
    """What transformers' LLaVA puts in place of the image tokens (LlavaModel.get_image_features)."""
    config = model.config
    with torch.inference_mode():
        return list(
            model.model.get_image_features(
                pixel_values=pixel_values,
                vision_feature_layer=config.vision_feature_layer,
                vision_feature_select_strategy=config.vision_feature_select_strategy,
                output_hidden_states=True,
            ).pooler_output
        )


def qwen_visual(model: Any) -> Any:
    return model.visual if hasattr(model, "visual") else model.model.visual


@pytest.fixture(scope="module")
def siglip_dir(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    path = tmp_path_factory.mktemp("siglip")
    return path, save_siglip(path)


@pytest.fixture(scope="module")
def clip_dir(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    path = tmp_path_factory.mktemp("clip")
    return path, save_clip(path)


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    path = tmp_path_factory.mktemp("qwen")
    return path, save_qwen(path)


# --- builtin ----------------------------------------------------------------------------------------


def test_builtin_is_deterministic_and_batches_like_single_images() -> None:
    first, second = (
        load_tower("builtin:vit-small", device=CPU, dtype=F32),
        load_tower("builtin:vit-small", device=CPU, dtype=F32),
    )
    assert first.info.fingerprint == second.info.fingerprint
    pictures = images()[:3]
    batched = encode(first, pictures)
    assert [e.embeds.shape for e in batched] == [(196, 384)] * 3
    for picture, one in zip(pictures, batched, strict=True):
        assert_close(encode(second, [picture])[0].embeds, one.embeds)


# --- SigLIP -----------------------------------------------------------------------------------------


def test_siglip_matches_transformers_on_the_processors_pixel_values(siglip_dir) -> None:
    from transformers import SiglipImageProcessorPil

    path, model = siglip_dir
    tower = load(path)
    assert (tower.info.name, tower.info.hidden_size, tower.info.source) == ("siglip", 32, str(path))
    pictures = images()
    inputs = SiglipImageProcessorPil.from_pretrained(path)(images=pictures, return_tensors="pt")
    prepared = [tower.prepare(p) for p in pictures]
    assert all(p.pixels.dtype == torch.uint8 and p.tokens == 16 for p in prepared)
    assert_close(tower.pixel_values(prepared), inputs["pixel_values"])  # type: ignore[attr-defined]

    with torch.inference_mode():
        expected = model.vision_model(pixel_values=inputs["pixel_values"]).last_hidden_state
        encoded = tower.forward(prepared)
    for row, out in zip(expected, encoded, strict=True):
        assert out.grid_thw is None
        assert out.embeds.shape == (16, 32) and out.embeds.dtype == F32
        assert out.embeds.device == CPU and out.embeds.is_contiguous()
        assert_close(out.embeds, row)


@pytest.mark.parametrize("layout", ["transformers 5 (bare keys)", "transformers 4 (vision_model.)"])
def test_siglip_vision_only_checkpoints_load(tmp_path: Path, layout: str) -> None:
    model = save_siglip(tmp_path, full=False)
    if "vision_model." in layout:
        rewrite_weights(tmp_path, lambda t: {f"vision_model.{k}": v for k, v in t.items()})
    tower = load(tmp_path)
    picture = image(40, 30)
    inputs = {"pixel_values": tower.pixel_values([tower.prepare(picture)])}  # type: ignore[attr-defined]
    with torch.inference_mode():
        expected = model(**inputs).last_hidden_state[0]
    assert_close(encode(tower, [picture])[0].embeds, expected)


def test_siglip_batches_like_single_images(siglip_dir) -> None:
    tower = load(siglip_dir[0])
    pictures = images()
    for picture, out in zip(pictures, encode(tower, pictures), strict=True):
        assert_close(encode(tower, [picture])[0].embeds, out.embeds)


# --- CLIP -------------------------------------------------------------------------------------------

CLIP_PROCESSORS = {
    "shortest edge then crop": {"size": {"shortest_edge": 32}, "crop_size": {"height": 32, "width": 32}},
    "crop larger than the resize (zero padding)": {
        "size": {"shortest_edge": 27},
        "crop_size": {"height": 32, "width": 32},
        "resample": 2,
    },
    "exact size, no crop": {"size": {"height": 32, "width": 32}, "do_center_crop": False},
}


@pytest.mark.parametrize("processor", CLIP_PROCESSORS.values(), ids=CLIP_PROCESSORS.keys())
def test_clip_matches_transformers_on_the_processors_pixel_values(tmp_path: Path, processor: dict[str, Any]) -> None:
    from transformers import CLIPImageProcessorPil

    model = save_clip(tmp_path, processor)
    tower = load(tmp_path)
    assert (tower.info.name, tower.info.hidden_size) == ("clip", 32)
    pictures = images()
    inputs = CLIPImageProcessorPil.from_pretrained(tmp_path)(images=pictures, return_tensors="pt")
    prepared = [tower.prepare(p) for p in pictures]
    assert_close(tower.pixel_values(prepared), inputs["pixel_values"])  # type: ignore[attr-defined]
    with torch.inference_mode():
        expected = model.vision_model(pixel_values=inputs["pixel_values"]).last_hidden_state
        encoded = tower.forward(prepared)
    for row, out in zip(expected, encoded, strict=True):
        assert out.embeds.shape == (17, 32)  # CLS + 4x4 patches
        assert_close(out.embeds, row)


def test_clip_legacy_int_sizes_and_vision_only_checkpoints(tmp_path: Path) -> None:
    from transformers import CLIPImageProcessorPil

    model = save_clip(tmp_path, full=False)
    processor = json.loads((tmp_path / "preprocessor_config.json").read_text())
    processor.update(size=32, crop_size=32)  # as openai/clip-vit-* still ship them
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(processor))
    tower = load(tmp_path)
    pictures = images()[:3]
    inputs = CLIPImageProcessorPil.from_pretrained(tmp_path)(images=pictures, return_tensors="pt")
    with torch.inference_mode():
        expected = model(pixel_values=inputs["pixel_values"]).last_hidden_state
    for row, out in zip(expected, encode(tower, pictures), strict=True):
        assert_close(out.embeds, row)


def test_clip_batches_like_single_images(clip_dir) -> None:
    tower = load(clip_dir[0])
    pictures = images()
    for picture, out in zip(pictures, encode(tower, pictures), strict=True):
        assert_close(encode(tower, [picture])[0].embeds, out.embeds)


def test_clip_preprocessing_that_cannot_fit_the_model_is_refused(tmp_path: Path) -> None:
    save_clip(tmp_path, {"size": {"shortest_edge": 32}, "crop_size": {"height": 24, "width": 24}})
    with pytest.raises(TowerError, match=r"preprocessing makes 24x24, the model takes 32x32"):
        load(tmp_path)


# --- LLaVA ---------------------------------------------------------------------------------------------

LLAVA_CASES: dict[str, dict[str, Any]] = {
    "LLaVA-1.5: CLIP, penultimate layer, CLS dropped": {},
    "padded to a square with the mean colour": {"processor": {"do_pad": True}},
    "several layers, CLS kept": {"vision_feature_layer": [-3, 1], "vision_feature_select_strategy": "full"},
    "SigLIP, last layer, every patch": {
        "vision": "siglip",
        "vision_feature_layer": -1,
        "vision_feature_select_strategy": "full",
    },
}


@pytest.mark.parametrize("case", LLAVA_CASES.values(), ids=LLAVA_CASES.keys())
def test_llava_is_the_vision_tower_and_projector_as_transformers_runs_them(
    tmp_path: Path, case: dict[str, Any]
) -> None:
    """The embeddings are at the language model's width (48, not the vision tower's 32): what a
    LLaVA in vLLM takes as image_embeds and puts in place of the image's placeholder tokens."""
    from transformers import AutoImageProcessor

    model = save_llava(tmp_path, **case)
    tower = load(tmp_path)
    assert (tower.info.name, tower.info.hidden_size) == ("llava", 48)
    pictures = images()
    inputs = AutoImageProcessor.from_pretrained(tmp_path, backend="pil")(images=pictures, return_tensors="pt")
    prepared = [tower.prepare(p) for p in pictures]
    assert_close(tower.pixel_values(prepared), inputs["pixel_values"])  # type: ignore[attr-defined]
    encoded = encode(tower, pictures)
    for out, expected in zip(encoded, llava_features(model, inputs["pixel_values"]), strict=True):
        assert out.embeds.shape == expected.shape == (prepared[0].tokens, 48)
        assert out.grid_thw is None
        assert_close(out.embeds, expected)
    for picture, out in zip(pictures, encoded, strict=True):  # batches like single images
        assert_close(encode(tower, [picture])[0].embeds, out.embeds)


def test_llava_reads_the_hubs_layout_and_only_the_layers_it_uses(tmp_path: Path) -> None:
    """The Hub's llava-hf checkpoints (transformers 4) nest the vision model under vision_model.;
    the last vision layer (LLaVA-1.5 reads the penultimate), the post-layernorm and the language
    model are never read, so changing them keeps the fingerprint."""
    model = save_llava(tmp_path / "t5")
    path = copy(tmp_path / "t5", tmp_path)
    hub = {"vision_tower.": "vision_tower.vision_model."}

    def to_hub(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {
            next((new + k[len(old) :] for old, new in hub.items() if k.startswith(old)), k): v
            for k, v in tensors.items()
        }

    rewrite_weights(path, to_hub)
    tower = load(path)
    assert tower.info.fingerprint == load(tmp_path / "t5").info.fingerprint
    assert tower.info.extra["vision_layers"] == "2 of 3"
    picture = image(50, 30)
    from transformers import CLIPImageProcessorPil

    pixel_values = CLIPImageProcessorPil.from_pretrained(path)(images=[picture], return_tensors="pt")["pixel_values"]
    assert_close(encode(tower, [picture])[0].embeds, llava_features(model, pixel_values)[0])
    unused = (
        "vision_tower.vision_model.encoder.layers.2.mlp.fc1.bias",
        "vision_tower.vision_model.post_layernorm.bias",
        "language_model.model.norm.weight",
    )
    rewrite_weights(path, lambda t: {**t, **{k: t[k] + 1 for k in unused}})
    assert load(path).info.fingerprint == tower.info.fingerprint
    rewrite_weights(
        path, lambda t: {**t, "multi_modal_projector.linear_2.bias": t["multi_modal_projector.linear_2.bias"] + 1}
    )
    assert load(path).info.fingerprint != tower.info.fingerprint


def test_llava_configs_it_cannot_serve_are_refused(tmp_path: Path) -> None:
    save_llava(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    for change, message in (
        ({"vision_feature_layer": 7}, r"vision_feature_layer 7: each must be an index into the 4 hidden states"),
        ({"vision_feature_select_strategy": "class"}, r"not a LLaVA config: .*vision_feature_select_strategy"),
        ({"vision_config": {"model_type": "pixtral"}}, r"a LLaVA with a pixtral vision tower is not supported"),
    ):
        (tmp_path / "config.json").write_text(json.dumps({**config, **change}))
        with pytest.raises(TowerError, match=message):
            load(tmp_path)


# --- Qwen2.5-VL -------------------------------------------------------------------------------------


def test_qwen_matches_the_full_models_visual_tower(qwen_dir) -> None:
    from transformers import Qwen2VLImageProcessorPil

    path, model = qwen_dir
    tower = load(path)
    assert (tower.info.name, tower.info.hidden_size) == ("qwen2_5_vl", 48)
    processor = Qwen2VLImageProcessorPil.from_pretrained(path)
    for picture in images():
        inputs = processor(images=[picture], return_tensors="pt")
        prepared = tower.prepare(picture)
        pixel_values, grid_thw = tower.pixel_values([prepared])  # type: ignore[attr-defined]
        assert prepared.grid_thw is not None
        assert grid_thw.tolist() == inputs["image_grid_thw"].tolist() == [list(prepared.grid_thw)]
        assert_close(pixel_values, inputs["pixel_values"])
        with torch.inference_mode():
            expected = qwen_visual(model)(inputs["pixel_values"], grid_thw=inputs["image_grid_thw"]).pooler_output
            (out,) = tower.forward([prepared])
        t, h, w = prepared.grid_thw
        assert out.embeds.shape == (t * h * w // 4, 48) == (prepared.tokens, 48)
        assert out.grid_thw == prepared.grid_thw
        assert_close(out.embeds, expected)


def test_qwen_batches_mixed_sizes_like_single_images(qwen_dir) -> None:
    tower = load(qwen_dir[0])
    pictures = images()
    batched = encode(tower, pictures)
    assert len({out.grid_thw for out in batched}) > 1
    for picture, out in zip(pictures, batched, strict=True):
        (single,) = encode(tower, [picture])
        assert single.grid_thw == out.grid_thw
        assert_close(out.embeds, single.embeds)
        assert out.embeds.is_contiguous() and out.embeds.untyped_storage().nbytes() == out.embeds.nbytes


def test_qwen_reads_only_the_vision_tensors(qwen_dir, monkeypatch: pytest.MonkeyPatch) -> None:
    read: list[str] = []

    class Recording:
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            self.inner: Any = safe_open(*args, **kwargs)

        def __enter__(self) -> Recording:
            self.file = self.inner.__enter__()
            return self

        def __exit__(self, *exc: object) -> None:
            self.inner.__exit__(*exc)

        def keys(self) -> list[str]:
            return list(self.file.keys())

        def get_slice(self, key: str) -> Any:
            return self.file.get_slice(key)

        def get_tensor(self, key: str) -> Any:
            read.append(key)
            return self.file.get_tensor(key)

    monkeypatch.setattr(hf_checkpoint, "safe_open", Recording)
    path, model = qwen_dir
    tower = load(path)
    assert read and all(key.startswith("visual.") for key in read)
    assert len(read) == len(qwen_visual(model).state_dict())
    assert not any("language_model" in name or "lm_head" in name for name, _ in tower.model.named_parameters())  # type: ignore[attr-defined]


def test_qwen_model_visual_layout_and_hub_config(qwen_dir, tmp_path: Path) -> None:
    source, _ = qwen_dir
    path = copy(source, tmp_path)
    rewrite_weights(path, lambda t: {("model." + k if k.startswith("visual.") else k): v for k, v in t.items()})
    # the shape of Qwen/Qwen2.5-VL-7B-Instruct's config.json and preprocessor_config.json
    config = json.loads((path / "config.json").read_text())
    vision = {k: v for k, v in config["vision_config"].items() if k not in ("rope_parameters", "in_channels")}
    config["vision_config"] = {**vision, "model_type": "qwen2_5_vl", "in_chans": 3, "spatial_patch_size": 14}
    config.update(rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]}, torch_dtype="bfloat16")
    (path / "config.json").write_text(json.dumps(config))
    processor = json.loads((path / "preprocessor_config.json").read_text())
    del processor["size"], processor["resample"], processor["rescale_factor"]
    processor.update(min_pixels=QWEN_PIXELS["shortest_edge"], max_pixels=QWEN_PIXELS["longest_edge"])
    (path / "preprocessor_config.json").write_text(json.dumps(processor))

    tower, reference = load(path), load(source)
    pictures = images()
    for ours, theirs in zip(encode(tower, pictures), encode(reference, pictures), strict=True):
        assert ours.grid_thw == theirs.grid_thw
        assert_close(ours.embeds, theirs.embeds)


def test_qwen_in_bfloat16_keeps_its_rotary_frequencies_in_fp32(qwen_dir) -> None:
    path, _ = qwen_dir
    tower = load(path, torch.bfloat16)
    reference = load(path)
    assert tower.model.rotary_pos_emb.inv_freq.dtype == F32  # type: ignore[attr-defined]
    assert {p.dtype for p in tower.model.parameters()} == {torch.bfloat16}  # type: ignore[attr-defined]
    assert tower.info.fingerprint != reference.info.fingerprint
    picture = image(64, 40)
    (low,), (full,) = encode(tower, [picture]), encode(reference, [picture])
    assert low.embeds.dtype == torch.bfloat16
    torch.testing.assert_close(low.embeds.float(), full.embeds, atol=0.1, rtol=0.05)


# --- loading: shards, fingerprints, errors ----------------------------------------------------------


def test_sharded_checkpoints_load_the_same_weights(qwen_dir, tmp_path: Path) -> None:
    source, model = qwen_dir
    path = tmp_path / "sharded"
    model.save_pretrained(path, safe_serialization=True, max_shard_size="20KB")
    shutil.copy(source / "preprocessor_config.json", path)
    assert (path / "model.safetensors.index.json").is_file() and not (path / "model.safetensors").exists()
    assert len(set(json.loads((path / "model.safetensors.index.json").read_text())["weight_map"].values())) > 2
    sharded, single = load(path), load(source)
    assert sharded.info.fingerprint == single.info.fingerprint  # content, not file layout
    picture = image(50, 30)
    assert_close(encode(sharded, [picture])[0].embeds, encode(single, [picture])[0].embeds)


def test_fingerprints_follow_weights_and_preprocessing(siglip_dir, tmp_path: Path) -> None:
    source, _ = siglip_dir
    base = load(source).info.fingerprint
    assert base.startswith("siglip/v1/float32/")
    assert load(source).info.fingerprint == base

    path = copy(source, tmp_path)
    processor = json.loads((path / "preprocessor_config.json").read_text())
    (path / "preprocessor_config.json").write_text(json.dumps({**processor, "image_mean": [0.4, 0.5, 0.5]}))
    assert load(path).info.fingerprint != base

    path = copy(source, tmp_path / "weights")
    key = "vision_model.post_layernorm.bias"
    rewrite_weights(path, lambda t: {**t, key: t[key] + 0.01})  # same shapes, same file size
    assert load(path).info.fingerprint != base

    path = copy(source, tmp_path / "text")
    key = "text_model.final_layer_norm.bias"
    rewrite_weights(path, lambda t: {**t, key: t[key] + 0.01})  # not a weight the tower reads
    assert load(path).info.fingerprint == base


def test_missing_weights_are_named(siglip_dir, tmp_path: Path) -> None:
    path = copy(siglip_dir[0], tmp_path)
    rewrite_weights(path, lambda t: {k: v for k, v in t.items() if "layers.1.mlp.fc2" not in k})
    with pytest.raises(TowerError, match=r"2 missing \(vision_model\.encoder\.layers\.1\.mlp\.fc2\.bias, "):
        load(path)


def test_unexpected_weights_are_named(qwen_dir, tmp_path: Path) -> None:
    path = copy(qwen_dir[0], tmp_path)
    rewrite_weights(path, lambda t: {**t, "visual.blocks.2.norm1.weight": torch.ones(32)})
    with pytest.raises(TowerError, match=r"1 unexpected \(visual\.blocks\.2\.norm1\.weight\)"):
        load(path)


def test_weights_that_do_not_fit_the_config_are_refused(qwen_dir, tmp_path: Path) -> None:
    path = copy(qwen_dir[0], tmp_path)
    config = json.loads((path / "config.json").read_text())
    config["vision_config"]["out_hidden_size"] = 64
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(TowerError, match=r"visual\.merger\.mlp\.2\.\w+ has shape \[48.*\], the config makes \[64"):
        load(path)


def test_a_missing_shard_is_refused(qwen_dir, tmp_path: Path) -> None:
    path = tmp_path / "sharded"
    qwen_dir[1].save_pretrained(path, safe_serialization=True, max_shard_size="20KB")
    shutil.copy(qwen_dir[0] / "preprocessor_config.json", path)
    shard = sorted(path.glob("model-*.safetensors"))[0]
    shard.unlink()
    with pytest.raises(TowerError, match=rf"shard {shard.name} is missing"):
        load(path)


def test_pickled_weights_are_refused_unread(siglip_dir, tmp_path: Path) -> None:
    path = copy(siglip_dir[0], tmp_path)
    (path / "model.safetensors").unlink()
    (path / "pytorch_model.bin").write_bytes(b"not even read")
    with pytest.raises(TowerError, match=r"only pickled weights \(pytorch_model\.bin\); .* safetensors only"):
        load(path)


def test_no_weights_at_all(siglip_dir, tmp_path: Path) -> None:
    path = copy(siglip_dir[0], tmp_path)
    (path / "model.safetensors").unlink()
    with pytest.raises(TowerError, match=r"no model\.safetensors or model\.safetensors\.index\.json"):
        load(path)


def test_a_missing_preprocessor_config_is_refused(clip_dir, tmp_path: Path) -> None:
    path = copy(clip_dir[0], tmp_path)
    (path / "preprocessor_config.json").unlink()
    with pytest.raises(TowerError, match=r"preprocessor_config\.json: missing"):
        load(path)


def test_unknown_model_types_and_specs_are_refused(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llava_next"}))
    with pytest.raises(
        TowerError, match=r"model_type 'llava_next' is not supported \(siglip, clip, qwen2_5_vl, llava\)"
    ):
        load(tmp_path)
    with pytest.raises(TowerError, match=r"neither builtin:NAME nor a directory with a config\.json"):
        load(tmp_path / "nowhere")
    with pytest.raises(TowerError, match=r"unknown builtin tower 'builtin:vit-huge'"):
        load_tower("builtin:vit-huge", device=CPU, dtype=F32)


def test_a_bad_config_is_a_tower_error(siglip_dir, tmp_path: Path) -> None:
    path = copy(siglip_dir[0], tmp_path)
    config = json.loads((path / "config.json").read_text())
    config["vision_config"]["hidden_size"] = "wide"
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(TowerError, match=r"config\.json: not a SigLIP config"):
        load(path)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_qwen_on_cuda_in_bfloat16_is_close_to_cpu_fp32(qwen_dir) -> None:
    path, _ = qwen_dir
    cuda = load_tower(str(path), device=torch.device("cuda"), dtype=torch.bfloat16)
    cpu = load(path)
    pictures = images()
    for ours, theirs in zip(encode(cuda, pictures), encode(cpu, pictures), strict=True):
        assert ours.embeds.device == CPU and ours.embeds.dtype == torch.bfloat16
        assert ours.grid_thw == theirs.grid_thw
        torch.testing.assert_close(ours.embeds.float(), theirs.embeds, atol=0.1, rtol=0.05)

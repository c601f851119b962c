"""The Qwen2.5-VL vision tower, read out of a full ``Qwen2_5_VLForConditionalGeneration`` directory.

Only the tensors under ``visual.`` (the hub layout) or ``model.visual.`` (the model's own module
path since transformers 4.52, which some versions save) are read, into transformers'
``Qwen2_5_VisionTransformerPretrainedModel`` built from the ``vision_config``; the language model
is never built or read.

Output: the patch merger's output, which is what Qwen2.5-VL puts in place of its image tokens and
what vLLM takes as ``image_embeds``: ``t * h * w / merge_size ** 2`` rows of ``out_hidden_size``
per image, with the image's ``(t, h, w)`` patch grid (``image_grid_thw``; ``t`` is 1 for an image).

Preprocessing follows ``Qwen2VLImageProcessor``: ``smart_resize`` to multiples of
``patch_size * merge_size`` with the pixel count in ``[min_pixels, max_pixels]``, then patches in
its order (merge windows row-major, then the patches inside each window). :meth:`prepare` keeps
each patch as uint8 ``(3, patch, patch)``; :meth:`forward` normalizes and repeats it over
``temporal_patch_size`` on the device, giving the processor's ``(C, T, ph, pw)`` flattening.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from PIL import Image

from ..preprocess import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD, resize_exact, smart_resize, to_tensor
from .base import Encoded, Prepared, TowerError, checkpoint_info
from .hf_checkpoint import (
    PROCESSOR_FILE,
    CheckpointTower,
    PixelNorm,
    fingerprint,
    load_model,
    positive_int,
    read_json,
    resample_of,
)

NAME = "qwen2_5_vl"
VERSION = 1  # bump when the output or the preprocessing of the same files changes

# Qwen2VLImageProcessor's defaults, for keys a preprocessor_config.json leaves out
DEFAULT_MIN_PIXELS = 56 * 56
DEFAULT_MAX_PIXELS = 28 * 28 * 1280


@dataclass(eq=False, kw_only=True)
class Qwen25VLTower(CheckpointTower):
    patch_size: int
    merge_size: int
    temporal_patch_size: int
    min_pixels: int
    max_pixels: int
    resample: str

    def prepare(self, image: Image.Image) -> Prepared:
        p, m = self.patch_size, self.merge_size
        height, width = smart_resize(
            image.height, image.width, factor=p * m, min_pixels=self.min_pixels, max_pixels=self.max_pixels
        )
        pixels = to_tensor(resize_exact(image, height, width, self.resample))
        gh, gw = height // p, width // p
        # (C, gh/m, m, p, gw/m, m, p) -> (gh/m, gw/m, m, m, C, p, p): Qwen2VLImageProcessor's patch order
        patches = pixels.view(3, gh // m, m, p, gw // m, m, p).permute(1, 4, 2, 5, 0, 3, 6)
        return Prepared(patches.reshape(gh * gw, 3, p, p), gh * gw // (m * m), (1, gh, gw))

    def pixel_values(self, batch: Sequence[Prepared]) -> tuple[torch.Tensor, torch.Tensor]:
        """The batch as the model takes it (the processor's ``pixel_values``, ``image_grid_thw``), on the device."""
        patches = torch.cat([p.pixels for p in batch]).to(self.device, non_blocking=True)
        x = self.norm(patches).to(self.dtype)  # (N, C, p, p)
        # an image is a video of temporal_patch_size identical frames: (N, C, T, p, p), flattened
        x = x.unsqueeze(2).expand(-1, -1, self.temporal_patch_size, -1, -1).reshape(x.shape[0], -1)
        grid_thw = torch.tensor([p.grid_thw for p in batch], dtype=torch.long, device=self.device)
        return x, grid_thw

    def forward(self, batch: Sequence[Prepared]) -> list[Encoded]:
        out = self.model(*self.pixel_values(batch)).pooler_output.to("cpu")
        rows = out.split([p.tokens for p in batch])
        return [Encoded(row.clone(), p.grid_thw) for row, p in zip(rows, batch, strict=True)]


def load_qwen2_5_vl(path: Path, config: dict[str, Any], *, device: torch.device, dtype: torch.dtype) -> Qwen25VLTower:
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel

    vision = _vision_config(path, config)
    processor_file = path / PROCESSOR_FILE
    processor = read_json(processor_file)
    sizes = _patch_sizes(processor, processor_file, vision)
    min_pixels, max_pixels = _pixel_range(processor, processor_file)
    if processor.get("do_resize", True) is not True:
        raise TowerError(f"{processor_file}: do_resize must be true")
    norm = PixelNorm.from_processor(processor, processor_file, mean=OPENAI_CLIP_MEAN, std=OPENAI_CLIP_STD)

    model, digest = load_model(
        path,
        lambda: Qwen2_5_VisionTransformerPretrainedModel(vision),
        prefixes=("visual.", "model.visual."),
        device=device,
        dtype=dtype,
    )
    patch_size, merge_size, temporal_patch_size = sizes
    info = checkpoint_info(
        NAME,
        source=str(path),
        fingerprint=fingerprint(NAME, VERSION, path, digest, dtype),
        hidden_size=vision.out_hidden_size,
        patch_size=patch_size,
        merge_size=merge_size,
        temporal_patch_size=temporal_patch_size,
        min_pixels=min_pixels,
        max_pixels=max_pixels,
        output="merger output, with image_grid_thw",
    )
    return Qwen25VLTower(
        model=model,
        patch_size=patch_size,
        merge_size=merge_size,
        temporal_patch_size=temporal_patch_size,
        min_pixels=min_pixels,
        max_pixels=max_pixels,
        resample=resample_of(processor, processor_file),
        norm=norm,
        info=info,
        device=device,
        dtype=dtype,
    )


def _vision_config(path: Path, config: dict[str, Any]) -> Any:
    from huggingface_hub.errors import StrictDataclassError
    from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLVisionConfig

    vision = config.get("vision_config")
    if not isinstance(vision, dict):
        raise TowerError(f"{path / 'config.json'}: no vision_config")
    # hub configs name the vision model_type "qwen2_5_vl" (or leave it out); the class sets its own
    vision = {key: value for key, value in vision.items() if key != "model_type"}
    try:
        return Qwen2_5_VLVisionConfig.from_dict(vision)
    except (TypeError, ValueError, KeyError, StrictDataclassError) as exc:
        raise TowerError(f"{path / 'config.json'}: not a Qwen2.5-VL vision_config: {exc}") from None


def _patch_sizes(processor: dict[str, Any], where: Path, vision: Any) -> tuple[int, int, int]:
    sizes = []
    for key, model_key, default in (
        ("patch_size", "patch_size", 14),
        ("merge_size", "spatial_merge_size", 2),
        ("temporal_patch_size", "temporal_patch_size", 2),
    ):
        value = positive_int(processor.get(key, default), key, where)
        if value != getattr(vision, model_key):
            raise TowerError(
                f"{where}: {key} {value} differs from the vision_config's {model_key} {getattr(vision, model_key)}"
            )
        sizes.append(value)
    return sizes[0], sizes[1], sizes[2]


def _pixel_range(processor: dict[str, Any], where: Path) -> tuple[int, int]:
    """``min_pixels``/``max_pixels`` win over ``size.shortest_edge``/``size.longest_edge``, as in transformers."""
    size = processor.get("size")
    size = size if isinstance(size, dict) else {}
    low = processor.get("min_pixels")
    high = processor.get("max_pixels")
    low = positive_int(size.get("shortest_edge", DEFAULT_MIN_PIXELS) if low is None else low, "min_pixels", where)
    high = positive_int(size.get("longest_edge", DEFAULT_MAX_PIXELS) if high is None else high, "max_pixels", where)
    if low > high:
        raise TowerError(f"{where}: min_pixels {low} is over max_pixels {high}")
    return low, high

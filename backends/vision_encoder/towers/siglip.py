"""SigLIP vision towers (``model_type`` ``siglip`` or ``siglip_vision_model``) from a local directory.

Output: ``SiglipVisionModel``'s ``last_hidden_state``, which is after ``post_layernorm``:
``(image_size / patch_size) ** 2`` rows of ``hidden_size`` per image, one per patch, no pooling.
These are the patch features SigLIP-based VLMs (PaliGemma, Idefics3) take into their projector.
The attention-pooling head (``head.*``) only makes the single pooled vector for image-text
similarity, so its weights are not read and it never runs. A consumer that wants the features
before the final norm (LLaVA-OneVision's ``vision_feature_layer``) needs another output.

Weights: a full ``SiglipModel`` checkpoint (``siglip``) gives its ``vision_model.*`` tensors; a
``SiglipVisionModel`` checkpoint has them under ``vision_model.`` (transformers 4) or bare
(transformers 5). Preprocessing follows ``SiglipImageProcessor``: resize straight to
``size.height x size.width`` (aspect ratio not kept, no crop), then rescale and normalize.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from PIL import Image

from ..preprocess import HALF, resize_exact, to_tensor
from . import hf_checkpoint as hf
from .base import Prepared, TowerError

NAME = "siglip"
VERSION = 1  # bump when the output or the preprocessing of the same files changes
OUTPUT = "last_hidden_state (after post_layernorm)"  # what /health says the embeddings are


@dataclass(eq=False, kw_only=True)
class SiglipTower(hf.FixedSizeTower):
    size: tuple[int, int]
    tokens: int
    resample: str

    def prepare(self, image: Image.Image) -> Prepared:
        height, width = self.size
        return Prepared(to_tensor(resize_exact(image, height, width, self.resample)), self.tokens)


def load_siglip(path: Path, config: dict[str, Any], *, device: torch.device, dtype: torch.dtype) -> SiglipTower:
    from transformers import SiglipConfig, SiglipVisionConfig, SiglipVisionModel

    full = config.get("model_type") == "siglip"
    vision = hf.vision_config(path, config, SiglipConfig, SiglipVisionConfig, "siglip", "SigLIP")
    vision.vision_use_head = False  # see the module docstring
    processor_file = path / hf.PROCESSOR_FILE
    processor = hf.read_json(processor_file)
    size = size_of(processor, processor_file, vision.image_size)
    norm = hf.PixelNorm.from_processor(processor, processor_file, mean=HALF, std=HALF)
    resample = hf.resample_of(processor, processor_file)

    prefixes = ("vision_model.",) if full else ("vision_model.", "")
    model, digest = hf.load_model(
        path, lambda: SiglipVisionModel(vision), prefixes=prefixes, skip=("head.",), device=device, dtype=dtype
    )
    tokens = (vision.image_size // vision.patch_size) ** 2
    info = hf.fixed_size_info(NAME, VERSION, path, vision, digest=digest, dtype=dtype, tokens=tokens, output=OUTPUT)
    return SiglipTower(
        model=model, size=size, tokens=tokens, resample=resample, norm=norm, info=info, device=device, dtype=dtype
    )


def size_of(processor: dict[str, Any], where: Path, image_size: int) -> tuple[int, int]:
    if processor.get("do_resize", True) is not True:
        raise TowerError(f"{where}: do_resize must be true (the model takes one fixed size)")
    size = processor.get("size", {"height": 224, "width": 224})
    if not isinstance(size, dict) or "height" not in size or "width" not in size:
        raise TowerError(f"{where}: size must be {{'height': H, 'width': W}}, got {size!r}")
    height = hf.positive_int(size["height"], "size.height", where)
    width = hf.positive_int(size["width"], "size.width", where)
    if (height, width) != (image_size, image_size):
        raise TowerError(f"{where}: size {height}x{width} differs from the model's image_size {image_size}")
    return height, width

"""CLIP vision towers (``model_type`` ``clip`` or ``clip_vision_model``) from a local directory.

Output: ``CLIPVisionModel``'s ``last_hidden_state``, the CLS row included:
``1 + (image_size / patch_size) ** 2`` rows of ``hidden_size`` per image, CLS first. It is exactly
what transformers returns (the encoder's last layer; CLIP's ``post_layernorm`` applies only to the
pooled CLS vector, so not here), and a consumer that wants patch rows only drops row 0. Neither
``visual_projection`` nor a VLM's projector is applied: those belong to the consumer's checkpoint.
LLaVA-style models read the penultimate layer instead, which this tower does not offer.

Weights: a full ``CLIPModel`` checkpoint (``clip``) gives its ``vision_model.*`` tensors; a
``CLIPVisionModel`` checkpoint has them under ``vision_model.`` (transformers 4) or bare
(transformers 5). Preprocessing follows ``CLIPImageProcessor``: resize the short side to
``size.shortest_edge`` (or straight to ``size.height x size.width``), center-crop to ``crop_size``,
then rescale and normalize.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from PIL import Image

from ..preprocess import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD, center_crop, resize_exact, resize_shortest_edge, to_tensor
from . import hf_checkpoint as hf
from .base import Prepared, TowerError

NAME = "clip"
VERSION = 1  # bump when the output or the preprocessing of the same files changes
OUTPUT = "last_hidden_state (CLS first, no post_layernorm)"  # what /health says the embeddings are


@dataclass(frozen=True)
class ClipResize:
    """``shortest_edge`` or an exact ``(height, width)``, then an optional center crop."""

    shortest_edge: int | None
    exact: tuple[int, int] | None
    crop: tuple[int, int] | None
    resample: str

    def __call__(self, image: Image.Image) -> torch.Tensor:
        if self.shortest_edge is not None:
            image = resize_shortest_edge(image, self.shortest_edge, self.resample)
        elif self.exact is not None:
            image = resize_exact(image, *self.exact, self.resample)
        pixels = to_tensor(image)
        return center_crop(pixels, *self.crop).contiguous() if self.crop is not None else pixels


@dataclass(eq=False, kw_only=True)
class ClipTower(hf.FixedSizeTower):
    resize: ClipResize
    tokens: int

    def prepare(self, image: Image.Image) -> Prepared:
        return Prepared(self.resize(image), self.tokens)


def load_clip(path: Path, config: dict[str, Any], *, device: torch.device, dtype: torch.dtype) -> ClipTower:
    from transformers import CLIPConfig, CLIPVisionConfig, CLIPVisionModel

    full = config.get("model_type") == "clip"
    vision = hf.vision_config(path, config, CLIPConfig, CLIPVisionConfig, "clip", "CLIP")
    processor_file = path / hf.PROCESSOR_FILE
    processor = hf.read_json(processor_file)
    resize = resize_of(processor, processor_file, vision.image_size)
    norm = hf.PixelNorm.from_processor(processor, processor_file, mean=OPENAI_CLIP_MEAN, std=OPENAI_CLIP_STD)

    prefixes = ("vision_model.",) if full else ("vision_model.", "")
    model, digest = hf.load_model(path, lambda: CLIPVisionModel(vision), prefixes=prefixes, device=device, dtype=dtype)
    tokens = 1 + (vision.image_size // vision.patch_size) ** 2
    info = hf.fixed_size_info(NAME, VERSION, path, vision, digest=digest, dtype=dtype, tokens=tokens, output=OUTPUT)
    return ClipTower(model=model, resize=resize, tokens=tokens, norm=norm, info=info, device=device, dtype=dtype)


def resize_of(processor: dict[str, Any], where: Path, image_size: int) -> ClipResize:
    """CLIPImageProcessor's size rules; the result must be the model's square ``image_size``."""
    if processor.get("do_resize", True) is not True:
        raise TowerError(f"{where}: do_resize must be true (the model takes one fixed size)")
    size = processor.get("size", {"shortest_edge": 224})
    if isinstance(size, int):  # old configs: an int size is the shortest edge
        size = {"shortest_edge": size}
    if not isinstance(size, dict):
        raise TowerError(f"{where}: size must be an object, got {size!r}")
    shortest, exact = None, None
    if "shortest_edge" in size and size.get("longest_edge") is None:
        shortest = hf.positive_int(size["shortest_edge"], "size.shortest_edge", where)
    elif "height" in size and "width" in size:
        height = hf.positive_int(size["height"], "size.height", where)
        exact = height, hf.positive_int(size["width"], "size.width", where)
    else:
        raise TowerError(f"{where}: size must be {{'shortest_edge': N}} or {{'height': H, 'width': W}}, got {size}")
    crop = None
    if processor.get("do_center_crop", True):
        crop_size = processor.get("crop_size", {"height": 224, "width": 224})
        if isinstance(crop_size, int):
            crop_size = {"height": crop_size, "width": crop_size}
        if not isinstance(crop_size, dict) or "height" not in crop_size or "width" not in crop_size:
            raise TowerError(f"{where}: crop_size must be {{'height': H, 'width': W}}, got {crop_size!r}")
        crop = (
            hf.positive_int(crop_size["height"], "crop_size.height", where),
            hf.positive_int(crop_size["width"], "crop_size.width", where),
        )
    final = crop or exact
    if final != (image_size, image_size):
        made = "images of varying size" if final is None else f"{final[0]}x{final[1]}"
        raise TowerError(f"{where}: preprocessing makes {made}, the model takes {image_size}x{image_size}")
    return ClipResize(shortest, exact, crop, hf.resample_of(processor, where))

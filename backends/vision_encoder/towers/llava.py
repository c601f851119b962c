"""LLaVA towers (``model_type`` ``llava``): the model's vision tower *and* its projector, from a full
LLaVA checkpoint, so that the output is what the language model reads.

Output: ``(tokens, text_config.hidden_size)`` per image, exactly
``LlavaModel.get_image_features`` in transformers and what vLLM's ``LlavaForConditionalGeneration``
computes from pixels: the hidden states of ``vision_feature_layer`` (one layer, or several
concatenated), CLS dropped under ``vision_feature_select_strategy: default``, then
``multi_modal_projector`` (``linear_1``, the activation, ``linear_2``). This is the one shape of
``image_embeds`` vLLM takes for a LLaVA model: its data parser holds a tensor's last dimension to
the language model's hidden size (``_get_expected_hidden_size``), and the rows become the image's
placeholder tokens one for one (``get_feature_size``). A bare CLIP or SigLIP tower's features
(before the projector, at the vision width) are refused there.

The vision model is built with only the layers the selected features need (vLLM does the same,
``_get_num_hidden_layers``), so LLaVA-1.5's penultimate-layer features cost one layer less and the
last layer's weights are not read; the vision model's ``post_layernorm`` and SigLIP's pooling head
never touch the selected features, so they are not read either. Nor is the language model: a 7B
checkpoint costs the vision tower's and projector's bytes.

Vision towers: CLIP (LLaVA-1.5) and SigLIP (LLaVA-Interleave). Pixtral-based LLaVA checkpoints
are refused (vLLM takes no ``image_embeds`` for them). Preprocessing follows the checkpoint's
processor: CLIP's shortest-edge resize and center crop, or SigLIP's exact resize; with
``do_pad`` (``LlavaImageProcessor``) the image is first padded to a square with the mean colour,
as LLaVA-1.5 was trained.

Weights: a transformers-4 checkpoint (the Hub's ``llava-hf/*``) has ``vision_tower.`` and
``multi_modal_projector.`` at the top; transformers 5 saves them under ``model.``.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from PIL import Image
from torch import nn

from ..preprocess import HALF, OPENAI_CLIP_MEAN, OPENAI_CLIP_STD, resize_exact, to_tensor
from . import hf_checkpoint as hf
from .base import Encoded, Prepared, TowerError, checkpoint_info
from .clip import resize_of
from .siglip import size_of

NAME = "llava"
VERSION = 1  # bump when the output or the preprocessing of the same files changes
STRATEGIES = ("default", "full")  # vLLM's "class" keeps one row: no LLaVA checkpoint uses it


# the checkpoint's key prefixes, the longest first: the Hub's (transformers 4) nest the vision model
# under vision_model., transformers 5 saves it bare; a model saved from LlavaModel has them under model.
VISION_PREFIXES = (
    "model.vision_tower.vision_model.",
    "vision_tower.vision_model.",
    "model.vision_tower.",
    "vision_tower.",
)
PROJECTOR_PREFIXES = ("model.multi_modal_projector.", "multi_modal_projector.")


class LlavaEncoder(nn.Module):
    """The vision model and the projector, loaded each from its prefix of the checkpoint."""

    def __init__(self, vision_tower: nn.Module, projector: nn.Module) -> None:
        super().__init__()
        self.vision_tower = vision_tower
        self.multi_modal_projector = projector


@dataclass(frozen=True)
class Selection:
    """Which hidden states become the features: ``layers`` index ``hidden_states`` of the
    truncated model (the embeddings first, then each layer), ``drop_cls`` drops row 0."""

    layers: tuple[int, ...]
    drop_cls: bool

    def __call__(self, hidden_states: Sequence[torch.Tensor]) -> torch.Tensor:
        start = 1 if self.drop_cls else 0
        return torch.cat([hidden_states[i][:, start:] for i in self.layers], dim=-1)


@dataclass(eq=False, kw_only=True)
class LlavaTower(hf.FixedSizeTower):
    resize: Callable[[Image.Image], torch.Tensor]
    selection: Selection
    tokens: int

    def prepare(self, image: Image.Image) -> Prepared:
        return Prepared(self.resize(image), self.tokens)

    def forward(self, batch: Sequence[Prepared]) -> list[Encoded]:
        model: Any = self.model
        out = model.vision_tower(pixel_values=self.pixel_values(batch), output_hidden_states=True)
        features = model.multi_modal_projector(self.selection(out.hidden_states)).to("cpu")
        return [Encoded(row.clone()) for row in features]


@dataclass(frozen=True)
class PadToSquare:
    """``LlavaImageProcessor``'s ``do_pad``: the image centred on a square of the mean colour."""

    color: tuple[int, int, int]

    def __call__(self, image: Image.Image) -> Image.Image:
        side = max(image.size)
        if image.width == image.height:
            return image
        square = Image.new("RGB", (side, side), self.color)
        square.paste(image, ((side - image.width) // 2, (side - image.height) // 2))
        return square


@dataclass(frozen=True)
class LlavaResize:
    pad: PadToSquare | None
    then: Callable[[Image.Image], torch.Tensor]

    def __call__(self, image: Image.Image) -> torch.Tensor:
        return self.then(self.pad(image) if self.pad is not None else image)


@dataclass(frozen=True)
class ExactResize:
    size: tuple[int, int]
    resample: str

    def __call__(self, image: Image.Image) -> torch.Tensor:
        return to_tensor(resize_exact(image, *self.size, self.resample))


def load_llava(path: Path, config: dict[str, Any], *, device: torch.device, dtype: torch.dtype) -> LlavaTower:
    from huggingface_hub.errors import StrictDataclassError
    from transformers import CLIPVisionConfig, LlavaConfig, SiglipVisionConfig

    config_file = path / hf.CONFIG_FILE
    try:
        llava = LlavaConfig.from_dict(config)
    except (TypeError, ValueError, KeyError, StrictDataclassError) as exc:
        raise TowerError(f"{config_file}: not a LLaVA config: {exc}") from None
    if not isinstance(llava.vision_config, CLIPVisionConfig | SiglipVisionConfig):
        kind = getattr(llava.vision_config, "model_type", type(llava.vision_config).__name__)
        raise TowerError(
            f"{config_file}: a LLaVA with a {kind} vision tower is not supported (clip_vision_model,"
            " siglip_vision_model); vLLM takes no image_embeds for Pixtral-based LLaVA"
        )
    clip = isinstance(llava.vision_config, CLIPVisionConfig)
    vision: Any = llava.vision_config
    selection, depth = _selection(llava, vision, config_file)
    processor_file = path / hf.PROCESSOR_FILE
    processor = hf.read_json(processor_file)
    default = (OPENAI_CLIP_MEAN, OPENAI_CLIP_STD) if clip else (HALF, HALF)
    norm = hf.PixelNorm.from_processor(processor, processor_file, mean=default[0], std=default[1])
    pad = _pad(processor, processor_file, default[0])
    resize = LlavaResize(pad, _resize(processor, processor_file, vision.image_size, clip=clip))

    full_depth = vision.num_hidden_layers
    vision.num_hidden_layers = depth
    skip = [f"encoder.layers.{i}." for i in range(depth, full_depth)] + ["post_layernorm.", "head."]
    tower, tower_digest = hf.load_model(
        path,
        lambda: _vision_model(vision, clip=clip),
        prefixes=VISION_PREFIXES,
        skip=skip,
        device=device,
        dtype=dtype,
    )
    projector, projector_digest = hf.load_model(
        path, lambda: _projector(llava), prefixes=PROJECTOR_PREFIXES, device=device, dtype=dtype
    )
    digest = hashlib.sha256(f"{tower_digest}\0{projector_digest}".encode()).hexdigest()
    model = LlavaEncoder(tower, projector)
    patches = (vision.image_size // vision.patch_size) ** 2
    tokens = patches + (1 if clip else 0) - (1 if selection.drop_cls else 0)
    text: Any = llava.text_config
    hidden = text.hidden_size
    info = checkpoint_info(
        NAME,
        source=str(path),
        fingerprint=hf.fingerprint(NAME, VERSION, path, digest, dtype),
        hidden_size=hidden,
        image_size=vision.image_size,
        patch_size=vision.patch_size,
        tokens_per_image=tokens,
        vision_tower="clip" if clip else "siglip",
        vision_layers=f"{depth} of {full_depth}",
        output=f"multi_modal_projector(hidden_states{list(selection.layers)}, {llava.vision_feature_select_strategy})",
    )
    return LlavaTower(
        model=model, resize=resize, selection=selection, tokens=tokens, norm=norm, info=info, device=device, dtype=dtype
    )


def _vision_model(vision: Any, *, clip: bool) -> nn.Module:
    from transformers import CLIPVisionModel, SiglipVisionModel

    if clip:
        model: nn.Module = CLIPVisionModel(vision)
    else:
        vision.vision_use_head = False
        model = SiglipVisionModel(vision)
    # applied to the last layer's output only (CLIP: to the pooled CLS), never to the selected states
    model.post_layernorm = nn.Identity()
    return model


def _projector(llava: Any) -> nn.Module:
    from transformers.models.llava.modeling_llava import LlavaMultiModalProjector

    return LlavaMultiModalProjector(llava)


def _selection(llava: Any, vision: Any, where: Path) -> tuple[Selection, int]:
    """The selection and how many layers it needs, from ``vision_feature_layer`` and the strategy."""
    strategy = llava.vision_feature_select_strategy
    if strategy not in STRATEGIES:
        raise TowerError(f"{where}: vision_feature_select_strategy {strategy!r} is not one of {STRATEGIES}")
    wanted = llava.vision_feature_layer
    layers = list(wanted) if isinstance(wanted, list | tuple) else [wanted]
    total = vision.num_hidden_layers
    absolute = []
    for layer in layers:
        if isinstance(layer, bool) or not isinstance(layer, int) or not -(total + 1) <= layer <= total:
            raise TowerError(
                f"{where}: vision_feature_layer {wanted!r}: each must be an index into the"
                f" {total + 1} hidden states (-{total + 1}..{total})"
            )
        absolute.append(layer if layer >= 0 else total + 1 + layer)
    if not layers:
        raise TowerError(f"{where}: vision_feature_layer is an empty list")
    return Selection(tuple(absolute), drop_cls=strategy == "default"), max(max(absolute), 1)


def _pad(processor: dict[str, Any], where: Path, mean: Sequence[float]) -> PadToSquare | None:
    if not processor.get("do_pad", False):
        return None
    mean = processor.get("image_mean", mean)
    if not isinstance(mean, list | tuple) or len(mean) != 3 or not all(isinstance(m, int | float) for m in mean):
        raise TowerError(f"{where}: image_mean must be 3 numbers, got {mean!r}")
    red, green, blue = (int(m * 255) for m in mean)
    return PadToSquare((red, green, blue))


def _resize(
    processor: dict[str, Any], where: Path, image_size: int, *, clip: bool
) -> Callable[[Image.Image], torch.Tensor]:
    if clip:
        return resize_of(processor, where, image_size)
    return ExactResize(size_of(processor, where, image_size), hf.resample_of(processor, where))

"""What every vision tower provides to the batcher.

A tower splits its work in two: :meth:`VisionTower.prepare` runs on CPU threads, one image at a
time (resize, to a uint8 tensor; the model's own image-processor rules), and
:meth:`VisionTower.forward` runs on the device, a batch at a time (normalize once for the whole
batch, then the transformer). ``forward`` returns one ``(tokens, hidden)`` tensor per image, after
the projector or merger where the model has one, and for the Qwen2-VL family the image's
``(t, h, w)`` patch grid, which vLLM needs with the embeddings.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from PIL import Image


@dataclass(frozen=True)
class Prepared:
    """One image, ready for the device: ``pixels`` as the tower's prepare left them."""

    pixels: torch.Tensor  # uint8; shape is the tower's business (CHW, or patches for Qwen2-VL)
    tokens: int  # how many embedding rows the image yields (for the batch token budget)
    grid_thw: tuple[int, int, int] | None = None


@dataclass(frozen=True)
class Encoded:
    embeds: torch.Tensor  # (tokens, hidden), on CPU, contiguous, in the tower's dtype
    grid_thw: tuple[int, int, int] | None = None


class TowerError(ValueError):
    """A spec that names no tower this backend can load, or a checkpoint it cannot read."""


@dataclass(frozen=True)
class TowerInfo:
    name: str  # e.g. builtin:vit-small, siglip, clip, qwen2_5_vl
    source: str  # the spec it was loaded from
    fingerprint: str  # identifies the weights and preprocessing: part of every cache key
    hidden_size: int
    demo_weights: bool = False  # random weights, for demos only
    extra: dict[str, object] = field(default_factory=dict)


class VisionTower(ABC):
    info: TowerInfo
    device: torch.device
    dtype: torch.dtype

    @abstractmethod
    def prepare(self, image: Image.Image) -> Prepared:
        """Resize and convert one RGB image (CPU; called from worker threads)."""

    @abstractmethod
    def forward(self, batch: Sequence[Prepared]) -> list[Encoded]:
        """Encode a batch (the device; called from the one executor thread, under inference_mode)."""


def checkpoint_info(name: str, *, source: str, fingerprint: str, hidden_size: int, **extra: object) -> TowerInfo:
    """The TowerInfo of a tower read from a checkpoint directory (``extra``: what /health shows)."""
    return TowerInfo(name=name, source=source, fingerprint=fingerprint, hidden_size=hidden_size, extra=extra)

"""``builtin:vit-small``: a small ViT-style tower built in code from a fixed config and seed.

Its weights are random (seed 0): the embeddings mean nothing. It exists so that the gateway and
the backend run end to end anywhere, offline, with no checkpoint; /health and the docs say
``demo_weights: true``. Preprocessing is SigLIP's (224x224 bicubic, mean = std = 0.5).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from PIL import Image
from torch import nn

from ..preprocess import HALF, normalize, resize_exact, to_tensor
from .base import Encoded, Prepared, TowerInfo, VisionTower

IMAGE_SIZE = 224
PATCH = 16
HIDDEN = 384
DEPTH = 6
HEADS = 6
SEED = 0
VERSION = 1


class _ViT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        grid = IMAGE_SIZE // PATCH
        self.patch = nn.Conv2d(3, HIDDEN, kernel_size=PATCH, stride=PATCH)
        self.position = nn.Parameter(torch.randn(1, grid * grid, HIDDEN) * 0.02)
        layer = nn.TransformerEncoderLayer(
            HIDDEN, HEADS, dim_feedforward=4 * HIDDEN, activation="gelu", batch_first=True, norm_first=True
        )
        self.blocks = nn.TransformerEncoder(layer, DEPTH, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(HIDDEN)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        x = self.patch(pixels).flatten(2).transpose(1, 2) + self.position
        out: torch.Tensor = self.norm(self.blocks(x))
        return out


class BuiltinViT(VisionTower):
    def __init__(self, device: torch.device, dtype: torch.dtype) -> None:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(SEED)
            model = _ViT()
        self.model = model.eval().to(device=device, dtype=dtype)
        self.device, self.dtype = device, dtype
        tokens = (IMAGE_SIZE // PATCH) ** 2
        self.tokens = tokens
        self.info = TowerInfo(
            name="builtin:vit-small",
            source="builtin:vit-small",
            fingerprint=f"builtin:vit-small/v{VERSION}/seed{SEED}/{str(dtype).removeprefix('torch.')}",
            hidden_size=HIDDEN,
            demo_weights=True,
            extra={"image_size": IMAGE_SIZE, "patch_size": PATCH, "depth": DEPTH, "tokens_per_image": tokens},
        )

    def prepare(self, image: Image.Image) -> Prepared:
        return Prepared(to_tensor(resize_exact(image, IMAGE_SIZE, IMAGE_SIZE)), self.tokens)

    def forward(self, batch: Sequence[Prepared]) -> list[Encoded]:
        pixels = torch.stack([p.pixels for p in batch]).to(self.device, non_blocking=True)
        x = normalize(pixels, HALF, HALF).to(self.dtype)
        out = self.model(x).to("cpu")
        return [Encoded(row.contiguous()) for row in out]

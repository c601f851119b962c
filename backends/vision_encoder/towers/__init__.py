"""Loading a vision tower from a spec: ``builtin:NAME`` or a local model directory.

A directory is read offline and safetensors-only (no pickles, no remote code). Its
``config.json`` ``model_type`` picks the loader:

* ``siglip``, ``siglip_vision_model``  -> :mod:`.siglip`
* ``clip``, ``clip_vision_model``      -> :mod:`.clip`
* ``qwen2_5_vl`` (the full VL checkpoint; only the ``visual.`` weights are read) -> :mod:`.qwen2_5_vl`
* ``llava`` (the full checkpoint; the vision tower and the projector are read) -> :mod:`.llava`

Only the last two give what a vLLM language model takes as ``image_embeds`` (its hidden width);
SigLIP's and CLIP's features are before a model's projector (docs/encoder.md).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from .base import Encoded, Prepared, TowerError, TowerInfo, VisionTower

__all__ = ["Encoded", "Prepared", "TowerError", "TowerInfo", "VisionTower", "load_tower", "resolve_device"]


def resolve_device(device: str) -> tuple[torch.device, torch.dtype]:
    """``auto``: cuda with bf16 when available, else cpu with fp32."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise TowerError(f"device {device!r} asked for, but CUDA is not available")
    return dev, (torch.bfloat16 if dev.type == "cuda" else torch.float32)


def load_tower(spec: str, *, device: torch.device, dtype: torch.dtype) -> VisionTower:
    if spec == "builtin:vit-small":
        from .builtin import BuiltinViT

        return BuiltinViT(device, dtype)
    if spec.startswith("builtin:"):
        raise TowerError(f"unknown builtin tower {spec!r} (builtin: vit-small)")
    path = Path(spec)
    config_file = path / "config.json"
    if not config_file.is_file():
        raise TowerError(f"{spec!r} is neither builtin:NAME nor a directory with a config.json")
    config = json.loads(config_file.read_text())
    model_type = config.get("model_type")
    if model_type in ("siglip", "siglip_vision_model"):
        from .siglip import load_siglip

        return load_siglip(path, config, device=device, dtype=dtype)
    if model_type in ("clip", "clip_vision_model"):
        from .clip import load_clip

        return load_clip(path, config, device=device, dtype=dtype)
    if model_type == "qwen2_5_vl":
        from .qwen2_5_vl import load_qwen2_5_vl

        return load_qwen2_5_vl(path, config, device=device, dtype=dtype)
    if model_type == "llava":
        from .llava import load_llava

        return load_llava(path, config, device=device, dtype=dtype)
    raise TowerError(f"{spec}: model_type {model_type!r} is not supported (siglip, clip, qwen2_5_vl, llava)")

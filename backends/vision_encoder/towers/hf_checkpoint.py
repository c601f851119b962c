"""A transformers-format model directory, read offline and safetensors-only.

The towers read three things from it: ``config.json`` (parsed by :func:`~.load_tower`),
``preprocessor_config.json`` (:func:`read_json`, then :func:`resample_of` and :class:`PixelNorm`)
and the weights (:func:`load_model`): ``model.safetensors``, or the shards named by
``model.safetensors.index.json``. Pickled weights (``*.bin``, ``*.pt``, ...) are refused, never
opened, and no code from the directory runs. Only the tensors under the tower's key prefix are
read, so a full vision-language checkpoint costs the vision tower's bytes, not the language model's.

:func:`fingerprint` is a sha256 over the tower's name and loader version, its dtype, the bytes of
``config.json`` and ``preprocessor_config.json``, and the content (name, dtype, shape and bytes) of
every tensor the tower loaded. It hashes content rather than file headers, sizes or mtimes: a
fine-tune with the same shapes gets a new fingerprint, while a copy or a resharding of the same
weights keeps it (and so keeps its cache entries).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from .base import Encoded, Prepared, TowerError, TowerInfo, VisionTower, checkpoint_info

WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
CONFIG_FILE = "config.json"
PROCESSOR_FILE = "preprocessor_config.json"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")

# PIL's resampling codes as saved by transformers' image processors (PILImageResampling)
_RESAMPLE_CODES = {2: "bilinear", 3: "bicubic"}


def read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_bytes())
    except FileNotFoundError:
        raise TowerError(f"{path}: missing") from None
    except (OSError, ValueError) as exc:
        raise TowerError(f"{path}: not readable JSON: {exc}") from None
    if not isinstance(data, dict):
        raise TowerError(f"{path}: expected a JSON object")
    return data


def weight_files(directory: Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file that holds it."""
    index = directory / INDEX_FILE
    if index.is_file():
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise TowerError(f"{index}: no weight_map")
        for name in set(weight_map.values()):
            if not isinstance(name, str) or Path(name).name != name or not name.endswith(".safetensors"):
                raise TowerError(f"{index}: shard {name!r} is not a .safetensors file in {directory}")
            if not (directory / name).is_file():
                raise TowerError(f"{index}: shard {name} is missing")
        return {key: directory / name for key, name in weight_map.items()}
    single = directory / WEIGHTS_FILE
    if single.is_file():
        try:
            with safe_open(single, framework="pt") as f:
                return dict.fromkeys(f.keys(), single)
        except (SafetensorError, OSError) as exc:
            raise TowerError(f"{single}: not a readable safetensors file: {exc}") from None
    pickles = sorted(p.name for p in directory.iterdir() if p.suffix in PICKLE_SUFFIXES)
    if pickles:
        raise TowerError(
            f"{directory}: only pickled weights ({', '.join(pickles)}); this backend loads safetensors only"
            " (convert them, e.g. save_pretrained(..., safe_serialization=True))"
        )
    raise TowerError(f"{directory}: no {WEIGHTS_FILE} or {INDEX_FILE}")


def load_model(
    directory: Path,
    build: Callable[[], nn.Module],
    *,
    prefixes: Sequence[str],
    skip: Sequence[str] = (),
    device: torch.device,
    dtype: torch.dtype,
) -> tuple[nn.Module, str]:
    """Build a model without initializing its weights, fill it from the checkpoint; return it and its digest.

    The tensors read are those under the first of ``prefixes`` that the checkpoint has, with the prefix
    stripped; they must be exactly the model's state-dict entries. A missing or unexpected name, or a
    shape that differs, is a :class:`TowerError`. Names starting with one of ``skip`` are not read,
    nor are the model's non-persistent buffers that older checkpoints carry (``position_ids``).
    Floating-point tensors are cast to ``dtype``; buffers the model computes itself (rotary
    frequencies) keep the dtype the model gave them.
    """
    from transformers.initialization import no_init_weights

    files = weight_files(directory)
    prefix = next((p for p in prefixes if any(key.startswith(p) for key in files)), None)
    if prefix is None:
        wanted = " or ".join(repr(p) for p in prefixes)
        raise TowerError(f"{directory}: no weights under {wanted} (is this the right model_type?)")
    try:
        with no_init_weights():
            model = build()
    except (TypeError, ValueError) as exc:  # e.g. a hidden size the head count does not divide
        raise TowerError(f"{directory / CONFIG_FILE}: cannot build the model: {exc}") from None
    expected = model.state_dict()
    computed = {name for name, _ in model.named_buffers()} - expected.keys()
    found = {
        key[len(prefix) :]: key
        for key in files
        if key.startswith(prefix) and not key[len(prefix) :].startswith(tuple(skip))
    }
    found = {name: key for name, key in found.items() if name not in computed}
    _check_names(directory, prefix, expected.keys(), found.keys())
    state, digests = _read_tensors(files, found, expected, device=device, dtype=dtype)
    model.load_state_dict(state, strict=True, assign=True)
    model.to(device).eval().requires_grad_(False)
    digest = hashlib.sha256()
    for name in sorted(digests):
        digest.update(digests[name])
    return model, digest.hexdigest()


def _check_names(directory: Path, prefix: str, expected: Iterable[str], found: Iterable[str]) -> None:
    missing, unexpected = sorted(set(expected) - set(found)), sorted(set(found) - set(expected))
    if not missing and not unexpected:
        return
    where = f"{directory} (keys under {prefix!r})" if prefix else str(directory)
    parts = [
        f"{len(names)} {what} ({_some(prefix, names)})"
        for what, names in (("missing", missing), ("unexpected", unexpected))
        if names
    ]
    raise TowerError(f"{where}: weights do not match the config: {'; '.join(parts)}")


def _some(prefix: str, names: Sequence[str], shown: int = 5) -> str:
    listed = ", ".join(prefix + name for name in names[:shown])
    return listed + (f", ... {len(names) - shown} more" if len(names) > shown else "")


def _read_tensors(
    files: dict[str, Path],
    found: dict[str, str],
    expected: dict[str, torch.Tensor],
    *,
    device: torch.device,
    dtype: torch.dtype,
) -> tuple[dict[str, torch.Tensor], dict[str, bytes]]:
    by_file: dict[Path, list[str]] = {}
    for name, key in found.items():
        by_file.setdefault(files[key], []).append(name)
    state: dict[str, torch.Tensor] = {}
    digests: dict[str, bytes] = {}
    for file, names in sorted(by_file.items()):
        try:
            with safe_open(file, framework="pt", device="cpu") as f:
                for name in names:
                    shape = tuple(f.get_slice(found[name]).get_shape())
                    if shape != tuple(expected[name].shape):
                        raise TowerError(
                            f"{file}: {found[name]} has shape {list(shape)}, the config makes"
                            f" {list(expected[name].shape)}"
                        )
                    tensor = f.get_tensor(found[name])
                    digests[name] = _tensor_digest(name, tensor)
                    cast = dtype if tensor.is_floating_point() else tensor.dtype
                    state[name] = tensor.to(device=device, dtype=cast)
        except (SafetensorError, OSError) as exc:
            raise TowerError(f"{file}: cannot read weights: {exc}") from None
    return state, digests


def _tensor_digest(name: str, tensor: torch.Tensor) -> bytes:
    h = hashlib.sha256(f"{name}\0{tensor.dtype}\0{list(tensor.shape)}\0".encode())
    h.update(tensor.contiguous().reshape(-1).view(torch.uint8).numpy().data)
    return h.digest()


def fingerprint(name: str, version: int, directory: Path, weights_digest: str, dtype: torch.dtype) -> str:
    """``NAME/vVERSION/DTYPE/HEX``; see the module docstring for what the hash covers."""
    h = hashlib.sha256(f"{name}\0{version}\0{dtype}\0{weights_digest}\0".encode())
    for file in (CONFIG_FILE, PROCESSOR_FILE):
        h.update(hashlib.sha256((directory / file).read_bytes()).digest())
    return f"{name}/v{version}/{str(dtype).removeprefix('torch.')}/{h.hexdigest()[:32]}"


def resample_of(processor: dict[str, Any], where: Path) -> str:
    """The ``resample`` a processor config names, as :data:`..preprocess.RESAMPLE` spells it."""
    code = processor.get("resample", 3)  # every processor our towers mirror defaults to bicubic
    if code not in _RESAMPLE_CODES:
        names = ", ".join(f"{k} ({v})" for k, v in _RESAMPLE_CODES.items())
        raise TowerError(f"{where}: resample {code!r} is not supported (supported: {names})")
    return _RESAMPLE_CODES[code]


def positive_int(value: object, what: str, where: Path) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise TowerError(f"{where}: {what} must be a positive integer, got {value!r}")
    return value


@dataclass(frozen=True)
class PixelNorm:
    """The processor's rescale then normalize: ``(x * rescale_factor - mean) / std``, per channel."""

    rescale: float
    mean: tuple[float, float, float]
    std: tuple[float, float, float]

    @classmethod
    def from_processor(
        cls, processor: dict[str, Any], where: Path, *, mean: Sequence[float], std: Sequence[float]
    ) -> PixelNorm:
        rescale = processor.get("rescale_factor", 1 / 255) if processor.get("do_rescale", True) else 1.0
        if processor.get("do_normalize", True):
            mean, std = processor.get("image_mean", mean), processor.get("image_std", std)
        else:
            mean, std = (0.0, 0.0, 0.0), (1.0, 1.0, 1.0)
        try:
            norm = cls(float(rescale), _triple(mean), _triple(std))
        except (TypeError, ValueError) as exc:
            raise TowerError(f"{where}: bad rescale_factor, image_mean or image_std: {exc}") from None
        if 0.0 in norm.std:
            raise TowerError(f"{where}: image_std has a zero: {list(norm.std)}")
        return norm

    def __call__(self, pixels: torch.Tensor, *, channel_dim: int = 1) -> torch.Tensor:
        """uint8 pixels (any shape with 3 channels at ``channel_dim``) -> float32, on their device."""
        shape = [1] * pixels.dim()
        shape[channel_dim] = 3
        mean = torch.tensor(self.mean, dtype=torch.float32, device=pixels.device).view(shape)
        std = torch.tensor(self.std, dtype=torch.float32, device=pixels.device).view(shape)
        return (pixels.to(torch.float32) * self.rescale - mean) / std


def _triple(value: object) -> tuple[float, float, float]:
    if isinstance(value, int | float):
        return (float(value),) * 3
    if not isinstance(value, list | tuple) or len(value) != 3:
        raise ValueError(f"expected 3 numbers, got {value!r}")
    a, b, c = (float(v) for v in value)
    return a, b, c


@dataclass(eq=False, kw_only=True)
class CheckpointTower(VisionTower):
    """A tower read from a checkpoint directory: its module, how its pixels are normalized, and
    where it runs. Subclasses are dataclasses too and add their preprocessing's fields."""

    model: nn.Module
    norm: PixelNorm
    info: TowerInfo
    device: torch.device
    dtype: torch.dtype


class FixedSizeTower(CheckpointTower):
    """A tower whose images are all resized to one shape (SigLIP, CLIP): batches stack."""

    def pixel_values(self, batch: Sequence[Prepared]) -> torch.Tensor:
        """The batch as the model takes it (the processor's ``pixel_values``), on the device."""
        pixels = torch.stack([p.pixels for p in batch]).to(self.device, non_blocking=True)
        return self.norm(pixels).to(self.dtype)

    def forward(self, batch: Sequence[Prepared]) -> list[Encoded]:
        out = self.model(pixel_values=self.pixel_values(batch)).last_hidden_state.to("cpu")
        return [Encoded(row.clone()) for row in out]  # each row its own storage, not a view of the batch


def fixed_size_info(
    name: str, version: int, path: Path, vision: Any, *, digest: str, dtype: torch.dtype, tokens: int, output: str
) -> TowerInfo:
    """The TowerInfo of a fixed-size ViT tower (CLIP, SigLIP) read from ``path``."""
    return checkpoint_info(
        name,
        source=str(path),
        fingerprint=fingerprint(name, version, path, digest, dtype),
        hidden_size=vision.hidden_size,
        image_size=vision.image_size,
        patch_size=vision.patch_size,
        tokens_per_image=tokens,
        output=output,
    )


def vision_config(
    path: Path, config: dict[str, Any], full_class: Any, vision_class: Any, full_type: str, label: str
) -> Any:
    """The vision config of a full checkpoint (``model_type`` full_type) or of a vision-only one."""
    from huggingface_hub.errors import StrictDataclassError

    try:
        if config.get("model_type") == full_type:
            return full_class.from_dict(config).vision_config
        return vision_class.from_dict(config)
    except (TypeError, ValueError, KeyError, StrictDataclassError) as exc:
        raise TowerError(f"{path / 'config.json'}: not a {label} config: {exc}") from None

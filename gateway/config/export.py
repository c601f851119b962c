"""A config as plain JSON-ready data: what ``GET /admin/config`` shows."""

from __future__ import annotations

import dataclasses
import enum
import urllib.parse
from collections.abc import Mapping
from typing import Any

from .keys import VIDEO_KEYS
from .types import GatewayConfig, ModelConfig, Policy


def as_dict(config: GatewayConfig) -> dict[str, Any]:
    """Every section and default, as routing.yaml would spell it (weights inline with upstreams)."""
    data: dict[str, Any] = _plain(config)
    for key in ("_by_name", "source", "sha256"):
        data.pop(key, None)
    store = data["server"]["limits_store"]
    if store is not None:  # a password in the store's URL is a secret: never shown
        store["url"] = _without_password(store["url"])
    for model, raw in zip(config.models, data["models"], strict=True):
        weights = model.weights or (1,) * len(model.upstreams)
        raw["upstreams"] = [{"url": u, "weight": w} for u, w in zip(model.upstreams, weights, strict=True)]
        del raw["weights"]
        raw["on_unsupported"] = {m.value: _policy(p) for m, p in model.on_unsupported.items()}
        raw["on_unsupported_output"] = {m.value: _policy(p) for m, p in model.on_unsupported_output.items()}
        _visual(model, raw)
        if (made := model.output_limits) is not None:  # as routing.yaml spells them
            sizes = [f"{w}x{h}" for w, h in made.sizes]
            spelled = {"image": made.images, "image_sizes": sizes, "image_pixels": made.pixels,
                       "speech_input_chars": made.speech_chars}  # fmt: skip
            raw["output_limits"] = {k: v for k, v in spelled.items() if v}
    return data


def _without_password(url: str) -> str:
    parts = urllib.parse.urlsplit(url)
    if parts.password is None:
        return url
    user = parts.username or ""
    host = parts.netloc.rpartition("@")[2]
    return urllib.parse.urlunsplit(parts._replace(netloc=f"{user}:***@{host}"))


# a formula's own keys, as routing.yaml spells a custom one (the others: presets only)
FORMULA_KEYS = {
    "grid": ("patch", "merge", "min_pixels", "max_pixels"),
    "longest_edge": ("patch", "longest_edge"),
    "fixed": ("fixed",),
    "tiles": ("patch", "fixed", "tiles"),
    "anyres": ("patch", "side", "pinpoints"),
}


def _visual(model: ModelConfig, raw: dict[str, Any]) -> None:
    """The visual keys as routing.yaml spells them: the formula (its preset, or its own keys),
    the visual limits inside ``limits``, ``on_oversize``."""
    for key, name in (("max_visual_tokens", "visual_tokens"), ("max_image_pixels", "image_pixels")):
        value = raw.pop(key)
        if value is not None:
            raw["limits"][name] = value
    spec = model.visual_tokens
    if spec is None:
        raw["visual_tokens"] = None
    else:
        kept = FORMULA_KEYS[spec.kind]
        formula: dict[str, Any] = {"preset": spec.preset} if spec.preset else {k: raw["visual_tokens"][k] for k in kept}
        if spec.remote is not None:
            formula["remote"] = spec.remote if spec.remote == "fetch" else list(spec.remote)
        if spec.video is not None:
            video = spec.video
            sampling = {"frames": video.frames} if video.frames is not None else {"fps": video.fps}
            formula["video"] = {**sampling, **{k: getattr(video, k) for k in VIDEO_KEYS if k not in ("frames", "fps")}}
        raw["visual_tokens"] = formula
    oversize = model.on_oversize
    targets = {k: v for k, v in (("max_pixels", oversize.max_pixels), ("max_tokens", oversize.max_tokens)) if v}
    raw["on_oversize"] = {"downscale": targets} if oversize.action == "downscale" else "reject"


def _policy(policy: Policy) -> str | dict[str, Any]:
    """A policy as routing.yaml spells it (what /admin/config shows parses back)."""
    if policy.history != "reject":
        return {"history": policy.history}
    if policy.action in ("redirect", "speak"):
        return {policy.action: policy.target}
    if policy.action == "transcribe":
        return {"transcribe": policy.target, "on_error": policy.on_error}
    if policy.action == "describe":
        return {"describe": policy.target, "prompt": policy.prompt, "on_error": policy.on_error,
                "max_images": policy.max_images}  # fmt: skip
    if policy.action == "extract":
        return {
            "extract": {
                "max_pages": policy.max_pages,
                "timeout_s": policy.timeout_s,
                "page_images": policy.page_images,
                "dpi": policy.dpi,
            },
            "max_files": policy.max_files,
        }
    if policy.action == "frames":
        return {
            "frames": policy.frames,
            "fps": policy.fps,
            "max_side": policy.max_side,
            "timestamps": policy.timestamps,
        }
    return policy.action


def _plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        # a field made from the others (init=False: ServerConfig.content_bounds) is not config
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value) if f.init}
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, Mapping):
        return {str(_plain(k)): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value

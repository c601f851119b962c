"""The keys of a model that say what its images cost: ``visual_tokens`` (a preset, or a formula
of its own), the limits ``visual_tokens`` and ``image_pixels`` beside the modalities' in
``limits:``, and ``on_oversize`` (reject, or downscale)."""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

from .keys import OVERSIZE_KEYS, VIDEO_KEYS, VISUAL_KEYS, VISUAL_LIMITS
from .loader import MISSING, join_path
from .readers import Readers, show, unknown_message
from .types import VIDEO_PRESETS, VISUAL_PRESETS, Oversize, VideoTokens, VisualTokens

MAX_PIXELS = 1 << 40  # a limit or a target beyond this is a typo
MAX_FRAMES = 1 << 16  # frames a video processor may take


class VisualReaders(Readers):
    def visual(self, raw: dict[str, Any], path: str) -> dict[str, Any]:
        """A model's visual keys, as ModelConfig keyword arguments (of ``limits``, the visual ones:
        the modalities' are read with the others)."""
        limits = raw.get("limits")
        found: dict[str, Any] = {}
        if isinstance(limits, dict):
            for key, name in zip(VISUAL_LIMITS, ("max_visual_tokens", "max_image_pixels"), strict=True):
                if key in limits:
                    found[name] = self.integer(limits[key], f"{path}.limits.{key}", 1, minimum=1, maximum=MAX_PIXELS)
        spec = self.visual_tokens(raw.get("visual_tokens", MISSING), f"{path}.visual_tokens")
        if spec is not None:
            found["visual_tokens"] = spec
        elif "max_visual_tokens" in found:
            self.problem(
                f"{path}.limits.visual_tokens", "a visual_tokens limit needs the model's visual_tokens: formula"
            )
        oversize = self.oversize(raw.get("on_oversize", MISSING), f"{path}.on_oversize")
        if oversize.action == "downscale":
            if oversize.max_tokens is not None and spec is None:
                self.problem(f"{path}.on_oversize", "a max_tokens target needs the model's visual_tokens: formula")
            targets = (
                oversize.max_pixels,
                oversize.max_tokens,
                found.get("max_image_pixels"),
                found.get("max_visual_tokens"),
            )
            if all(t is None for t in targets):
                self.problem(
                    f"{path}.on_oversize",
                    "downscale needs a target: limits.image_pixels, limits.visual_tokens, "
                    "or {downscale: {max_pixels: N}}",
                )
        found["on_oversize"] = oversize  # its own targets only: admission takes the least of each and its limit
        return found

    def visual_tokens(self, value: Any, path: str) -> VisualTokens | None:
        """``{preset: NAME}``, ``{patch, merge, min_pixels, max_pixels}``, ``{patch, longest_edge}``
        or ``{fixed: N}``; each may say ``remote: [W, H]``."""
        if value is MISSING:
            return None
        raw = self.mapping(value, path, VISUAL_KEYS, what="visual_tokens")
        if raw is None:
            return None
        raw = dict(raw)
        remote = self._remote(raw.pop("remote", MISSING), f"{path}.remote")
        video = raw.pop("video", MISSING)
        spec = self._image_tokens(raw, value, path, remote)
        if spec is None or video is MISSING:
            return spec
        return dataclasses.replace(spec, video=self.video_tokens(video, f"{path}.video", spec))

    def video_tokens(self, value: Any, path: str, spec: VisualTokens) -> VideoTokens | None:
        """``video: {}`` (the preset's video processor), or with ``frames: N`` or ``fps: F``
        (``min_frames``, ``max_frames``), ``min_pixels``, ``max_pixels``, ``temporal_patch``."""
        if spec.kind != "grid":
            self.problem(
                path,
                "videos are counted for grid formulas (Qwen2-VL, Qwen2.5-VL, Qwen3-VL, or "
                "{patch, merge, min_pixels, max_pixels}), whose processors take video",
            )
            return None
        raw = {} if value is None else self.mapping(value, path, VIDEO_KEYS, what="video")
        if raw is None:
            return None
        base = VIDEO_PRESETS.get(spec.preset or "") or VideoTokens(
            "frame", spec.patch, spec.merge, 2, spec.min_pixels, min(spec.max_pixels, MAX_PIXELS)
        )
        if "frames" in raw and "fps" in raw:
            self.problem(path, "frames (N spread over the video) and fps (F a second) are one or the other")
            return None
        sampling: dict[str, Any] = {}
        if "frames" in raw:
            sampling = {"frames": self.integer(raw["frames"], f"{path}.frames", 32, minimum=1, maximum=MAX_FRAMES)}
            sampling["fps"] = None
        elif "fps" in raw:
            sampling = {"frames": None, "fps": self.number(raw["fps"], f"{path}.fps", 2.0)}

        def whole(key: str, default: int, minimum: int, maximum: int) -> int:
            return self.integer(raw.get(key, MISSING), f"{path}.{key}", default, minimum=minimum, maximum=maximum)

        low, high = (
            whole("min_frames", base.min_frames, 1, MAX_FRAMES),
            whole("max_frames", base.max_frames, 1, MAX_FRAMES),
        )
        if high < low:
            self.problem(f"{path}.max_frames", f"must be at least min_frames ({low})")
        pixels_low = whole("min_pixels", base.min_pixels, 0, MAX_PIXELS)
        pixels_high = whole("max_pixels", base.max_pixels, 1, MAX_PIXELS)
        token = (base.patch * base.merge) ** 2
        if pixels_high < max(pixels_low, token):
            self.problem(f"{path}.max_pixels", f"must be at least min_pixels and one token's {token} pixels")
        return dataclasses.replace(
            base,
            temporal_patch=whole("temporal_patch", base.temporal_patch, 1, 64),
            min_pixels=pixels_low,
            max_pixels=pixels_high,
            min_frames=low,
            max_frames=high,
            **sampling,
        )

    def _image_tokens(
        self, raw: dict[str, Any], value: Any, path: str, remote: tuple[int, int] | Literal["fetch"] | None
    ) -> VisualTokens | None:
        if "preset" in raw:
            preset = raw.pop("preset")
            if preset not in VISUAL_PRESETS:
                self.problem(f"{path}.preset", unknown_message(preset, tuple(VISUAL_PRESETS), "preset"))
                return None
            for key in raw:
                self.problem(
                    join_path(path, key),
                    f"'{key}' does not go with a preset: a formula of its own has no preset",
                    at_key=True,
                )
            return dataclasses.replace(VISUAL_PRESETS[preset], preset=preset, remote=remote)
        if "fixed" in raw:
            fixed = self.integer(raw.pop("fixed"), f"{path}.fixed", 1, minimum=1, maximum=1 << 20)
            for key in raw:
                self.problem(join_path(path, key), f"'{key}' does not go with fixed: N", at_key=True)
            return VisualTokens("fixed", fixed=fixed, remote=remote)
        if "patch" not in raw:
            self.problem(path, "must be {preset: NAME}, {patch: P, merge: M, min_pixels, max_pixels}, "
                               f"{{patch: P, longest_edge: PX}} or {{fixed: N}}, not {show(value)}")  # fmt: skip
            return None
        patch = self.integer(raw["patch"], f"{path}.patch", 14, minimum=1, maximum=4096)
        if "longest_edge" in raw:
            edge = self.integer(raw["longest_edge"], f"{path}.longest_edge", 1024, minimum=patch, maximum=1 << 20)
            for key in set(raw) - {"patch", "longest_edge"}:
                self.problem(join_path(path, key), f"'{key}' does not go with longest_edge", at_key=True)
            return VisualTokens("longest_edge", patch=patch, longest_edge=edge, remote=remote)
        merge = self.integer(raw.get("merge", 1), f"{path}.merge", 1, minimum=1, maximum=64)
        low = self.integer(raw.get("min_pixels", 0), f"{path}.min_pixels", 0, minimum=0, maximum=MAX_PIXELS)
        high = self.integer(
            raw.get("max_pixels", MAX_PIXELS), f"{path}.max_pixels", MAX_PIXELS, minimum=1, maximum=MAX_PIXELS
        )
        if high < max(low, (patch * merge) ** 2):
            self.problem(
                f"{path}.max_pixels", f"must be at least min_pixels and one token's {(patch * merge) ** 2} pixels"
            )
        return VisualTokens("grid", patch=patch, merge=merge, min_pixels=low, max_pixels=high, remote=remote)

    def _remote(self, value: Any, path: str) -> tuple[int, int] | Literal["fetch"] | None:
        if value is MISSING:
            return None
        if value == "fetch":
            return "fetch"
        if (
            isinstance(value, list)
            and len(value) == 2
            and all(isinstance(v, int) and not isinstance(v, bool) and 1 <= v <= 1 << 20 for v in value)
        ):
            return value[0], value[1]
        self.problem(path, f"must be fetch (the gateway reads each remote image's header) or [WIDTH, HEIGHT] (the "
                           f"size assumed of one), not {show(value)}")  # fmt: skip
        return None

    def oversize(self, value: Any, path: str) -> Oversize:
        if value is MISSING or value == "reject":
            return Oversize()
        if value == "downscale":
            return Oversize("downscale")
        if isinstance(value, dict) and set(value) == {"downscale"} and isinstance(value["downscale"], dict):
            target = self.mapping(value["downscale"], f"{path}.downscale", OVERSIZE_KEYS, what="a downscale target")
            if target:
                pixels, tokens = (
                    self.integer(target[k], f"{path}.downscale.{k}", 0, minimum=1, maximum=MAX_PIXELS)
                    if k in target
                    else None
                    for k in OVERSIZE_KEYS
                )
                return Oversize("downscale", pixels or None, tokens or None)
        self.problem(
            path, f"must be reject, downscale or {{downscale: {{max_pixels: N, max_tokens: N}}}}, not {show(value)}"
        )
        return Oversize()

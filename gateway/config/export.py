"""A config as plain JSON-ready data: what ``GET /admin/config`` shows."""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping
from typing import Any

from .types import GatewayConfig, Policy


def as_dict(config: GatewayConfig) -> dict[str, Any]:
    """Every section and default, as routing.yaml would spell it (weights inline with upstreams)."""
    data: dict[str, Any] = _plain(config)
    for key in ("_by_name", "source", "sha256"):
        data.pop(key, None)
    for model, raw in zip(config.models, data["models"], strict=True):
        weights = model.weights or (1,) * len(model.upstreams)
        raw["upstreams"] = [{"url": u, "weight": w} for u, w in zip(model.upstreams, weights, strict=True)]
        del raw["weights"]
        raw["on_unsupported"] = {m.value: _policy(p) for m, p in model.on_unsupported.items()}
    return data


def _policy(policy: Policy) -> str | dict[str, str | None]:
    return {"redirect": policy.target} if policy.action == "redirect" else policy.action


def _plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, Mapping):
        return {str(_plain(k)): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value

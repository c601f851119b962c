"""One generation of the running config: the config, and what the config store built from it
(each model's replica pool, its upstream key, the client keys). A request takes the live one
once, at admission, and works with it to its last byte (gateway.server.store swaps them)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from ..admission.auth import Keyring
from ..config import GatewayConfig
from .replicas import Pool


@dataclass(frozen=True, slots=True)
class Live:
    """One generation: what a request works with from admission to its last byte."""

    config: GatewayConfig
    generation: int
    pools: Mapping[str, Pool]  # each model's upstream pool, by model name
    # each model's "Authorization" value for its upstreams (models with api_key_env whose variable is set)
    upstream_auth: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    keyring: Keyring | None = None  # the client keys, when the config has auth

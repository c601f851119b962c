"""routing.yaml -> a frozen, validated :class:`GatewayConfig`.

Loading has three steps: YAML is composed into nodes (so every value keeps its line and column),
the nodes are parsed section by section into frozen dataclasses, and :func:`validate` checks what
spans sections (redirect targets, loops, encoders). Every problem found is collected, and all of
them are raised together as one :class:`~gateway.errors.ConfigError`, each rendered as
``FILE:LINE:COL: dotted.path: message``. The schema is documented in ``docs/routing.md`` and,
for editors, ``docs/routing.schema.json``.

The package, one step a module: ``types`` (keys, defaults, frozen types), ``loader`` (YAML with
marks), ``readers`` (typed values), ``sections`` (one method a section), ``pools`` (a model's
replica keys: balance, retries, breaker, timeouts, concurrency, health checks), ``validate``
(checks across sections), ``export`` (a config back to plain data, for ``GET /admin/config``).
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import yaml

from ..errors import ConfigError, ConfigProblem
from .environment import env_secret
from .export import as_dict
from .keys import BALANCE_POLICIES, PRIORITIES
from .loader import TooLargeError
from .sections import Parser
from .types import (
    REJECT,
    ApiKey,
    AuthConfig,
    BreakerConfig,
    EncoderConfig,
    GatewayConfig,
    HealthCheckConfig,
    LimitsStoreConfig,
    MediaConfig,
    ModelConfig,
    Policy,
    PriorityCap,
    QueueConfig,
    RateLimit,
    RetryConfig,
    ServerConfig,
    TimeoutConfig,
    TracingConfig,
)
from .validate import extras, missing_software, validate, validate_host

__all__ = [
    "BALANCE_POLICIES",
    "PRIORITIES",
    "REJECT",
    "ApiKey",
    "AuthConfig",
    "BreakerConfig",
    "EncoderConfig",
    "GatewayConfig",
    "HealthCheckConfig",
    "LimitsStoreConfig",
    "MediaConfig",
    "ModelConfig",
    "Policy",
    "PriorityCap",
    "QueueConfig",
    "RateLimit",
    "RetryConfig",
    "ServerConfig",
    "TimeoutConfig",
    "TracingConfig",
    "as_dict",
    "env_secret",
    "extras",
    "load_config",
    "missing_software",
    "parse_config",
]


def load_config(path: str | Path, *, here: bool = False) -> GatewayConfig:
    """Read and validate a routing.yaml; raise ConfigError listing every problem. ``here`` also
    checks what only this machine can (local encoders' model directories)."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError([ConfigProblem(str(path), 0, 0, "", f"cannot read file: {exc}")]) from None
    return parse_config(text, filename=str(path), here=here)


def _whole(document: Any, config: GatewayConfig) -> bool:
    """Whether every model of the document was read, each with its name."""
    listed = document.get("models") if isinstance(document, dict) else None
    return isinstance(listed, list) and len(listed) == len(config.models) and all(m.name for m in config.models)


def parse_config(text: str, *, filename: str = "routing.yaml", here: bool = False) -> GatewayConfig:
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        line, col = (mark.line + 1, mark.column + 1) if mark else (0, 0)
        message = f"invalid YAML: {exc.problem or exc.context}"
        raise ConfigError([ConfigProblem(filename, line, col, "", message)]) from None
    except yaml.YAMLError as exc:
        raise ConfigError([ConfigProblem(filename, 0, 0, "", f"invalid YAML: {exc}")]) from None
    parser = Parser(filename)
    if node is None:
        parser.problem("", "the file is empty (expected a mapping with 'version' and 'models')")
        raise ConfigError(parser.problems)
    try:
        document = parser.to_python(node, "")
    except (TooLargeError, RecursionError) as exc:  # alias bombs, recursive aliases, absurd nesting
        what = str(exc) if isinstance(exc, TooLargeError) else "nesting too deep (a recursive alias?)"
        raise ConfigError([ConfigProblem(filename, 0, 0, "", f"cannot read this file: {what}")]) from None
    config = parser.config(document, source=filename, sha256=hashlib.sha256(text.encode()).hexdigest())
    if config is not None and (not parser.problems or _whole(document, config)):
        # the checks across sections run despite a wrong value: every problem of a table is said
        # at once, not one model's after another's are fixed (but not where a model or its name
        # could not be read: what refers to it, and where, would be wrong)
        validate(config, parser)
        if here and not parser.problems:
            validate_host(config, parser)
    if parser.problems:
        # one problem per place: the first found says most (an unreadable value is also a wrong one)
        first = {(p.path, p.line, p.column): p for p in reversed(parser.problems)}
        kept = [p for p in parser.problems if first[(p.path, p.line, p.column)] is p]
        raise ConfigError(sorted(kept, key=lambda p: (p.line, p.column)))
    assert config is not None
    return config

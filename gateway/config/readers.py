"""Typed readers of routing.yaml values: each returns the value, or records a problem at its place."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

from ..errors import did_you_mean
from ..modalities import MODALITY_NAMES, Modality
from .keys import BUILTIN_TOWERS, ENV_NAME, HOST_NAME
from .loader import MISSING, MarkedDocument, join_path


class Readers(MarkedDocument):
    # --- typed readers ---------------------------------------------------------------------

    def mapping(self, value: Any, path: str, allowed: tuple[str, ...], *, what: str) -> dict[str, Any] | None:
        if not isinstance(value, dict):
            self.problem(path, f"{what} must be a mapping, not {describe(value)}")
            return None
        for key in value:
            if key not in allowed:
                self.problem(join_path(path, key), unknown_message(key, allowed, "key"), at_key=True)
        return value

    def string(self, value: Any, path: str, default: Any = MISSING) -> Any:
        if value is MISSING:
            return self._required(path, default)
        if not isinstance(value, str) or not value.strip():
            self.problem(path, f"must be a non-empty string, not {describe(value)}")
            return default if default is not MISSING else None
        return value

    def integer(self, value: Any, path: str, default: int, *, minimum: int, maximum: int | None = None) -> int:
        if value is MISSING:
            return default
        if isinstance(value, bool) or not isinstance(value, int):
            self.problem(path, f"must be an integer, not {describe(value)}")
            return default
        if value < minimum or (maximum is not None and value > maximum):
            bound = f"between {minimum} and {maximum}" if maximum is not None else f"at least {minimum}"
            self.problem(path, f"must be {bound}, not {value}")
            return default
        return value

    def number(self, value: Any, path: str, default: float, *, positive: bool = True) -> float:
        if value is MISSING:
            return default
        if isinstance(value, bool) or not isinstance(value, int | float) or not is_finite(value):
            self.problem(path, f"must be a number, not {describe(value)}")
            return default
        if value < 0 or (positive and value == 0):
            self.problem(path, f"must be {'greater than 0' if positive else 'at least 0'}, not {value}")
            return default
        return float(value)

    def boolean(self, value: Any, path: str, default: bool) -> bool:
        if value is MISSING:
            return default
        if not isinstance(value, bool):
            self.problem(path, f"must be true or false, not {describe(value)}")
            return default
        return value

    def string_list(self, value: Any, path: str) -> list[tuple[str, str]]:
        """[(item, item_path)] of the string items; problems for the others."""
        if not isinstance(value, list):
            self.problem(path, f"must be a list, not {describe(value)}")
            return []
        items = []
        for i, item in enumerate(value):
            if isinstance(item, str) and item.strip():
                items.append((item, f"{path}[{i}]"))
            else:
                self.problem(f"{path}[{i}]", f"must be a non-empty string, not {describe(item)}")
        return items

    def url_list(self, value: Any, path: str, *, missing: tuple[str, str], empty: str, what: str) -> list[str]:
        if value is MISSING:
            self.problem(*missing)
            return []
        items = self.string_list(value, path)
        if isinstance(value, list) and not value:
            self.problem(path, empty)
        urls: list[str] = []
        for item, item_path in items:
            url = self.url(item, item_path)
            if url is None:
                continue
            if url in urls:
                self.problem(item_path, f"duplicate {what} '{item}'")
            else:
                urls.append(url)
        return urls

    def choice(self, value: Any, path: str, allowed: tuple[str, ...], what: str, default: str) -> str:
        """One of ``allowed`` (``default`` when absent; said, and the default, when not one)."""
        if value is MISSING:
            return default
        if value not in allowed:
            self.problem(path, unknown_message(value, allowed, what))
            return default
        return str(value)

    def optional_mapping(self, value: Any, path: str, keys: tuple[str, ...], what: str) -> dict[str, Any] | None:
        """An optional section: None when absent or null (or not a mapping: said)."""
        if value is MISSING or value is None:
            return None
        return self.mapping(value, path, keys, what=what)

    def url(self, value: str, path: str) -> str | None:
        try:
            parts = urlsplit(value)
        except ValueError as exc:  # e.g. a malformed IPv6 host
            self.problem(path, f"bad URL '{value}': {exc}")
            return None
        problem = None
        if parts.scheme not in ("http", "https"):
            problem = "must be an http:// or https:// URL"
        elif not parts.hostname:
            problem = "has no host"
        elif parts.query or parts.fragment:
            problem = "must not have a query or fragment (the request path is appended to it)"
        elif parts.username or parts.password:
            problem = "must not carry credentials"
        else:
            try:
                parts.port  # noqa: B018 - raises ValueError for a bad port
            except ValueError:
                problem = "has an invalid port"
        if problem:
            self.problem(path, f"bad URL '{value}': {problem}")
            return None
        return value.rstrip("/")

    def env_name(self, value: Any, path: str) -> str | None:
        if isinstance(value, str) and ENV_NAME.fullmatch(value):
            return value
        self.problem(path, f"must be the name of an environment variable (like VLLM_API_KEY), not {show(value)}")
        return None

    def listen_address(self, value: Any, path: str, default: str | None) -> str | None:
        """``HOST:PORT`` (``[::1]:PORT`` for IPv6)."""
        if value is MISSING or value is None:
            return default
        host, sep, port = value.rpartition(":") if isinstance(value, str) else ("", "", "")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            self.problem(path, f"must be HOST:PORT (like 127.0.0.1:9090), not {show(value)}")
            return default
        return str(value)

    def host_name(self, value: str, path: str) -> bool:
        if HOST_NAME.fullmatch(value.rstrip(".")):
            return True
        self.problem(
            path,
            f"'{value}' is not a host name: write the domain alone, like images.example.com "
            "(no scheme, port, path or wildcard; its subdomains are allowed too)",
        )
        return False

    def tower(self, value: Any, path: str) -> str:
        """An encoder's model: a builtin name, or a directory (which validate_host looks for)."""
        default = "builtin:vit-small"
        model = self.string(value, path, default)
        if not isinstance(model, str):
            return default
        if model.startswith("builtin:") and model not in BUILTIN_TOWERS:
            self.problem(path, unknown_message(model, BUILTIN_TOWERS, "builtin tower"))
        return model

    def modality(self, value: Any, path: str, *, at_key: bool = False) -> Modality | None:
        if isinstance(value, str) and value in MODALITY_NAMES:
            return Modality(value)
        self.problem(path, unknown_message(value, MODALITY_NAMES, "modality"), at_key=at_key)
        return None

    def _required(self, path: str, default: Any) -> Any:
        if default is MISSING:
            self.problem(path, "is required")
            return None
        return default


def is_finite(value: float) -> bool:
    try:
        return math.isfinite(value)
    except OverflowError:  # an int too large for a float
        return False


def describe(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return f"boolean {str(value).lower()}"
    if isinstance(value, dict):
        return "a mapping"
    if isinstance(value, list):
        return "a list"
    if isinstance(value, str):
        return f"string {value!r}"
    return f"{type(value).__name__} {value!r}"


def show(value: Any) -> str:
    """A value as YAML would write it, for messages."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, dict | list):
        return ("{}" if isinstance(value, dict) else "[]") if not value else describe(value)
    return repr(value)


def unknown_message(value: Any, allowed: tuple[str, ...], what: str) -> str:
    message = f"unknown {what} {show(value)} (expected one of: {', '.join(allowed)})"
    return message + did_you_mean(value, allowed) if isinstance(value, str) else message


def fields(raw: dict[str, Any], path: str, defaults: object) -> Callable[[str], tuple[Any, str, Any]]:
    """For a section's typed readers: a key's raw value, its dotted path, and its default."""

    def get(key: str) -> tuple[Any, str, Any]:
        return raw.get(key, MISSING), f"{path}.{key}", getattr(defaults, key)

    return get

"""The ``auth:`` section: the API keys clients must present, what each may use, and its limits."""

from __future__ import annotations

import math
from typing import Any

from .keys import API_KEY_KEYS, AUTH_KEYS, PRIORITIES, PRIORITY_KEYS, RATE_LIMIT_KEYS, SHA256_HEX
from .loader import MISSING
from .readers import Readers, describe, fields
from .types import ApiKey, AuthConfig, PriorityCap, RateLimit


class AuthReaders(Readers):
    def auth(self, value: Any) -> AuthConfig | None:
        raw = self.mapping(value, "auth", AUTH_KEYS, what="auth")
        if raw is None:
            return None
        keys = raw.get("keys", MISSING)
        if keys is MISSING or keys == []:
            self.problem("auth", "'keys' must list at least one key (leave 'auth' out to run without keys)")
            return None
        if not isinstance(keys, list):
            self.problem("auth.keys", f"must be a list of keys, not {describe(keys)}")
            return None
        parsed = [k for i, item in enumerate(keys) if (k := self.api_key(item, f"auth.keys[{i}]")) is not None]
        return AuthConfig(tuple(parsed))

    def api_key(self, value: Any, path: str) -> ApiKey | None:
        raw = self.mapping(value, path, API_KEY_KEYS, what="a key")
        if raw is None:
            return None
        name = self.string(raw.get("name", MISSING), f"{path}.name")
        key_env, key_sha256 = raw.get("key_env", MISSING), raw.get("key_sha256", MISSING)
        if (key_env is MISSING) == (key_sha256 is MISSING):
            self.problem(path, "give exactly one of 'key_env' (an environment variable) or 'key_sha256'")
        if key_env is not MISSING:
            key_env = self.env_name(key_env, f"{path}.key_env") or MISSING
        if key_sha256 is not MISSING and not (isinstance(key_sha256, str) and SHA256_HEX.fullmatch(key_sha256)):
            # the value is not echoed: it may be a key pasted in by mistake
            self.problem(f"{path}.key_sha256", "must be 64 lowercase hex digits: the sha256 of the key")
            key_sha256 = MISSING
        models = raw.get("models", MISSING)
        patterns = () if models is MISSING else tuple(m for m, _ in self.string_list(models, f"{path}.models"))
        if models == []:
            self.problem(f"{path}.models", "must list at least one model (leave it out for every model)")
        max_concurrency = raw.get("max_concurrency", MISSING)
        if name is None:
            return None
        return ApiKey(
            name=name,
            key_env=None if key_env is MISSING else key_env,
            key_sha256=None if key_sha256 is MISSING else key_sha256,
            models=patterns,
            rate_limit=self.rate_limit(raw.get("rate_limit", MISSING), f"{path}.rate_limit"),
            max_concurrency=None
            if max_concurrency is MISSING
            else self.integer(max_concurrency, f"{path}.max_concurrency", 0, minimum=1) or None,
            priority=self.priority(raw.get("priority", MISSING), f"{path}.priority"),
        )

    def priority(self, value: Any, path: str) -> PriorityCap:
        """A key's classes: ``max`` (its cap; default ``default``) and ``default`` (without the
        header; default the lower of ``default`` and ``max``)."""
        if value is MISSING:
            return PriorityCap()
        raw = self.mapping(value, path, PRIORITY_KEYS, what="priority")
        if raw is None:
            return PriorityCap()
        cap = self.choice(raw.get("max", MISSING), f"{path}.max", PRIORITIES, "priority class", "default")
        lowered = PRIORITIES[max(PRIORITIES.index("default"), PRIORITIES.index(cap))]
        default = self.choice(raw.get("default", MISSING), f"{path}.default", PRIORITIES, "priority class", lowered)
        if PRIORITIES.index(default) < PRIORITIES.index(cap):
            self.problem(f"{path}.default", f"'{default}' is above the key's max '{cap}'")
            default = cap
        return PriorityCap(default, cap)

    def rate_limit(self, value: Any, path: str) -> RateLimit | None:
        if value is MISSING:
            return None
        raw = self.mapping(value, path, RATE_LIMIT_KEYS, what="rate_limit")
        if raw is None:
            return None
        get = fields(raw, path, RateLimit(0.0, 0))
        rpm, rpm_path, _ = get("requests_per_minute")
        visual, visual_path, _ = get("visual_tokens_per_minute")
        tpm, tpm_path, _ = get("tokens_per_minute")
        tpd, tpd_path, _ = get("tokens_per_day")
        if rpm is MISSING and visual is MISSING and tpm is MISSING and tpd is MISSING:
            self.problem(
                path,
                "one of 'requests_per_minute', 'tokens_per_minute', 'tokens_per_day' or 'visual_tokens_per_minute' "
                "is required",
            )
            return None
        per_minute = None if rpm is MISSING else self.number(rpm, rpm_path, 60.0)
        if per_minute is None and "burst" in raw:
            self.problem(f"{path}.burst", "burst is the requests' (requests_per_minute)")
        # default burst: one second's worth, at least 1
        burst = self.integer(
            raw.get("burst", MISSING), f"{path}.burst", max(1, math.ceil((per_minute or 60) / 60)), minimum=1
        )
        tokens = None if visual is MISSING else self.number(visual, visual_path, 1.0)
        minute = None if tpm is MISSING else self.number(tpm, tpm_path, 1.0)
        day = None if tpd is MISSING else self.number(tpd, tpd_path, 1.0)
        return RateLimit(per_minute, burst, tokens, minute, day)

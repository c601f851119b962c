"""A generation: what one config makes once for every request that takes it (gateway.config.generation)."""

from __future__ import annotations

import hashlib

import pytest

from gateway.config import parse_config
from gateway.config.generation import Generation, Keyring, is_bearer
from gateway.errors import InvalidApiKeyError

HASHED = hashlib.sha256(b"other-secret").hexdigest()
MODELS = """
models:
  - name: vision
    upstreams: [http://127.0.0.1:9]
    accepts: [text, image]
    api_key_env: VISION_UPSTREAM_KEY
  - name: plain
    upstreams: [http://127.0.0.1:9]
    accepts: [text]
"""
YAML = (
    "version: 1\nauth:\n  keys:\n    - {name: team, key_env: TEAM_KEY}\n"
    + f"    - {{name: hashed, key_sha256: {HASHED}}}\n"
    + MODELS
)


def test_a_generation_holds_the_keys_the_upstream_keys_and_the_pools_it_was_given(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("TEAM_KEY", " team-secret\n")  # as a mounted secret file holds it
    monkeypatch.setenv("VISION_UPSTREAM_KEY", "up-secret")
    config = parse_config(YAML)
    generation = Generation.build(config, 3, {"vision": "pool-a", "plain": "pool-b"})
    assert generation.number == 3 and generation.config is config
    assert dict(generation.pools) == {"vision": "pool-a", "plain": "pool-b"}
    assert dict(generation.upstream_auth) == {"vision": "Bearer up-secret"}
    assert generation.keyring is not None
    assert generation.keyring.find("Bearer team-secret").name == "team"
    assert generation.keyring.find("bearer other-secret").name == "hashed"  # the scheme in any case
    # the header as clients send it is read without bearer_token: the same answers as through it
    assert generation.keyring.find("Bearer  team-secret \t").name == "team"
    assert generation.keyring.find("BEARER team-secret").name == "team"
    for header in (None, "", "Bearer", "Bearer ", "Bearer   ", "Basic team-secret", "Bearer wrong", "Bearerteam-secret",
                   "Bearer \udcff"):  # fmt: skip
        with pytest.raises(InvalidApiKeyError):
            generation.keyring.find(header)


def test_an_unset_key_variable_is_no_key_and_without_auth_there_is_no_keyring(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TEAM_KEY", raising=False)
    monkeypatch.delenv("VISION_UPSTREAM_KEY", raising=False)
    generation: Generation[str] = Generation.build(parse_config(YAML), 1, {})
    assert dict(generation.upstream_auth) == {}
    assert isinstance(generation.keyring, Keyring) and [k.name for _, k in generation.keyring.entries] == ["hashed"]
    assert Generation.build(parse_config("version: 1" + MODELS), 1, {}).keyring is None


def test_a_bearer_token_is_compared_whatever_its_scheme_case() -> None:
    assert is_bearer("BEARER s3cret", "s3cret") and is_bearer("bearer  s3cret ", "s3cret")
    assert (
        not is_bearer("Bearer s3cre", "s3cret") and not is_bearer(None, "s3cret") and not is_bearer("s3cret", "s3cret")
    )

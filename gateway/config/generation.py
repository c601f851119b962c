"""One generation of the running config: the :class:`~gateway.config.GatewayConfig` and what is
made from it once, when it is swapped in, for every request that takes it: the client keys
(:class:`Keyring`, each by its sha256), each model's upstream ``Authorization`` value, and each
model's replica pool. A request takes the live generation once, at admission, and works with it to
its last byte (gateway.server.store swaps them).

The pools are the upstream stage's (gateway.upstream.replicas.Pool): a generation names their type
as a parameter, ``Generation[Pool]``, so that the config stage knows nothing of replicas."""

from __future__ import annotations

import hashlib
import hmac
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Generic, TypeVar

from ..errors import InvalidApiKeyError
from .environment import env_secret
from .types import ApiKey, AuthConfig, GatewayConfig

log = logging.getLogger(__name__)

PoolT = TypeVar("PoolT")


def bearer_token(authorization: str | None) -> str | None:
    """The token of an ``Authorization: Bearer TOKEN`` header (the scheme in any case), or None."""
    scheme, _, token = (authorization or "").partition(" ")
    token = token.strip()
    return token if scheme.lower() == "bearer" and token else None


def digest_of(secret: str) -> bytes:
    """The sha256 secrets are compared by: equal lengths whatever the secret, and any header
    bytes (aiohttp hands non-UTF-8 ones over as surrogates) hash without an error."""
    return hashlib.sha256(secret.encode("utf-8", "surrogatepass")).digest()


def is_bearer(authorization: str | None, secret: str) -> bool:
    """Whether the header carries ``secret`` as its Bearer token, compared in constant time."""
    token = bearer_token(authorization)
    return token is not None and hmac.compare_digest(digest_of(token), digest_of(secret))


@dataclass(frozen=True, slots=True)
class Keyring:
    """The keys of one config generation, by the sha256 of their value. A key is found by the
    sha256 of what a client sends, in a table of digests: one lookup, however many keys. What
    its time could tell is how the digest of a guess falls among the keys' digests, which says
    nothing of how close the guess came to a key (the digests of two near guesses are unrelated).
    It was a scan comparing every digest in constant time: a cost a request that grew with the keys."""

    entries: tuple[tuple[bytes, ApiKey], ...]
    by_digest: Mapping[bytes, ApiKey] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "by_digest", dict(self.entries))  # a digest given twice: the last key

    @classmethod
    def build(cls, auth: AuthConfig) -> Keyring:
        entries = []
        for key in auth.keys:
            if key.key_sha256 is not None:
                entries.append((bytes.fromhex(key.key_sha256), key))
            elif key.key_env is not None and (value := env_secret(key.key_env)):
                entries.append((digest_of(value), key))
            else:  # serve and reloads refuse this (validate_host); a config built in code may not
                log.warning("API key %s: %s is not set; the key is not accepted", key.name, key.key_env)
        return cls(tuple(entries))

    def find(self, authorization: str | None) -> ApiKey:
        """The key an ``Authorization`` header carries; InvalidApiKeyError when none matches."""
        found = self.key_of(authorization)
        if found is not None:
            return found
        if not bearer_token(authorization):
            raise InvalidApiKeyError("Missing API key: send 'Authorization: Bearer <key>' (or 'x-api-key: <key>')")
        raise InvalidApiKeyError("Invalid API key")

    def key_of(self, authorization: str | None) -> ApiKey | None:
        """The key an ``Authorization`` header carries, or None (the front door's, for a request
        that has one: :meth:`find` says why not)."""
        # (bearer_token and digest_of, inline for the header as clients send it: every keyed request)
        if authorization is not None and authorization.startswith("Bearer "):
            token: str | None = authorization[7:].strip()
        else:
            token = bearer_token(authorization)
        if not token:
            return None
        return self.by_digest.get(hashlib.sha256(token.encode("utf-8", "surrogatepass")).digest())


def upstream_auth(config: GatewayConfig) -> Mapping[str, str]:
    """Each model's ``Authorization`` value for its upstreams: models with ``api_key_env`` whose
    variable is set."""
    auth = {}
    for m in config.models:
        if m.api_key_env is None:
            continue
        key = env_secret(m.api_key_env)
        if key:
            auth[m.name] = f"Bearer {key}"
        else:  # serve and reloads refuse this (validate_host); a config built in code may not
            log.warning("model %s: %s is not set; its upstreams get no key", m.name, m.api_key_env)
    return MappingProxyType(auth)


@dataclass(frozen=True, slots=True)
class Generation(Generic[PoolT]):
    """One generation: what a request works with from admission to its last byte."""

    config: GatewayConfig
    number: int  # 1 at start, one more at each reload that took
    pools: Mapping[str, PoolT]  # each model's upstream pool, by model name
    upstream_auth: Mapping[str, str]  # see upstream_auth()
    keyring: Keyring | None  # the client keys, when the config has auth

    @classmethod
    def build(cls, config: GatewayConfig, number: int, pools: Mapping[str, PoolT]) -> Generation[PoolT]:
        keyring = Keyring.build(config.auth) if config.auth is not None else None
        return cls(config, number, MappingProxyType(dict(pools)), upstream_auth(config), keyring)

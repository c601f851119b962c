"""What the gateway reads from its environment: secrets named by routing.yaml (``key_env``,
``api_key_env``, ``admin_token_env``), never written into the config itself."""

from __future__ import annotations

import os


def env_secret(name: str) -> str:
    """A secret as an environment variable holds it, without the spaces and the line break a
    mounted secret file ends in ("" when unset): how every key and token the gateway reads is read."""
    return os.environ.get(name, "").strip()

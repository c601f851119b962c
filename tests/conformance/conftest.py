"""The conformance suite: what the gateway sends, held to the engines' own code.

Run by ``make conformance`` in a virtualenv of its own (pinned vLLM and SGLang, installed without
their GPU dependencies: tests/conformance/README.md). Where neither is installed (``make test``'s
venv), nothing here is collected.

An engine here is a stand-in (tools.standin) whose ``check`` is the engine's own: every JSON body
it receives is validated by vLLM's request models and parsed by vLLM's chat parser with its media
decoded (tests/conformance/engines/vllm_side.py), or by SGLang's request models
(engines/sglang_side.py); a body the engine refuses is answered 400 with the engine's message,
as the engine answers it. A test sends through the gateway, then reads what the engine found.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from importlib.util import find_spec
from typing import Any

import pytest

from tests.conftest import Upstream

# nothing of the engines' own may reach a hub: their configs and tokenizers are written here
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

ENGINES_INSTALLED = find_spec("vllm") is not None and find_spec("sglang") is not None
collect_ignore_glob = [] if ENGINES_INSTALLED else ["test_*.py"]


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The engines' own modules warn as they import and run (deprecations of torch, pydantic,
    transformers): theirs to mend, not the gateway's, so here warnings are not errors."""
    for item in items:
        if "conformance" in item.nodeid:
            item.add_marker(pytest.mark.filterwarnings("default"))


# route -> the name of the engine module's check for it
VLLM_ROUTES = {
    "/v1/chat/completions": "chat",
    "/v1/responses": "responses",
    "/v1/messages": "messages",
    "/v1/messages/count_tokens": "messages_count_tokens",
    "/v1/embeddings": "embeddings",
    "/v1/score": "score",
    "/score": "score",
    "/v1/rerank": "rerank",
    "/rerank": "rerank",
    "/v2/rerank": "rerank",
    "/v1/audio/transcriptions": "transcription",
    "/v1/audio/translations": "translation",
    "/v1/realtime": "realtime",  # each client event of a session
}
SGLANG_ROUTES = {
    "/v1/chat/completions": "chat",
    "/v1/responses": "responses",
    "/v1/messages": "messages",
    "/v1/embeddings": "embeddings",
    "/v1/score": "score",
    "/v1/rerank": "rerank",
    "/v1/audio/transcriptions": "transcription",
    "/v1/images/generations": "image_generation",  # its diffusion server's (sglang.multimodal_gen)
}


@dataclass
class Checked:
    """One body an engine received, and what its own code made of it."""

    path: str
    body: dict[str, Any]
    found: Any = None  # the engine module's Found, when accepted
    refused: Exception | None = None


@dataclass
class Engine:
    """A stand-in whose every body is held to a real engine's code."""

    upstream: Upstream
    checked: list[Checked] = field(default_factory=list)

    @property
    def url(self) -> str:
        return self.upstream.url

    def last(self, path: str | None = None) -> Checked:
        """The last body received (on ``path``), accepted by the engine (else the test fails)."""
        found = [c for c in self.checked if path is None or c.path == path]
        assert found, f"the engine received nothing{f' on {path}' if path else ''}"
        checked = found[-1]
        assert checked.refused is None, f"the engine refused {checked.path}: {checked.refused}\n{checked.body}"
        return checked

    def refusals(self) -> list[Checked]:
        return [c for c in self.checked if c.refused is not None]


def _checker(module: Any, routes: Mapping[str, str], engine: Engine, options: Mapping[str, Any]) -> Any:
    def check(path: str, body: Any) -> str | None:
        name = routes.get(path)
        if name is None:
            return f"{path} is not a route this engine serves"
        checked = Checked(path, body)
        engine.checked.append(checked)
        try:
            checked.found = getattr(module, name)(body, **options)
        except module.Refused as refused:
            checked.refused = refused
            return str(refused)
        return None

    return check


@functools.cache
def _warm(module: Any) -> None:
    module.chat({"model": "m", "messages": [{"role": "user", "content": "hi"}]})


@pytest.fixture
async def vllm(upstream_factory: Callable[..., Awaitable[Upstream]]) -> Callable[..., Awaitable[Engine]]:
    """A factory of vLLM engines: ``await vllm(engine=vllm_side.Engine(...))``."""
    from tests.conformance.engines import vllm_side

    _warm(vllm_side)  # vLLM's first check imports it (seconds): not while a gateway waits on the engine
    return _factory(upstream_factory, vllm_side, VLLM_ROUTES, "vllm")


@pytest.fixture
async def sglang(upstream_factory: Callable[..., Awaitable[Upstream]]) -> Callable[..., Awaitable[Engine]]:
    """A factory of SGLang engines."""
    from tests.conformance.engines import sglang_side

    return _factory(upstream_factory, sglang_side, SGLANG_ROUTES, "sglang")


def _factory(
    upstream_factory: Callable[..., Awaitable[Upstream]], module: Any, routes: Mapping[str, str], default: str
) -> Callable[..., Awaitable[Engine]]:
    """Engines whose stand-in holds every body to ``module``'s checks (``options``: the checks')."""

    async def make(name: str = default, **options: Any) -> Engine:
        upstream = await upstream_factory(name)
        engine = Engine(upstream)
        upstream.standin.check = _checker(module, routes, engine, options)
        return engine

    return make

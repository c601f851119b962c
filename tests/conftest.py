"""Shared fixtures: real servers on 127.0.0.1 (stand-in upstreams, the gateway) and the real openai SDK."""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from importlib.util import find_spec
from pathlib import Path
from typing import Any

import openai
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer
from prometheus_client import CollectorRegistry

from gateway.config import GatewayConfig, parse_config
from gateway.server.app import SERVER_OPTIONS, create_app
from gateway.server.state import SERVICES_KEY
from tools.standin import StandIn


@dataclass
class Upstream:
    standin: StandIn
    server: TestServer
    url: str

    @property
    def received(self) -> list[Any]:
        return self.standin.received


@dataclass
class Gateway:
    app: web.Application
    server: TestServer
    url: str
    registry: CollectorRegistry

    @property
    def config(self) -> GatewayConfig:
        return self.app[SERVICES_KEY].store.current

    def sample(self, name: str, **labels: str) -> float:
        """A metric's value, summed over the series whose labels include ``labels`` (so a test
        names only the labels it is about); 0 when there is none."""
        return sum(
            sample.value
            for metric in self.registry.collect()
            for sample in metric.samples
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items())
        )

    def client(self) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=f"{self.url}/v1", api_key="sk-test", max_retries=0)


async def _start(app: web.Application) -> TestServer:
    """Served as `modality-gateway serve` serves it (TestServer sets handler_cancellation itself)."""
    server = TestServer(app, host="127.0.0.1", port=0)
    await server.start_server(**{k: v for k, v in SERVER_OPTIONS.items() if k != "handler_cancellation"})
    return server


@pytest.fixture
async def upstream_factory() -> AsyncIterator[Callable[..., Awaitable[Upstream]]]:
    servers: list[TestServer] = []

    async def make(
        name: str = "standin", app: web.Application | None = None, files: dict[str, bytes] | None = None
    ) -> Upstream:
        """A stand-in upstream; or ``app``; or, with ``files``, a media server of these bodies by
        path (as application/octet-stream: the gateway reads what they are from their bytes)."""
        standin = StandIn(name)
        if files is not None:
            app = _files_app(files)
        server = await _start(app if app is not None else standin.app())
        servers.append(server)
        return Upstream(standin, server, str(server.make_url("")).rstrip("/"))

    yield make
    for server in servers:
        await server.close()


def _files_app(files: dict[str, bytes]) -> web.Application:
    async def serve(request: web.Request) -> web.Response:
        return web.Response(body=files[request.path], content_type="application/octet-stream")

    app = web.Application()
    app.router.add_get("/{name}", serve)
    return app


@pytest.fixture
async def upstream(upstream_factory: Callable[..., Awaitable[Upstream]]) -> Upstream:
    return await upstream_factory("up")


@pytest.fixture
async def gateway_factory(tmp_path: Path) -> AsyncIterator[Callable[..., Awaitable[Gateway]]]:
    servers: list[TestServer] = []

    async def make(yaml_text: str, *, write_file: bool = False, watch: bool = False) -> Gateway:
        path = None
        if write_file:
            path = tmp_path / "routing.yaml"
            path.write_text(yaml_text)
        config = parse_config(yaml_text, filename=str(path or "routing.yaml"))
        registry = CollectorRegistry()
        app = create_app(config, registry=registry, config_path=str(path) if path else None, watch=watch)
        server = await _start(app)
        servers.append(server)
        return Gateway(app, server, str(server.make_url("")).rstrip("/"), registry)

    yield make
    for server in servers:
        await server.close()


# Tests that run the real encoder backend (a subprocess) need the `encoder` extra; the rest of the
# gateway's tests run on `pip install -e .[dev]` alone.
needs_encoder = pytest.mark.skipif(
    any(find_spec(m) is None for m in ("torch", "PIL")),
    reason="needs the encoder extra (torch, Pillow): pip install -e '.[encoder]'",
)


# Tests of video sampled as frames need the `video` extra (PyAV): a gateway refuses such a table
# where PyAV is missing.
needs_video = pytest.mark.skipif(
    find_spec("av") is None, reason="needs the video extra (PyAV): pip install -e '.[video]'"
)


def error_body(error: openai.APIError) -> dict[str, Any]:
    """The gateway's error object, as the openai SDK hands it over (typed ``object``)."""
    assert isinstance(error.body, dict), error.body
    return error.body


def free_port() -> int:
    """A loopback port free right now (nothing listens on it until someone binds it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def routing(*models: str, server: str = "", extra: str = "") -> str:
    """A routing.yaml from model blocks (each a YAML list item, indented by two spaces)."""
    head = "version: 1\n"
    if server:
        head += f"server: {server}\n"
    return head + extra + "models:\n" + "\n".join(models)

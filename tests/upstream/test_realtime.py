"""gateway.upstream.realtime: the engine's side of a realtime session, opened through the attempt
loop: its lease given back on every path, its client unbounded in connections."""

from __future__ import annotations

import asyncio

import pytest
from prometheus_client import CollectorRegistry

from gateway.config import ModelConfig, parse_config
from gateway.errors import UpstreamConnectError
from gateway.metrics import GatewayMetrics
from gateway.upstream.realtime import Hub, connect
from gateway.upstream.replicas import Pool, Replica


def _model(url: str) -> ModelConfig:
    config = parse_config(
        "version: 1\nmodels:\n"
        f"  - {{name: asr, upstreams: ['{url}'], accepts: [text, audio], apis: [realtime],\n"
        "     timeouts: {connect_s: 30}}\n"
    )
    return config.models[0]


async def test_a_client_gone_while_the_engine_opens_gives_its_lease_back() -> None:
    """An engine that takes the connection and never answers the upgrade: the session's opening
    cancelled (its client left) leaves the replica's load as it was."""
    accepted, done = asyncio.Event(), asyncio.Event()

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted.set()
        await reader.read(1 << 16)
        await done.wait()
        writer.close()

    server = await asyncio.start_server(silent, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    model, hub = _model(url), Hub()
    replica = Replica(url)
    pool = Pool("asr", [replica])
    opening = asyncio.create_task(connect(hub, pool, model, {}, GatewayMetrics(CollectorRegistry())))
    await accepted.wait()
    assert replica.in_flight == 1
    opening.cancel()
    with pytest.raises(asyncio.CancelledError):
        await opening
    assert replica.in_flight == 0 and replica.probes == 0
    done.set()
    await hub.close()
    server.close()
    await server.wait_closed()


async def test_no_replica_taking_the_session_is_a_502_naming_each(unused_tcp_port: int) -> None:
    url = f"http://127.0.0.1:{unused_tcp_port}"
    hub = Hub()
    replica = Replica(url)
    with pytest.raises(UpstreamConnectError) as refused:
        await connect(hub, Pool("asr", [replica]), _model(url), {}, GatewayMetrics(CollectorRegistry()))
    assert f"{url}: connection refused" in str(refused.value) and replica.in_flight == 0
    assert hub.http.connector is not None and hub.http.connector.limit == 0  # a connection a session, unbounded
    await hub.close()

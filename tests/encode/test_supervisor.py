"""Local encoders: the gateway starts the backend process, waits for it, restarts it when it dies."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from typing import Any

import aiohttp
import openai
import pytest
from aiohttp.test_utils import TestServer
from prometheus_client import CollectorRegistry

from gateway.config import parse_config
from gateway.encode.supervisor import Supervisor, Timings
from gateway.server.app import create_app
from gateway.server.state import SERVICES_KEY
from tests.conftest import Gateway, Upstream, error_body, needs_encoder, routing
from tests.images import image_part, png


def local_config(upstream: Upstream) -> str:
    return routing(
        f"  - {{name: vl, upstreams: [{upstream.url}], accepts: [text, image], encode: {{image: vision}}}}",
        extra="encoders:\n  vision: {kind: local, model: 'builtin:vit-small', device: cpu, timeout_s: 60}\n",
    )


ADMIN_ENV = "GATEWAY_ADMIN_TOKEN"  # the default server.admin_token_env


@pytest.fixture(autouse=True)
def _admin_token(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ADMIN_ENV, "s3cret")


async def readyz(gw: Gateway) -> tuple[int, dict[str, Any]]:
    """/readyz's full report (the admin's view)."""
    async with aiohttp.ClientSession() as session:
        async with session.get(f"{gw.url}/readyz", headers={"Authorization": "Bearer s3cret"}) as resp:
            return resp.status, await resp.json()


async def wait_for(predicate, *, seconds: float) -> None:
    for _ in range(int(seconds / 0.1)):  # bounded
        if await predicate():
            return
        await asyncio.sleep(0.1)
    raise AssertionError("condition not met in time")


@needs_encoder
async def test_a_local_encoder_is_started_supervised_and_restarted(gateway_factory, upstream: Upstream) -> None:
    gw = await gateway_factory(local_config(upstream))
    status, body = await readyz(gw)
    assert status == 503 and body["status"] == "starting"

    async def ready() -> bool:
        return (await readyz(gw))[0] == 200

    await wait_for(ready, seconds=120)
    async with gw.client() as client:
        await client.chat.completions.create(model="vl", messages=[{"role": "user", "content": [image_part(png())]}])
    part = upstream.received[0].json()["messages"][0]["content"][0]
    from tests.backends.test_epd import load_as_vllm_does  # torch: only where the encoder extra is

    assert load_as_vllm_does(part["image_embeds"]).shape == (196, 384)

    encoder = (await readyz(gw))[1]["encoders"]["vision"]
    assert encoder["kind"] == "local" and encoder["restarts"] == 0
    os.kill(encoder["pid"], signal.SIGKILL)

    async def restarted() -> bool:
        status, body = await readyz(gw)
        return status == 200 and body["encoders"]["vision"]["restarts"] == 1

    await wait_for(restarted, seconds=120)


async def test_a_backend_that_keeps_dying_keeps_the_gateway_unready(upstream_factory, tmp_path) -> None:
    upstream = await upstream_factory("up")
    registry = CollectorRegistry()
    config = parse_config(local_config(upstream))
    supervisor = Supervisor(config, command=[sys.executable, "-c", "import sys; sys.exit(3)"])
    app = create_app(config, registry=registry, supervisor=supervisor)
    server = TestServer(app, host="127.0.0.1", port=0)
    await server.start_server()
    try:
        gw = Gateway(app, server, str(server.make_url("")).rstrip("/"), registry)

        async def died_twice() -> bool:
            return (await readyz(gw))[1]["encoders"]["vision"]["restarts"] >= 2

        await wait_for(died_twice, seconds=30)
        status, body = await readyz(gw)
        assert status == 503 and body["encoders"]["vision"]["last_error"] == "exit code 3"
        async with gw.client() as client:  # images for that model cannot be encoded meanwhile
            with pytest.raises(openai.InternalServerError) as caught:
                await client.chat.completions.create(
                    model="vl", messages=[{"role": "user", "content": [image_part(png())]}]
                )
        assert error_body(caught.value)["code"] == "encoder_unavailable"
    finally:
        await server.close()


def test_the_gateway_never_imports_torch() -> None:
    code = (
        "import sys, gateway.server.app, gateway.server.cli, gateway.encode.client, gateway.media.fetch; "
        "import gateway.encode.supervisor; "
        "assert 'torch' not in sys.modules, 'torch was imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


@needs_encoder
async def test_a_supervised_backend_exits_when_its_parent_dies(tmp_path) -> None:
    """The gateway passes --parent-pid: a gateway killed with SIGKILL leaves no encoder behind."""
    pid_file = tmp_path / "pid"
    launcher = (
        "import subprocess, sys, os\n"
        "p = subprocess.Popen([sys.executable, '-m', 'backends.vision_encoder', 'serve', '--device', 'cpu',\n"
        "                      '--port', '0', '--parent-pid', str(os.getpid())])\n"
        f"open({str(pid_file)!r}, 'w').write(str(p.pid))\n"
        "import time; time.sleep(600)\n"
    )
    parent = subprocess.Popen([sys.executable, "-c", launcher])
    try:
        for _ in range(200):
            if pid_file.exists() and pid_file.read_text():
                break
            await asyncio.sleep(0.05)
        child = int(pid_file.read_text())
        parent.kill()
        parent.wait(timeout=10)

        def alive() -> bool:
            try:
                os.kill(child, 0)
            except ProcessLookupError:
                return False
            with open(f"/proc/{child}/stat") as f:  # a zombie has exited; nobody is left to reap it
                return f.read().split()[2] != "Z"

        for _ in range(600):  # bounded: torch import, then the one-second parent check
            if not alive():
                break
            await asyncio.sleep(0.05)
        assert not alive()
    finally:
        if parent.poll() is None:
            parent.kill()


HANGING_BACKEND = """
import asyncio, sys
from aiohttp import web
port = int(sys.argv[sys.argv.index('--port') + 1])
checks = 0
async def health(request):
    global checks
    checks += 1
    if checks > 2:
        await asyncio.sleep(3600)  # wedged: alive, but never answers again
    return web.json_response({'status': 'ok'})
app = web.Application()
app.router.add_get('/health', health)
web.run_app(app, host='127.0.0.1', port=port, print=None)
"""


async def test_a_backend_that_stops_answering_is_killed_and_restarted(upstream_factory) -> None:
    upstream = await upstream_factory("up")
    registry = CollectorRegistry()
    config = parse_config(local_config(upstream))
    timings = Timings(health_interval_s=0.1, health_timeout_s=0.3)
    supervisor = Supervisor(config, command=[sys.executable, "-c", HANGING_BACKEND], timings=timings)
    app = create_app(config, registry=registry, supervisor=supervisor)
    server = TestServer(app, host="127.0.0.1", port=0)
    await server.start_server()
    try:
        gw = Gateway(app, server, str(server.make_url("")).rstrip("/"), registry)

        async def restarted() -> bool:
            return (await readyz(gw))[1]["encoders"]["vision"]["restarts"] >= 1

        await wait_for(restarted, seconds=60)
    finally:
        await server.close()


@needs_encoder
async def test_a_reload_starts_and_stops_local_encoders(gateway_factory, upstream: Upstream, tmp_path) -> None:
    plain = routing(
        f"  - {{name: vl, upstreams: [{upstream.url}], accepts: [text, image]}}", server="{reload_interval_s: 0}"
    )
    gw = await gateway_factory(plain, write_file=True)
    assert (await readyz(gw))[0] == 200
    (tmp_path / "routing.yaml").write_text(local_config(upstream))
    await gw.app[SERVICES_KEY].store.reload()

    async def ready() -> bool:
        status, body = await readyz(gw)
        return status == 200 and body["encoders"].get("vision", {}).get("ready") is True

    await wait_for(ready, seconds=120)
    pid = (await readyz(gw))[1]["encoders"]["vision"]["pid"]
    async with gw.client() as client:
        raw = await client.chat.completions.with_raw_response.create(
            model="vl", messages=[{"role": "user", "content": [image_part(png())]}]
        )
    assert raw.headers["x-gateway-encoded"] == "1"

    (tmp_path / "routing.yaml").write_text(plain)
    await gw.app[SERVICES_KEY].store.reload()
    assert "vision" not in (await readyz(gw))[1]["encoders"]

    async def stopped() -> bool:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        return False

    await wait_for(stopped, seconds=30)


async def test_a_local_encoder_listens_on_the_port_its_table_names(upstream_factory, tmp_path) -> None:
    """``encoders.NAME.port``: a known loopback port (for a scrape of its /metrics), not a free one."""
    from tests.conftest import free_port

    upstream, port, said = await upstream_factory("up"), free_port(), tmp_path / "argv"
    config = parse_config(local_config(upstream).replace("timeout_s: 60}", f"timeout_s: 60, port: {port}}}"))
    assert config.encoders["vision"].port == port
    record = f"import sys; open({str(said)!r}, 'w').write(' '.join(sys.argv[1:])); sys.exit(3)"
    supervisor = Supervisor(config, command=[sys.executable, "-c", record])
    await supervisor.start()
    try:

        async def started() -> bool:
            return said.exists() and said.read_text() != ""

        await wait_for(started, seconds=30)
        assert said.read_text() == f"--port {port}"
        assert supervisor.encoders["vision"].url == f"http://127.0.0.1:{port}"
    finally:
        await supervisor.close()

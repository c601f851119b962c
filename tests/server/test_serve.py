"""`modality-gateway serve` as a real process: start, serve, reload on SIGHUP, stop on SIGTERM."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from pathlib import Path

import aiohttp

from tests.conftest import Upstream, free_port, routing


async def wait_healthy(url: str, process: asyncio.subprocess.Process) -> None:
    async with aiohttp.ClientSession() as session:
        for _ in range(300):  # bounded: about 15 s
            assert process.returncode is None, "the gateway exited during start-up"
            try:
                async with session.get(f"{url}/healthz") as resp:
                    if resp.status == 200:
                        return
            except aiohttp.ClientConnectionError:
                pass
            await asyncio.sleep(0.05)
    raise AssertionError("the gateway did not become healthy")


async def start(config: Path, port: int, env: dict[str, str] | None = None) -> asyncio.subprocess.Process:
    """`modality-gateway serve` on a loopback port, its output piped."""
    return await asyncio.create_subprocess_exec(
        sys.executable, "-m", "gateway", "serve", "--config", str(config), "--port", str(port),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT, env=env,
    )  # fmt: skip


async def finish(process: asyncio.subprocess.Process) -> str:
    """Kill the process if it is still running; what it printed."""
    if process.returncode is None:
        process.kill()
        await process.wait()
    assert process.stdout is not None
    return (await process.stdout.read()).decode()


async def test_serve_reloads_on_sighup_and_stops_on_sigterm(upstream: Upstream, tmp_path: Path) -> None:
    config = tmp_path / "routing.yaml"
    config.write_text(
        routing(f"  - {{name: first, upstreams: [{upstream.url}], accepts: [text]}}", server="{reload_interval_s: 0}")
    )
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    process = await start(config, port)
    try:
        await wait_healthy(url, process)
        async with aiohttp.ClientSession() as session:
            body = {"model": "first", "messages": [{"role": "user", "content": "hi"}]}
            async with session.post(f"{url}/v1/chat/completions", json=body) as resp:
                assert resp.status == 200
                assert (await resp.json())["choices"][0]["message"]["content"].startswith("[up] model=first")
            config.write_text(
                routing(
                    f"  - {{name: second, upstreams: [{upstream.url}], accepts: [text]}}",
                    server="{reload_interval_s: 0}",
                )
            )
            process.send_signal(signal.SIGHUP)
            for _ in range(200):
                async with session.get(f"{url}/v1/models") as resp:
                    ids = [m["id"] for m in (await resp.json())["data"]]
                if ids == ["second"]:
                    break
                await asyncio.sleep(0.05)
            assert ids == ["second"]
        process.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(process.wait(), timeout=15) == 0
    finally:
        output = await finish(process)
    assert "serving 1 models" in output
    assert "generation 2 in effect" in output


async def test_serve_refuses_an_invalid_config_with_exit_2(tmp_path: Path) -> None:
    config = tmp_path / "routing.yaml"
    config.write_text("version: 1\nmodels:\n  - name: m\n    upstreams: [http://127.0.0.1:1]\n    accepts: [txt]\n")
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "gateway", "serve", "--config", str(config),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    _, stderr = await asyncio.wait_for(process.communicate(), timeout=30)
    assert process.returncode == 2
    assert f"{config}:5:15: models[0].accepts[0]: unknown modality 'txt'" in stderr.decode()


async def test_headers_that_trickle_in_are_cut_at_the_idle_timeout(upstream: Upstream, tmp_path: Path) -> None:
    config = tmp_path / "routing.yaml"
    config.write_text(
        routing(
            f"  - {{name: m, upstreams: [{upstream.url}], accepts: [text]}}",
            server="{reload_interval_s: 0, client_idle_timeout_s: 0.5}",
        )
    )
    port = free_port()
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "gateway", "serve", "--config", str(config), "--port", str(port),
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL,
    )  # fmt: skip
    try:
        await wait_healthy(f"http://127.0.0.1:{port}", process)
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        loop = asyncio.get_running_loop()
        started = loop.time()
        try:
            writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHo")  # and the rest never comes
            async with asyncio.timeout(10):
                assert await reader.read() == b""  # closed, with nothing said
        finally:
            writer.close()
        assert loop.time() - started < 5  # aiohttp's default would wait 75 s
    finally:
        process.kill()
        await process.wait()


async def test_sigterm_drains_readyz_turns_503_new_requests_are_served_in_the_grace_period_and_the_long_one_ends(
    upstream: Upstream, tmp_path: Path
) -> None:
    config = tmp_path / "routing.yaml"
    config.write_text(
        routing(
            f"  - {{name: m, upstreams: [{upstream.url}], accepts: [text]}}",
            server="{reload_interval_s: 0, drain_grace_s: 1.5, drain_timeout_s: 10}",
        )
    )
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    process = await start(config, port)
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}

    async def ask(headers: dict[str, str] | None = None) -> int:
        # a new connection each time: what a load balancer that has not noticed yet would open
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as session:
            async with session.post(f"{url}/v1/chat/completions", json=body, headers=headers or {}) as resp:
                await resp.read()
                return resp.status

    try:
        await wait_healthy(url, process)
        long = asyncio.create_task(ask({"X-Standin-Delay-Ms": "3000"}))
        while not upstream.received:
            await asyncio.sleep(0.01)
        process.send_signal(signal.SIGTERM)
        loop = asyncio.get_running_loop()
        signalled = loop.time()
        async with aiohttp.ClientSession() as session:
            for _ in range(100):
                async with session.get(f"{url}/readyz") as resp:
                    if resp.status == 503:
                        assert (await resp.json())["status"] == "draining"
                        break
                await asyncio.sleep(0.01)
            else:
                raise AssertionError("/readyz did not turn 503")
        during_grace = []
        while loop.time() - signalled < 1.0:  # well inside the 1.5 s grace period
            during_grace.append(await ask())
            await asyncio.sleep(0.05)
        assert len(during_grace) >= 5 and during_grace == [200] * len(during_grace)  # zero connection errors
        assert await long == 200  # the 3 s request outlived the listener
        assert await asyncio.wait_for(process.wait(), timeout=15) == 0
    finally:
        output = await finish(process)
    assert "SIGTERM: draining" in output and "closing the listener" in output and "stopped" in output
    assert '"POST /v1/chat/completions HTTP/1.1" 200' in output and " rid=" in output  # the access log, by default


async def test_admin_listen_serves_admin_and_metrics_apart_from_the_api(upstream: Upstream, tmp_path: Path) -> None:
    port, admin = free_port(), free_port()
    config = tmp_path / "routing.yaml"
    config.write_text(
        routing(
            f"  - {{name: m, upstreams: [{upstream.url}], accepts: [text]}}",
            server=f"{{reload_interval_s: 0, admin_listen: '127.0.0.1:{admin}', drain_grace_s: 0, access_log: false}}",
        )
    )
    process = await start(config, port, env={**os.environ, "GATEWAY_ADMIN_TOKEN": "s3cret"})
    main, side = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{admin}"
    try:
        await wait_healthy(main, process)
        await wait_healthy(side, process)
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
        token = {"Authorization": "Bearer s3cret"}
        async with aiohttp.ClientSession() as session:
            async with session.post(f"{main}/v1/chat/completions", json=body) as resp:
                assert resp.status == 200
            async with session.post(f"{side}/v1/chat/completions", json=body) as resp:
                assert resp.status == 404  # the API is not on the admin port
            for path in ("/metrics", "/admin/config", "/status", "/"):  # the status page too: it names every model
                async with session.get(f"{main}{path}", headers=token) as resp:
                    assert resp.status == 404, path  # nor admin on the public one
                async with session.get(f"{side}{path}", headers=token) as resp:
                    assert resp.status == 200, path
            for url in (main, side):
                async with session.get(f"{url}/readyz") as resp:
                    assert resp.status == 200
        process.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(process.wait(), timeout=15) == 0
    finally:
        output = await finish(process)
    assert f"admin endpoints, /metrics and the status page on http://127.0.0.1:{admin} only" in output
    assert "no 'auth:' section: anyone who reaches" in output
    assert " rid=" not in output  # server.access_log: false


async def test_a_served_heap_is_frozen_after_startup_and_collected_less_often() -> None:
    """settle_heap (run by serve once the app is set up) in a process of its own: startup's
    objects out of the collector's sight, the youngest generation collected every GC_YOUNG."""
    check = (
        "import gc\n"
        "from gateway.server.lifecycle import GC_YOUNG, settle_heap\n"
        "settle_heap()\n"
        "assert gc.get_freeze_count() > 1000, gc.get_freeze_count()\n"
        "assert gc.get_threshold()[0] == GC_YOUNG > 700, gc.get_threshold()\n"
    )
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-c", check, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT
    )
    output, _ = await process.communicate()
    assert process.returncode == 0, output.decode()


async def test_a_port_in_use_is_one_line_and_exit_1_not_a_traceback(upstream: Upstream, tmp_path: Path) -> None:
    """Another process on the port (a gateway left running, an engine): one line that says so and
    what to do, for one process and for --workers alike."""
    import socket

    config = tmp_path / "routing.yaml"
    config.write_text(routing(f"  - {{name: m, upstreams: [{upstream.url}], accepts: [text]}}"))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        for workers in ("1", "2"):
            process = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "gateway", "serve", "--config", str(config), "--port", str(port),
                "--workers", workers, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
            )  # fmt: skip
            _, err = await asyncio.wait_for(process.communicate(), timeout=60)
            said = err.decode()
            assert process.returncode == 1, said
            assert f"modality-gateway: cannot listen on http://127.0.0.1:{port}: address already in use (" in said
            assert "Traceback" not in said and "serving 1 models from" not in said  # it is not serving


async def test_ctrl_c_stops_an_idle_gateway_without_the_grace_period(upstream: Upstream, tmp_path: Path) -> None:
    """SIGINT (a Ctrl-C at a terminal) skips drain_grace_s, which is for load balancers (an hour
    here: the test would time out waiting, were it kept)."""
    port = free_port()
    config = tmp_path / "routing.yaml"
    config.write_text(
        routing(
            f"  - {{name: m, upstreams: [{upstream.url}], accepts: [text]}}",
            server="{reload_interval_s: 0, drain_grace_s: 3600}",
        )
    )
    process = await start(config, port)
    try:
        await wait_healthy(f"http://127.0.0.1:{port}", process)
        process.send_signal(signal.SIGINT)
        assert await asyncio.wait_for(process.wait(), timeout=120) == 0
    finally:
        output = await finish(process)
    assert "SIGINT: stopping; requests in flight have" in output and "stopped" in output

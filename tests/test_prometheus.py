"""The gateway's /metrics as Prometheus itself sees it: promtool's lint, and a real server's scrape."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
from pathlib import Path

import aiohttp
import openai
import pytest

from tests.conftest import Gateway, Upstream, free_port, routing

# `make test` installs Debian's prometheus package; CI must run these, a laptop without root may skip them.
pytestmark = pytest.mark.skipif(
    (shutil.which("promtool") is None or shutil.which("prometheus") is None) and os.environ.get("CI") != "true",
    reason="needs Debian's prometheus package (make test installs it)",
)

VIDEO = {"type": "video_url", "video_url": {"url": "data:video/mp4;base64,AAAA"}}


@pytest.fixture
async def busy_gateway(gateway_factory, upstream: Upstream) -> Gateway:
    gw = await gateway_factory(
        routing(
            f"  - {{name: vision, upstreams: [{upstream.url}], accepts: [text, image], "
            "on_unsupported: {video: {redirect: omni}}}",
            f"  - {{name: omni, upstreams: [{upstream.url}], accepts: [text, image, video]}}",
            f"  - {{name: texty, upstreams: [{upstream.url}], accepts: [text]}}",
        )
    )
    async with gw.client() as client:
        await client.chat.completions.create(model="vision", messages=[{"role": "user", "content": [VIDEO]}])
        with pytest.raises(openai.BadRequestError):
            await client.chat.completions.create(model="texty", messages=[{"role": "user", "content": [VIDEO]}])
    return gw


async def test_metrics_pass_promtool_lint(busy_gateway: Gateway) -> None:
    async with aiohttp.ClientSession() as session:
        async with session.get(f"{busy_gateway.url}/metrics") as resp:
            exposition = await resp.read()
    result = subprocess.run(
        ["promtool", "check", "metrics"], input=exposition, capture_output=True, timeout=60, check=False
    )
    assert result.returncode == 0, result.stdout.decode() + result.stderr.decode()


async def test_a_real_prometheus_scrapes_rejections_and_redirects(busy_gateway: Gateway, tmp_path: Path) -> None:
    target = busy_gateway.url.removeprefix("http://")
    (tmp_path / "prometheus.yml").write_text(
        "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
        "scrape_configs:\n"
        f"  - job_name: gateway\n    static_configs: [{{targets: ['{target}']}}]\n"
    )
    port = free_port()
    process = await asyncio.create_subprocess_exec(
        "prometheus", f"--config.file={tmp_path / 'prometheus.yml'}", f"--storage.tsdb.path={tmp_path / 'data'}",
        f"--web.listen-address=127.0.0.1:{port}",
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL,
    )  # fmt: skip
    queries = {
        'sum(gateway_modality_rejections_total{model="texty",modality="video",reason="unsupported"})': "1",
        'sum(gateway_modality_redirects_total{model="vision",modality="video",target="omni"})': "1",
        'sum(gateway_requests_total{model="texty",code="400"})': "1",
    }
    results: dict[str, str | None] = {}
    try:
        async with aiohttp.ClientSession() as session:
            for _ in range(300):  # bounded: about 30 s for start-up and the first scrapes
                results = {q: await _query(session, port, q) for q in queries}
                if results == queries:
                    break
                await asyncio.sleep(0.1)
    finally:
        process.terminate()
        await asyncio.wait_for(process.wait(), timeout=30)
    assert results == queries


async def _query(session: aiohttp.ClientSession, port: int, query: str) -> str | None:
    try:
        async with session.get(f"http://127.0.0.1:{port}/api/v1/query", params={"query": query}) as resp:
            if resp.status != 200:
                return None
            data = (await resp.json())["data"]["result"]
    except aiohttp.ClientConnectionError:
        return None
    return data[0]["value"][1] if data else None

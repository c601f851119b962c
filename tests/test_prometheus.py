"""The gateway's /metrics as Prometheus itself sees it: promtool's lint, and a real server's scrape."""

from __future__ import annotations

import asyncio
import hashlib
import os
import shutil
import subprocess
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import openai
import pytest
from aiohttp import web
from aiohttp.typedefs import Handler
from prometheus_client.parser import text_string_to_metric_families

from gateway.config import PRIORITIES
from tests.conftest import Gateway, Upstream, free_port, routing
from tools.standin import StandIn

# `make test` installs Debian's prometheus package; CI must run these, a laptop without root may skip them.
pytestmark = pytest.mark.skipif(
    (shutil.which("promtool") is None or shutil.which("prometheus") is None) and os.environ.get("CI") != "true",
    reason="needs Debian's prometheus package (make test installs it)",
)

VIDEO = {"type": "video_url", "video_url": {"url": "data:video/mp4;base64,AAAA"}}
HI = [{"role": "user", "content": "hi"}]
# Gateway.client's key is "ci"'s; "tight" has one request, then one a minute
KEYS = (
    "auth:\n  keys:\n"
    f"    - {{name: ci, key_sha256: {hashlib.sha256(b'sk-test').hexdigest()}}}\n"
    f"    - {{name: tight, key_sha256: {hashlib.sha256(b'sk-tight').hexdigest()}, "
    "rate_limit: {requests_per_minute: 1, burst: 1}}\n"
)


@pytest.fixture
async def sick(upstream_factory: Callable[..., Awaitable[Upstream]]) -> Upstream:
    """A replica that answers every request 503: retried elsewhere, and ejected at once."""
    sick = await upstream_factory("sick")
    sick.standin.fail_status = 503
    return sick


@dataclass
class Held:
    """A replica that keeps each chat request until ``release`` is set (its /health answers at once)."""

    upstream: Upstream
    arrived: asyncio.Event
    release: asyncio.Event


@pytest.fixture
async def held(upstream_factory: Callable[..., Awaitable[Upstream]]) -> Held:
    arrived, release = asyncio.Event(), asyncio.Event()

    @web.middleware
    async def hold(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.path == "/v1/chat/completions":
            arrived.set()
            await release.wait()
        return await handler(request)

    app = StandIn("held").app()
    app.middlewares.append(hold)
    return Held(await upstream_factory("held", app), arrived, release)


ADMIN_TOKEN = "admin-token"  # with auth on, /metrics on the main port needs it
SCRAPE = {"Authorization": f"Bearer {ADMIN_TOKEN}"}


@pytest.fixture
async def busy_gateway(
    gateway_factory, upstream: Upstream, sick: Upstream, held: Held, monkeypatch: pytest.MonkeyPatch
) -> Gateway:
    monkeypatch.setenv("GATEWAY_ADMIN_TOKEN", ADMIN_TOKEN)
    gw = await gateway_factory(
        routing(
            f"  - {{name: vision, upstreams: [{upstream.url}], accepts: [text, image], "
            "on_unsupported: {video: {redirect: omni}}}",
            f"  - {{name: omni, upstreams: [{upstream.url}], accepts: [text, image, video]}}",
            f"  - {{name: texty, upstreams: [{upstream.url}], accepts: [text]}}",
            # round robin takes the first replica first: the 503 is retried on the other, and the
            # sick one's breaker opens on its first failure (and stays open: nothing probes it)
            f"  - {{name: pooled, upstreams: [{sick.url}, {upstream.url}], accepts: [text], balance: round_robin, "
            "retries: {backoff_s: 0}, breaker: {failures: 1, open_s: 600}}",
            # one request at a time and no queue: the second of a concurrent pair is shed (429); one
            # health check as the gateway starts (the next would be 10 minutes later)
            f"  - {{name: limited, upstreams: [{held.upstream.url}], accepts: [text], max_concurrency: 1, "
            "queue: {size: 0}, health_check: {interval_s: 600}}",
            extra=KEYS,
        )
    )
    async with gw.client() as client:
        await client.chat.completions.create(model="vision", messages=[{"role": "user", "content": [VIDEO]}])
        with pytest.raises(openai.BadRequestError):
            await client.chat.completions.create(model="texty", messages=[{"role": "user", "content": [VIDEO]}])
        await client.chat.completions.create(model="pooled", messages=HI)
        first = asyncio.create_task(client.chat.completions.create(model="limited", messages=HI))
        try:
            await asyncio.wait_for(held.arrived.wait(), timeout=10)  # upstream: it holds limited's one slot
            with pytest.raises(openai.RateLimitError) as shed:
                await client.chat.completions.create(model="limited", messages=HI)
            assert shed.value.code == "queue_full"
        finally:
            held.release.set()
            await asyncio.wait_for(first, timeout=10)
    async with openai.AsyncOpenAI(base_url=f"{gw.url}/v1", api_key="sk-wrong", max_retries=0) as wrong:
        with pytest.raises(openai.AuthenticationError):
            await wrong.chat.completions.create(model="texty", messages=HI)
    async with openai.AsyncOpenAI(base_url=f"{gw.url}/v1", api_key="sk-tight", max_retries=0) as tight:
        await tight.chat.completions.create(model="texty", messages=HI)
        with pytest.raises(openai.RateLimitError) as limited:
            await tight.chat.completions.create(model="texty", messages=HI)
        assert limited.value.code == "rate_limit_exceeded"
    assert len(sick.received) == 1
    passed = {"model": "limited", "upstream": held.upstream.url, "result": "pass"}
    for _ in range(500):  # bounded (5 s): the probe went out as the gateway started
        if gw.sample("gateway_health_checks_total", **passed):
            break
        await asyncio.sleep(0.01)
    assert gw.sample("gateway_health_checks_total", **passed) == 1
    return gw


async def test_metrics_pass_promtool_lint(
    busy_gateway: Gateway, upstream: Upstream, sick: Upstream, held: Held
) -> None:
    async with aiohttp.ClientSession() as session:
        async with session.get(f"{busy_gateway.url}/metrics", headers=SCRAPE) as resp:
            exposition = await resp.read()
    result = subprocess.run(
        ["promtool", "check", "metrics"], input=exposition, capture_output=True, timeout=60, check=False
    )
    assert result.returncode == 0, result.stdout.decode() + result.stderr.decode()
    # the replica pools' families are in it, with series (the gauges are read at scrape time)
    families = {f.name: f for f in text_string_to_metric_families(exposition.decode())}
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value for f in families.values() for s in f.samples}

    def value(name: str, **labels: str) -> float | None:
        return samples.get((name, tuple(sorted(labels.items()))))

    bad, good = {"model": "pooled", "upstream": sick.url}, {"model": "pooled", "upstream": upstream.url}
    assert (value("gateway_upstream_healthy", **bad), value("gateway_upstream_healthy", **good)) == (0, 1)
    states = {s: value("gateway_upstream_breaker_state", **bad, state=s) for s in ("closed", "half_open", "open")}
    assert states == {"closed": 0, "half_open": 0, "open": 1}
    assert value("gateway_upstream_breaker_state", **good, state="closed") == 1
    assert (value("gateway_upstream_in_flight", **bad), value("gateway_upstream_in_flight", **good)) == (0, 0)
    assert value("gateway_upstream_ejections_total", **bad) == 1
    assert value("gateway_upstream_ejections_total", **good) == 0  # declared: rate() sees the first one
    assert value("gateway_retries_total", model="pooled", reason="http_503") == 1
    assert value("gateway_retries_refused_total", model="pooled") == 0
    # concurrency (models with max_concurrency only) and health checks
    limited = {"model": "limited"}
    assert (
        value("gateway_shed_total", **limited, reason="queue_full", priority="default"),
        value("gateway_shed_total", **limited, reason="queue_timeout", priority="default"),
        value("gateway_shed_total", **limited, reason="preempted", priority="bulk"),  # declared: every class
    ) == (1, 0, 0)
    assert value("gateway_queue_wait_seconds_count", **limited, priority="default") == 1
    assert value("gateway_queue_wait_seconds_count", **limited, priority="system") == 0
    depths = [value("gateway_queue_depth", **limited, priority=p) for p in PRIORITIES]
    assert depths == [0, 0, 0, 0] and value("gateway_model_in_flight", **limited) == 0
    assert value("gateway_shed_total", model="pooled", reason="queue_full", priority="default") is None  # limits only
    assert value("gateway_health_checks_total", **limited, upstream=held.upstream.url, result="pass") == 1
    assert value("gateway_requests_total", **limited, code="429", key="ci", api="chat") == 1
    # API keys: a wrong one, and tight's second request within its minute
    assert (
        value("gateway_auth_failures_total", reason="invalid"),
        value("gateway_auth_failures_total", reason="missing"),
    ) == (1, 0)
    assert value("gateway_rate_limited_total", key="tight", reason="rate") == 1
    assert value("gateway_rate_limited_total", key="tight", reason="concurrency") == 0
    assert value("gateway_rate_limited_total", key="ci", reason="rate") == 0  # declared per key
    assert value("gateway_requests_total", model="_unknown", code="429", key="tight", api="chat") == 1
    assert value("gateway_requests_total", model="texty", code="200", key="tight", api="chat") == 1
    assert [s.labels["sha256"] for s in families["gateway_config_info"].samples] == [busy_gateway.config.sha256]


async def test_a_real_prometheus_scrapes_admission_replica_health_shedding_and_keys(
    busy_gateway: Gateway, tmp_path: Path
) -> None:
    target = busy_gateway.url.removeprefix("http://")
    (tmp_path / "prometheus.yml").write_text(
        "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
        "scrape_configs:\n"
        f"  - job_name: gateway\n    static_configs: [{{targets: ['{target}']}}]\n"
        f"    authorization: {{credentials: {ADMIN_TOKEN}}}\n"
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
        'sum(gateway_retries_total{model="pooled",reason="http_503"})': "1",
        'sum(gateway_upstream_ejections_total{model="pooled"})': "1",
        'sum(gateway_upstream_healthy{model="pooled"})': "1",  # of 2
        'sum(gateway_upstream_breaker_state{model="pooled",state="open"})': "1",
        'sum(gateway_upstream_in_flight{model="pooled"})': "0",
        'sum(gateway_shed_total{model="limited",reason="queue_full"})': "1",
        'sum(gateway_queue_depth{model="limited"})': "0",
        'sum(gateway_health_checks_total{model="limited",result="pass"})': "1",
        "count(count by (sha256) (gateway_config_info))": "1",  # the dashboard's "versions live"
        'sum(gateway_auth_failures_total{reason="invalid"})': "1",
        'sum(gateway_rate_limited_total{key="tight",reason="rate"})': "1",
        'sum(gateway_requests_total{key="tight"})': "2",  # the one answered and the one refused
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

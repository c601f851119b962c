"""The dashboard and the alerts name only metrics that the gateway and the encoder backend export
(here: both run, so every metric they export is there to be named)."""

from __future__ import annotations

import base64

import aiohttp

from tests.conftest import routing
from tests.images import png
from tests.test_deploy import METRIC, alert_queries, dashboard_queries


async def test_dashboards_and_alerts_name_only_exported_metrics(gateway_factory, upstream, backend_factory) -> None:
    backend = await backend_factory()
    config = routing(
        f"  - {{name: vl, upstreams: [{upstream.url}], accepts: [text, image], encode: {{image: v}}}}",
        extra=f"encoders:\n  v: {{kind: http, urls: [{backend.url}]}}\n",
    )
    gw = await gateway_factory(config)
    async with aiohttp.ClientSession() as session:
        image = {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(png()).decode()}}
        body = {"model": "vl", "messages": [{"role": "user", "content": [image]}]}
        async with session.post(f"{gw.url}/v1/chat/completions", json=body) as resp:
            assert resp.status == 200
        exported = ""
        for url in (gw.url, backend.url):
            async with session.get(f"{url}/metrics") as resp:
                exported += await resp.text()
    names = {line.split("{")[0].split(" ")[0] for line in exported.splitlines() if line and not line.startswith("#")}
    names |= {line.split()[2] for line in exported.splitlines() if line.startswith("# HELP ")}  # no series yet
    histograms = [
        line.split()[2] for line in exported.splitlines() if line.startswith("# TYPE ") and "histogram" in line
    ]
    names |= {f"{h}{suffix}" for h in histograms for suffix in ("_bucket", "_sum", "_count")}
    referenced = {m for q in dashboard_queries() + alert_queries() for m in METRIC.findall(q)}
    missing = sorted(m for m in referenced if m not in names)
    assert not missing, f"queries name metrics nobody exports: {missing}"

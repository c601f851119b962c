"""N gateways x M encoders, for real, on loopback (issue 10).

Two gateway processes read one routing.yaml from a ConfigMap-style directory; two encoder backend
processes (``kind: http``, the builtin tower on CPU) encode their images; the stand-in upstream is
the ``upstream`` fixture; one real Prometheus scrapes both gateways. The topology and its steps are
``tools/cluster_demo.py``'s (``make cluster-demo`` shows them to a human); these tests assert on
what the steps return.
"""

from __future__ import annotations

from pathlib import Path

import aiohttp
import pytest

from tests.conftest import Upstream, needs_encoder
from tests.images import png
from tests.test_prometheus import pytestmark as needs_prometheus
from tools.cluster_demo import (
    MODEL,
    NEW_MODEL,
    Cluster,
    edit_config,
    kill_one_encoder,
    query,
    samples,
    scrape,
    settled,
    spread,
    stream,
    total,
)

pytestmark = needs_encoder


def image(i: int) -> bytes:
    """The i-th image of a test: each its own color, so that no encoder answers from its cache."""
    return png((i % 256, i // 256 % 256, 7))


@needs_prometheus
async def test_two_gateways_spread_over_two_encoders_outlive_one_follow_a_configmap_edit_and_add_up_in_prometheus(
    upstream: Upstream, tmp_path: Path, record_property
) -> None:
    async with Cluster(tmp_path, upstream.url) as cluster, aiohttp.ClientSession() as session:
        config = cluster.config_dir
        assert Path(config / "routing.yaml").readlink() == Path("..data/routing.yaml")
        first_data = (config / "..data").readlink()
        assert first_data.name.startswith("..20")

        # 1. EPD requests through both gateways are encoded on both encoders
        result = await spread(session, cluster, image, count=16)
        assert [(r.status, r.encoded) for r in result.replies] == [(200, "1")] * 16, result.replies
        assert {r.gateway for r in result.replies} == {0, 1}
        assert all(result.images_by_encoder.values()), result.images_by_encoder  # each took some
        assert sum(result.images_by_encoder.values()) == 16  # each image encoded once, on one of them
        for received in upstream.received:
            assert [p["type"] for p in received.json()["messages"][0]["content"]] == ["text", "image_embeds"]

        # 2. an encoder dies (SIGKILL): the gateways go on with the other, and no request fails
        victim, survivor = cluster.encoders
        before = await total(session, survivor, "vision_encoder_images_total", result="ok")
        await cluster.kill(victim)
        await settled(victim)  # requests in flight on a dying encoder: the next test
        after_kill = await stream(session, cluster, MODEL, image, 24, first=100)
        assert [(r.status, r.encoded) for r in after_kill] == [(200, "1")] * 24, after_kill
        assert await total(session, survivor, "vision_encoder_images_total", result="ok") == before + 24
        for url in cluster.gateways:  # the dead one was never "answered" by anything but a refusal
            outcomes = await samples(session, url, "gateway_encoder_requests_total")
            assert {dict(k)["outcome"] for k, v in outcomes.items() if v} <= {"ok", "connect_error"}, outcomes

        # 3. the ConfigMap is edited as the kubelet does it: both gateways serve the new model
        swap = await edit_config(session, cluster, image, bound_s=10.0)  # raises past the bound
        print(
            f"\nConfigMap swap to {NEW_MODEL} live: " + ", ".join(f"{s * 1000:.0f} ms" for s in swap.seconds.values())
        )
        record_property("swap_to_live_ms", {cluster.service(u).name: round(s * 1000) for u, s in swap.seconds.items()})
        assert sorted(swap.seconds) == sorted(cluster.gateways)
        assert [(r.status, r.encoded) for r in swap.replies] == [(200, "1"), (200, "1")], swap.replies
        assert all(f"model={NEW_MODEL} " in r.content for r in swap.replies)
        assert (config / "..data").readlink() != first_data and not (config / first_data).exists()

        # 4. one Prometheus adds up both gateways' counters, series by series
        assert cluster.prometheus is not None
        scraped = await scrape(session, cluster, bound_s=20.0)
        for url in cluster.gateways:  # every request the tests sent, counted by the gateway it went to
            assert sum(scraped.own[url].values()) == cluster.sent[url]
        assert scraped.summed == scraped.expected_sums
        assert {tuple(v for _, v in key) for key in scraped.expected_sums} == {
            ("chat", "200", "-", MODEL),
            ("chat", "200", "-", NEW_MODEL),
            ("chat", "404", "-", "_unknown"),  # NEW_MODEL until each gateway had reloaded
        }
        per_instance = {(url, key): value for url, series in scraped.own.items() for key, value in series.items()}
        assert scraped.by_instance == per_instance
        up = await query(session, cluster.prometheus, 'up{job="gateway"}')
        assert sorted(("http://" + r["metric"]["instance"], r["value"][1]) for r in up or []) == sorted(
            (url, "1") for url in cluster.gateways
        )


@pytest.mark.skipif(
    not Path("/proc/net/tcp").exists(), reason="needs Linux's /proc/net/tcp to see a request wait in an encoder"
)
async def test_requests_in_flight_on_an_encoder_that_is_killed_are_encoded_on_the_other(
    upstream: Upstream, tmp_path: Path
) -> None:
    async with Cluster(tmp_path, upstream.url, prometheus=False) as cluster, aiohttp.ClientSession() as session:
        kill = await kill_one_encoder(session, cluster, image, count=32, kill_after=8)
    if not kill.waiting:  # not an expected failure: the case was not set up
        pytest.fail("no request was waiting in the frozen encoder when it was killed")
    assert len(kill.replies) == 32
    assert kill.failed == [], f"{len(kill.failed)} failed: {kill.failed}; encoder outcomes {kill.encoder_outcomes}"

"""vLLM's own encoder instances behind the gateway (encoders of ``kind: vllm``, gateway/encode/epd.py).

Real servers on loopback: stand-in encoder-only instances that record what they prime into a
cache shared with a stand-in ec_consumer, which refuses raw images mixed with embeddings (as
vLLM does) and records whether every ``image_embeds`` reference it got was primed first; the
real openai SDK as the client.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import aiohttp
import openai
import pytest

from gateway.config import parse_config
from gateway.errors import ConfigError
from gateway.server.state import SERVICES_KEY
from tests.conftest import Gateway, Upstream, error_body, free_port, needs_video, routing
from tests.images import data_url, flat_png
from tests.videos import video, video_part  # each skips without PyAV
from tools.standin import StandIn
from tools.vllm_epd import ConsumerLog, EncoderInstance, consumer, grid

pytestmark = pytest.mark.timeout(60)


@dataclass
class Cluster:
    encoders: list[EncoderInstance]
    encoder_urls: list[str]
    standin: StandIn
    log: ConsumerLog
    consumer_url: str


@pytest.fixture
async def cluster(upstream_factory: Callable[..., Awaitable[Upstream]]) -> Cluster:
    cache: set[str] = set()
    encoders = [EncoderInstance(f"enc-{i}", cache) for i in range(2)]
    urls = [(await upstream_factory(e.name, e.app())).url for e in encoders]
    standin, log = StandIn("pd"), ConsumerLog()
    pd = await upstream_factory("pd", consumer(standin, cache, log))
    return Cluster(encoders, urls, standin, log, pd.url)


def table(c: Cluster, *, options: str = "", encoder: str = "") -> str:
    urls = ", ".join(c.encoder_urls)
    encoders = f"encoders:\n  vision: {{kind: vllm, urls: [{urls}]{encoder}}}\n"
    model = (
        f"  - {{name: kimi, upstream_model: kimi-k3, upstreams: [{c.consumer_url}], accepts: [text, image], "
        f"encode: {{image: vision}}{options}}}"
    )
    return routing(model, extra=encoders)


def image(seed: int) -> bytes:
    return flat_png(8, 8, bytes([seed % 256, 7, 11]))


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def ask(*images: bytes, text: str = "what is this?") -> list[dict[str, Any]]:
    content: list[dict[str, Any]] = [{"type": "text", "text": text}]
    content += [{"type": "image_url", "image_url": {"url": data_url(i)}} for i in images]
    return [{"role": "user", "content": content}]


def parts_received(c: Cluster, n: int = -1) -> list[dict[str, Any]]:
    body = c.standin.received[n].json()
    return [p for m in body["messages"] if isinstance(m["content"], list) for p in m["content"]]


async def test_images_are_primed_on_the_encoders_and_reach_the_consumer_as_metadata(gateway_factory, cluster):
    gw: Gateway = await gateway_factory(table(cluster))
    images = [image(i) for i in range(6)]
    async with gw.client() as client:
        raw = await client.chat.completions.with_raw_response.create(model="kimi", messages=ask(*images))
    assert raw.headers["X-Gateway-Encoded"] == "6"
    primes = [p for e in cluster.encoders for p in e.primes]
    assert sorted(p.uuid for p in primes) == sorted(sha(i) for i in images)  # each once
    assert all(p.model == "kimi-k3" for p in primes)  # the model's upstream name
    assert all(p.url.startswith("data:image/png;base64,") for p in primes)
    parts = parts_received(cluster)
    assert parts[0] == {"type": "text", "text": "what is this?"}
    assert parts[1:] == [
        {"type": "image_embeds", "image_embeds": {"image_grid_thw": grid(sha(i))}, "uuid": sha(i)} for i in images
    ]  # metadata-only references, one level of nesting flattened, in the client's order
    assert cluster.log.misses == [] and len(cluster.log.hits) == 6  # every one primed before the consumer
    body = cluster.standin.received[-1].json()
    assert sorted(body["ec_transfer_params"]) == sorted(sha(i) for i in images)
    assert body["model"] == "kimi-k3"


async def test_the_same_image_always_goes_to_the_same_instance(gateway_factory, cluster):
    gw = await gateway_factory(table(cluster))
    images = [image(i) for i in range(16)]
    async with gw.client() as client:
        for _ in range(3):
            await client.chat.completions.create(model="kimi", messages=ask(*images))
    where: dict[str, set[str]] = {}
    for e in cluster.encoders:
        for p in e.primes:
            where.setdefault(p.uuid, set()).add(e.name)
    assert len(where) == 16 and all(len(names) == 1 for names in where.values())  # affinity: its cache hits
    assert all(e.primes for e in cluster.encoders)  # and the images spread over both


async def test_identical_images_in_one_request_are_primed_once(gateway_factory, cluster):
    gw = await gateway_factory(table(cluster))
    same = image(1)
    async with gw.client() as client:
        await client.chat.completions.create(model="kimi", messages=ask(same, same, same))
    assert [p.uuid for e in cluster.encoders for p in e.primes] == [sha(same)]
    assert [p["uuid"] for p in parts_received(cluster)[1:]] == [sha(same)] * 3


async def test_images_for_one_instance_go_together_up_to_max_batch_size(gateway_factory, cluster):
    gw = await gateway_factory(table(cluster, encoder=", max_batch_size: 2"))
    images = [image(i) for i in range(10)]
    async with gw.client() as client:
        await client.chat.completions.create(model="kimi", messages=ask(*images))
    for e in cluster.encoders:
        assert e.requests == -(-len(e.primes) // 2)  # ceil: groups of at most 2
    assert sum(len(e.primes) for e in cluster.encoders) == 10


async def test_processor_kwargs_go_to_the_encoders_too(gateway_factory, cluster):
    gw = await gateway_factory(table(cluster))
    kwargs = {"mm_processor_kwargs": {"max_pixels": 4096}, "media_io_kwargs": {"image": {"mode": "RGB"}}}
    async with gw.client() as client:
        await client.chat.completions.create(model="kimi", messages=ask(image(3)), extra_body=kwargs)
    (prime,) = [p for e in cluster.encoders for p in e.primes]
    assert prime.carried == kwargs  # both sides size the image alike
    assert cluster.standin.received[-1].json()["mm_processor_kwargs"] == {"max_pixels": 4096}


async def test_a_failing_instance_is_passed_over(gateway_factory, cluster):
    cluster.encoders[0].fail_status = 503
    gw = await gateway_factory(table(cluster))
    images = [image(i) for i in range(16)]
    async with gw.client() as client:
        await client.chat.completions.create(model="kimi", messages=ask(*images))
    assert sorted(p.uuid for p in cluster.encoders[1].primes) == sorted(sha(i) for i in images)
    assert cluster.log.misses == [] and len(cluster.log.hits) == 16
    assert gw.sample("gateway_encoder_requests_total", encoder="vision", outcome="overloaded") >= 1
    failing, working = cluster.encoder_urls
    assert gw.sample("gateway_encoder_backend_requests_total", backend=failing, outcome="overloaded") >= 1
    assert gw.sample("gateway_encoder_backend_requests_total", backend=working, outcome="ok") >= 1
    assert gw.sample("gateway_encoder_backend_seconds_count", encoder="vision", backend=working) >= 1


async def test_an_instance_that_answers_404_is_passed_over_not_blamed_on_the_client(gateway_factory, cluster):
    cluster.encoders[0].fail_status = 404  # e.g. serving another model name
    gw = await gateway_factory(table(cluster))
    async with gw.client() as client:
        await client.chat.completions.create(model="kimi", messages=ask(*(image(i) for i in range(4))))
    assert len(cluster.encoders[1].primes) == 4 and cluster.log.misses == []


async def test_numeric_metadata_goes_through(gateway_factory, cluster):
    for e in cluster.encoders:
        e.extra_metadata = {"num_tokens": 256}
    gw = await gateway_factory(table(cluster))
    async with gw.client() as client:
        await client.chat.completions.create(model="kimi", messages=ask(image(1)))
    (_, part) = parts_received(cluster)
    assert part["image_embeds"] == {"image_grid_thw": grid(sha(image(1))), "num_tokens": 256}


async def test_an_instance_that_is_not_listening_is_passed_over(gateway_factory, cluster):
    cluster.encoder_urls[0] = f"http://127.0.0.1:{free_port()}"
    gw = await gateway_factory(table(cluster))
    async with gw.client() as client:
        await client.chat.completions.create(model="kimi", messages=ask(*(image(i) for i in range(4))))
    assert len(cluster.encoders[1].primes) == 4 and cluster.log.misses == []


@pytest.mark.parametrize("fault", ["fail_status", "reset"])
async def test_every_instance_failing_is_a_503_with_on_encoder_error_fail(gateway_factory, cluster, fault):
    for e in cluster.encoders:
        setattr(e, fault, 500 if fault == "fail_status" else True)
    gw = await gateway_factory(table(cluster))
    async with gw.client() as client:
        with pytest.raises(openai.APIStatusError) as caught:
            await client.chat.completions.create(model="kimi", messages=ask(image(1)))
    assert caught.value.status_code == 503
    assert error_body(caught.value)["code"] == "encoder_unavailable"
    assert cluster.standin.received == []  # the consumer was never asked


async def test_every_instance_failing_forwards_the_media_with_passthrough(gateway_factory, cluster):
    for e in cluster.encoders:
        e.fail_status = 500
    gw = await gateway_factory(table(cluster, options=", on_encoder_error: passthrough"))
    async with gw.client() as client:
        await client.chat.completions.create(model="kimi", messages=ask(image(1), image(2)))
    parts = parts_received(cluster)
    assert [p["type"] for p in parts] == ["text", "image_url", "image_url"]  # the consumer encodes them itself
    assert gw.sample("gateway_encoder_passthrough_total", model="kimi", encoder="vision") == 1


async def test_without_metadata_every_image_goes_raw_with_its_uuid(gateway_factory, cluster):
    cluster.encoders[0].metadata = False  # an older vLLM on one instance
    gw = await gateway_factory(table(cluster))
    images = [image(i) for i in range(16)]
    async with gw.client() as client:
        await client.chat.completions.create(model="kimi", messages=ask(*images))
    assert cluster.encoders[0].primes, "the test needs images on the instance without metadata"
    parts = parts_received(cluster)[1:]
    assert [p["type"] for p in parts] == ["image_url"] * 16  # never mixed with embeddings
    assert [p["uuid"] for p in parts] == [sha(i) for i in images]  # the connector finds them by uuid
    assert cluster.log.raw_with_uuid == [sha(i) for i in images]


async def test_a_stream_is_relayed_after_priming(gateway_factory, cluster):
    gw = await gateway_factory(table(cluster))
    async with gw.client() as client:
        stream = await client.chat.completions.create(model="kimi", messages=ask(image(5)), stream=True)
        chunks = [c async for c in stream]
    assert chunks and chunks[-1].choices[0].finish_reason == "stop"
    assert cluster.log.hits == [sha(image(5))]


async def test_a_client_that_leaves_while_priming_cancels_the_primes(gateway_factory, cluster):
    for e in cluster.encoders:
        e.delay_s = 30.0
    gw = await gateway_factory(table(cluster))
    async with gw.client() as client:
        with pytest.raises(openai.APITimeoutError):
            await client.chat.completions.create(model="kimi", messages=ask(*(image(i) for i in range(4))), timeout=2.0)
    for _ in range(200):  # the gateway's handler is cancelled, its priming requests closed
        if sum(e.cancelled for e in cluster.encoders) == sum(e.requests for e in cluster.encoders):
            break
        await asyncio.sleep(0.01)
    assert sum(e.requests for e in cluster.encoders) >= 1
    assert sum(e.cancelled for e in cluster.encoders) == sum(e.requests for e in cluster.encoders)
    assert cluster.standin.received == []
    snapshot = gw.app[SERVICES_KEY].encoder._replicas.snapshot()
    assert [r["in_flight"] for r in snapshot] == [0, 0]  # every lease given back, started or not


def test_a_vllm_encoder_takes_urls_timeout_and_batch_size() -> None:
    config = parse_config(
        "version: 1\nencoders:\n  v: {kind: vllm, urls: ['http://e:8000'], max_batch_size: 4, timeout_s: 9}\n"
        "models:\n  - {name: m, upstreams: ['http://pd:8000'], accepts: [text, image], encode: {image: v}}\n"
    )
    spec = config.encoders["v"]
    assert (spec.kind, spec.urls, spec.max_batch_size, spec.timeout_s) == ("vllm", ("http://e:8000",), 4, 9.0)
    model = "models:\n  - {name: m, upstreams: ['http://pd:8000'], accepts: [text]}\n"
    default = parse_config(f"version: 1\nencoders:\n  v: {{kind: vllm, urls: ['http://e:8000']}}\n{model}")
    assert default.encoders["v"].max_batch_size == 8
    with pytest.raises(ConfigError) as caught:
        parse_config(f"version: 1\nencoders:\n  v: {{kind: vllm, model: x}}\n{model}", filename="r.yaml")
    text = str(caught.value)
    assert "'urls' is required for a vllm encoder" in text
    assert "encoders.v.model: unknown key 'model'" in text


async def test_requests_under_min_images_go_straight_to_the_engine(gateway_factory, cluster):
    gw = await gateway_factory(
        table(cluster, options="").replace("encode: {image: vision}", "encode: {image: vision, min_images: 2}")
    )
    async with gw.client() as client:
        one = await client.chat.completions.with_raw_response.create(model="kimi", messages=ask(image(1)))
        two = await client.chat.completions.with_raw_response.create(model="kimi", messages=ask(image(2), image(3)))
    assert "X-Gateway-Encoded" not in one.headers and two.headers["X-Gateway-Encoded"] == "2"
    assert sorted(p.uuid for e in cluster.encoders for p in e.primes) == sorted([sha(image(2)), sha(image(3))])
    first = [p for m in cluster.standin.received[0].json()["messages"] for p in m["content"]]
    assert [p["type"] for p in first] == ["text", "image_url"] and "uuid" not in first[1]  # raw, as sent
    assert gw.sample("gateway_encode_decisions_total", model="kimi", decision="direct") == 1
    assert gw.sample("gateway_encode_decisions_total", model="kimi", decision="encoded") == 1


@pytest.mark.parametrize(
    ("encode", "problem"),
    [
        ("{image: v, min_images: 0}", "models[0].encode.min_images: must be"),
        ("{min_images: 2}", "models[0].encode.min_images: min_images needs an image encoder"),
    ],
)
def test_min_images_is_checked(encode: str, problem: str) -> None:
    text = (
        "version: 1\nencoders:\n  v: {kind: vllm, urls: ['http://e:8000']}\n"
        f"models:\n  - {{name: m, upstreams: ['http://pd:8000'], accepts: [text, image], encode: {encode}}}\n"
    )
    with pytest.raises(ConfigError) as caught:
        parse_config(text, filename="r.yaml")
    assert problem in str(caught.value)


@pytest.mark.parametrize("stream", [False, True])
async def test_a_consumer_that_misses_an_embedding_gets_the_request_again_primed_again(
    gateway_factory, cluster, stream
):
    cluster.log.evict_next = 1  # evicted between priming and the consumer's load
    gw = await gateway_factory(table(cluster))
    async with gw.client() as client:
        if stream:
            chunks = [c async for c in await client.chat.completions.create(
                model="kimi", messages=ask(image(1), image(2)), stream=True)]  # fmt: skip
            assert chunks[-1].choices[0].finish_reason == "stop"
        else:
            reply = await client.chat.completions.create(model="kimi", messages=ask(image(1), image(2)))
            assert reply.choices[0].finish_reason == "stop"
    assert cluster.log.errors == 1  # the client saw none of it
    assert sum(len(e.primes) for e in cluster.encoders) == 4  # primed twice
    assert len(cluster.standin.received) == 1  # the middleware answered the first; the engine the second
    assert gw.sample("gateway_retries_total", model="kimi", reason="ec_error") == 1


async def test_a_consumer_that_misses_twice_is_answered_as_it_answered(gateway_factory, cluster):
    cluster.log.evict_next = 2
    gw = await gateway_factory(table(cluster))
    async with gw.client() as client:
        with pytest.raises(openai.InternalServerError):
            await client.chat.completions.create(model="kimi", messages=ask(image(1)))
    assert cluster.log.errors == 2  # once more, not more


async def test_readyz_shows_the_instances_their_kind_and_health(gateway_factory, cluster, monkeypatch):
    monkeypatch.setenv("GATEWAY_ADMIN_TOKEN", "s3cret")
    cluster.encoders[0].fail_status = 503
    gw = await gateway_factory(table(cluster))
    async with gw.client() as client:
        await client.chat.completions.create(model="kimi", messages=ask(*(image(i) for i in range(16))))
    async with aiohttp.ClientSession() as session:
        async with session.get(f"{gw.url}/readyz", headers={"Authorization": "Bearer s3cret"}) as resp:
            report = await resp.json()
    vision = report["encoders"]["vision"]
    assert (vision["kind"], vision["urls"]) == ("vllm", cluster.encoder_urls)
    health = {b["url"]: b for b in vision["backends"]}
    assert health[cluster.encoder_urls[0]]["breaker"] == "open"  # one failure: passed over from then on
    assert health[cluster.encoder_urls[1]]["breaker"] == "closed"


async def test_a_request_of_many_images_puts_each_where_it_would_go_alone(gateway_factory, cluster):
    gw = await gateway_factory(table(cluster))
    images = [image(i) for i in range(8)]
    async with gw.client() as client:
        await client.chat.completions.create(model="kimi", messages=ask(*images))
        for one in images:
            await client.chat.completions.create(model="kimi", messages=ask(one))
    where: dict[str, set[str]] = {}
    for e in cluster.encoders:
        for p in e.primes:
            where.setdefault(p.uuid, set()).add(e.name)
    assert all(len(names) == 1 for names in where.values()), where  # the load bound never split them


async def test_the_consumer_retry_keeps_to_retries_attempts(gateway_factory, cluster):
    cluster.log.evict_next = 1
    gw = await gateway_factory(table(cluster, options=", retries: {attempts: 0}"))
    async with gw.client() as client:
        with pytest.raises(openai.APIStatusError) as caught:
            await client.chat.completions.create(model="kimi", messages=ask(image(1)))
    assert caught.value.status_code == 502 and cluster.log.errors == 1
    assert gw.sample("gateway_retries_total", model="kimi", reason="ec_error") == 0


@needs_video
async def test_video_frames_are_primed_like_images_and_primed_again_after_a_miss(gateway_factory, cluster):
    """on_unsupported: {video: {frames: N}} with a vllm encoder: each frame is primed on the
    instance its uuid hashes to and reaches the consumer as a metadata-only reference; a consumer
    that lost them gets the request again with the frames primed again."""

    gw = await gateway_factory(table(cluster, options=", on_unsupported: {video: {frames: 3, max_side: 32}}"))
    content = [
        {"type": "text", "text": "what happens?"},
        {"type": "image_url", "image_url": {"url": data_url(image(1))}},
    ]
    messages = [{"role": "user", "content": [*content, video_part(video())]}]
    async with gw.client() as client:
        raw = await client.chat.completions.with_raw_response.create(model="kimi", messages=messages)
        assert raw.headers["X-Gateway-Encoded"] == "4" and raw.headers["X-Gateway-Route"] == "transcode"
        parts = parts_received(cluster)
        assert [p["type"] for p in parts] == ["text", "image_embeds"] + ["text", "image_embeds"] * 3
        frames = [p["uuid"] for p in parts[3::2]]
        assert len(set(frames)) == 3 and parts[1]["uuid"] == sha(image(1))
        primes = [p for e in cluster.encoders for p in e.primes]
        assert sorted(p.uuid for p in primes) == sorted([sha(image(1)), *frames])
        assert all(p.url.startswith("data:image/jpeg;base64,") for p in primes if p.uuid in frames)
        assert cluster.log.misses == [] and len(cluster.log.hits) == 4
        cluster.log.evict_next = 1
        await client.chat.completions.create(model="kimi", messages=messages)
    assert cluster.log.errors == 1
    assert parts_received(cluster) == parts  # the same frames, primed again
    assert gw.sample("gateway_retries_total", model="kimi", reason="ec_error") == 1


@needs_video
async def test_frames_are_not_held_to_the_image_limit_and_a_refused_frame_names_its_video(gateway_factory, cluster):
    """A video's frames are the gateway's own JPEGs: primed as they are (not decoded again from
    their data URLs, not held to media.max_image_bytes). A refused group is blamed on the part
    that carries its first image, not on the request's first image."""

    options = ", on_unsupported: {video: {frames: 3, max_side: 32}}"
    config = table(cluster, options=options, encoder=", max_batch_size: 1")
    gw = await gateway_factory(config.replace("models:", "media: {max_image_bytes: 200}\nmodels:", 1))
    png = image(1)
    assert len(png) < 200
    content = [{"type": "image_url", "image_url": {"url": data_url(png)}}, video_part(video(size=(320, 240)))]
    messages = [{"role": "user", "content": content}]
    async with gw.client() as client:
        await client.chat.completions.create(model="kimi", messages=messages)
        assert len([p for e in cluster.encoders for p in e.primes]) == 4  # frames far over 200 bytes
        for e in cluster.encoders:
            e.refuse_jpeg = True
        with pytest.raises(openai.BadRequestError) as caught:
            await client.chat.completions.create(model="kimi", messages=messages)
    error = error_body(caught.value)
    assert (error["code"], error["param"]) == ("invalid_image", "messages[0].content[1]")
    assert error["message"].startswith("messages[0].content[1]: a frame of the video: encoder 'vision' refused")
    assert gw.sample("gateway_modality_rejections_total", model="kimi", modality="video", reason="media_refused") == 1


# --- what an encoder instance answers is bounded (issue 20) ------------------------------------


@pytest.mark.parametrize(
    ("raw", "why"),
    [
        (b'"deep":' + b"[" * 300 + b"1" + b"]" * 300, "nested over 8 levels"),  # a 500: orjson writes 254 at most
        (b'"big":"' + b"x" * (3 << 20) + b'"', "a reply over"),  # 3 MB: a 27 MB consumer body, parsed on the loop
        (b'"big":"' + b"x" * (9 << 10) + b'"', "of 9"),  # one entry over its 8 KiB
    ],
    ids=["nested 300 levels", "3 MB reply", "9 KiB entry"],
)
async def test_an_instance_whose_reply_cannot_go_on_is_passed_over_never_a_500(gateway_factory, cluster, raw, why):
    bad, good = cluster.encoders
    bad.raw_metadata = raw
    gw = await gateway_factory(table(cluster))
    async with gw.client() as client:
        await client.chat.completions.create(model="kimi", messages=ask(*(image(i) for i in range(6))))
        body = cluster.standin.received[-1].body
        assert len(body) < 8 << 10  # what the good instance primed, as metadata
        for e in cluster.encoders:
            e.raw_metadata = raw
        with pytest.raises(openai.APIStatusError) as caught:
            await client.chat.completions.create(model="kimi", messages=ask(image(99)))
    assert caught.value.status_code == 503 and error_body(caught.value)["code"] == "encoder_unavailable"
    assert why in error_body(caught.value)["message"]
    assert bad.requests >= 1 and good.primes  # the bad one's images went to the good one
    assert cluster.log.misses == []


async def test_pdf_page_images_are_primed_like_images(gateway_factory, cluster):
    """A PDF's page images (on_unsupported: {file: {extract: {page_images: true}}}) go through
    the encoder with the request's own images: the consumer, which refuses raw images mixed with
    embeddings, gets references only."""
    import base64

    from tools import pdfs

    options = ", on_unsupported: {file: {extract: {page_images: true, dpi: 36}}}"
    gw = await gateway_factory(table(cluster, options=options))
    document = "data:application/pdf;base64," + base64.b64encode(pdfs.text_pdf(["one", "two"])).decode()
    messages = ask(image(1))
    messages[0]["content"].append({"type": "file", "file": {"filename": "a.pdf", "file_data": document}})
    async with gw.client() as client:
        raw = await client.chat.completions.with_raw_response.create(model="kimi", messages=messages)
    assert raw.headers["X-Gateway-Encoded"] == "3" and raw.headers["X-Gateway-Route"] == "extract"
    parts = parts_received(cluster)
    assert [p["type"] for p in parts] == ["text", "image_embeds"] + ["text", "image_embeds"] * 2
    primes = [p for e in cluster.encoders for p in e.primes]
    assert sum(p.url.startswith("data:image/png;base64,") for p in primes) == 3
    assert cluster.log.misses == [] and len(cluster.log.hits) == 3

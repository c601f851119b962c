"""Images encoded by the gateway, held to vLLM 0.33's own embedding path: the shipped
``qwen-vl-epd`` with a Qwen2.5-VL tower (built from a small config) through vLLM's chat parser and
its Qwen2-VL field factory; a LLaVA tower (vision tower and projector) through vLLM's LLaVA; the
bare CLIP tower's features refused there, as the docs say; Encode/Prefill/Decode's priming request
and the metadata-only consumer request through vLLM's parser, as an encoder instance and as an EC
consumer take them."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from tests.conformance.conftest import Engine
from tests.conftest import needs_encoder, routing
from tests.images import data_url, image_part, png
from tools.standin import StandIn
from tools.vllm_epd import ConsumerLog, EncoderInstance, consumer

pytestmark = [needs_encoder, pytest.mark.timeout(240)]
ROOT = Path(__file__).resolve().parent.parent.parent
OUT_HIDDEN = 48  # the small tower's merger width (tests/backends/test_towers.py QWEN_VISION)


async def test_the_shipped_qwen_vl_epd_with_a_qwen_tower_passes_vllms_qwen2_vl_embedding_path(
    gateway_factory, vllm, upstream_factory, tmp_path: Path
) -> None:
    from tests.backends.test_towers import save_qwen
    from tests.conformance.engines import vllm_side
    from tests.test_readme import _ready

    save_qwen(tmp_path / "qwen")
    engine: Engine = await vllm(engine=vllm_side.Engine(model="qwen2.5-vl", hidden_size=OUT_HIDDEN))
    text = (ROOT / "routing.yaml").read_text(encoding="utf-8")
    text = text.replace("model: builtin:vit-small", f"model: {tmp_path / 'qwen'}")
    for url in ("http://127.0.0.1:8000", "http://127.0.0.1:8001", "http://127.0.0.1:30000"):
        text = text.replace(url, engine.url if url.endswith("8000") else (await upstream_factory("other")).url)
    gw = await gateway_factory(text)
    await _ready(gw.url)
    images = [png(size=(56, 84)), png((10, 200, 10), size=(84, 56))]
    async with gw.client() as client:
        raw = await client.chat.completions.with_raw_response.create(
            model="qwen-vl-epd",
            messages=[{"role": "user", "content": [{"type": "text", "text": "what?"}, *map(image_part, images)]}],
        )
    assert raw.headers["X-Gateway-Encoded"] == "2"
    checked = engine.last()
    parts = [p for p in checked.body["messages"][0]["content"] if p["type"] == "image_embeds"]
    assert len(parts) == 2 and checked.found.counts == {"image": 2} and checked.found.embeds == {"image": 2}
    items = vllm_side.image_embeds(*(p["image_embeds"] for p in parts), engine=vllm_side.QWEN2_5_VL)
    for item in items:
        assert isinstance(item, dict)
        t, h, w = item["image_grid_thw"].tolist()
        assert item["image_embeds"].shape == (t * h * w // 4, OUT_HIDDEN)


async def _encoded_through_the_gateway(gateway_factory, engine: Engine, tower: Path, images: list[bytes]) -> Any:
    """A chat request with ``images`` to a model whose images ``tower`` encodes, sent to ``engine``:
    the body the engine received."""
    from tests.test_readme import _ready

    gw = await gateway_factory(
        routing(
            f"  - {{name: llava, upstreams: [{engine.url}], accepts: [text, image], encode: {{image: vision}}}}",
            extra=f"encoders:\n  vision: {{kind: local, model: {tower}, device: cpu}}\n",
        )
    )
    await _ready(gw.url)
    async with gw.client() as client:
        raw = await client.chat.completions.with_raw_response.create(
            model="llava",
            messages=[{"role": "user", "content": [{"type": "text", "text": "what?"}, *map(image_part, images)]}],
        )
    assert raw.headers["X-Gateway-Encoded"] == str(len(images))
    return engine.last()


async def test_a_llava_tower_makes_what_vllms_llava_reads_in_place_of_each_image(
    gateway_factory, vllm, tmp_path: Path
) -> None:
    """The LLaVA tower's rows are at the language model's width and one per placeholder token;
    vLLM's data parser (hidden size) and LLaVA's input schema take them."""
    from tests.backends.test_towers import save_llava
    from tests.conformance.engines import vllm_side

    save_llava(tmp_path / "llava")  # 32x32 images, 8-pixel patches, penultimate layer, no CLS: 16 rows of 48
    llava = vllm_side.Engine(model="llava-1.5", hidden_size=48)
    engine: Engine = await vllm(engine=llava)
    images = [png(size=(56, 84)), png((10, 200, 10), size=(84, 56))]
    checked = await _encoded_through_the_gateway(gateway_factory, engine, tmp_path / "llava", images)
    parts = [p for p in checked.body["messages"][0]["content"] if p["type"] == "image_embeds"]
    assert checked.found.counts == {"image": 2} and checked.found.embeds == {"image": 2}
    items = vllm_side.image_embeds(*(p["image_embeds"] for p in parts), engine=llava)
    assert [tuple(getattr(item, "shape", ())) for item in items] == [(16, 48), (16, 48)]  # bare tensors


async def test_a_bare_clip_towers_features_are_refused_by_vllms_llava(gateway_factory, vllm, tmp_path: Path) -> None:
    """What docs/encoder.md says: a CLIP tower's features are the vision width (32 here), before
    the model's projector; vLLM refuses them for a model whose language model is 48 wide, and the
    client gets vLLM's 400."""
    import openai

    from tests.backends.test_towers import save_clip
    from tests.conformance.engines import vllm_side

    save_clip(tmp_path / "clip")
    engine: Engine = await vllm(engine=vllm_side.Engine(model="llava-1.5", hidden_size=48))
    with pytest.raises(openai.BadRequestError, match=r"hidden dimension mismatch: got 32, but model expects 48"):
        await _encoded_through_the_gateway(gateway_factory, engine, tmp_path / "clip", [png(size=(32, 32))])
    (refusal,) = engine.refusals()
    assert isinstance(refusal.refused, vllm_side.Refused) and refusal.refused.stage == "processor"


async def test_epd_priming_and_the_metadata_only_consumer_request_are_what_vllm_takes(
    gateway_factory, upstream_factory
) -> None:
    from tests.conformance.engines import vllm_side

    cache: set[str] = set()
    primes: list[Any] = []

    @web.middleware
    async def held_to_vllm(request: web.Request, handler: Any) -> web.StreamResponse:
        body = await request.json()
        primes.append(vllm_side.chat(body, engine=vllm_side.QWEN2_5_VL))  # raises: the test fails
        return await handler(request)

    instance = EncoderInstance("enc", cache)
    app = instance.app()
    app.middlewares.append(held_to_vllm)
    encoder = await upstream_factory("enc", app)
    standin, log = StandIn("pd"), ConsumerLog()
    consumer_engine = vllm_side.Engine(model="qwen2.5-vl", ec_consumer=True)
    received: list[Any] = []

    def check(path: str, body: Any) -> str | None:
        try:
            received.append(vllm_side.chat(body, engine=consumer_engine))
        except vllm_side.Refused as refused:
            return str(refused)
        return None

    standin.check = check
    pd = await upstream_factory("pd", consumer(standin, cache, log))
    gw = await gateway_factory(
        routing(
            f"  - {{name: kimi, upstream_model: kimi-k3, upstreams: [{pd.url}], accepts: [text, image], "
            "encode: {image: vision}}",
            extra=f"encoders:\n  vision: {{kind: vllm, urls: [{encoder.url}]}}\n",
        )
    )
    images = [png(size=(28 * i, 28)) for i in (1, 2, 3)]
    async with gw.client() as client:
        await client.chat.completions.create(
            model="kimi", messages=[{"role": "user", "content": [image_part(i) for i in images]}]
        )
    assert [p.counts for p in primes] == [{"image": 3}]  # one priming request of the three images
    assert primes[0].uuids["image"] == tuple(hashlib.sha256(i).hexdigest() for i in images)
    (found,) = received
    assert found.counts == {"image": 3} and found.uuid_only == 0
    assert log.misses == [] and data_url(images[0]) not in standin.received[-1].body.decode()

"""routing.yaml edits take effect without a restart: file watching, POST /admin/reload, SIGHUP."""

from __future__ import annotations

import asyncio
import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

from gateway.server.state import SERVICES_KEY
from tests.conftest import Gateway, Upstream, routing
from tests.images import png

TOKEN_ENV = "MODALITY_GATEWAY_TEST_ADMIN_TOKEN"


def one_model(url: str, name: str = "m", accepts: str = "[text]", interval: float = 0) -> str:
    return routing(
        f"  - {{name: {name}, upstreams: [{url}], accepts: {accepts}}}",
        server=f"{{admin_token_env: {TOKEN_ENV}, reload_interval_s: {interval}}}",
    )


async def post_reload(gw: Gateway, token: str | None) -> tuple[int, dict[str, Any]]:
    headers = {"Authorization": f"Bearer {token}"} if token is not None else {}
    async with aiohttp.ClientSession() as session:
        async with session.post(f"{gw.url}/admin/reload", headers=headers) as resp:
            return resp.status, await resp.json()


async def models(gw: Gateway) -> list[str]:
    async with gw.client() as client:
        return [m.id for m in (await client.models.list()).data]


async def test_admin_reload_is_disabled_without_a_token(gateway_factory, upstream, monkeypatch) -> None:
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    gw = await gateway_factory(one_model(upstream.url), write_file=True)
    status, body = await post_reload(gw, "anything")
    assert status == 403
    assert body["error"]["code"] == "admin_disabled" and TOKEN_ENV in body["error"]["message"]


async def test_admin_reload_needs_the_right_token(gateway_factory, upstream, monkeypatch) -> None:
    monkeypatch.setenv(TOKEN_ENV, "s3cret")
    gw = await gateway_factory(one_model(upstream.url), write_file=True)
    assert (await post_reload(gw, None))[0] == 401
    status, body = await post_reload(gw, "wrong")
    assert status == 401 and body["error"]["code"] == "invalid_admin_token"


async def test_admin_reload_swaps_in_the_new_table(gateway_factory, upstream, monkeypatch, tmp_path) -> None:
    monkeypatch.setenv(TOKEN_ENV, "s3cret")
    gw = await gateway_factory(one_model(upstream.url), write_file=True)
    (tmp_path / "routing.yaml").write_text(one_model(upstream.url, name="n", accepts="[text, image]"))
    status, body = await post_reload(gw, "s3cret")
    assert (status, body) == (200, {"status": "reloaded", "config_generation": 2, "models": 1})
    assert await models(gw) == ["n"]
    assert gw.sample("gateway_config_reloads_total", result="success") == 1
    assert gw.sample("gateway_config_generation") == 2


async def test_an_invalid_edit_keeps_the_running_table(gateway_factory, upstream, monkeypatch, tmp_path) -> None:
    monkeypatch.setenv(TOKEN_ENV, "s3cret")
    gw = await gateway_factory(one_model(upstream.url), write_file=True)
    (tmp_path / "routing.yaml").write_text(one_model(upstream.url, accepts="[text, vidoe]"))
    status, body = await post_reload(gw, "s3cret")
    assert status == 422
    assert body["error"]["code"] == "invalid_config"
    assert "models[0].accepts[1]: unknown modality 'vidoe'" in body["error"]["message"]
    assert await models(gw) == ["m"]
    assert gw.sample("gateway_config_reloads_total", result="failure") == 1
    async with gw.client() as client:  # still serving on the old table
        await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])


async def test_an_edited_file_is_picked_up_by_the_watcher(gateway_factory, upstream, tmp_path) -> None:
    gw = await gateway_factory(one_model(upstream.url, interval=0.05), write_file=True, watch=True)
    (tmp_path / "routing.yaml").write_text(one_model(upstream.url, name="fresh", interval=0.05))
    for _ in range(400):  # bounded: 4 s at most
        if gw.config.model("fresh"):
            break
        await asyncio.sleep(0.01)
    assert await models(gw) == ["fresh"]
    assert gw.sample("gateway_config_generation") == 2


async def test_the_watcher_skips_a_broken_edit_and_takes_the_next(gateway_factory, upstream, tmp_path) -> None:
    gw = await gateway_factory(one_model(upstream.url, interval=0.05), write_file=True, watch=True)
    path = tmp_path / "routing.yaml"
    path.write_text("version: 1\nmodels: [")
    for _ in range(400):
        if gw.sample("gateway_config_reloads_total", result="failure"):
            break
        await asyncio.sleep(0.01)
    assert gw.sample("gateway_config_reloads_total", result="failure") == 1
    assert gw.config.model("m") is not None
    path.write_text(one_model(upstream.url, name="fixed", interval=0.05))
    for _ in range(400):
        if gw.config.model("fixed"):
            break
        await asyncio.sleep(0.01)
    assert gw.config.model("fixed") is not None


async def test_reload_without_a_file_is_a_clear_400(gateway_factory, upstream, monkeypatch) -> None:
    monkeypatch.setenv(TOKEN_ENV, "s3cret")
    gw = await gateway_factory(one_model(upstream.url))
    status, body = await post_reload(gw, "s3cret")
    assert status == 400 and "without a config file" in body["error"]["message"]


@dataclass
class HeldImage:
    """A media server whose images are held until ``release`` (``/cat.png``; ``/redirect.png``
    then redirects to ``localhost``, a name the resolver checks), an encoder backend, an upstream."""

    media: Upstream
    encoder: Upstream
    upstream: Upstream
    fetching: asyncio.Event
    release: asyncio.Event

    def body(self, path: str) -> dict[str, Any]:
        part = {"type": "image_url", "image_url": {"url": f"{self.media.url}{path}"}}
        return {"model": "m", "messages": [{"role": "user", "content": [part]}]}

    def table(self, *, media: str = "media: {allow_private_networks: true}\n", encode: bool = True) -> str:
        server = f"server: {{admin_token_env: {TOKEN_ENV}, reload_interval_s: 0}}\n"
        if not encode:
            model = f"  - {{name: m, upstreams: [{self.upstream.url}], accepts: [text, image]}}\n"
            return f"version: 1\n{server}{media}models:\n{model}"
        return (
            f"version: 1\n{server}{media}encoders:\n  enc: {{kind: http, urls: [{self.encoder.url}]}}\nmodels:\n"
            f"  - {{name: m, upstreams: [{self.upstream.url}], accepts: [text, image], encode: {{image: enc}}}}\n"
        )


async def held_image(upstream_factory: Any) -> HeldImage:
    fetching, release = asyncio.Event(), asyncio.Event()

    async def held(request: web.Request) -> web.Response:
        fetching.set()
        await release.wait()
        if request.path == "/redirect.png":
            raise web.HTTPFound(f"http://localhost:{request.url.port}/image.png")
        return web.Response(body=png(), content_type="image/png")

    async def image(request: web.Request) -> web.Response:
        return web.Response(body=png(), content_type="image/png")

    async def encode(request: web.Request) -> web.Response:
        await request.read()
        return web.json_response({"image_embeds": "QUFB"})

    media_app, encoder_app = web.Application(), web.Application()
    media_app.router.add_get("/cat.png", held)
    media_app.router.add_get("/redirect.png", held)
    media_app.router.add_get("/image.png", image)
    encoder_app.router.add_post("/v1/encode", encode)
    media, encoder = await upstream_factory("media", media_app), await upstream_factory("enc", encoder_app)
    return HeldImage(media, encoder, await upstream_factory("up"), fetching, release)


async def test_a_reload_between_admission_and_encoding_does_not_pull_the_encoder_away(
    gateway_factory, upstream_factory, monkeypatch
) -> None:
    # The request holds the config it was admitted under; a reload that removes its encoder while
    # its image is still being fetched used to make it a 500 (KeyError in the encoder client).
    monkeypatch.setenv(TOKEN_ENV, "s3cret")
    held = await held_image(upstream_factory)
    gw = await gateway_factory(held.table(), write_file=True)
    async with aiohttp.ClientSession() as session:
        request = asyncio.create_task(session.post(f"{gw.url}/v1/chat/completions", json=held.body("/cat.png")))
        await held.fetching.wait()  # admitted, encoder chosen, image on its way
        (Path(gw.config.source)).write_text(held.table(encode=False))
        assert (await post_reload(gw, "s3cret"))[0] == 200
        assert gw.config.encoders == {}
        held.release.set()
        async with await request as resp:
            assert resp.status == 200, await resp.text()
            assert resp.headers["X-Gateway-Encoded"] == "1"
    assert held.upstream.received[0].json()["messages"][0]["content"][0]["type"] == "image_embeds"


async def test_a_reload_that_tightens_the_media_rules_leaves_a_fetch_under_way_its_own(
    gateway_factory, upstream_factory, monkeypatch
) -> None:
    # The fetcher's rules were swapped by a listener on every reload, behind the requests'
    # snapshots: an image admitted under allow_private_networks: true whose redirect came after
    # a reload to false was refused (400 media_refused), the redirect resolved under the new rules.
    monkeypatch.setenv(TOKEN_ENV, "s3cret")
    held = await held_image(upstream_factory)
    gw = await gateway_factory(held.table(), write_file=True)
    body = held.body("/redirect.png")
    async with aiohttp.ClientSession() as session:
        request = asyncio.create_task(session.post(f"{gw.url}/v1/chat/completions", json=body))
        await held.fetching.wait()  # admitted, its image on its way
        (Path(gw.config.source)).write_text(held.table(media=""))  # private networks refused
        assert (await post_reload(gw, "s3cret"))[0] == 200
        assert not gw.config.media.allow_private_networks
        held.release.set()
        async with await request as resp:
            assert resp.status == 200, await resp.text()
            assert resp.headers["X-Gateway-Encoded"] == "1"
        # a request admitted under the new rules is held to them
        async with session.post(f"{gw.url}/v1/chat/completions", json=body) as resp:
            assert resp.status == 400 and (await resp.json())["error"]["code"] == "media_refused"


async def test_fifty_reloads_under_load_fail_no_request(gateway_factory, upstream_factory, tmp_path) -> None:
    a, b = await upstream_factory("a"), await upstream_factory("b")
    configs = [
        one_model(a.url),
        routing(f"  - {{name: m, upstreams: [{a.url}, {b.url}], accepts: [text, image], balance: round_robin}}"),
        one_model(b.url, accepts="[text, image]"),
    ]
    gw = await gateway_factory(configs[0], write_file=True)
    store = gw.app[SERVICES_KEY].store
    done = asyncio.Event()

    async def load() -> list[int]:
        statuses: list[int] = []
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}
        async with aiohttp.ClientSession() as session:

            async def one() -> None:
                while not done.is_set():
                    async with session.post(f"{gw.url}/v1/chat/completions", json=body) as resp:
                        await resp.read()
                        statuses.append(resp.status)

            await asyncio.gather(*(one() for _ in range(6)))
        return statuses

    running = asyncio.create_task(load())
    for i in range(50):
        (tmp_path / "routing.yaml").write_text(configs[(i + 1) % len(configs)])
        await store.reload()
        await asyncio.sleep(0.005)  # let requests through between reloads
    done.set()
    statuses = await running
    assert store.generation == 51
    assert len(statuses) > 50 and set(statuses) == {200}
    assert gw.sample("gateway_config_reloads_total", result="success") == 50
    assert len(a.received) > 0 and len(b.received) > 0


async def test_config_info_names_the_live_file_by_its_sha256(gateway_factory, upstream, tmp_path) -> None:
    first = one_model(upstream.url)
    gw = await gateway_factory(first, write_file=True)
    assert gw.sample("gateway_config_info", sha256=hashlib.sha256(first.encode()).hexdigest()) == 1
    second = one_model(upstream.url, name="n")
    (tmp_path / "routing.yaml").write_text(second)
    await gw.app[SERVICES_KEY].store.reload()
    assert gw.sample("gateway_config_info", sha256=hashlib.sha256(second.encode()).hexdigest()) == 1
    assert (
        gw.registry.get_sample_value("gateway_config_info", {"sha256": hashlib.sha256(first.encode()).hexdigest()})
        is None
    )


async def test_admin_config_shows_the_effective_config_to_the_admin_only(
    gateway_factory, upstream, monkeypatch
) -> None:
    monkeypatch.setenv(TOKEN_ENV, "s3cret")
    monkeypatch.setenv("MODALITY_GATEWAY_TEST_UPSTREAM_KEY", "sk-upstream-secret")
    text = routing(
        f"  - {{name: m, upstreams: [{upstream.url}, {{url: http://127.0.0.1:9, weight: 3}}], accepts: [text],"
        " api_key_env: MODALITY_GATEWAY_TEST_UPSTREAM_KEY, on_unsupported: {image: strip}}",
        server=f"{{admin_token_env: {TOKEN_ENV}, reload_interval_s: 0}}",
    )
    gw = await gateway_factory(text)
    async with aiohttp.ClientSession() as session:
        async with session.get(f"{gw.url}/admin/config") as resp:
            assert resp.status == 401
        async with session.get(f"{gw.url}/admin/config", headers={"Authorization": "Bearer s3cret"}) as resp:
            assert resp.status == 200
            raw = await resp.text()
            shown = await resp.json()
    assert "sk-upstream-secret" not in raw and "s3cret" not in raw
    assert shown["config_generation"] == 1 and shown["sha256"] == hashlib.sha256(text.encode()).hexdigest()
    model = shown["config"]["models"][0]
    assert model["upstreams"] == [{"url": upstream.url, "weight": 1}, {"url": "http://127.0.0.1:9", "weight": 3}]
    assert model["api_key_env"] == "MODALITY_GATEWAY_TEST_UPSTREAM_KEY"
    assert model["on_unsupported"] == {"image": "strip"} and model["accepts"] == ["text"]
    assert model["retries"]["on_status"] == [429, 502, 503, 504] and model["breaker"]["failures"] == 5
    assert shown["config"]["server"]["reload_interval_s"] == 0


async def test_the_admin_token_is_a_bearer_token_whatever_the_schemes_case(gateway_factory, upstream, monkeypatch):
    monkeypatch.setenv(TOKEN_ENV, "s3cret")
    gw = await gateway_factory(one_model(upstream.url))
    async with aiohttp.ClientSession() as session:
        for header, status in (("Bearer s3cret", 200), ("bearer s3cret", 200), ("s3cret", 401), ("Basic s3cret", 401)):
            async with session.get(f"{gw.url}/admin/config", headers={"Authorization": header}) as resp:
                assert resp.status == status, header


async def test_an_unknown_expect_header_is_a_417_in_the_openai_shape_on_every_route(gateway_factory, upstream):
    gw = await gateway_factory(one_model(upstream.url))
    async with aiohttp.ClientSession() as session:
        for path in ("/healthz", "/readyz", "/v1/models", "/metrics", "/admin/config"):
            async with session.get(f"{gw.url}{path}", headers={"Expect": "teapot"}) as resp:
                assert resp.status == 417, path
                assert (await resp.json())["error"]["code"] == "http_417"
                assert "X-Request-Id" in resp.headers


async def test_an_admin_token_of_any_bytes_is_a_401_not_a_500(gateway_factory, upstream, monkeypatch) -> None:
    monkeypatch.setenv(TOKEN_ENV, "s3cret")
    gw = await gateway_factory(one_model(upstream.url))
    for path, status in ((b"/readyz", b"200"), (b"/admin/config", b"401")):
        reader, writer = await asyncio.open_connection(gw.server.host, gw.server.port)
        writer.write(
            b"GET " + path + b" HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer \xff\xfe\r\nConnection: close\r\n\r\n"
        )
        async with asyncio.timeout(10):
            answer = await reader.read()
        writer.close()
        assert answer.split(b" ")[1] == status, answer[:200]

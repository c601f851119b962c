"""API keys: who may come in, which models each key sees, and each key's limits (OpenAI SDK end to end)."""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path

import aiohttp
import openai
import pytest
from aiohttp import web

from gateway.config import parse_config
from gateway.errors import ConfigError
from gateway.server.state import SERVICES_KEY
from tests.conftest import Gateway, error_body, routing

HI = [{"role": "user", "content": "hi"}]
TEAM_A, TEAM_B = "sk-team-a-0123456789", "sk-team-b-9876543210"
ENV_A = "MODALITY_GATEWAY_TEST_KEY_A"


def with_auth(upstream_url: str, keys: str, *, models: tuple[str, ...] = ("m", "qwen-7b", "qwen-72b", "secret")) -> str:
    blocks = [f"  - {{name: {m}, upstreams: [{upstream_url}], accepts: [text]}}" for m in models]
    return routing(*blocks, extra=f"auth:\n  keys:\n{keys}\n", server="{reload_interval_s: 0}")


def key_a(**extra: str) -> str:
    more = "".join(f", {k}: {v}" for k, v in extra.items())
    return f"    - {{name: team-a, key_env: {ENV_A}{more}}}"


def key_b(**extra: str) -> str:
    more = "".join(f", {k}: {v}" for k, v in extra.items())
    return f"    - {{name: team-b, key_sha256: {hashlib.sha256(TEAM_B.encode()).hexdigest()}{more}}}"


def client(gw: Gateway, key: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{gw.url}/v1", api_key=key, max_retries=0)


def digest(name: str) -> str:
    return hashlib.sha256(name.encode()).hexdigest()


@pytest.fixture(autouse=True)
def _key_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_A, TEAM_A)


async def test_a_key_from_the_environment_or_by_its_sha256_lets_a_client_in(gateway_factory, upstream) -> None:
    gw = await gateway_factory(with_auth(upstream.url, f"{key_a()}\n{key_b()}"))
    for key in (TEAM_A, TEAM_B):
        async with client(gw, key) as c:
            reply = await c.chat.completions.create(model="m", messages=HI)
        assert (reply.choices[0].message.content or "").startswith("[up] model=m")
    assert gw.sample("gateway_requests_total", model="m", code="200", key="team-a") == 1
    assert gw.sample("gateway_requests_total", model="m", code="200", key="team-b") == 1


async def test_no_key_and_a_wrong_key_are_the_same_401(gateway_factory, upstream) -> None:
    gw = await gateway_factory(with_auth(upstream.url, key_a()))
    for key in ("sk-wrong", TEAM_A + "x"):
        async with client(gw, key) as c:
            with pytest.raises(openai.AuthenticationError) as caught:
                await c.chat.completions.create(model="m", messages=HI)
        assert caught.value.status_code == 401
        body = error_body(caught.value)
        assert body["code"] == "invalid_api_key" and body["type"] == "authentication_error"
        assert key not in str(body)
    async with aiohttp.ClientSession() as session:
        for path in ("/v1/models", "/v1/chat/completions"):  # no key at all
            async with session.request("GET" if path == "/v1/models" else "POST", f"{gw.url}{path}") as resp:
                assert resp.status == 401 and (await resp.json())["error"]["code"] == "invalid_api_key"
        async with session.get(f"{gw.url}/v1/models", headers={"Authorization": f"Basic {TEAM_A}"}) as resp:
            assert resp.status == 401  # only Bearer
        async with session.get(f"{gw.url}/healthz") as resp:
            assert resp.status == 200  # health needs no key
    assert gw.sample("gateway_auth_failures_total", reason="missing") == 2
    assert gw.sample("gateway_auth_failures_total", reason="invalid") == 3  # a Basic header is a wrong one


async def test_a_401_and_a_400_are_final_for_the_openai_sdk_a_429_is_not(gateway_factory, upstream) -> None:
    """``x-should-retry: false`` on what a retry would get again: the openai SDK, retries on,
    sends a wrong key once; a 429 keeps the SDK's own choice (no header)."""
    gw = await gateway_factory(with_auth(upstream.url, key_a()))
    async with openai.AsyncOpenAI(base_url=f"{gw.url}/v1", api_key="sk-wrong", max_retries=3) as c:
        with pytest.raises(openai.AuthenticationError) as caught:
            await c.chat.completions.create(model="m", messages=HI)
    assert caught.value.response.headers["x-should-retry"] == "false"
    assert gw.sample("gateway_auth_failures_total", reason="invalid") == 1
    async with aiohttp.ClientSession() as session:
        async with session.post(
            f"{gw.url}/v1/chat/completions", data=b"{", headers={"Authorization": f"Bearer {TEAM_A}"}
        ) as resp:
            assert resp.status == 400 and resp.headers["x-should-retry"] == "false"
    assert not upstream.received


async def test_a_key_sees_only_its_models_and_others_are_404_as_if_absent(gateway_factory, upstream) -> None:
    gw = await gateway_factory(with_auth(upstream.url, f"{key_a(models='[m, qwen-*]')}\n{key_b()}"))
    async with client(gw, TEAM_A) as c:
        assert [m.id for m in (await c.models.list()).data] == ["m", "qwen-7b", "qwen-72b"]
        await c.chat.completions.create(model="qwen-72b", messages=HI)
        errors = []
        for name in ("secret", "no-such-model"):
            with pytest.raises(openai.NotFoundError) as caught:
                await c.chat.completions.create(model=name, messages=HI)
            errors.append(error_body(caught.value))
        with pytest.raises(openai.NotFoundError):
            await c.completions.create(model="secret", prompt="hi")
    assert [e["code"] for e in errors] == ["model_not_found"] * 2
    assert "secret" not in errors[1]["message"]  # the list of models names only the key's
    assert errors[0]["message"].replace("secret", "X") == errors[1]["message"].replace("no-such-model", "X")
    assert gw.sample("gateway_requests_total", model="_unknown", code="404", key="team-a") == 3
    async with client(gw, TEAM_B) as c:  # no models list: every model
        assert len((await c.models.list()).data) == 4


async def test_a_keys_headers_win_over_an_engines_own(gateway_factory, upstream_factory) -> None:
    """An engine that answers with x-ratelimit-* of its own (a hosted API behind the gateway):
    the client's limits are its key's at the gateway, whole or streamed."""

    async def engine(request: web.Request) -> web.StreamResponse:
        own = {"x-ratelimit-remaining-requests": "7", "x-ratelimit-limit-tokens": "5"}
        asked = await request.json()
        if asked.get("user") == "refuse":  # the engine's own 429: its own word on when to come back
            error = {"error": {"message": "slow down", "type": "rate_limit_error", "code": None, "param": None}}
            return web.json_response(error, status=429, headers=own)
        if asked.get("stream"):
            response = web.StreamResponse(headers={"Content-Type": "text/event-stream", **own})
            await response.prepare(request)
            await response.write(b"data: [DONE]\n\n")
            return response
        body = {"id": "x", "object": "chat.completion", "created": 0, "model": "m", "choices": []}
        if asked.get("user") == "large":  # sent by aiohttp once the handler returns, not at once by the relay
            body["padding"] = "x" * 40_000
        return web.json_response(body, headers=own)

    app = web.Application()
    app.router.add_post("/v1/chat/completions", engine)
    up = await upstream_factory("engine", app)
    limits = "{requests_per_minute: 60, burst: 10, tokens_per_minute: 1000}"
    gw = await gateway_factory(with_auth(up.url, key_a(rate_limit=limits)))
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {TEAM_A}"}) as session:
        for stream in (False, True):
            body = {"model": "m", "messages": HI, "stream": stream}
            async with session.post(f"{gw.url}/v1/chat/completions", json=body) as resp:
                assert resp.status == 200
                assert resp.headers["x-ratelimit-remaining-requests"] == (
                    "9" if not stream else "7"
                )  # (the 429 between spent one too)
                assert resp.headers["x-ratelimit-limit-tokens"] == "1000"
                assert len(resp.headers.getall("x-ratelimit-remaining-requests")) == 1
            async with session.post(f"{gw.url}/v1/chat/completions", json={**body, "user": "refuse"}) as resp:
                assert resp.status == 429 and resp.headers["x-ratelimit-remaining-requests"] == "7"
                assert resp.headers["x-ratelimit-limit-tokens"] == "5"  # the engine's, streamed or not
        large = {"model": "m", "messages": HI, "user": "large"}
        async with session.post(f"{gw.url}/v1/chat/completions", json=large) as resp:
            assert resp.status == 200 and len(await resp.read()) > 40_000
            assert resp.headers["x-ratelimit-limit-tokens"] == "1000" and resp.headers["X-Request-Id"]


async def test_a_budget_a_reload_took_away_is_not_spent_and_is_full_if_it_comes_back() -> None:
    from gateway.admission.auth import KeyLimits
    from gateway.config import ApiKey, RateLimit

    now = [0.0]
    limits = KeyLimits(clock=lambda: now[0])
    both = ApiKey("k", key_sha256="0" * 64, rate_limit=RateLimit(None, 1, tokens_per_minute=1000, tokens_per_day=1e7))
    day_only = ApiKey("k", key_sha256="0" * 64, rate_limit=RateLimit(None, 1, tokens_per_day=1e7))
    _, slot = await limits.admit(both)
    limits.finish(both, 10, slot)
    for _ in range(10):  # reloaded without tokens_per_minute: replies spend the day's budget only
        now[0] += 60
        _, slot = await limits.admit(day_only)
        limits.finish(day_only, 100_000, slot)
    now[0] += 60  # tokens_per_minute back
    headers, _ = await limits.admit(both)
    assert headers["x-ratelimit-remaining-tokens"] == "1000"
    assert int(headers["x-ratelimit-remaining-tokens-day"]) < 1e7 - 900_000


async def test_a_reload_that_lowers_a_rate_takes_nothing_back_from_before_it() -> None:
    """What a key earned before a reload, at the rate it had then, is kept: the new rate counts
    from the reload on (it was applied to the whole time since the key's last request)."""
    from gateway.admission.auth import KeyLimits
    from gateway.config import ApiKey, RateLimit
    from gateway.errors import RateLimitedError

    now = [0.0]
    limits = KeyLimits(clock=lambda: now[0])
    fast = ApiKey("k", key_sha256="0" * 64, rate_limit=RateLimit(60.0, 10))  # one a second, 10 at once
    slow = ApiKey("k", key_sha256="0" * 64, rate_limit=RateLimit(6.0, 10))  # the same key reloaded: one in 10 s
    for _ in range(10):
        await limits.admit(fast)
    with pytest.raises(RateLimitedError):
        await limits.admit(fast)  # empty
    now[0] = 5.0  # 5 earned at one a second; then the reload
    headers, _ = await limits.admit(slow)
    assert headers["x-ratelimit-remaining-requests"] == "4"  # at 0.1 a second it would have been refused
    for _ in range(4):
        await limits.admit(slow)
    now[0] = 10.0  # from the reload on: 5 s at 0.1 a second, half a request
    with pytest.raises(RateLimitedError):
        await limits.admit(slow)


async def test_a_request_admitted_before_a_reload_and_ending_after_it_brings_no_old_rate_back() -> None:
    from gateway.admission.auth import KeyLimits
    from gateway.config import ApiKey, RateLimit
    from gateway.errors import RateLimitedError

    now = [0.0]
    limits = KeyLimits(clock=lambda: now[0])
    fast = ApiKey("k", key_sha256="0" * 64, rate_limit=RateLimit(600.0, 10, tokens_per_minute=1e9))
    slow = ApiKey("k", key_sha256="0" * 64, rate_limit=RateLimit(6.0, 10, tokens_per_minute=1e9))
    _, slot = await limits.admit(fast)  # a long stream, admitted at 10 a second
    for _ in range(9):
        await limits.admit(fast)
    with pytest.raises(RateLimitedError):
        await limits.admit(slow)  # reloaded: its first request settles the key (empty, 0.1 a second from now)
    limits.finish(fast, 100, slot)  # the stream ends, admitted under the old limits
    limits.check_tokens(fast)
    now[0] = 1.0  # one second at 0.1 a second: nothing to admit (at the old rate, 10)
    with pytest.raises(RateLimitedError):
        await limits.admit(slow)


async def test_a_reload_settles_each_key_when_it_happens_not_at_its_next_request() -> None:
    """The store's reload settles every key at once: the time after the reload counts at the new
    rate even for a key idle since before it."""
    from gateway.admission.auth import KeyLimits
    from gateway.config import parse_config as parse

    def table(rpm: int) -> str:
        return (
            "version: 1\nauth:\n  keys:\n    - {name: k, key_sha256: '" + "0" * 64 + "', rate_limit: "
            f"{{requests_per_minute: {rpm}, burst: 10}}}}\n"
            "models:\n  - {name: m, upstreams: [http://h:1], accepts: [text]}\n"
        )

    now = [0.0]
    limits = KeyLimits(clock=lambda: now[0])
    fast, slow = parse(table(60)), parse(table(6))
    assert fast.auth is not None and slow.auth is not None
    for _ in range(10):
        await limits.admit(fast.auth.keys[0])
    now[0] = 2.0  # 2 earned at one a second
    limits.reloaded(slow)
    now[0] = 12.0  # 10 s at 0.1 a second: 1 more, 3 in all (a settle at this request: 12)
    headers, _ = await limits.admit(slow.auth.keys[0])
    assert headers["x-ratelimit-remaining-requests"] == "2"


async def test_the_rate_limit_is_429_with_retry_after_and_the_openai_headers(gateway_factory, upstream) -> None:
    gw = await gateway_factory(with_auth(upstream.url, key_a(rate_limit="{requests_per_minute: 6, burst: 2}")))
    async with client(gw, TEAM_A) as c:
        first = await c.chat.completions.with_raw_response.create(model="m", messages=HI)
        second = await c.chat.completions.with_raw_response.create(model="m", messages=HI, stream=True)
        stream = second.parse()
        assert isinstance(stream, openai.AsyncStream)
        async for _ in stream:
            pass
        with pytest.raises(openai.RateLimitError) as caught:
            await c.chat.completions.create(model="m", messages=HI)
    assert first.headers["x-ratelimit-limit-requests"] == "6"
    assert first.headers["x-ratelimit-remaining-requests"] == "1"
    assert second.headers["x-ratelimit-remaining-requests"] == "0"  # a stream's headers carry them too
    assert second.headers["x-ratelimit-reset-requests"].endswith("s")
    refused = caught.value.response
    assert error_body(caught.value)["code"] == "rate_limit_exceeded"
    assert int(refused.headers["Retry-After"]) >= 1 and refused.headers["x-ratelimit-remaining-requests"] == "0"
    assert gw.sample("gateway_rate_limited_total", key="team-a", reason="rate") == 1
    assert gw.sample("gateway_requests_total", code="429", key="team-a") == 1
    assert len(upstream.received) == 2
    assert not [name for r in upstream.received for name in r.headers if name.lower().startswith("x-ratelimit")]


async def test_the_rate_limit_refills(gateway_factory, upstream) -> None:
    gw = await gateway_factory(with_auth(upstream.url, key_a(rate_limit="{requests_per_minute: 60, burst: 1}")))
    clock = [100.0]
    gw.app[SERVICES_KEY].key_limits.clock = lambda: clock[0]  # an injected clock
    async with client(gw, TEAM_A) as c:
        await c.chat.completions.create(model="m", messages=HI)
        with pytest.raises(openai.RateLimitError):
            await c.chat.completions.create(model="m", messages=HI)
        clock[0] += 1.0  # one request a second
        await c.chat.completions.create(model="m", messages=HI)


async def test_a_keys_concurrency_limit_is_429(gateway_factory, upstream) -> None:
    upstream.standin.delay_ms = 300
    gw = await gateway_factory(with_auth(upstream.url, f"{key_a(max_concurrency='1')}\n{key_b()}"))
    async with client(gw, TEAM_A) as a, client(gw, TEAM_B) as b:
        results = await __import__("asyncio").gather(
            a.chat.completions.create(model="m", messages=HI),
            a.chat.completions.create(model="m", messages=HI),
            b.chat.completions.create(model="m", messages=HI),  # another key is not limited by it
            return_exceptions=True,
        )
    refused = [r for r in results if isinstance(r, openai.RateLimitError)]
    assert len(refused) == 1 and error_body(refused[0])["code"] == "concurrency_limit_exceeded"
    assert gw.sample("gateway_rate_limited_total", key="team-a", reason="concurrency") == 1


async def test_the_clients_key_never_goes_upstream_nor_into_logs_or_metrics(
    gateway_factory, upstream_factory, monkeypatch, caplog
) -> None:
    plain, keyed = await upstream_factory("plain"), await upstream_factory("keyed")
    monkeypatch.setenv("MODALITY_GATEWAY_TEST_UPSTREAM_KEY", "sk-upstream")
    text = routing(
        f"  - {{name: m, upstreams: [{plain.url}], accepts: [text]}}",
        f"  - {{name: k, upstreams: [{keyed.url}], accepts: [text], api_key_env: MODALITY_GATEWAY_TEST_UPSTREAM_KEY}}",
        extra=f"auth:\n  keys:\n{key_a()}\n",
    )
    gw = await gateway_factory(text)
    caplog.set_level(logging.DEBUG)
    async with client(gw, TEAM_A) as c:
        await c.chat.completions.create(model="m", messages=HI)
        await c.chat.completions.create(model="k", messages=HI)
    async with client(gw, "sk-wrong-guess") as c:
        with pytest.raises(openai.AuthenticationError):
            await c.chat.completions.create(model="m", messages=HI)
    assert "Authorization" not in plain.received[0].headers
    assert keyed.received[0].headers["Authorization"] == "Bearer sk-upstream"
    monkeypatch.setenv("GATEWAY_ADMIN_TOKEN", "admin-token")
    async with aiohttp.ClientSession() as session:
        async with session.get(f"{gw.url}/metrics", headers={"Authorization": "Bearer admin-token"}) as resp:
            assert resp.status == 200
            exposition = await resp.text()
    for secret in (TEAM_A, "sk-wrong-guess", "sk-upstream"):
        assert secret not in caplog.text and secret not in exposition


async def test_a_reload_adds_and_removes_keys(gateway_factory, upstream, tmp_path: Path) -> None:
    gw = await gateway_factory(with_auth(upstream.url, key_a()), write_file=True)
    (tmp_path / "routing.yaml").write_text(with_auth(upstream.url, key_b()))
    await gw.app[SERVICES_KEY].store.reload()
    async with client(gw, TEAM_A) as c:
        with pytest.raises(openai.AuthenticationError):
            await c.chat.completions.create(model="m", messages=HI)
    async with client(gw, TEAM_B) as c:
        await c.chat.completions.create(model="m", messages=HI)
    (tmp_path / "routing.yaml").write_text(routing(f"  - {{name: m, upstreams: [{upstream.url}], accepts: [text]}}"))
    await gw.app[SERVICES_KEY].store.reload()  # auth removed: open again, and the client's header passes
    async with client(gw, "anything") as c:
        await c.chat.completions.create(model="m", messages=HI)
    assert upstream.received[-1].headers["Authorization"] == "Bearer anything"
    assert gw.sample("gateway_requests_total", model="m", code="200", key="-") == 1


@pytest.mark.parametrize(
    ("keys", "expected"),
    [
        ("    - {name: a}", "auth.keys[0]: give exactly one of 'key_env' (an environment variable) or 'key_sha256'"),
        (
            f"    - {{name: a, key_env: X, key_sha256: {digest('zero')}}}",
            "auth.keys[0]: give exactly one of 'key_env' (an environment variable) or 'key_sha256'",
        ),
        (
            "    - {name: a, key_sha256: sk-pasted-key}",
            "auth.keys[0].key_sha256: must be 64 lowercase hex digits: the sha256 of the key",
        ),
        (
            f"    - {{name: a, key_sha256: {digest('zero')}, models: [nope-*]}}",
            "auth.keys[0].models[0]: 'nope-*' names no model here",
        ),
        (
            f"    - {{name: a, key_sha256: {digest('zero')}}}\n    - {{name: a, key_sha256: {digest('one')}}}",
            "auth.keys[1].name: duplicate key name 'a' (first at auth.keys[0])",
        ),
        (
            f"    - {{name: a, key_sha256: {digest('zero')}, rate_limit: {{burst: 3}}}}",
            "auth.keys[0].rate_limit: one of 'requests_per_minute', 'tokens_per_minute', 'tokens_per_day' or "
            "'visual_tokens_per_minute' is required",
        ),
    ],
)
def test_key_entries_are_checked(keys: str, expected: str) -> None:
    text = routing("  - {name: m, upstreams: ['http://h:1'], accepts: [text]}", extra=f"auth:\n  keys:\n{keys}\n")
    with pytest.raises(ConfigError) as info:
        parse_config(text)
    assert [str(p).split(": ", 1)[1] for p in info.value.problems] == [expected]
    assert "sk-pasted-key" not in str(info.value)  # a key pasted in by mistake is not echoed


def test_a_key_env_must_be_set_where_the_gateway_runs(monkeypatch) -> None:
    text = routing("  - {name: m, upstreams: ['http://h:1'], accepts: [text]}", extra=f"auth:\n  keys:\n{key_a()}\n")
    monkeypatch.delenv(ENV_A)
    parse_config(text)  # `check FILE`: any machine
    with pytest.raises(ConfigError) as info:
        parse_config(text, here=True)
    assert f"the environment variable {ENV_A} is not set" in str(info.value)


# --- holes an adversarial run found (issue 20) ------------------------------------------------


def keyed_table(urls: dict[str, str], keys: str) -> str:
    """kimi redirects video to omni and transcribes audio with whisper."""
    return routing(
        f"  - {{name: kimi, upstreams: [{urls['kimi']}], accepts: [text, image], "
        "on_unsupported: {video: {redirect: omni}, audio: {transcribe: whisper}}}",
        f"  - {{name: omni, upstreams: [{urls['omni']}], accepts: [text, image, video]}}",
        f"  - {{name: whisper, upstreams: [{urls['whisper']}], accepts: [text, audio]}}",
        extra=f"auth:\n  keys:\n{keys}\n",
    )


VIDEO = {"type": "video_url", "video_url": {"url": "data:video/mp4;base64,AAAA"}}
AUDIO = {"type": "input_audio", "input_audio": {"data": "UklGRiQAAABXQVZF", "format": "wav"}}


async def test_a_key_is_never_served_by_a_model_outside_its_list(gateway_factory, upstream_factory) -> None:
    """A key limited to kimi sent kimi a video (redirected to omni) and audio (transcribed by
    whisper): omni answered, and X-Gateway-Model named it. A model a request is redirected to,
    or that converts its media, counts as used by the key: outside its list, the modality is
    refused as kimi's own, naming neither."""
    ups = {name: await upstream_factory(name) for name in ("kimi", "omni", "whisper")}
    gw = await gateway_factory(keyed_table({n: u.url for n, u in ups.items()}, f"{key_a(models='[kimi]')}\n{key_b()}"))
    async with client(gw, TEAM_A) as c:
        for part, modality in ((VIDEO, "video"), (AUDIO, "audio")):
            with pytest.raises(openai.BadRequestError) as caught:
                await c.chat.completions.create(model="kimi", messages=[{"role": "user", "content": [part]}])
            error = error_body(caught.value)
            assert (error["code"], error["param"]) == ("unsupported_modality", "messages[0].content[0]")
            assert error["message"] == (
                f"Model 'kimi' does not accept {modality} input: messages[0].content[0] is "
                f"'{part['type']}'. It accepts: text, image."
            )
            assert "omni" not in caught.value.response.text and "whisper" not in caught.value.response.text
            assert caught.value.response.headers["X-Gateway-Model"] == "kimi"  # the model named, refusing
    assert all(u.received == [] for u in ups.values())
    assert gw.sample("gateway_modality_rejections_total", model="kimi", reason="unsupported") == 2
    async with client(gw, TEAM_B) as c:  # every model: redirected, and transcribed
        raw = await c.chat.completions.with_raw_response.create(
            model="kimi", messages=[{"role": "user", "content": [VIDEO]}]
        )
        assert raw.headers["X-Gateway-Model"] == "omni"
        await c.chat.completions.create(model="kimi", messages=[{"role": "user", "content": [AUDIO]}])
    assert len(ups["omni"].received) == 1 and len(ups["whisper"].received) == 1 and len(ups["kimi"].received) == 1


async def test_a_key_with_the_target_in_its_list_is_redirected_and_transcribed(
    gateway_factory, upstream_factory
) -> None:
    ups = {name: await upstream_factory(name) for name in ("kimi", "omni", "whisper")}
    gw = await gateway_factory(keyed_table({n: u.url for n, u in ups.items()}, key_a(models="[kimi, omni, whisper]")))
    async with client(gw, TEAM_A) as c:
        raw = await c.chat.completions.with_raw_response.create(
            model="kimi", messages=[{"role": "user", "content": [VIDEO]}]
        )
        assert raw.headers["X-Gateway-Model"] == "omni"
        await c.chat.completions.create(model="kimi", messages=[{"role": "user", "content": [AUDIO]}])
    assert len(ups["whisper"].received) == 1


async def test_metrics_on_the_main_port_need_the_admin_token_with_auth_on(
    gateway_factory, upstream, monkeypatch
) -> None:
    """/metrics names every model (those hidden from a key too), every key's name and the
    upstream URLs, and a scrape costs ~10 ms of the event loop: with auth on it was open to anyone
    on the main port."""
    gw = await gateway_factory(with_auth(upstream.url, key_a(models="[m]")))
    async with aiohttp.ClientSession() as session:
        async with session.get(f"{gw.url}/metrics") as resp:  # no admin token configured: disabled
            assert resp.status == 403
            body = await resp.json()
        assert body["error"]["code"] == "admin_disabled" and "needs the admin token" in body["error"]["message"]
        monkeypatch.setenv("GATEWAY_ADMIN_TOKEN", "admin-token")
        for headers in ({}, {"Authorization": f"Bearer {TEAM_A}"}, {"Authorization": "Bearer wrong"}):
            async with session.get(f"{gw.url}/metrics", headers=headers) as resp:
                assert resp.status == 401
                text = await resp.text()
            assert "secret" not in text and upstream.url not in text
        async with session.get(f"{gw.url}/metrics", headers={"Authorization": "Bearer admin-token"}) as resp:
            assert resp.status == 200
            assert "gateway_requests_total" in await resp.text()


async def test_metrics_need_the_admin_token_on_admin_listen_too(gateway_factory, upstream, monkeypatch) -> None:
    """A port apart is often reachable from a whole cluster: with auth on, its /metrics needs the
    token as well (Prometheus sends it: the ServiceMonitor of deploy/k8s names the Secret)."""
    monkeypatch.setenv("GATEWAY_ADMIN_TOKEN", "admin-token\n")  # a mounted secret's newline is no part of it
    gw = await gateway_factory(with_auth(upstream.url, key_a()))
    gw.app[SERVICES_KEY].lifecycle.admin_port = gw.server.port  # as if this were the admin listener
    async with aiohttp.ClientSession() as session:
        async with session.get(f"{gw.url}/metrics") as resp:
            assert resp.status == 401
        async with session.get(f"{gw.url}/metrics", headers={"Authorization": "Bearer admin-token"}) as resp:
            assert resp.status == 200


async def test_metrics_stay_open_without_auth(gateway_factory, upstream) -> None:
    gw = await gateway_factory(routing(f"  - {{name: m, upstreams: [{upstream.url}], accepts: [text]}}"))
    async with aiohttp.ClientSession() as session, session.get(f"{gw.url}/metrics") as resp:
        assert resp.status == 200


async def test_a_key_env_with_a_trailing_newline_is_the_key_without_it(gateway_factory, upstream, monkeypatch) -> None:
    """A mounted secret file ends in a newline: the key never matched, with no warning."""
    monkeypatch.setenv(ENV_A, TEAM_A + "\n")
    text = with_auth(upstream.url, key_a())
    parse_config(text, here=True)  # serve accepts it
    gw = await gateway_factory(text)
    async with client(gw, TEAM_A) as c:
        await c.chat.completions.create(model="m", messages=HI)


def test_a_key_env_with_a_control_character_inside_is_refused(monkeypatch) -> None:
    monkeypatch.setenv(ENV_A, "sk-one\nsk-two")
    text = routing("  - {name: m, upstreams: ['http://h:1'], accepts: [text]}", extra=f"auth:\n  keys:\n{key_a()}\n")
    with pytest.raises(ConfigError) as info:
        parse_config(text, here=True)
    assert f"the value of {ENV_A} holds a line break or another control character" in str(info.value)
    assert "sk-one" not in str(info.value)


@pytest.mark.parametrize(
    "header",
    [f"Authorization: Bearer {TEAM_A}\x00".encode(), f"Authorization: Bearer\r\n {TEAM_A}".encode()],
    ids=["nul", "obs-fold"],
)
async def test_a_header_the_parser_refuses_never_puts_the_key_in_a_log(
    gateway_factory, upstream, caplog, header: bytes
) -> None:
    """aiohttp logged ERROR with a traceback quoting the header line, the key with it (~0.7 KB of
    ERROR for each such request)."""
    import asyncio

    gw = await gateway_factory(with_auth(upstream.url, key_a()))
    caplog.set_level(logging.DEBUG)
    port = gw.server.port
    assert port is not None
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n" + header + b"\r\nContent-Length: 2\r\n\r\n{}")
    await writer.drain()
    status = await asyncio.wait_for(reader.readline(), 10)
    writer.close()
    assert status.split()[1] == b"400"
    assert TEAM_A not in caplog.text
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert "HTTP request refused by the parser (400)" in caplog.text


def visual_png() -> str:
    import base64
    import io

    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", (1280, 720)).save(out, "PNG")  # 1,196 tokens to Qwen2.5-VL
    return "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()


async def test_a_keys_visual_tokens_a_minute_are_429_with_their_own_headers(gateway_factory, upstream) -> None:
    pytest.importorskip("PIL")
    model = (
        f"  - {{name: q, upstreams: [{upstream.url}], accepts: [text, image], visual_tokens: {{preset: qwen2.5-vl}}}}"
    )
    keys = "\n".join(
        (key_a(rate_limit="{visual_tokens_per_minute: 2500}"), key_b(rate_limit="{visual_tokens_per_minute: 1000}"))
    )
    gw = await gateway_factory(routing(model, extra=f"auth:\n  keys:\n{keys}\n"))
    gw.app[SERVICES_KEY].key_limits.clock = lambda: 1000.0  # no refill between the requests: exact counts
    ask = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": visual_png()}}]}]
    async with client(gw, TEAM_A) as c:
        first = await c.chat.completions.with_raw_response.create(model="q", messages=ask)
        await c.chat.completions.create(model="q", messages=ask)
        with pytest.raises(openai.RateLimitError) as caught:
            await c.chat.completions.create(model="q", messages=ask)
        text = await c.chat.completions.with_raw_response.create(model="q", messages=HI)  # no images: no visual tokens
    assert first.headers["x-ratelimit-limit-visual-tokens"] == "2500"
    assert first.headers["x-ratelimit-remaining-visual-tokens"] == str(2500 - 1196)
    assert "x-ratelimit-limit-requests" not in first.headers  # no requests_per_minute, no request limit
    refused = caught.value.response
    assert error_body(caught.value)["code"] == "visual_tokens_rate_limit_exceeded"
    assert "images come to 1196, 108 are left" in error_body(caught.value)["message"]
    assert int(refused.headers["Retry-After"]) >= 1 and refused.headers["x-ratelimit-remaining-visual-tokens"] == "108"
    assert text.http_response.status_code == 200
    assert gw.sample("gateway_rate_limited_total", key="team-a", reason="visual_tokens") == 1
    assert len(upstream.received) == 3  # the refused one never left
    async with client(gw, TEAM_B) as c:  # a request past a whole minute of the key's never passes
        with pytest.raises(openai.RateLimitError) as never:
            await c.chat.completions.create(model="q", messages=ask)
    assert "more than this key's 1000 a minute: it cannot pass" in error_body(never.value)["message"]
    assert "Retry-After" not in never.value.response.headers


async def test_the_visual_token_bucket_refills_a_minutes_worth_at_most() -> None:
    from gateway.admission.auth import KeyLimits
    from gateway.config import ApiKey, RateLimit
    from gateway.errors import VisualTokensRateLimitedError

    now = [0.0]
    limits = KeyLimits(clock=lambda: now[0])
    key = ApiKey("k", key_sha256="0" * 64, rate_limit=RateLimit(None, 1, 600.0))  # 10 tokens a second
    assert limits.spend_visual(key, 600)["x-ratelimit-remaining-visual-tokens"] == "0"
    with pytest.raises(VisualTokensRateLimitedError) as caught:
        limits.spend_visual(key, 50)
    assert caught.value.headers["Retry-After"] == "5"
    now[0] = 5.0
    assert limits.spend_visual(key, 50)["x-ratelimit-remaining-visual-tokens"] == "0"
    now[0] = 1000.0  # refilled, to a minute's worth and no more
    assert limits.spend_visual(key, 1)["x-ratelimit-remaining-visual-tokens"] == "599"
    assert await limits.admit(key) == ({}, None)  # no requests_per_minute: requests are not limited


async def test_a_keys_buckets_refill_with_the_clock_and_a_reply_spends_its_tokens() -> None:
    """KeyLimits straight: a request spends one of its bucket, a reply its tokens of both
    budgets (below 0 if it costs more); the headers say what is left and when it is full again;
    a budget spent refuses before the request is (its bucket keeps the request)."""
    from gateway.admission.auth import KeyLimits
    from gateway.config import ApiKey, RateLimit
    from gateway.errors import RateLimitedError, TokensRateLimitedError

    now = [0.0]
    limits = KeyLimits(clock=lambda: now[0])
    limit = RateLimit(60.0, 2, tokens_per_minute=600.0, tokens_per_day=86_400.0)  # 1 request, 10 and 1 tokens a second
    key = ApiKey("k", key_sha256="0" * 64, rate_limit=limit, max_concurrency=1)
    headers, slot = await limits.admit(key)
    assert slot is not None and headers == {
        "x-ratelimit-limit-requests": "60", "x-ratelimit-remaining-requests": "1", "x-ratelimit-reset-requests": "1s",
        "x-ratelimit-limit-tokens": "600", "x-ratelimit-remaining-tokens": "600", "x-ratelimit-reset-tokens": "0ms",
        "x-ratelimit-limit-tokens-day": "86400", "x-ratelimit-remaining-tokens-day": "86400",
        "x-ratelimit-reset-tokens-day": "0ms",
    }  # fmt: skip
    limits.finish(key, 700, slot)  # more than the minute's budget: below 0
    now[0] = 5.0  # 50 tokens back: -50, still short; the request bucket full again meanwhile
    with pytest.raises(TokensRateLimitedError) as short:
        await limits.admit(key)
    assert short.value.headers["x-ratelimit-remaining-tokens"] == "0" and short.value.headers["Retry-After"] == "6"
    now[0] = 12.0  # 120 back: 20 left
    headers, slot = await limits.admit(key)
    assert headers["x-ratelimit-remaining-tokens"] == "20" and headers["x-ratelimit-remaining-requests"] == "1"
    assert headers["x-ratelimit-remaining-tokens-day"] == str(86_400 - 700 + 12)
    limits.finish(key, 0, slot)
    headers, slot = await limits.admit(key)
    assert headers["x-ratelimit-remaining-requests"] == "0" and headers["x-ratelimit-reset-requests"] == "2s"
    limits.finish(key, 0, slot)
    with pytest.raises(RateLimitedError) as refused:
        await limits.admit(key)
    assert refused.value.headers["Retry-After"] == "1"


def test_a_rate_limit_needs_one_of_its_limits() -> None:
    text = (
        "version: 1\nauth:\n  keys:\n    - {name: a, key_sha256: %s, rate_limit: {burst: 3}}\n"
        "models:\n  - {name: m, upstreams: ['http://h'], accepts: [text]}\n"
    )
    with pytest.raises(ConfigError) as caught:
        parse_config(text % ("0" * 64), filename="r.yaml")
    assert (
        "one of 'requests_per_minute', 'tokens_per_minute', 'tokens_per_day' or 'visual_tokens_per_minute' is required"
        in str(caught.value)
    )


def test_a_key_below_its_limits_shares_its_headers_until_a_level_they_say_changes() -> None:
    """A key whose buckets are full request after request (refilled to capacity) answers with
    the headers made once; a level that changed, or a reload's new limits, makes new ones, and
    the shared mapping is never changed under an earlier request."""
    from gateway.admission.auth import KeyLimits
    from gateway.config import ApiKey, RateLimit

    now = [0.0]
    limits = KeyLimits(clock=lambda: now[0])
    limit = RateLimit(600.0, 5, tokens_per_minute=600.0)  # 10 requests and 10 tokens a second
    key = ApiKey("k", key_sha256="0" * 64, rate_limit=limit)
    first, _ = limits.admit_now(key)
    now[0] = 1.0  # full again: the same levels said
    second, _ = limits.admit_now(key)
    assert second is first and first["x-ratelimit-remaining-requests"] == "4"
    limits.finish(key, 300, None)
    third, _ = limits.admit_now(key)  # 300 tokens spent: said anew, the earlier headers as they were
    assert third is not first and third["x-ratelimit-remaining-tokens"] == "300"
    assert first["x-ratelimit-remaining-tokens"] == "600"
    now[0] = 2.0
    fourth, _ = limits.admit_now(key)
    assert fourth["x-ratelimit-remaining-tokens"] == "310"  # 10 back in 1 s of 10 a second
    lower = ApiKey("k", key_sha256="0" * 64, rate_limit=RateLimit(300.0, 5, tokens_per_minute=600.0))
    now[0] = 60.0  # full again under the reload's limits: the same levels, other limits
    reloaded, _ = limits.admit_now(lower)
    assert reloaded["x-ratelimit-limit-requests"] == "300"

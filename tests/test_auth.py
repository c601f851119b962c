"""API keys: who may come in, which models each key sees, and each key's limits (OpenAI SDK end to end)."""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path

import aiohttp
import openai
import pytest

from gateway.config import parse_config
from gateway.errors import ConfigError
from gateway.state import SERVICES_KEY
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


async def test_the_rate_limit_refills(gateway_factory, upstream) -> None:
    gw = await gateway_factory(with_auth(upstream.url, key_a(rate_limit="{requests_per_minute: 60, burst: 1}")))
    clock = [100.0]
    gw.app[SERVICES_KEY].key_limits._clock = lambda: clock[0]  # an injected clock
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
    async with aiohttp.ClientSession() as session:
        async with session.get(f"{gw.url}/metrics") as resp:
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
            "auth.keys[0].rate_limit: 'requests_per_minute' is required",
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

"""Token accounting: every API's usage counted per model and key from its replies, whole and
streamed, with the real openai and anthropic SDKs; per-key token budgets held before admission
(429 with the x-ratelimit-*-tokens headers, in each API's error shape), the visual tokens known
at admission held to them too."""

from __future__ import annotations

from typing import Any

import aiohttp
import anthropic
import openai
import pytest

from gateway.server.state import SERVICES_KEY
from tests.conftest import Gateway, Upstream, error_body, routing
from tests.images import data_url, flat_png

pytestmark = pytest.mark.timeout(60)
KEY_ENV = "MODALITY_GATEWAY_TEST_USAGE_KEY"
APIS = "[chat, completions, responses, messages, embeddings, score, rerank]"


def table(upstream: Upstream, rate_limit: str = "", visual: bool = False) -> str:
    counted = ", visual_tokens: {preset: qwen2.5-vl}" if visual else ""
    model = f"  - {{name: m, upstreams: [{upstream.url}], accepts: [text, image], apis: {APIS}{counted}}}"
    if not rate_limit:
        return routing(model)
    keys = f"auth:\n  keys:\n    - {{name: team-a, key_env: {KEY_ENV}, rate_limit: {rate_limit}}}\n"
    return routing(model, extra=keys)


def tokens(gw: Gateway, kind: str, key: str = "-") -> float:
    return gw.sample("gateway_tokens_total", model="m", key=key, kind=kind)


async def post(gw: Gateway, path: str, body: dict[str, Any], key: str = "sk-usage") -> tuple[int, Any]:
    async with aiohttp.ClientSession() as session:
        async with session.post(gw.url + path, json=body, headers={"Authorization": f"Bearer {key}"}) as resp:
            return resp.status, await resp.json()


async def test_usage_of_every_api_is_counted_as_the_client_sees_it(gateway_factory, upstream: Upstream) -> None:
    gw = await gateway_factory(table(upstream))
    messages: Any = [{"role": "user", "content": "hello there"}]
    prompt = completion = 0
    async with gw.client() as client:
        chat = await client.chat.completions.create(model="m", messages=messages)
        assert chat.usage is not None
        prompt, completion = prompt + chat.usage.prompt_tokens, completion + chat.usage.completion_tokens
        stream = await client.chat.completions.create(
            model="m", messages=messages, stream=True, stream_options={"include_usage": True}
        )
        last = [chunk async for chunk in stream][-1]
        assert last.usage is not None
        prompt, completion = prompt + last.usage.prompt_tokens, completion + last.usage.completion_tokens
        text = await client.completions.create(model="m", prompt="once upon")
        assert text.usage is not None
        prompt, completion = prompt + text.usage.prompt_tokens, completion + text.usage.completion_tokens
        response = await client.responses.create(model="m", input="hi")
        assert response.usage is not None
        prompt, completion = prompt + response.usage.input_tokens, completion + response.usage.output_tokens
        async with client.responses.stream(model="m", input="hi again") as events:
            final = await events.get_final_response()
        assert final.usage is not None
        prompt, completion = prompt + final.usage.input_tokens, completion + final.usage.output_tokens
        embedded = await client.embeddings.create(model="m", input=["a", "b"])
        prompt += embedded.usage.prompt_tokens
    async with anthropic.AsyncAnthropic(base_url=gw.url, api_key="sk", max_retries=0) as claude:
        message = await claude.messages.create(model="m", max_tokens=16, messages=messages)
        prompt, completion = prompt + message.usage.input_tokens, completion + message.usage.output_tokens
        async with claude.messages.stream(model="m", max_tokens=16, messages=messages) as events:
            streamed = await events.get_final_message()
        prompt, completion = prompt + streamed.usage.input_tokens, completion + streamed.usage.output_tokens
        await claude.messages.count_tokens(model="m", messages=messages)  # a question, not a spend
    for path, body in (
        ("/v1/score", {"text_1": "a", "text_2": "b"}),
        ("/v1/rerank", {"query": "q", "documents": ["d"]}),
    ):
        status, answer = await post(gw, path, {"model": "m", **body})
        assert status == 200
        prompt += answer["usage"]["prompt_tokens"]
    assert (tokens(gw, "prompt"), tokens(gw, "completion")) == (prompt, completion)
    assert completion > 0 and tokens(gw, "cached") == 0


async def test_a_stream_whose_client_asked_no_usage_counts_none(gateway_factory, upstream: Upstream) -> None:
    gw = await gateway_factory(table(upstream))
    async with gw.client() as client:
        stream = await client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "x"}], stream=True
        )
        assert [chunk async for chunk in stream]
    assert tokens(gw, "prompt") == tokens(gw, "completion") == 0


async def test_a_failed_reply_spends_nothing(gateway_factory, upstream: Upstream) -> None:
    gw = await gateway_factory(table(upstream))
    async with gw.client() as client:
        with pytest.raises(openai.BadRequestError):
            await client.chat.completions.create(
                model="m", messages=[{"role": "user", "content": "x"}], extra_headers={"X-Standin-Status": "400"}
            )
    assert tokens(gw, "prompt") == 0


async def test_a_keys_token_budget_holds_from_what_its_replies_spent(
    gateway_factory, upstream: Upstream, monkeypatch
) -> None:
    monkeypatch.setenv(KEY_ENV, "sk-usage")
    gw = await gateway_factory(table(upstream, "{tokens_per_minute: 60}"))
    now = [1000.0]
    gw.app[SERVICES_KEY].key_limits.clock = lambda: now[0]  # an injected clock: one token a second
    ask: Any = [{"role": "user", "content": "hello"}]
    async with openai.AsyncOpenAI(base_url=f"{gw.url}/v1", api_key="sk-usage", max_retries=0) as client:
        raw = await client.chat.completions.with_raw_response.create(model="m", messages=ask)
        assert raw.headers["x-ratelimit-limit-tokens"] == "60"
        assert raw.headers["x-ratelimit-remaining-tokens"] == "60"  # nothing spent before this reply
        spent = raw.parse().usage
        assert spent is not None and spent.total_tokens > 10
        while tokens(gw, "prompt", "team-a") + tokens(gw, "completion", "team-a") < 60:  # the minute's budget spent
            await client.chat.completions.create(model="m", messages=ask)
        served = len(upstream.received)
        with pytest.raises(openai.RateLimitError) as caught:
            await client.chat.completions.create(model="m", messages=ask)
        assert error_body(caught.value)["code"] == "tokens_rate_limit_exceeded"
        assert "60 tokens per minute" in error_body(caught.value)["message"]
        headers = caught.value.response.headers
        assert headers["x-ratelimit-remaining-tokens"] == "0" and int(headers["Retry-After"]) >= 1
        assert len(upstream.received) == served  # refused before admission: the engine untouched
        now[0] += int(headers["Retry-After"])
        await client.chat.completions.create(model="m", messages=ask)  # refilled
    assert gw.sample("gateway_rate_limited_total", key="team-a", reason="tokens") == 1


async def test_the_daily_budget_says_so_and_the_anthropic_door_answers_in_its_shape(
    gateway_factory, upstream: Upstream, monkeypatch
) -> None:
    monkeypatch.setenv(KEY_ENV, "sk-usage")
    gw = await gateway_factory(table(upstream, "{tokens_per_day: 10}"))
    gw.app[SERVICES_KEY].key_limits.clock = lambda: 5.0
    async with anthropic.AsyncAnthropic(base_url=gw.url, api_key="sk-usage", max_retries=0) as claude:
        ask: Any = [{"role": "user", "content": "hi"}]
        raw = await claude.messages.with_raw_response.create(model="m", max_tokens=8, messages=ask)
        assert raw.headers["x-ratelimit-limit-tokens-day"] == "10"
        with pytest.raises(anthropic.RateLimitError) as caught:  # the first reply spent more than 10
            await claude.messages.create(model="m", max_tokens=8, messages=ask)
    body = caught.value.body
    assert isinstance(body, dict) and body["type"] == "error" and body["error"]["type"] == "rate_limit_error"
    assert "10 tokens per day" in body["error"]["message"]
    assert caught.value.response.headers["x-ratelimit-remaining-tokens-day"] == "0"


async def test_visual_tokens_count_in_the_budget_before_any_reply(
    gateway_factory, upstream: Upstream, monkeypatch
) -> None:
    monkeypatch.setenv(KEY_ENV, "sk-usage")
    gw = await gateway_factory(table(upstream, "{tokens_per_minute: 1000}", visual=True))
    gw.app[SERVICES_KEY].key_limits.clock = lambda: 5.0
    image = data_url(flat_png(1280, 720, b"\x80\x80\x80"))  # 1,196 tokens to Qwen2.5-VL
    ask: Any = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": image}}]}]
    async with openai.AsyncOpenAI(base_url=f"{gw.url}/v1", api_key="sk-usage", max_retries=0) as client:
        with pytest.raises(openai.RateLimitError) as caught:
            await client.chat.completions.create(model="m", messages=ask)
        assert (
            "1196 tokens" in error_body(caught.value)["message"]
            and "cannot pass" in error_body(caught.value)["message"]
        )
        assert upstream.received == []
        small = data_url(flat_png(280, 280, b"\x80\x80\x80"))  # 100 tokens
        small_ask: Any = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": small}}]}]
        stream = await client.chat.completions.create(model="m", messages=small_ask, stream=True)
        assert [chunk async for chunk in stream]  # no usage asked for: the gateway asked for it
    spent = tokens(gw, "prompt", "team-a") + tokens(gw, "completion", "team-a")  # what the engine said
    remaining = gw.app[SERVICES_KEY].key_limits.check_tokens(gw.config.auth.keys[0])
    assert remaining["x-ratelimit-remaining-tokens"] == str(int(1000 - spent))


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
async def test_a_stream_that_asks_no_usage_still_spends_its_keys_token_budget(
    gateway_factory, upstream: Upstream, monkeypatch, path: str
) -> None:
    """Without ``stream_options.include_usage`` the engine says nothing of a stream's cost: 20
    streams of 200 tokens spent nothing of a budget of 100 a minute. For a key with token budgets
    the gateway asks for it, reads it, and does not relay it: the client gets the stream it asked for."""
    monkeypatch.setenv(KEY_ENV, "sk-usage")
    gw = await gateway_factory(table(upstream, "{tokens_per_minute: 1000}"))
    chat = path.endswith("chat/completions")
    body: dict[str, Any] = {"model": "m", "stream": True}
    body.update({"messages": [{"role": "user", "content": "hello"}]} if chat else {"prompt": "hello"})
    async with aiohttp.ClientSession() as session:
        async with session.post(f"{gw.url}{path}", json=body, headers={"Authorization": "Bearer sk-usage"}) as resp:
            assert resp.status == 200
            text = await resp.text()
    assert upstream.received[-1].json()["stream_options"] == {"include_usage": True}  # asked for the key
    assert '"usage"' not in text.replace('"usage":null', "") and text.rstrip().endswith("data: [DONE]")
    assert tokens(gw, "prompt", "team-a") > 0 and tokens(gw, "completion", "team-a") > 0
    async with openai.AsyncOpenAI(base_url=f"{gw.url}/v1", api_key="sk-usage", max_retries=0) as client:
        stream = await client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "hi"}], stream=True, stream_options={"include_usage": True}
        )
        chunks = [chunk async for chunk in stream]
    assert chunks[-1].usage is not None  # asked by the client: relayed as ever


async def test_a_key_without_limits_is_counted_and_never_asked_of_the_limits(
    gateway_factory, upstream: Upstream, monkeypatch
) -> None:
    """Nothing to hold it to: the front door neither admits it through the key limits nor ends
    it there (two calls a request it would pay for nothing), and its answers say no limits."""
    monkeypatch.setenv(KEY_ENV, "sk-usage")
    model = f"  - {{name: m, upstreams: [{upstream.url}], accepts: [text, image], apis: {APIS}}}"
    gw = await gateway_factory(routing(model, extra=f"auth:\n  keys:\n    - {{name: team-a, key_env: {KEY_ENV}}}\n"))
    async with openai.AsyncOpenAI(base_url=f"{gw.url}/v1", api_key="sk-usage", max_retries=0) as client:
        for _ in range(3):
            raw = await client.chat.completions.with_raw_response.create(
                model="m", messages=[{"role": "user", "content": "hello"}]
            )
            assert not [name for name in raw.headers if name.startswith("x-ratelimit-")]
    assert tokens(gw, "prompt", "team-a") > 0  # counted, as the key's
    assert gw.app[SERVICES_KEY].key_limits._keys == {}  # never admitted there, nor ended

"""Priority classes: x-priority capped by the key, a saturated model's queue served by class, the
lower classes shed before their first upstream byte (OpenAI and Anthropic SDKs end to end)."""

from __future__ import annotations

import asyncio
import hashlib
from typing import Any

import anthropic
import openai
import pytest

from gateway.admission.priority import ANONYMOUS, priority_of
from gateway.config import PRIORITIES, PriorityCap, parse_config
from gateway.errors import ConfigError, InvalidPriorityError
from gateway.server.state import SERVICES_KEY
from tests.conftest import Gateway, Upstream, error_body, routing

HI = [{"role": "user", "content": "hi"}]
KEYS = {"batch": "sk-batch-0123456789", "app": "sk-app-0123456789", "ops": "sk-ops-0123456789"}


def keyed(upstream_url: str, *, queue: str = "{size: 2}", reserved: str = "") -> str:
    lines = []
    caps = {
        "batch": "{default: bulk, max: bulk}",
        "app": "{default: interactive, max: interactive}",
        "ops": "{max: system}",
    }
    for name, cap in caps.items():
        digest = hashlib.sha256(KEYS[name].encode()).hexdigest()
        lines.append(f"    - {{name: {name}, key_sha256: {digest}, priority: {cap}}}")
    return routing(
        f"  - {{name: m, upstreams: [{upstream_url}], accepts: [text], max_concurrency: 1, queue: {queue}}}",
        extra="auth:\n  keys:\n" + "\n".join(lines) + "\n",
        server="{reload_interval_s: 0}",
    )


def client(gw: Gateway, key: str, priority: str | None = None) -> openai.AsyncOpenAI:
    headers = {"x-priority": priority} if priority else None
    return openai.AsyncOpenAI(base_url=f"{gw.url}/v1", api_key=KEYS[key], max_retries=0, default_headers=headers)


async def queued(gw: Gateway, n: int) -> None:
    gate = gw.app[SERVICES_KEY].gates("m")
    while gate.queued < n:  # bounded by the test's timeout
        await asyncio.sleep(0.001)


async def reached(upstream: Upstream, n: int) -> None:
    while len(upstream.received) < n:
        await asyncio.sleep(0.001)


def classes(upstream: Upstream) -> list[str]:
    """The class of each request the engine got, in the order it got them."""
    return [r.headers["X-Gateway-Priority"] for r in upstream.received]


# --- the class of a request -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("header", "cap", "expected"),
    [
        (None, PriorityCap(), "default"),
        ("", PriorityCap(), "default"),
        ("bulk", PriorityCap(), "bulk"),
        (" Interactive ", PriorityCap(), "default"),  # above the cap: served at it
        ("system", PriorityCap("default", "interactive"), "interactive"),
        ("system", PriorityCap("interactive", "system"), "system"),
        (None, PriorityCap("interactive", "system"), "interactive"),
        ("interactive", ANONYMOUS, "interactive"),
        ("system", ANONYMOUS, "interactive"),  # no key grants the top class
    ],
)
def test_a_request_may_lower_its_class_never_raise_it_past_its_cap(
    header: str | None, cap: PriorityCap, expected: str
) -> None:
    assert PRIORITIES[priority_of(header, cap)] == expected


def test_an_unknown_class_is_refused_by_name() -> None:
    with pytest.raises(InvalidPriorityError) as caught:
        priority_of("urgent", PriorityCap())
    assert caught.value.status == 400 and caught.value.code == "invalid_priority"
    assert "'urgent'" in caught.value.message and "system, interactive, default, bulk" in caught.value.message


@pytest.mark.parametrize(
    ("entry", "expected"),
    [
        ("priority: {max: urgent}", "auth.keys[0].priority.max: unknown priority class 'urgent' (expected one of: "),
        ("priority: {default: interactive}", "auth.keys[0].priority.default: 'interactive' is above the key's max"),
        ("priority: {top: system}", "auth.keys[0].priority.top: unknown key 'top' (expected one of: default, max)"),
        ("priority: bulk", "auth.keys[0].priority: priority must be a mapping, not string 'bulk'"),
    ],
)
def test_a_keys_priority_is_checked(entry: str, expected: str) -> None:
    digest = hashlib.sha256(b"k").hexdigest()
    text = routing(
        "  - {name: m, upstreams: ['http://h:1'], accepts: [text]}",
        extra=f"auth:\n  keys:\n    - {{name: a, key_sha256: {digest}, {entry}}}\n",
    )
    with pytest.raises(ConfigError) as info:
        parse_config(text)
    first = str(info.value.problems[0]).split(": ", 1)[1]
    assert first.startswith(expected), info.value.problems


def test_a_keys_default_follows_its_max_down() -> None:
    digest = hashlib.sha256(b"k").hexdigest()
    keys = "\n".join(
        f"    - {{name: k{i}, key_sha256: {hashlib.sha256(str(i).encode()).hexdigest()}, {entry}}}"
        for i, entry in enumerate(["priority: {max: bulk}", "priority: {max: system}", "models: [m]"])
    )
    config = parse_config(
        routing("  - {name: m, upstreams: ['http://h:1'], accepts: [text]}", extra=f"auth:\n  keys:\n{keys}\n")
    )
    assert config.auth is not None and digest
    assert [k.priority for k in config.auth.keys] == [
        PriorityCap("bulk", "bulk"),
        PriorityCap("default", "system"),
        PriorityCap("default", "default"),
    ]


@pytest.mark.parametrize(
    ("options", "expected"),
    [
        ("max_concurrency: 2, queue: {reserved: 2}", "2 slots reserved for the system class need a max_concurrency"),
        ("queue: {reserved: 1}", "1 slots reserved for the system class need a max_concurrency above it (none is set)"),
    ],
)
def test_reserved_slots_leave_some_for_the_other_classes(options: str, expected: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_config(routing(f"  - {{name: m, upstreams: ['http://h:1'], accepts: [text], {options}}}"))
    first = str(info.value.problems[0]).split(": ", 1)[1]
    assert first.startswith(f"models[0].queue.reserved: {expected}"), info.value.problems


# --- a saturated model ------------------------------------------------------------------------


async def test_a_full_queue_sheds_bulk_for_interactive_before_any_byte_went_upstream(upstream, gateway_factory) -> None:
    upstream.standin.hold = asyncio.Event()
    gw = await gateway_factory(keyed(upstream.url))
    async with client(gw, "batch") as batch, client(gw, "app") as app:
        first = asyncio.create_task(batch.chat.completions.create(model="m", messages=HI))
        await reached(upstream, 1)  # it holds the one slot, its bytes upstream
        waiting = []
        for _ in range(2):
            waiting.append(asyncio.create_task(batch.chat.completions.create(model="m", messages=HI)))
            await queued(gw, len(waiting))
        urgent: asyncio.Task[Any] = asyncio.create_task(
            app.chat.completions.with_raw_response.create(model="m", messages=HI)
        )
        with pytest.raises(openai.InternalServerError) as caught:
            await waiting[1]  # the newest bulk one gave its place
        assert caught.value.status_code == 503 and caught.value.response.headers["Retry-After"] == "1"
        body = error_body(caught.value)
        assert body["code"] == "preempted" and body["type"] == "server_error" and "bulk" in body["message"]
        assert len(upstream.received) == 1  # the one in flight kept its slot
        upstream.standin.hold.set()
        raw = await urgent
        await asyncio.gather(first, waiting[0])
    assert raw.headers["X-Gateway-Priority"] == "interactive"
    assert classes(upstream) == ["bulk", "interactive", "bulk"]  # served ahead of the bulk one queued before it
    assert gw.sample("gateway_shed_total", model="m", reason="preempted", priority="bulk") == 1
    assert gw.sample("gateway_requests_total", model="m", code="503", key="batch") == 1
    assert gw.sample("gateway_queue_wait_seconds_count", model="m", priority="interactive") == 1
    assert gw.sample("gateway_queue_wait_seconds_count", model="m", priority="bulk") == 2
    assert gw.sample("gateway_queue_depth", model="m") == 0


async def test_under_a_burst_interactive_requests_go_first_and_nothing_is_shed_after_its_first_byte(
    upstream, gateway_factory
) -> None:
    """24 bulk requests from many connections fill a model of one slot and 8 waiting; 4 interactive
    ones come after them: each is the next served, bulk ones wait or are shed, and every request
    the engine got was answered in full."""
    upstream.standin.hold = asyncio.Event()
    gw = await gateway_factory(keyed(upstream.url, queue="{size: 8, timeout_s: 30}"))
    async with client(gw, "batch") as batch, client(gw, "app") as app:
        bulk = [asyncio.create_task(batch.chat.completions.create(model="m", messages=HI)) for _ in range(24)]
        await reached(upstream, 1)
        await queued(gw, 8)
        urgent = [asyncio.create_task(app.chat.completions.create(model="m", messages=HI)) for _ in range(4)]
        gate = gw.app[SERVICES_KEY].gates("m")
        while gate.queued_at(PRIORITIES.index("interactive")) < 4:
            await asyncio.sleep(0.001)
        upstream.standin.hold.set()
        served = await asyncio.gather(*urgent)
        results = await asyncio.gather(*bulk, return_exceptions=True)
    assert all((r.choices[0].message.content or "").startswith("[up]") for r in served)
    assert classes(upstream)[1:5] == ["interactive"] * 4  # the next four served, past 8 bulk ones waiting
    ok = [r for r in results if not isinstance(r, BaseException)]
    shed = [r for r in results if isinstance(r, openai.APIStatusError)]
    assert len(ok) + len(shed) == 24 and len(ok) == 5  # the one in flight, and the four left waiting
    codes = sorted(error_body(r)["code"] for r in shed)
    assert codes == ["preempted"] * 4 + ["queue_full"] * 15
    assert len(upstream.received) == len(ok) + len(served)  # every request the engine saw was served


async def test_reserved_slots_serve_the_system_class_at_once(upstream, gateway_factory) -> None:
    upstream.standin.hold = asyncio.Event()
    gw = await gateway_factory(
        keyed(upstream.url, queue="{size: 4, reserved: 1}").replace("max_concurrency: 1", "max_concurrency: 2")
    )
    async with client(gw, "app") as app, client(gw, "ops", "system") as ops:
        busy = asyncio.create_task(app.chat.completions.create(model="m", messages=HI))
        await reached(upstream, 1)
        waiting = asyncio.create_task(app.chat.completions.create(model="m", messages=HI))
        await queued(gw, 1)
        system: asyncio.Task[Any] = asyncio.create_task(
            ops.chat.completions.with_raw_response.create(model="m", messages=HI)
        )
        await reached(upstream, 2)  # in at once, past the interactive one waiting
        assert classes(upstream) == ["interactive", "system"]
        upstream.standin.hold.set()
        raw = await system
        await asyncio.gather(busy, waiting)
    assert raw.headers["X-Gateway-Priority"] == "system"
    assert gw.sample("gateway_queue_wait_seconds_count", model="m", priority="system") == 1


async def test_a_key_asking_above_its_cap_is_served_at_it(upstream, gateway_factory) -> None:
    gw = await gateway_factory(keyed(upstream.url))
    for key, asked, got in (("batch", "system", "bulk"), ("app", "bulk", "bulk"), ("ops", None, "default")):
        async with client(gw, key, asked) as c:
            raw = await c.chat.completions.with_raw_response.create(model="m", messages=HI)
        assert raw.headers["X-Gateway-Priority"] == got
    assert classes(upstream) == ["bulk", "bulk", "default"]
    # the client's ask stays here: the engine gets the class its key allows, never "system" raw
    assert all("x-priority" not in r.headers for r in upstream.received)


async def test_an_unknown_class_is_a_400_in_each_apis_shape_and_nothing_goes_upstream(
    upstream, gateway_factory
) -> None:
    gw = await gateway_factory(routing(f"  - {{name: m, upstreams: [{upstream.url}], accepts: [text]}}"))
    async with openai.AsyncOpenAI(
        base_url=f"{gw.url}/v1", api_key="sk", max_retries=0, default_headers={"x-priority": "urgent"}
    ) as c:
        with pytest.raises(openai.BadRequestError) as caught:
            await c.chat.completions.create(model="m", messages=HI)
    body: dict[str, Any] = error_body(caught.value)
    assert body["code"] == "invalid_priority" and "'urgent'" in body["message"]
    async with anthropic.AsyncAnthropic(
        base_url=gw.url, api_key="sk", max_retries=0, default_headers={"x-priority": "urgent"}
    ) as a:
        with pytest.raises(anthropic.BadRequestError) as refused:
            await a.messages.create(model="m", max_tokens=8, messages=[{"role": "user", "content": "hi"}])
    assert refused.value.body["type"] == "error"  # type: ignore[index]
    assert refused.value.body["error"]["type"] == "invalid_request_error"  # type: ignore[index]
    assert upstream.received == []
    async with gw.client() as c:  # still serving; without keys up to interactive
        raw = await c.chat.completions.with_raw_response.create(
            model="m", messages=HI, extra_headers={"x-priority": "system"}
        )
    assert raw.headers["X-Gateway-Priority"] == "interactive"


async def test_the_engines_own_priority_in_the_body_is_only_the_top_class_keys_to_set(
    upstream, gateway_factory
) -> None:
    """vLLM and SGLang act on a body's ``priority`` as sent: a key capped at bulk sent -1000 and
    went first. Only a key that may ask for system may set it; without auth the body goes as sent."""
    gw = await gateway_factory(keyed(upstream.url))
    async with client(gw, "batch") as c:
        with pytest.raises(openai.BadRequestError) as caught:
            await c.chat.completions.create(model="m", messages=HI, extra_body={"priority": -1000})
        await c.chat.completions.create(model="m", messages=HI, extra_body={"priority": 0})  # the default: fine
    body = error_body(caught.value)
    assert (body["code"], body["param"]) == ("invalid_priority", "priority")
    assert "key 'batch' may not set" in body["message"] and "x-priority" in body["message"]
    async with client(gw, "ops") as c:
        await c.chat.completions.create(model="m", messages=HI, extra_body={"priority": -5})
    assert [r.json().get("priority") for r in upstream.received] == [0, -5]
    open_gw = await gateway_factory(routing(f"  - {{name: m, upstreams: [{upstream.url}], accepts: [text]}}"))
    async with open_gw.client() as c:
        await c.chat.completions.create(model="m", messages=HI, extra_body={"priority": -7})
    assert upstream.received[-1].json()["priority"] == -7


def test_a_caps_default_rank_is_known_once_as_priority_of_reads_it() -> None:
    """A keyed request without the header is given its key's ``PriorityCap.rank`` at once
    (gateway.server.state.admitted_as): the class priority_of would say."""
    for default in PRIORITIES:
        cap = PriorityCap(default, "system")
        assert cap.rank == priority_of(None, cap) == PRIORITIES.index(default)
    assert PriorityCap("urgent").rank == -1  # (a cap built in code, unchecked: priority_of says what it says)

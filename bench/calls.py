"""The gateway hop's work per request, counted rather than timed: Python function calls.

Timing on a shared 2-core machine moves by ±30% from one run to the next; the number of function
calls a request makes does not. This runs a stand-in upstream, the gateway and a client in one
process on loopback, sends the same request ``n`` times straight to the upstream and ``n`` times
through the gateway (one at a time, keep-alive), counts every Python and C function call with
``sys.setprofile``, and reports the difference per request: the calls the gateway hop adds,
by module and by function. ``tests/test_cost.py`` holds these counts under a ceiling (a regression
guard that cannot flake); this script shows where they go:

    .venv/bin/python -m bench.calls               # text chat, non-streamed
    .venv/bin/python -m bench.calls --top 40 --scenario stream
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import gc
import hashlib
import sys
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from types import FrameType
from typing import Any

import aiohttp
import orjson
from aiohttp import web

from bench import minimal_proxy
from bench.hop import noise_png
from gateway.config import parse_config
from gateway.server.app import SERVER_OPTIONS, create_app
from tools.standin import StandIn

CONFIG = """
version: 1
server: {{reload_interval_s: 0, access_log: false{server}}}
{auth}models:
  - name: m
    upstreams: [{upstream}]
    accepts: [text, image]
  - name: counted
    upstreams: [{upstream}]
    accepts: [text, image]
    visual_tokens: {{preset: qwen2.5-vl}}
    limits: {{visual_tokens: 16384, image_pixels: 12845056}}
  - name: text-only
    upstreams: [{upstream}]
    accepts: [text]
"""
TEXT = {"model": "m", "messages": [{"role": "user", "content": "Hello there, how are you today?"}], "max_tokens": 16}
SCENARIOS: dict[str, dict[str, Any]] = {
    "text": TEXT,
    "stream": {**TEXT, "stream": True},
    "stream-20": {**TEXT, "stream": True, "ignore_eos": True, "max_tokens": 20},  # 20 content chunks
    "responses": {"model": "m", "input": "Hello there, how are you today?", "max_output_tokens": 16},
    "messages": {**TEXT, "max_tokens": 16},
    "reject": {
        "model": "text-only",
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "what is this?"},
                    {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}},
                ],
            }
        ],
    },
}

_PNG = "data:image/png;base64," + base64.b64encode(noise_png(64, 64, 0)).decode()
_IMAGE = {
    "model": "m",
    "messages": [
        {
            "role": "user",
            "content": [{"type": "text", "text": "what is this?"}, {"type": "image_url", "image_url": {"url": _PNG}}],
        }
    ],
    "max_tokens": 16,
}
SCENARIOS["image"] = _IMAGE  # a model that does not count visual tokens
SCENARIOS["image-counted"] = {**_IMAGE, "model": "counted"}  # one that does (visual_tokens, limits)

PATHS = {"responses": "/v1/responses", "messages": "/v1/messages"}  # the others: /v1/chat/completions

# The text request with a feature on: a key with limits (requests, tokens; far above what a run
# sends), and tracing with no request sampled (its collector never called: nothing to send)
KEY = "sk-calls-0123456789"
KEYED = (
    f"auth:\n  keys:\n    - {{name: bench, key_sha256: {hashlib.sha256(KEY.encode()).hexdigest()}, rate_limit: "
    "{requests_per_minute: 1000000000, burst: 1000000, tokens_per_minute: 1000000000000, tokens_per_day: "
    "1000000000000}}\n"
)
KEY_ALONE = f"auth:\n  keys:\n    - {{name: bench, key_sha256: {hashlib.sha256(KEY.encode()).hexdigest()}}}\n"
FEATURES: dict[str, tuple[str, str, dict[str, str]]] = {  # scenario: server keys, auth section, headers
    "keyed": ("", KEYED, {"Authorization": f"Bearer {KEY}"}),
    "key-alone": ("", KEY_ALONE, {"Authorization": f"Bearer {KEY}"}),  # a key without limits
    "unsampled": (", tracing: {otlp_endpoint: 'http://127.0.0.1:9', sample_ratio: 0}", "", {}),
    # every request sampled: the calls on the loop (the exporter's thread is not counted)
    "traced": (", tracing: {otlp_endpoint: 'http://127.0.0.1:9', sample_ratio: 1}", "", {}),
}


def config_text(upstream: str, scenario: str = "text") -> str:
    """The routing.yaml of a scenario's gateway: CONFIG, with the scenario's feature on."""
    server, auth, _ = FEATURES.get(scenario, ("", "", {}))
    return CONFIG.format(upstream=upstream, server=server, auth=auth)


SCENARIOS["keyed"] = SCENARIOS["key-alone"] = SCENARIOS["unsampled"] = SCENARIOS["traced"] = TEXT
SCENARIOS["text-counted"] = {**TEXT, "model": "counted"}  # text alone, to a model that counts images


@dataclass(frozen=True)
class Counts:
    direct: Counter[str]  # calls for n requests straight to the upstream
    gateway: Counter[str]  # calls for n requests through the gateway
    minimal: Counter[str]  # calls for n requests through bench.minimal_proxy
    n: int

    def per_request(self) -> float:
        """Calls the gateway hop adds per request (rejections: the gateway's answer alone)."""
        return (sum(self.gateway.values()) - sum(self.direct.values())) / self.n

    def minimal_per_request(self) -> float:
        """Calls the minimal aiohttp proxy's hop adds per request: the least the stack does."""
        return (sum(self.minimal.values()) - sum(self.direct.values())) / self.n

    def added(self, baseline: str = "direct") -> Counter[str]:
        """Calls by function the gateway makes over all n requests beyond ``baseline`` (direct or
        minimal; negative: fewer)."""
        added = Counter(self.gateway)
        added.subtract(self.direct if baseline == "direct" else self.minimal)
        return added


def _name(code: Any) -> str:
    if hasattr(code, "co_filename"):
        path = code.co_filename
        for marker in ("/site-packages/", "/lib/python3", "/work/main/", "/gateway/", "/tools/"):
            if marker in path:
                path = path.split(marker, 1)[1] if marker != "/gateway/" else "gateway/" + path.split(marker, 1)[1]
                break
        return f"{path}:{code.co_qualname}"
    module = getattr(code, "__module__", None) or type(getattr(code, "__self__", None)).__name__
    return f"<C> {module}.{getattr(code, '__qualname__', repr(code))}"


@contextmanager
def _counting(counter: Counter[Any]) -> Iterator[None]:
    def profile(frame: FrameType, event: str, arg: Any) -> None:
        if event == "call":
            counter[frame.f_code] += 1
        elif event == "c_call":
            counter[arg] += 1

    # a garbage collection in the window would count the finalizers of whatever else is garbage
    # (in the test suite: earlier tests' transports and sockets), not the hop: none runs in it
    enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    sys.setprofile(profile)
    try:
        yield
    finally:
        sys.setprofile(None)
        if enabled:
            gc.enable()


async def _serve(app: web.Application, **options: Any) -> tuple[web.AppRunner, str]:
    runner = web.AppRunner(app, access_log=None, **options)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    return runner, f"http://127.0.0.1:{port}"


async def measure(scenario: str = "text", n: int = 200, warmup: int = 50) -> Counts:
    """Count the calls of ``n`` requests of ``scenario`` direct and through the gateway."""
    body = orjson.dumps(SCENARIOS[scenario])
    path = PATHS.get(scenario, "/v1/chat/completions")
    upstream_runner, upstream = await _serve(StandIn().app())
    try:
        app = create_app(parse_config(config_text(upstream, scenario), filename="bench"))
    except BaseException:  # a table this machine refuses (tracing without its extra): nothing left open
        await upstream_runner.cleanup()
        raise
    gateway_runner, gateway = await _serve(app, **SERVER_OPTIONS)
    minimal_runner, minimal = await _serve(minimal_proxy.make_app(upstream))
    headers = {"Content-Type": "application/json", **FEATURES.get(scenario, ("", "", {}))[2]}
    try:
        async with aiohttp.ClientSession() as session:

            async def send(base: str) -> None:
                async with session.post(base + path, data=body, headers=headers) as resp:
                    await resp.read()

            async def count(base: str) -> Counter[str]:
                for _ in range(warmup):  # connections open, caches warm, first-call costs paid
                    await send(base)
                raw: Counter[Any] = Counter()
                with _counting(raw):
                    for _ in range(n):
                        await send(base)
                named: Counter[str] = Counter()
                for code, calls in raw.items():
                    named[_name(code)] += calls
                return named

            # the direct path has no rejection: the same request answered by the upstream is the baseline
            direct = await count(upstream)
            through = await count(gateway)
            least = await count(minimal)
    finally:
        await minimal_runner.cleanup()
        await gateway_runner.cleanup()
        await upstream_runner.cleanup()
    return Counts(direct, through, least, n)


def run(coroutine: Callable[[], Awaitable[Counts]], *, uvloop: bool = False) -> Counts:
    """On asyncio's own loop by default, as the tests count (its Python-level loop calls are
    in both paths' counts); ``uvloop``: on the loop ``serve`` uses, which does that work in C."""
    if uvloop:
        import uvloop as uv

        return uv.run(coroutine())  # type: ignore[arg-type]
    return asyncio.run(coroutine())  # type: ignore[arg-type]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scenario", choices=sorted(SCENARIOS), default="text")
    parser.add_argument("-n", type=int, default=200)
    parser.add_argument(
        "--uvloop", action="store_true", help="count on uvloop (as serve runs) instead of asyncio's loop"
    )
    parser.add_argument("--top", type=int, default=30)
    parser.add_argument(
        "--against", choices=["direct", "minimal"], default="minimal", help="the calls listed are the gateway's beyond"
    )
    args = parser.parse_args()
    counts = run(lambda: measure(args.scenario, args.n), uvloop=args.uvloop)
    added, least = counts.per_request(), counts.minimal_per_request()
    print(
        f"{args.scenario}: the gateway hop adds {added:.0f} calls a request; the minimal proxy's, {least:.0f} "
        f"({added / least:.2f}x)"
    )
    by_module: Counter[str] = Counter()
    for name, calls in counts.added(args.against).items():
        by_module[name.split(":", 1)[0].split("/", 1)[0] if not name.startswith("<C>") else "<C>"] += calls
    print(f"\nbeyond {args.against}, by package (calls a request):")
    for module, calls in by_module.most_common():
        print(f"  {calls / counts.n:8.1f}  {module}")
    print(f"\ntop {args.top} functions (calls a request):")
    for name, calls in counts.added(args.against).most_common(args.top):
        print(f"  {calls / counts.n:8.1f}  {name}")


if __name__ == "__main__":
    main()

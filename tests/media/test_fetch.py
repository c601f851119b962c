"""Image bytes from data URLs and from fetches under the media: rules (limits, SSRF guard).

Every media server here is a real aiohttp server on loopback; nothing leaves the machine. Addresses
that must be refused (10.0.0.1, 169.254.169.254, ...) are IP literals refused before any connection
(the ``no_connections`` fixture fails a test that tries one) or names answered by a fake resolver.
"""

from __future__ import annotations

import asyncio
import asyncio.selector_events
import base64
import errno
import ipaddress
import socket
import time
import tracemalloc
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote

import aiohttp
import pytest
from aiohttp import web
from aiohttp.abc import AbstractResolver, ResolveResult
from aiohttp.test_utils import TestServer

from gateway.config import MediaConfig
from gateway.errors import InvalidImageError, InvalidRequestError, MediaRefusedError
from gateway.media import fetch as media_module
from gateway.media.fetch import (
    MAX_REDIRECTS,
    MediaFetcher,
    MediaKind,
    NonPublicAddressError,
    PublicAddressResolver,
    decode_data_url,
    is_public_address,
)

PNG = base64.b64decode(
    "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNkYPhfDwAChwGA60e6kgAAAABJRU5ErkJggg=="
)
PNG_B64 = base64.b64encode(PNG).decode()
LOOPBACK_OK = MediaConfig(allow_private_networks=True)
STRICT = MediaConfig()


@dataclass
class MediaServer:
    server: TestServer
    host: str
    hits: list[str] = field(default_factory=list)

    def url(self, path: str, *, host: str | None = None) -> str:
        return f"http://{host or self.host}:{self.server.port}{path}"

    def redirect(self, target: str, *, host: str | None = None, status: int = 302) -> str:
        return self.url(f"/redirect?status={status}&to={quote(target, safe='')}", host=host)


def media_app(hits: list[str]) -> web.Application:
    async def image(request: web.Request) -> web.Response:
        return web.Response(body=PNG, content_type="image/png")

    async def sized(request: web.Request) -> web.StreamResponse:
        size = int(request.match_info["size"])
        if request.query.get("chunked"):
            response = web.StreamResponse()
            response.enable_chunked_encoding()
            await response.prepare(request)
            for start in range(0, size, 1000):
                await response.write(b"x" * min(1000, size - start))
            await response.write_eof()
            return response
        return web.Response(body=b"x" * size)

    async def endless(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse()  # no Content-Length: only the byte count can stop it
        await response.prepare(request)
        for _ in range(10_000):  # 640 MiB: a client that never stops reading fails the test by time
            await response.write(b"x" * 65536)
        return response

    async def claims_huge(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse()
        response.content_length = 10**9
        await response.prepare(request)
        await response.write(b"x" * 10)
        await asyncio.sleep(30)  # a client that reads instead of checking Content-Length times out
        return response

    async def slow(request: web.Request) -> web.Response:
        await asyncio.sleep(30)
        return web.Response(body=PNG)

    async def trickle(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse()
        await response.prepare(request)
        for _ in range(300):  # a byte every 0.1 s: no single read waits long, the whole fetch does
            await response.write(b"x")
            await asyncio.sleep(0.1)
        return response

    async def broken(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse()
        response.content_length = 1000
        await response.prepare(request)
        await response.write(b"x" * 10)
        assert request.transport is not None
        request.transport.close()
        return response

    async def status(request: web.Request) -> web.Response:
        return web.Response(status=int(request.match_info["code"]), text="no")

    async def redirect(request: web.Request) -> web.Response:
        code = int(request.query.get("status", "302"))
        return web.Response(status=code, headers={"Location": request.query["to"]})

    async def hops(request: web.Request) -> web.Response:
        left = int(request.match_info["n"])
        if left == 0:
            return web.Response(body=PNG)
        return web.Response(status=302, headers={"Location": f"/hops/{left - 1}"})

    async def loop(request: web.Request) -> web.Response:
        return web.Response(status=307, headers={"Location": "/loop"})

    async def no_location(request: web.Request) -> web.Response:
        return web.Response(status=302)

    async def headers(request: web.Request) -> web.Response:
        seen = ";".join(f"{k}={request.headers.get(k, '')}" for k in ("User-Agent", "Cookie"))
        return web.Response(text=seen, headers={"Set-Cookie": "session=abc; Path=/"})

    @web.middleware
    async def record(request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]):
        hits.append(request.path)
        return await handler(request)

    app = web.Application(middlewares=[record])
    app.router.add_get("/img.png", image)
    app.router.add_get("/sized/{size}", sized)
    app.router.add_get("/endless", endless)
    app.router.add_get("/claims-huge", claims_huge)
    app.router.add_get("/slow", slow)
    app.router.add_get("/trickle", trickle)
    app.router.add_get("/broken", broken)
    app.router.add_get("/status/{code}", status)
    app.router.add_get("/redirect", redirect)
    app.router.add_get("/hops/{n}", hops)
    app.router.add_get("/loop", loop)
    app.router.add_get("/no-location", no_location)
    app.router.add_get("/headers", headers)
    return app


async def start_media_server(host: str) -> MediaServer:
    hits: list[str] = []
    server = TestServer(media_app(hits), host=host, port=0, handler_cancellation=True)
    await server.start_server()
    return MediaServer(server, f"[{host}]" if ":" in host else host, hits)


@pytest.fixture
async def media_server() -> AsyncIterator[MediaServer]:
    server = await start_media_server("127.0.0.1")
    yield server
    await server.server.close()


def ipv6_loopback_available() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
    except OSError:
        return False
    return True


@pytest.fixture
async def media_server_v6() -> AsyncIterator[MediaServer]:
    if not ipv6_loopback_available():
        pytest.skip("no IPv6 loopback here")
    server = await start_media_server("::1")
    yield server
    await server.server.close()


FetcherFactory = Callable[..., Awaitable[MediaFetcher]]


@pytest.fixture
async def fetcher_factory() -> AsyncIterator[FetcherFactory]:
    fetchers: list[MediaFetcher] = []

    async def make(media: MediaConfig = STRICT, resolver: AbstractResolver | None = None) -> MediaFetcher:
        fetcher = MediaFetcher(media, resolver=resolver)
        await fetcher.start()
        fetchers.append(fetcher)
        return fetcher

    yield make
    for fetcher in fetchers:
        await fetcher.close()


@pytest.fixture(autouse=True)
def loopback_only(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """A guard against regressions: any connection to a non-loopback address fails the test unsent."""
    real = asyncio.selector_events.BaseSelectorEventLoop.sock_connect
    attempts: list[object] = []

    async def sock_connect(self: asyncio.AbstractEventLoop, sock: socket.socket, address: Any) -> None:
        if not ipaddress.ip_address(address[0].split("%")[0]).is_loopback:
            attempts.append(address)
            raise OSError(errno.ENETUNREACH, "the test guard refused a non-loopback connection")
        await real(self, sock, address)

    monkeypatch.setattr(asyncio.selector_events.BaseSelectorEventLoop, "sock_connect", sock_connect)
    yield
    assert not attempts, f"connections to non-loopback addresses were attempted: {attempts}"


@pytest.fixture
def no_connections(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail the test if the fetcher opens any connection (the refusal must come first)."""

    async def connect(*args: object, **kwargs: object) -> None:
        raise AssertionError("a connection was attempted")

    monkeypatch.setattr(aiohttp.BaseConnector, "connect", connect)


@pytest.fixture
def loopback_v4_is_public(monkeypatch: pytest.MonkeyPatch) -> None:
    """Let 127.0.0.1 count as public, so a redirect from a loopback server tests the address rules."""
    real = media_module._is_public

    def is_public(ip: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
        return ip == ipaddress.IPv4Address("127.0.0.1") or real(ip)

    monkeypatch.setattr(media_module, "_is_public", is_public)


class FakeResolver(AbstractResolver):
    """Answers names from a table, as DNS would; records what it was asked."""

    def __init__(self, table: dict[str, list[str]]) -> None:
        self.table = table
        self.asked: list[str] = []
        self.closed = False

    async def resolve(
        self, host: str, port: int = 0, family: socket.AddressFamily = socket.AF_INET
    ) -> list[ResolveResult]:
        self.asked.append(host)
        if host not in self.table:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return [
            ResolveResult(
                hostname=host,
                host=address,
                port=port,
                family=socket.AF_INET6 if ":" in address else socket.AF_INET,
                proto=0,
                flags=socket.AI_NUMERICHOST | socket.AI_NUMERICSERV,
            )
            for address in self.table[host]
        ]

    async def close(self) -> None:
        self.closed = True


async def refused(fetcher: MediaFetcher, url: str, kind: MediaKind = "image") -> MediaRefusedError:
    with pytest.raises(MediaRefusedError) as info:
        await fetcher.load(url, kind)
    return info.value


async def invalid(fetcher: MediaFetcher, url: str) -> InvalidImageError:
    with pytest.raises(InvalidImageError) as info:
        await fetcher.load(url)
    return info.value


# --- errors ----------------------------------------------------------------------------------


def test_error_classes_and_codes() -> None:
    assert issubclass(MediaRefusedError, InvalidRequestError)
    assert issubclass(InvalidImageError, InvalidRequestError)
    assert (MediaRefusedError.status, MediaRefusedError.type, MediaRefusedError.code) == (
        400,
        "invalid_request_error",
        "media_refused",
    )
    assert (InvalidImageError.status, InvalidImageError.code) == (400, "invalid_image")


async def test_refusals_name_only_the_host_and_leave_param_to_the_caller(fetcher_factory, no_connections) -> None:
    fetcher = await fetcher_factory()
    error = await refused(fetcher, "http://10.0.0.1/secret/path?token=hunter2")
    assert error.param is None
    assert "10.0.0.1" in error.message
    assert "secret" not in error.message and "hunter2" not in error.message
    assert error.__cause__ is None and (error.__context__ is None or error.__suppress_context__)
    assert error.to_dict()["error"]["code"] == "media_refused"


# --- data URLs -------------------------------------------------------------------------------


async def test_data_url_base64_png() -> None:
    fetcher = MediaFetcher(STRICT)  # data URLs need no session
    assert await fetcher.load(f"data:image/png;base64,{PNG_B64}") == PNG
    assert await fetcher.load(f"DATA:image/PNG;BASE64,{PNG_B64}") == PNG
    assert await fetcher.load(f"data:;base64,{PNG_B64}") == PNG


async def test_data_url_base64_tolerates_whitespace() -> None:
    wrapped = "\n".join(PNG_B64[i : i + 20] for i in range(0, len(PNG_B64), 20))
    assert await MediaFetcher(STRICT).load(f"data:image/png;base64, {wrapped}\r\n") == PNG


async def test_data_url_percent_encoded() -> None:
    fetcher = MediaFetcher(STRICT)
    assert await fetcher.load("data:,hello%20world") == b"hello world"
    assert await fetcher.load("data:image/png;name=x.png,%89PNG%0D%0A%1A%0A") == PNG[:8]


@pytest.mark.parametrize(
    "url",
    [
        "data:image/png;base64",  # no comma
        "data:",
        "data:image png;base64,AAAA",  # not a media type
        "data:base64,AAAA",  # 'base64' alone is a media type, and not a valid one
        "data:image/png;charset;base64,AAAA",  # a parameter without '='
    ],
)
async def test_malformed_data_url_is_an_invalid_image(url: str) -> None:
    error = await invalid(MediaFetcher(STRICT), url)
    assert "malformed" in error.message
    assert error.code == "invalid_image" and error.param is None


@pytest.mark.parametrize(
    "data",
    [
        "@@@@",
        "AAA",  # missing padding: strict base64
        "iVBO-w0K_goA",  # the URL-safe alphabet
        "AAAA%3D%3D",  # percent-encoding is not decoded in base64 data
        "AA\u00e9A",
    ],
)
async def test_bad_base64_is_an_invalid_image(data: str) -> None:
    error = await invalid(MediaFetcher(STRICT), f"data:image/png;base64,{data}")
    assert "base64" in error.message


@pytest.mark.parametrize("url", ["data:image/png;base64,", "data:image/png;base64,  \n", "data:,"])
async def test_empty_data_url_is_an_invalid_image(url: str) -> None:
    error = await invalid(MediaFetcher(STRICT), url)
    assert "no data" in error.message


async def test_data_url_over_the_cap_is_refused() -> None:
    fetcher = MediaFetcher(MediaConfig(max_image_bytes=10))
    ten = base64.b64encode(b"0123456789").decode()
    assert await fetcher.load(f"data:;base64,{ten}") == b"0123456789"
    assert await fetcher.load("data:,0123456789") == b"0123456789"
    for url in (
        f"data:;base64,{base64.b64encode(b'0123456789a').decode()}",
        f"data:;base64,{base64.b64encode(b'x' * 1_000_000).decode()}",
        "data:,0123456789a",
    ):
        error = await refused(fetcher, url)
        assert "max_image_bytes (10 bytes)" in error.message


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        ("%41%42%43", b"ABC"),
        ("a%2fb%2Fc", b"a/b/c"),
        ("back\\slash%5C", b"back\\slash\\"),  # a literal backslash is data, not an escape
        ("%00%ff", b"\x00\xff"),
        ("%41" * 400_000, b"A" * 400_000),  # more than one slice, escapes across the seams
        ("x" + "%41" * 400_000, b"x" + b"A" * 400_000),
    ],
)
def test_percent_decoding(data: str, expected: bytes) -> None:
    assert decode_data_url(f"data:,{data}", max_bytes=1 << 30) == expected


@pytest.mark.parametrize("data", ["%4", "%zz", "a%", "%%41", "%" * 2_000_000])
async def test_a_stray_percent_is_a_malformed_data_url(data: str) -> None:
    error = await invalid(MediaFetcher(STRICT), f"data:,{data}")
    assert error.message == "Image data URL is malformed: '%' must be followed by two hex digits"


@pytest.mark.parametrize("slice_chars", [4, 8, 1 << 20])
@pytest.mark.parametrize(
    ("data", "expected"),
    [
        ("QUFBQkJC", b"AAABBB"),
        ("QUFB\nQkJD\nRA==", b"AAABBCD"),
        ("QQ==QUFB", None),  # two encodings end to end: one strict decode refuses it, slices too
        ("QUFBQ===", None),
        ("QUFBQkJC=", None),
    ],
)
def test_base64_decodes_alike_whatever_the_slice_size(monkeypatch, slice_chars, data, expected) -> None:
    monkeypatch.setattr(media_module, "_SLICE_CHARS", slice_chars)
    if expected is None:
        with pytest.raises(InvalidImageError, match="not valid base64"):
            decode_data_url(f"data:;base64,{data}", max_bytes=1 << 20)
    else:
        assert decode_data_url(f"data:;base64,{data}", max_bytes=1 << 20) == expected


def test_a_header_that_is_not_ascii_does_not_make_the_base64_invalid() -> None:
    assert decode_data_url(f"data:image/png;name=caf\u00e9.png;base64,{PNG_B64}", max_bytes=1 << 20) == PNG


@contextmanager
def traced() -> Iterator[list[int]]:
    """Python allocations while the block runs: [peak bytes] once it ends."""
    peak: list[int] = []
    tracemalloc.start()
    try:
        yield peak
        peak.append(tracemalloc.get_traced_memory()[1])
    finally:
        tracemalloc.stop()


def test_a_percent_encoded_data_url_costs_little() -> None:
    # 30 MB of '%41' cost 2.3 GB and 7.5 s decoded by urllib's unquote_to_bytes
    url = "data:image/png," + "%41" * 10_000_000
    started = time.perf_counter()
    with traced() as peak:
        decoded = decode_data_url(url, max_bytes=20 << 20)
    elapsed = time.perf_counter() - started
    assert decoded == b"A" * 10_000_000
    assert peak[0] < 3 * len(url)  # the result, and a slice at a time
    assert elapsed < 3.0  # ~0.2 s here


def test_a_percent_encoded_data_url_over_the_cap_is_refused_before_decoding() -> None:
    url = "data:," + "%41" * 1_000_000
    with traced() as peak, pytest.raises(MediaRefusedError, match="max_image_bytes"):
        decode_data_url(url, max_bytes=100_000)
    assert peak[0] < 1 << 20  # refused from the length alone


def test_base64_padded_with_whitespace_costs_little() -> None:
    image = bytes(range(256)) * 40_000  # 10 MB
    url = "data:;base64," + " ".join(base64.b64encode(image).decode())  # 27 MB: a space after every character
    with traced() as peak:
        decoded = decode_data_url(url, max_bytes=20 << 20)
    assert decoded == image
    assert peak[0] < 2.5 * len(url)  # str.split made a string per character before: +0.5 GB


def test_base64_that_can_only_decode_too_large_is_refused_before_decoding() -> None:
    url = "data:;base64," + "QUFB" * 1_000_000
    with traced() as peak, pytest.raises(MediaRefusedError, match="max_image_bytes"):
        decode_data_url(url, max_bytes=1_000_000)
    assert peak[0] < 2.5 * len(url)  # the data as a string, as ASCII bytes, and without whitespace


# --- schemes and IP literals -----------------------------------------------------------------


@pytest.mark.parametrize(
    "url",
    [
        "file:///etc/passwd",
        "ftp://example.com/cat.png",
        "gopher://example.com/1",
        "javascript:alert(1)",
        "//example.com/cat.png",
        "example.com/cat.png",
    ],
)
async def test_non_http_schemes_are_refused(fetcher_factory, no_connections, url: str) -> None:
    fetcher = await fetcher_factory(LOOPBACK_OK)
    error = await refused(fetcher, url)
    assert "only http, https and data URLs are allowed" in error.message


@pytest.mark.parametrize(
    "url",
    [
        "http://10.0.0.1/",
        "http://172.16.5.4/",
        "http://192.168.1.1/",
        "http://169.254.169.254/latest/meta-data/",
        "http://100.64.0.1/",  # CGNAT
        "http://127.0.0.1:9/",
        "http://0.0.0.0/",
        "http://224.0.0.1/",
        "http://240.0.0.1/",
        "https://[::1]/",
        "http://[::]/",
        "http://[fc00::1]/",
        "http://[fd12:3456::1]/",
        "http://[fe80::1%25eth0]/",
        "http://[::ffff:169.254.169.254]/",  # IPv4-mapped: judged by the IPv4 address
        "http://[::ffff:10.0.0.1]/",
        "http://[ff02::1]/",
    ],
)
async def test_private_ip_literals_are_refused_before_connecting(fetcher_factory, no_connections, url: str) -> None:
    fetcher = await fetcher_factory(STRICT)
    error = await refused(fetcher, url)
    assert "is not a public address" in error.message


@pytest.mark.parametrize("url", ["http://2130706433/", "http://127.1/", "http://0177.0.0.1/"])
async def test_non_canonical_numeric_hosts_are_refused(fetcher_factory, no_connections, url: str) -> None:
    fetcher = await fetcher_factory(LOOPBACK_OK)
    error = await refused(fetcher, url)
    assert "not a canonical IP address" in error.message


async def test_urls_with_credentials_or_without_a_host(fetcher_factory, no_connections) -> None:
    fetcher = await fetcher_factory(LOOPBACK_OK)
    error = await refused(fetcher, "http://user:pw@127.0.0.1/x.png")
    assert "credentials" in error.message and "pw" not in error.message
    await invalid(fetcher, "http:///x.png")
    await invalid(fetcher, "http://127.0.0.1:99999/x.png")


# --- loopback fetches ------------------------------------------------------------------------


async def test_loopback_fetch_with_private_networks_allowed(fetcher_factory, media_server) -> None:
    fetcher = await fetcher_factory(LOOPBACK_OK)
    assert await fetcher.load(media_server.url("/img.png")) == PNG
    assert await fetcher.load(media_server.url("/img.png", host="localhost")) == PNG
    assert media_server.hits == ["/img.png", "/img.png"]


async def test_loopback_is_refused_by_default(fetcher_factory, media_server) -> None:
    fetcher = await fetcher_factory(STRICT)
    error = await refused(fetcher, media_server.url("/img.png"))
    assert "'127.0.0.1' is not a public address" in error.message
    error = await refused(fetcher, media_server.url("/img.png", host="localhost"))
    assert "'localhost' resolves to no public address" in error.message
    assert media_server.hits == []


async def test_ipv6_loopback(fetcher_factory, media_server_v6) -> None:
    strict = await fetcher_factory(STRICT)
    error = await refused(strict, media_server_v6.url("/img.png"))
    assert "'::1' is not a public address" in error.message
    assert media_server_v6.hits == []
    allowed = await fetcher_factory(LOOPBACK_OK)
    assert await allowed.load(media_server_v6.url("/img.png")) == PNG


async def test_sends_a_short_user_agent_and_no_cookies(fetcher_factory, media_server) -> None:
    fetcher = await fetcher_factory(LOOPBACK_OK)
    assert await fetcher.load(media_server.url("/headers")) == b"User-Agent=modality-gateway;Cookie="
    assert await fetcher.load(media_server.url("/headers")) == b"User-Agent=modality-gateway;Cookie="


async def test_no_proxy_from_the_environment(fetcher_factory, media_server, monkeypatch) -> None:
    monkeypatch.setenv("HTTP_PROXY", "http://10.9.9.9:3128")
    monkeypatch.setenv("http_proxy", "http://10.9.9.9:3128")
    fetcher = await fetcher_factory(LOOPBACK_OK)
    assert await fetcher.load(media_server.url("/img.png")) == PNG


# --- names, resolved at connect time ---------------------------------------------------------


@pytest.mark.parametrize(
    ("address", "public"),
    [
        ("8.8.8.8", True),
        ("93.184.215.14", True),
        ("2606:4700:4700::1111", True),
        ("::ffff:8.8.8.8", True),
        ("127.0.0.1", False),
        ("10.1.2.3", False),
        ("172.31.255.255", False),
        ("192.168.0.1", False),
        ("169.254.169.254", False),
        ("100.64.0.1", False),
        ("0.0.0.0", False),
        ("224.0.0.251", False),
        ("240.0.0.1", False),
        ("255.255.255.255", False),
        ("192.0.2.1", False),  # documentation
        ("::1", False),
        ("::", False),
        ("fc00::1", False),
        ("fe80::1", False),
        ("fe80::1%eth0", False),
        ("fec0::1", False),  # site-local
        ("ff02::1", False),
        ("2001:db8::1", False),
        ("::ffff:127.0.0.1", False),
        ("::ffff:169.254.169.254", False),
        ("2002:a00:1::", False),  # 6to4 of 10.0.0.1
        ("64:ff9b::a00:1", False),  # NAT64 of 10.0.0.1
        ("not-an-address", False),
    ],
)
def test_is_public_address(address: str, public: bool) -> None:
    assert is_public_address(address) is public


async def test_resolver_drops_non_public_addresses() -> None:
    inner = FakeResolver({"mixed.test": ["10.1.2.3", "93.184.215.14", "::ffff:127.0.0.1", "2606:4700::1"]})
    resolver = PublicAddressResolver(inner)
    results = await resolver.resolve("mixed.test", 443, socket.AF_UNSPEC)
    assert [r["host"] for r in results] == ["93.184.215.14", "2606:4700::1"]
    assert all(r["port"] == 443 for r in results)


async def test_resolver_refuses_a_name_with_only_private_addresses() -> None:
    resolver = PublicAddressResolver(FakeResolver({"internal.test": ["10.1.2.3", "169.254.169.254"]}))
    with pytest.raises(NonPublicAddressError, match=r"'internal\.test' resolves to no public address"):
        await resolver.resolve("internal.test", 80)
    resolver.allow_private = True
    assert [r["host"] for r in await resolver.resolve("internal.test", 80)] == ["10.1.2.3", "169.254.169.254"]
    await resolver.close()
    assert isinstance(resolver.inner, FakeResolver) and resolver.inner.closed


async def test_a_name_is_checked_at_connect_time(fetcher_factory) -> None:
    dns = FakeResolver({"internal.test": ["10.1.2.3"]})
    fetcher = await fetcher_factory(STRICT, resolver=dns)
    error = await refused(fetcher, "http://internal.test/cat.png")
    assert "'internal.test' resolves to no public address" in error.message
    assert dns.asked == ["internal.test"]  # the connector asked, and got nothing to connect to


async def test_a_name_that_rebinds_to_loopback_gets_nowhere(fetcher_factory, media_server) -> None:
    dns = FakeResolver({"media.test": ["127.0.0.1"]})
    strict = await fetcher_factory(STRICT, resolver=dns)
    await refused(strict, media_server.url("/img.png", host="media.test"))
    assert media_server.hits == []
    allowed = await fetcher_factory(LOOPBACK_OK, resolver=dns)
    assert await allowed.load(media_server.url("/img.png", host="media.test")) == PNG  # the resolver is the path


async def test_names_that_do_not_resolve(fetcher_factory) -> None:
    fetcher = await fetcher_factory(STRICT, resolver=FakeResolver({}))
    error = await refused(fetcher, "http://nowhere.test/cat.png")
    assert "'nowhere.test'" in error.message and "does not resolve" in error.message


# --- allow_domains ---------------------------------------------------------------------------


async def test_allow_domains_localhost(fetcher_factory, media_server) -> None:
    fetcher = await fetcher_factory(MediaConfig(allow_domains=("localhost",), allow_private_networks=True))
    assert await fetcher.load(media_server.url("/img.png", host="localhost")) == PNG
    error = await refused(fetcher, media_server.url("/img.png"))
    assert "'127.0.0.1' is not in media.allow_domains" in error.message
    await refused(fetcher, "http://example.com/cat.png")
    assert media_server.hits == ["/img.png"]


async def test_allow_domains_matches_the_domain_and_its_subdomains_only(fetcher_factory, media_server) -> None:
    dns = FakeResolver({name: ["127.0.0.1"] for name in ("media.test", "img.media.test", "badmedia.test")})
    media = MediaConfig(allow_domains=("Media.Test.",), allow_private_networks=True)
    fetcher = await fetcher_factory(media, resolver=dns)
    assert await fetcher.load(media_server.url("/img.png", host="media.test")) == PNG
    assert await fetcher.load(media_server.url("/img.png", host="IMG.media.test")) == PNG
    for host in ("badmedia.test", "media.test.evil.test", "test"):
        error = await refused(fetcher, media_server.url("/img.png", host=host))
        assert "is not in media.allow_domains" in error.message
    assert dns.asked == ["media.test", "img.media.test"]


# --- size, time, status ----------------------------------------------------------------------


async def test_size_cap_by_content_length(fetcher_factory, media_server) -> None:
    fetcher = await fetcher_factory(MediaConfig(allow_private_networks=True, max_image_bytes=5000))
    assert await fetcher.load(media_server.url("/sized/5000")) == b"x" * 5000
    error = await refused(fetcher, media_server.url("/sized/5001"))
    assert "max_image_bytes (5000 bytes)" in error.message


@pytest.mark.parametrize("chunked", ["", "?chunked=1"])
async def test_videos_and_audio_have_size_limits_of_their_own(fetcher_factory, media_server, chunked) -> None:
    limits = MediaConfig(allow_private_networks=True, max_image_bytes=10, max_video_bytes=5000, max_audio_bytes=3000)
    fetcher = await fetcher_factory(limits)
    assert await fetcher.load(media_server.url(f"/sized/5000{chunked}"), "video") == b"x" * 5000
    assert await fetcher.load(media_server.url(f"/sized/3000{chunked}"), "audio") == b"x" * 3000
    error = await refused(fetcher, media_server.url(f"/sized/5001{chunked}"), "video")
    assert error.message == "Video is larger than media.max_video_bytes (5000 bytes)"
    error = await refused(fetcher, media_server.url(f"/sized/3001{chunked}"), "audio")
    assert error.message == "Audio is larger than media.max_audio_bytes (3000 bytes)"
    error = await refused(fetcher, media_server.url(f"/sized/11{chunked}"))
    assert error.message == "Image is larger than media.max_image_bytes (10 bytes)"
    # data URLs too, and the messages name the medium
    clip = "data:video/mp4;base64," + base64.b64encode(b"v" * 5001).decode()
    assert (await refused(fetcher, clip, "video")).message.startswith("Video is larger than media.max_video_bytes")
    assert fetcher.max_bytes("audio") == 3000
    with pytest.raises(InvalidImageError, match=r"^Audio data URL is not valid base64$"):
        await fetcher.load("data:audio/wav;base64,@@@@", "audio")
    assert (await refused(fetcher, "ftp://media.test/v.mp4", "video")).message.startswith("Video URL has scheme 'ftp'")


async def test_content_length_is_checked_before_reading(fetcher_factory, media_server) -> None:
    fetcher = await fetcher_factory(MediaConfig(allow_private_networks=True, fetch_timeout_s=10))
    started = time.monotonic()
    error = await refused(fetcher, media_server.url("/claims-huge"))
    assert "max_image_bytes" in error.message
    assert time.monotonic() - started < 5  # refused on the header, not after waiting for the body


async def test_size_cap_while_streaming_without_content_length(fetcher_factory, media_server) -> None:
    fetcher = await fetcher_factory(MediaConfig(allow_private_networks=True, max_image_bytes=5000))
    assert await fetcher.load(media_server.url("/sized/5000?chunked=1")) == b"x" * 5000
    error = await refused(fetcher, media_server.url("/sized/5001?chunked=1"))
    assert "max_image_bytes (5000 bytes)" in error.message


async def test_an_endless_body_is_cut_at_the_cap(fetcher_factory, media_server) -> None:
    fetcher = await fetcher_factory(MediaConfig(allow_private_networks=True, max_image_bytes=1_000_000))
    error = await refused(fetcher, media_server.url("/endless"))
    assert "max_image_bytes" in error.message


async def test_a_slow_server_times_out(fetcher_factory, media_server) -> None:
    fetcher = await fetcher_factory(MediaConfig(allow_private_networks=True, fetch_timeout_s=0.3))
    started = time.monotonic()
    error = await refused(fetcher, media_server.url("/slow"))
    assert "'127.0.0.1' did not deliver the image within 0.3s" in error.message
    assert time.monotonic() - started < 3


async def test_the_timeout_covers_the_whole_fetch(fetcher_factory, media_server) -> None:
    fetcher = await fetcher_factory(MediaConfig(allow_private_networks=True, fetch_timeout_s=0.5))
    started = time.monotonic()
    error = await refused(fetcher, media_server.url("/trickle"))
    assert "within 0.5s" in error.message
    assert time.monotonic() - started < 3


@pytest.mark.parametrize("code", [404, 500, 403, 304])
async def test_non_2xx_is_refused(fetcher_factory, media_server, code: int) -> None:
    fetcher = await fetcher_factory(LOOPBACK_OK)
    error = await refused(fetcher, media_server.url(f"/status/{code}"))
    assert f"answered HTTP {code}" in error.message


async def test_an_empty_body_is_an_invalid_image(fetcher_factory, media_server) -> None:
    fetcher = await fetcher_factory(LOOPBACK_OK)
    error = await invalid(fetcher, media_server.url("/sized/0"))
    assert "empty body" in error.message


async def test_connection_failures(fetcher_factory, media_server) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead_port = s.getsockname()[1]
    fetcher = await fetcher_factory(LOOPBACK_OK)
    error = await refused(fetcher, f"http://127.0.0.1:{dead_port}/img.png")
    assert "the connection failed" in error.message
    error = await refused(fetcher, media_server.url("/broken"))
    assert "broke off" in error.message


# --- redirects -------------------------------------------------------------------------------


async def test_redirects_are_followed_up_to_the_limit(fetcher_factory, media_server) -> None:
    fetcher = await fetcher_factory(LOOPBACK_OK)
    assert MAX_REDIRECTS == 3
    assert await fetcher.load(media_server.url("/hops/3")) == PNG
    assert media_server.hits == ["/hops/3", "/hops/2", "/hops/1", "/hops/0"]
    for status in (301, 303, 307, 308):
        assert await fetcher.load(media_server.redirect(media_server.url("/img.png"), status=status)) == PNG


async def test_too_many_redirects(fetcher_factory, media_server) -> None:
    fetcher = await fetcher_factory(LOOPBACK_OK)
    error = await refused(fetcher, media_server.url("/hops/4"))
    assert "redirected more than 3 times" in error.message
    assert media_server.hits == ["/hops/4", "/hops/3", "/hops/2", "/hops/1"]


async def test_a_redirect_loop_stops_at_the_limit(fetcher_factory, media_server) -> None:
    fetcher = await fetcher_factory(LOOPBACK_OK)
    error = await refused(fetcher, media_server.url("/loop"))
    assert "redirected more than 3 times" in error.message
    assert media_server.hits == ["/loop"] * (MAX_REDIRECTS + 1)


@pytest.mark.usefixtures("loopback_v4_is_public")
@pytest.mark.parametrize(
    "target", ["http://169.254.169.254/latest/meta-data/", "http://10.0.0.1/x.png", "http://[::1]:9/x.png"]
)
async def test_a_redirect_to_a_private_address_is_refused(fetcher_factory, media_server, target: str) -> None:
    fetcher = await fetcher_factory(STRICT)
    assert await fetcher.load(media_server.url("/img.png")) == PNG  # 127.0.0.1 counts as public here
    error = await refused(fetcher, media_server.redirect(target))
    assert error.message.startswith("Image URL redirect host") and "is not a public address" in error.message
    assert media_server.hits == ["/img.png", "/redirect"]


@pytest.mark.usefixtures("loopback_v4_is_public")
async def test_a_redirect_to_a_private_name_is_refused_at_connect_time(fetcher_factory, media_server) -> None:
    dns = FakeResolver({"internal.test": ["10.1.2.3"]})
    fetcher = await fetcher_factory(STRICT, resolver=dns)
    error = await refused(fetcher, media_server.redirect("http://internal.test/x.png"))
    assert "'internal.test' resolves to no public address" in error.message
    assert dns.asked == ["internal.test"]


async def test_a_redirect_is_rechecked_for_scheme_and_domain(fetcher_factory, media_server) -> None:
    fetcher = await fetcher_factory(MediaConfig(allow_domains=("localhost",), allow_private_networks=True))
    error = await refused(fetcher, media_server.redirect("file:///etc/passwd", host="localhost"))
    assert "scheme 'file'" in error.message
    error = await refused(fetcher, media_server.redirect(media_server.url("/img.png"), host="localhost"))
    assert "redirect host '127.0.0.1' is not in media.allow_domains" in error.message
    error = await refused(fetcher, media_server.redirect("data:image/png;base64," + PNG_B64, host="localhost"))
    assert "scheme 'data'" in error.message
    error = await refused(fetcher, media_server.url("/no-location", host="localhost"))
    assert "without a Location" in error.message
    assert media_server.hits == ["/redirect"] * 3 + ["/no-location"]


# --- reload ----------------------------------------------------------------------------------


async def test_each_fetch_is_held_to_the_rules_it_is_given(fetcher_factory, media_server) -> None:
    # one fetcher, the rules of each request's config generation (a reload changes no fetch's)
    fetcher = await fetcher_factory(STRICT)
    by_name = media_server.url("/img.png", host="localhost")
    await refused(fetcher, by_name)
    assert await fetcher.load(by_name, "image", LOOPBACK_OK) == PNG
    assert await fetcher.load(media_server.url("/img.png"), "image", LOOPBACK_OK) == PNG
    # no pooled connection or cached DNS answer carries one request's rules to another
    await refused(fetcher, by_name)
    await refused(fetcher, media_server.url("/img.png"))
    with pytest.raises(MediaRefusedError) as info:
        await fetcher.load(by_name, "image", MediaConfig(allow_domains=("example.com",), allow_private_networks=True))
    assert "not in media.allow_domains" in info.value.message
    with pytest.raises(MediaRefusedError):
        await fetcher.load(by_name, "image", MediaConfig(allow_private_networks=True, max_image_bytes=10))
    with pytest.raises(MediaRefusedError):
        await fetcher.load("data:;base64," + PNG_B64, "image", MediaConfig(max_image_bytes=10))
    assert media_server.hits == ["/img.png"] * 3

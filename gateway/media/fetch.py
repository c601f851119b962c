"""The bytes of a media part (image, video, audio): decoded from a ``data:`` URL, or fetched under
the ``media:`` rules.

A fetch is an SSRF risk, so every rule is checked where it cannot be dodged:

- scheme (http, https), host (``allow_domains``: the domain or a subdomain of it; empty allows any)
  and IP literals are checked before each request, on the first URL and on every redirect;
- host names are checked when the connection is made: :class:`PublicAddressResolver` sits in the
  session's connector and drops every address that is not globally routable, so the address
  checked is the address connected to (a name that re-resolves to 10.0.0.1 gets nowhere);
- redirects are followed by hand (at most :data:`MAX_REDIRECTS`), ``fetch_timeout_s`` bounds the
  whole fetch, and the body is read only up to the size limit of its kind (``max_image_bytes``,
  ``max_video_bytes``, ``max_audio_bytes``).

:meth:`MediaFetcher.load` raises only :class:`~gateway.errors.MediaRefusedError` (policy, or the
fetch failed) and :class:`~gateway.errors.InvalidImageError` (malformed data URL, empty body). Their
messages name at most the URL's host, never its path or query; the caller sets ``param``.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import codecs
import functools
import hashlib
import ipaddress
import re
import socket
from typing import Literal

import aiohttp
from aiohttp.abc import AbstractResolver, ResolveResult
from aiohttp.resolver import DefaultResolver
from yarl import URL

from ..config import MediaConfig
from ..errors import GatewayError, InvalidImageError, MediaRefusedError

USER_AGENT = "modality-gateway"
MAX_REDIRECTS = 3
_REDIRECT_STATUSES = frozenset({301, 302, 303, 307, 308})
_CHUNK_BYTES = 64 * 1024
_NAT64 = ipaddress.IPv6Network("64:ff9b::/96")
_MEDIA_TYPE = re.compile(r"[\w!#$&^.+-]+/[\w!#$&^.+-]+")
_WHITESPACE = b" \t\n\r\f\v"
# Data URLs are decoded this many characters at a time (a multiple of 4, for base64).
_SLICE_CHARS = 1 << 20
# Data URLs larger than this are decoded on a worker thread: base64 of 20 MB takes ~0.2 s.
DECODE_IN_THREAD_CHARS = 1 << 20
HASH_IN_THREAD_BYTES = 1 << 20

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
MediaKind = Literal["image", "video", "audio", "file"]


class NonPublicAddressError(OSError):
    """Raised by :class:`PublicAddressResolver` when a name resolves to no public address."""


def is_public_address(address: str) -> bool:
    """True for a globally routable unicast address; IPv6 forms that embed IPv4 are judged by it."""
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return False
    return _is_public(ip)


def _is_public(ip: IPAddress) -> bool:
    if isinstance(ip, ipaddress.IPv6Address):
        embedded = ip.ipv4_mapped or ip.sixtofour
        if embedded is None and ip in _NAT64:
            embedded = ipaddress.IPv4Address(int(ip) & 0xFFFF_FFFF)
        if embedded is not None:
            return _is_public(embedded)
        if ip.is_site_local:
            return False
    # is_global alone misses multicast, and its lists differ between Python versions.
    special = ip.is_private or ip.is_loopback or ip.is_link_local or ip.is_multicast
    return ip.is_global and not (special or ip.is_reserved or ip.is_unspecified)


class PublicAddressResolver(AbstractResolver):
    """Wraps a resolver and drops the addresses the connector must not connect to."""

    def __init__(self, inner: AbstractResolver, *, allow_private: bool = False) -> None:
        self.inner = inner
        self.allow_private = allow_private

    async def resolve(
        self, host: str, port: int = 0, family: socket.AddressFamily = socket.AF_INET
    ) -> list[ResolveResult]:
        results = await self.inner.resolve(host, port, family)
        if self.allow_private:
            return results
        public = [r for r in results if is_public_address(r["host"])]
        if not public:
            raise NonPublicAddressError(f"'{host}' resolves to no public address")
        return public

    async def close(self) -> None:
        await self.inner.close()


class MediaFetcher:
    """Loads image bytes from data URLs and from http(s) URLs, under the ``media:`` rules of the
    config generation each request was admitted under (``media=``; the rules given here when
    none is): a reload never changes the rules of a fetch that is under way or of a request
    already admitted."""

    def __init__(self, media: MediaConfig, *, resolver: AbstractResolver | None = None) -> None:
        self._media = media
        self._inner_resolver = resolver  # the test seam; the default resolver when None
        self._inner: AbstractResolver | None = None
        # one session a value of allow_private_networks, each connecting through a resolver that
        # drops what it must not connect to (made when first used)
        self._sessions: dict[bool, aiohttp.ClientSession] = {}
        self._started = False

    async def start(self) -> None:
        self._started = True

    def _session(self, allow_private: bool) -> aiohttp.ClientSession:
        session = self._sessions.get(allow_private)
        if session is not None:
            return session
        assert self._started, "MediaFetcher.start() was not called"
        if self._inner is None:
            self._inner = self._inner_resolver or DefaultResolver()
        resolver = PublicAddressResolver(self._inner, allow_private=allow_private)
        # a pooled connection or a cached DNS answer was checked under the rules of another
        # request: every fetch resolves and connects afresh
        connector = aiohttp.TCPConnector(resolver=resolver, use_dns_cache=False, force_close=True)
        session = self._sessions[allow_private] = aiohttp.ClientSession(
            connector=connector,
            cookie_jar=aiohttp.DummyCookieJar(),
            trust_env=False,
            headers={"User-Agent": USER_AGENT, "Accept": "image/*"},
            timeout=aiohttp.ClientTimeout(total=None),  # load() bounds the whole fetch itself
        )
        return session

    async def close(self) -> None:
        sessions, self._sessions = self._sessions, {}
        for session in sessions.values():
            await session.close()
        if self._inner is not None:
            await self._inner.close()
            self._inner = None
        self._started = False

    def max_bytes(self, kind: MediaKind, media: MediaConfig | None = None) -> int:
        """The size limit of one medium of this kind, under ``media`` (the request's rules)."""
        return size_limit(media or self._media, kind)

    async def load(self, url: str, kind: MediaKind = "image", media: MediaConfig | None = None) -> bytes:
        """The bytes behind ``url``, under ``media`` (the request's rules), within the size limit
        of its ``kind`` (``media.max_image_bytes``, ``max_video_bytes``, ``max_audio_bytes``);
        raises MediaRefusedError or InvalidImageError, their messages naming the kind."""
        try:
            return await self._load(url, kind, media or self._media)
        except GatewayError as exc:
            if kind == "image":
                raise
            raise type(exc)(_reworded(exc.message, kind), param=exc.param, rejection=exc.rejection) from None

    async def _load(self, url: str, kind: MediaKind, media: MediaConfig) -> bytes:
        limit = size_limit(media, kind)
        if is_data_url(url):
            if len(url) > DECODE_IN_THREAD_CHARS:
                return await asyncio.to_thread(decode_data_url, url, max_bytes=limit)
            return decode_data_url(url, max_bytes=limit)
        target = _parse_url(url)
        try:
            async with asyncio.timeout(media.fetch_timeout_s):
                return await self._fetch(target, media, _normalize_domains(media.allow_domains), limit)
        except TimeoutError:
            raise MediaRefusedError(
                f"Image URL host '{target.host}' did not deliver the image within {media.fetch_timeout_s:g}s"
            ) from None

    async def _fetch(self, url: URL, media: MediaConfig, domains: tuple[str, ...], limit: int) -> bytes:
        session = self._session(media.allow_private_networks)
        for hop in range(MAX_REDIRECTS + 1):
            what = "Image URL" if hop == 0 else "Image URL redirect"
            _check(url, media, domains, what)
            try:
                async with session.get(url, allow_redirects=False) as response:
                    if response.status in _REDIRECT_STATUSES:
                        url = _redirect_target(response, what)
                        continue
                    if not 200 <= response.status < 300:
                        raise MediaRefusedError(f"{what} host '{url.host}' answered HTTP {response.status}")
                    return await _read_capped(response, limit, url.host)
            except aiohttp.ClientError as exc:
                raise MediaRefusedError(_fetch_failure(exc, what, url.host)) from None
        raise MediaRefusedError(f"Image URL redirected more than {MAX_REDIRECTS} times")


def _check(url: URL, media: MediaConfig, domains: tuple[str, ...], what: str) -> None:
    """The rules that can be checked before connecting; names are checked again at connect time."""
    if url.scheme not in ("http", "https"):
        scheme = f"scheme '{url.scheme}'" if url.scheme else "no scheme"
        raise MediaRefusedError(f"{what} has {scheme}; only http, https and data URLs are allowed")
    host = url.raw_host
    if not host:
        raise InvalidImageError(f"{what} has no host")
    if url.user is not None or url.password is not None:
        raise MediaRefusedError(f"{what} for host '{url.host}' carries credentials; they are not sent")
    if domains and not _domain_allowed(host.rstrip(".").lower(), domains):
        raise MediaRefusedError(f"{what} host '{url.host}' is not in media.allow_domains")
    ip = _ip_literal(url, what)
    if ip is not None and not media.allow_private_networks and not _is_public(ip):
        raise MediaRefusedError(
            f"{what} host '{url.host}' is not a public address (media.allow_private_networks is false)"
        )


async def sha256(data: bytes) -> str:
    """A medium's sha256, hex: what identical media are known by (encoder uuids, the conversions
    cache). Large media are hashed off the event loop (1 MiB takes ~0.6 ms)."""
    if len(data) > HASH_IN_THREAD_BYTES:
        return await asyncio.to_thread(lambda: hashlib.sha256(data).hexdigest())
    return hashlib.sha256(data).hexdigest()


def is_data_url(url: str) -> bool:
    return url[:5].lower() == "data:"


def decode_data_url(url: str, *, max_bytes: int) -> bytes:
    """Decode ``data:[<mediatype>][;base64],<data>`` (RFC 2397): strict base64, else percent-encoding.

    Sizes are checked before decoding, and decoding goes a slice at a time: no step holds more
    than a few copies of the data, and a caller on a worker thread lets the event loop run
    between slices.
    """
    comma = url.find(",", 5)  # no copies of the data but the ones decoding needs
    if comma < 0:
        raise InvalidImageError("Image data URL is malformed: no ',' before the data")
    header = url[5:comma]
    params = [p.strip() for p in header.split(";")]
    is_base64 = len(params) > 1 and params[-1].lower() == "base64"
    if is_base64:
        params.pop()
    media_type, attributes = params[0], params[1:]
    if media_type and not _MEDIA_TYPE.fullmatch(media_type):
        raise InvalidImageError(f"Image data URL is malformed: '{media_type[:40]}' is not a media type")
    if any("=" not in a for a in attributes):
        raise InvalidImageError("Image data URL is malformed: a media type parameter has no '='")
    start = comma + 1
    raw = _decode_base64(url, start, max_bytes) if is_base64 else _decode_percent(url, start, max_bytes)
    if len(raw) > max_bytes:
        raise _too_large(max_bytes)
    if not raw:
        raise InvalidImageError("Image data URL holds no data")
    return raw


def _decode_base64(url: str, start: int, max_bytes: int) -> bytes:
    if not url.isascii() and not url[start:].isascii():  # the header may name a file 'é.png'
        raise InvalidImageError("Image data URL is not valid base64")
    whole, offset = _encoded(url, start)
    size = len(whole) - offset
    # line breaks are allowed: what counts is the length without them, and decoding can't be cheaper
    if size // 4 * 3 > max_bytes + 2 and _length_without_whitespace(whole, offset) // 4 * 3 > max_bytes + 2:
        raise _too_large(max_bytes)
    try:
        return _b64decode(whole, offset)
    except binascii.Error:
        pass
    stripped = _without_whitespace(whole, offset)
    try:
        if len(stripped) == size:  # no whitespace: the error was real
            raise binascii.Error
        return _b64decode(stripped, 0)
    except binascii.Error:
        raise InvalidImageError("Image data URL is not valid base64") from None


# A slice at a time: one call over 30 MB would hold the GIL, and so the event loop, for 50 ms.
def _length_without_whitespace(whole: bytes, offset: int) -> int:
    return sum(len(whole[i : i + _SLICE_CHARS].translate(None, _WHITESPACE)) for i in _slices(whole, offset))


def _without_whitespace(whole: bytes, offset: int) -> bytes:
    return b"".join(whole[i : i + _SLICE_CHARS].translate(None, _WHITESPACE) for i in _slices(whole, offset))


def _slices(whole: bytes, offset: int) -> range:
    return range(offset, len(whole), _SLICE_CHARS)


def _b64decode(data: bytes, start: int) -> bytes:
    """Strict base64 of ``data[start:]``, a slice at a time; padding only at the very end, as one
    decode of the whole would demand."""
    padding = data.find(b"=", start)
    if (len(data) - start) % 4 or (padding != -1 and padding < len(data) - 2):
        raise binascii.Error("incomplete, or padded before the end")
    view = memoryview(data)
    return b"".join(base64.b64decode(view[i : i + _SLICE_CHARS], validate=True) for i in _slices(data, start))


def _decode_percent(url: str, start: int, max_bytes: int) -> bytes:
    # every byte of the result takes 1 to 3 characters ('%41')
    if (len(url) - start) // 3 > max_bytes:
        raise _too_large(max_bytes)
    raw, begin = _encoded(url, start)
    if raw.find(b"%", begin) < 0:
        return raw[begin:]
    if raw.find(b"%%", begin) >= 0:  # never valid, and it would make the slicing below crawl
        raise InvalidImageError("Image data URL is malformed: '%' must be followed by two hex digits")
    decoded = bytearray()
    while begin < len(raw):
        end = min(begin + _SLICE_CHARS, len(raw))
        while end < len(raw) and b"%" in raw[end - 2 : end]:  # never split an escape
            end -= 1
        if end <= begin:  # '%%%...': no escape can end here
            raise InvalidImageError("Image data URL is malformed: '%' must be followed by two hex digits")
        # %XX -> \xXX, decoded in C by the codec behind b"\x41" literals (backslashes escaped first)
        piece = raw[begin:end].replace(b"\\", b"\\\\").replace(b"%", b"\\x")
        try:
            decoded += codecs.escape_decode(piece)[0]
        except ValueError:
            raise InvalidImageError("Image data URL is malformed: '%' must be followed by two hex digits") from None
        if len(decoded) > max_bytes:
            raise _too_large(max_bytes)
        begin = end
    return bytes(decoded)


def _encoded(url: str, start: int) -> tuple[bytes, int]:
    """The URL as UTF-8, and where its data begins there: one copy, where ``url[start:]`` would add one."""
    return url.encode("utf-8"), len(url[:start].encode("utf-8"))


def _parse_url(url: str) -> URL:
    try:
        parsed = URL(url)
        parsed.port  # noqa: B018 - raises ValueError for a bad port
    except (ValueError, TypeError):
        raise InvalidImageError("Image URL is not a valid URL") from None
    return parsed


def _redirect_target(response: aiohttp.ClientResponse, what: str) -> URL:
    location = response.headers.get("Location")
    if not location:
        raise MediaRefusedError(f"{what} host '{response.url.host}' redirected without a Location")
    try:
        target = response.url.join(URL(location))
        target.port  # noqa: B018 - raises ValueError for a bad port
    except (ValueError, TypeError):
        raise MediaRefusedError(f"{what} host '{response.url.host}' redirected to an invalid URL") from None
    return target


async def _read_capped(response: aiohttp.ClientResponse, max_bytes: int, host: str | None) -> bytes:
    if response.content_length is not None and response.content_length > max_bytes:
        raise _too_large(max_bytes)
    chunks: list[bytes] = []
    size = 0
    async for chunk in response.content.iter_chunked(_CHUNK_BYTES):
        size += len(chunk)
        if size > max_bytes:
            raise _too_large(max_bytes)
        chunks.append(chunk)
    if not size:
        raise InvalidImageError(f"Image URL host '{host}' sent an empty body")
    return b"".join(chunks)


def _fetch_failure(exc: aiohttp.ClientError, what: str, host: str | None) -> str:
    """Why a fetch failed, in words; the exception's own text can carry internal addresses."""
    prefix = f"Could not fetch the image from host '{host}'"
    if isinstance(exc, aiohttp.ClientConnectorError):
        if isinstance(exc.os_error, NonPublicAddressError):
            return f"{what} host '{host}' resolves to no public address (media.allow_private_networks is false)"
        if isinstance(exc, aiohttp.ClientConnectorDNSError):
            return f"{prefix}: the name does not resolve"
        if isinstance(exc, aiohttp.ClientSSLError):
            return f"{prefix}: the TLS handshake failed"
        return f"{prefix}: the connection failed"
    if isinstance(exc, aiohttp.ClientPayloadError | aiohttp.ServerDisconnectedError):
        return f"{prefix}: the connection broke off"
    if isinstance(exc, aiohttp.ClientResponseError):
        return f"{prefix}: the response was malformed"
    return f"{prefix}: the request failed"


def size_limit(media: MediaConfig, kind: MediaKind) -> int:
    """The size limit of one medium of this kind."""
    if kind == "video":
        return media.max_video_bytes
    if kind == "audio":
        return media.max_audio_bytes
    if kind == "file":
        return media.max_file_bytes
    return media.max_image_bytes


def _too_large(max_bytes: int) -> MediaRefusedError:
    return MediaRefusedError(f"Image is larger than media.max_image_bytes ({max_bytes} bytes)")


def _reworded(message: str, kind: MediaKind) -> str:
    """A message of the image path (every message of this module is written for an image), for
    a video or an audio clip: the one place the other media are named."""
    noun = kind.capitalize()
    return (
        message.replace("Image is larger than media.max_image_bytes", f"{noun} is larger than media.max_{kind}_bytes")
        .replace("Image URL", f"{noun} URL")
        .replace("Image data URL", f"{noun} data URL")
        .replace("the image", f"the {kind}")
    )


def _ip_literal(url: URL, what: str) -> IPAddress | None:
    """The host as an IP address, or None for a name; refuses numeric hosts that are not canonical."""
    host = url.host or ""
    # aiohttp's own test: numeric hosts skip the resolver, so they must be judged here.
    if ":" not in host and not host.replace(".", "").isdigit():
        return None
    try:
        return ipaddress.ip_address(host)
    except ValueError:
        raise MediaRefusedError(f"{what} host '{host}' is not a canonical IP address") from None


@functools.lru_cache(maxsize=64)
def _normalize_domains(domains: tuple[str, ...]) -> tuple[str, ...]:
    normalized = []
    for domain in domains:
        name = domain.strip().rstrip(".").lower()
        try:
            name = URL.build(scheme="http", host=name).raw_host or name  # IDNA, as yarl encodes hosts
        except (ValueError, UnicodeError):
            pass
        normalized.append(name)
    return tuple(normalized)


def _domain_allowed(host: str, domains: tuple[str, ...]) -> bool:
    return any(host == d or host.endswith("." + d) for d in domains)

"""Turning a request's images into embeddings with the encoder backends (Encode/Prefill/Decode).

For a model with ``encode: {image: NAME}``, every ``image_url`` / ``input_image`` part is resolved to
bytes (a data URL, or a fetch under the ``media:`` rules), identical images are encoded once, all of
them concurrently, each on the least-loaded backend of encoder NAME, and each part becomes::

    {"type": "image_embeds", "image_embeds": <what the backend returned>, "uuid": "<sha256 of the bytes>"}

exactly what vLLM accepts with ``--enable-mm-embeds``. The backend returns vLLM's ``image_embeds``
value ready made (base64 of ``torch.save``, or the dict form with ``image_grid_thw``): the gateway
splices it in and never decodes, unpickles or re-encodes embeddings.

Parts that carry no image bytes (``file_id``, or a null image with a ``uuid`` that names media the
engine has cached) pass through unchanged. Media that cannot be had is a 400 (``media_refused``,
``invalid_image``); an encoder that cannot answer is a 503 ``encoder_unavailable``, which the
handler turns into a passthrough of the original images for models with
``on_encoder_error: passthrough``. aiohttp errors are mapped here and nowhere else.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, NamedTuple, TypeVar

import aiohttp
import orjson

from ..admission.parts import Part
from ..admission.plan import EXPAND
from ..admission.route import RoutePlan
from ..config import BreakerConfig, EncoderConfig, GatewayConfig, MediaConfig, ServerConfig
from ..errors import (
    EncoderError,
    GatewayError,
    ImagesRefusedError,
    InvalidImageError,
    MediaRefusedError,
    Rejection,
    error_detail,
)
from ..fanout import gather_all
from ..media.fetch import MediaFetcher, is_data_url, sha256
from ..metrics import GatewayMetrics
from ..tracing import Tracing, inject
from ..upstream.attempts import Attempts
from ..upstream.failures import CLIENT_ERRORS
from ..upstream.replicas import Pool, ReplicaSet
from ..upstream.wire import KEEPALIVE_S, whole_body
from . import epd

OCTETS = "application/octet-stream"  # an image as sent to an encoder backend: its bytes
log = logging.getLogger(__name__)

# Images of one request fetched or encoded at once; the backends batch across requests anyway.
PER_REQUEST_CONCURRENCY = 16
# Connections to all encoder backends together: a request with thousands of images queues here
# instead of exhausting the gateway's file descriptors.
MAX_ENCODER_CONNECTIONS = 256
T = TypeVar("T")
Replacements = dict[tuple[int, int], dict[str, Any]]


class Encoded(NamedTuple):
    """What encoding a request's images gave: the new parts, fields to add to the body, and how
    many images (frames included) were encoded."""

    replacements: Replacements
    fields: dict[str, Any]
    images: int = 0


class Image(NamedTuple):
    """An image to encode: a part of the request, a frame of one of its videos, or a page of one
    of its PDFs."""

    part: Part  # the request's part (for a frame: its video), which errors name
    url: str
    original: dict[str, Any]  # the image part as it stands
    frame: int | None = None  # a frame (a page image): its index among its video's (PDF's) parts
    data: bytes | None = None  # a frame: its JPEG, made by the gateway (not fetched, not held to a limit)


def _images(plan: RoutePlan, body: Mapping[str, Any], frames: Replacements) -> list[Image]:
    """The request's encodable images (those that carry bytes; a downscaled one at its new size),
    then its videos' frames and its PDFs' page images."""
    messages = body["messages"]
    images: list[Image] = []
    for part in plan.encode_parts:
        assert part.index is not None
        original = frames.get((part.message, part.index)) or messages[part.message]["content"][part.index]
        url = image_url(original)
        if url is not None:
            images.append(Image(part, url, original))
    made = (*(plan.frame_parts if plan.encodes_frames else ()), *(plan.extract_parts if plan.encodes_pages else ()))
    for source in made:  # videos as their frames, PDFs as their pages' text and images
        assert source.index is not None
        expanded = frames.get((source.message, source.index))
        if expanded is None or expanded.get("type") != EXPAND:
            continue  # a text file: no images
        jpegs: Mapping[int, bytes] = expanded.get("frames", {})
        for j, frame in enumerate(expanded["parts"]):
            url = image_url(frame) if frame.get("type") == "image_url" else None
            if url is not None:
                images.append(Image(source, url, frame, j, jpegs.get(j)))
    return images


def _placed(images: list[Image], new_parts: list[dict[str, Any]], frames: Replacements) -> Replacements:
    """The replacements: each image part by its new part; each video by its frames, encoded."""
    out: Replacements = {}
    expanded: dict[tuple[int, int], list[dict[str, Any]]] = {}
    for image, new in zip(images, new_parts, strict=True):
        assert image.part.index is not None
        key = (image.part.message, image.part.index)
        if image.frame is None:
            out[key] = new
            continue
        parts = expanded.get(key)
        if parts is None:
            parts = expanded[key] = list(frames[key]["parts"])
        parts[image.frame] = new
    for key, parts in expanded.items():
        out[key] = {"type": EXPAND, "parts": parts}
    return out


NOTHING = Encoded({}, {})


def image_url(part: Mapping[str, Any]) -> str | None:
    """The URL an image_url / input_image part carries, or None (file_id, cached-uuid reference)."""
    value = part.get("image_url")
    if isinstance(value, dict):
        value = value.get("url")
    return value if isinstance(value, str) and value else None


class EncoderClient:
    """Encodes images on the configured encoder backends over one shared ClientSession."""

    def __init__(
        self,
        metrics: GatewayMetrics,
        fetcher: MediaFetcher,
        local_urls: Callable[[str], str | None] = lambda name: None,
        *,
        tracing: Tracing | None = None,
    ) -> None:
        self._metrics = metrics
        self.fetcher = fetcher
        self._tracing = tracing  # each backend's request carries the encode span's traceparent
        self._local_urls = local_urls  # the supervisor's answer: where a local encoder listens, once ready
        # every backend's load and health, by URL; a request's pool is made from the URLs of its
        # encoder's config (the generation it was admitted under) when it encodes
        self._replicas = ReplicaSet(on_open=self._ejected)
        server = ServerConfig()  # until update() gives the config's
        self._connect_timeout_s = server.upstream_connect_timeout_s
        self._breaker = _breaker(server.upstream_cooldown_s)
        self._session: aiohttp.ClientSession | None = None
        self._rings: dict[tuple[str, tuple[str, ...]], Pool] = {}  # kind vllm: affinity pools, by URLs

    async def start(self, config: GatewayConfig) -> None:
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=MAX_ENCODER_CONNECTIONS, keepalive_timeout=KEEPALIVE_S),
            cookie_jar=aiohttp.DummyCookieJar(),
        )
        await self.fetcher.start()
        self.update(config)

    async def close(self) -> None:
        await self.fetcher.close()
        if self._session is not None:
            await self._session.close()

    def update(self, config: GatewayConfig) -> None:
        self._connect_timeout_s = config.server.upstream_connect_timeout_s
        self._breaker = _breaker(config.server.upstream_cooldown_s)
        self._replicas.retain(u for spec in config.encoders.values() for u in self.urls(spec))
        self._rings.clear()

    def backends(self, urls: Sequence[str]) -> list[dict[str, object]]:
        """The health of these backends (or vLLM encoder instances), as /readyz reports upstreams."""
        wanted = set(urls)
        return [entry for entry in self._replicas.snapshot() if entry["url"] in wanted]

    def urls(self, spec: EncoderConfig) -> list[str]:
        if spec.kind in ("http", "vllm"):
            return list(spec.urls)
        url = self._local_urls(spec.name)
        return [url] if url else []

    async def encode_or_pass(
        self, plan: RoutePlan, body: Mapping[str, Any], *, request_id: str, config: GatewayConfig, frames: Replacements
    ) -> Encoded:
        """:meth:`encode`; where the encoder fails and the model says ``on_encoder_error:
        passthrough``, nothing (the images go as sent), counted and said."""
        try:
            return await self.encode(plan, body, request_id=request_id, config=config, frames=frames)
        except EncoderError as exc:
            if plan.model.on_encoder_error != "passthrough":
                raise
            log.warning("encoder failed for model %s, sending the original images: %s", plan.model.name, exc.message)
            self._metrics.encoder_passthrough.labels(plan.model.name, plan.encoder or "").inc()
            return NOTHING

    async def encode(
        self,
        plan: RoutePlan,
        body: Mapping[str, Any],
        *,
        request_id: str,
        config: GatewayConfig,
        frames: Replacements | None = None,
    ) -> Encoded:
        """New parts for the request's encodable images, and for the frames of its videos
        (``frames``: the videos' replacements, each a part expanded into its frames). Raises 400s
        for bad media, EncoderError.

        ``config`` is the one the request was admitted under: a reload that removes the encoder
        while the request's images are fetched must not pull it away, nor change the ``media:``
        rules they are fetched under.
        """
        name = plan.encoder
        assert name is not None
        spec = config.encoders[name]  # validation guarantees it for the plan's own config
        images = _images(plan, body, frames or {})
        if not images:
            return NOTHING
        model = plan.model.name
        blobs = await self._load_all(images, model, config.media)
        shas = await asyncio.gather(*(sha256(b) for b in blobs))
        if self._tracing is not None and self._tracing.recording():  # the media named by hash, never shown
            self._tracing.current().set_attribute("gateway.encode.image.sha256", list(dict.fromkeys(shas)))
        if spec.kind == "vllm":
            new_parts, fields = await self._prime(spec, plan, body, images, shas, request_id)
        else:
            new_parts, fields = await self._encode_all(spec, images, blobs, shas, model, request_id), {}
        return Encoded(_placed(images, new_parts, frames or {}), fields, len(images))

    async def _encode_all(
        self,
        spec: EncoderConfig,
        images: list[Image],
        blobs: list[bytes],
        shas: list[str],
        model: str,
        request_id: str,
    ) -> list[dict[str, Any]]:
        """Each distinct image encoded once, on the least-loaded backend; the new parts."""
        unique = dict(zip(shas, blobs, strict=True))
        first: dict[str, Image] = {}
        for image, sha in zip(images, shas, strict=True):
            first.setdefault(sha, image)  # an error names the first part that carries the image
        limit = asyncio.Semaphore(PER_REQUEST_CONCURRENCY)
        pool = self._replicas.pool(spec.name, self.urls(spec), breaker=self._breaker)  # once per request
        job = _Job(spec, pool, model, request_id)
        replies = await gather_all(  # a refused image stops the others' encoding at once
            *(
                self._bounded(limit, functools.partial(self._encode_one, job, data, first[sha]))
                for sha, data in unique.items()
            )
        )
        by_sha = dict(zip(unique, replies, strict=True))
        return [{"type": "image_embeds", "image_embeds": by_sha[sha], "uuid": sha} for sha in shas]

    async def _prime(
        self,
        spec: EncoderConfig,
        plan: RoutePlan,
        body: Mapping[str, Any],
        images: list[Image],
        shas: list[str],
        request_id: str,
    ) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        """Images to vLLM encoder instances (gateway.encode.epd); the new parts for the consumer, and the
        fields its body gets."""
        assert self._session is not None, "EncoderClient.start() was not called"
        urls = tuple(self.urls(spec))
        pool = self._rings.get((spec.name, urls))
        if pool is None:  # the ring is made once per encoder and URL list, not per request
            pool = self._rings[(spec.name, urls)] = self._replicas.pool(
                spec.name, urls, balance="affinity", breaker=self._breaker
            )
        priming = epd.Priming(
            self._session,
            spec,
            pool,
            plan.model.upstream_name,
            epd.carried(body),
            request_id,
            self._metrics,
            self._tracing,
        )
        items: dict[str, epd.Item] = {}
        for image, sha in zip(images, shas, strict=True):
            if sha not in items:
                items[sha] = epd.Item.of(priming, sha, image.url)
        try:
            primed = await epd.prime(priming, list(items.values()), PER_REQUEST_CONCURRENCY)
        except InvalidImageError as exc:  # an instance refused a group: located at its first image
            refused = set(exc.uuids) if isinstance(exc, ImagesRefusedError) else set()
            first = next((i for i, sha in zip(images, shas, strict=True) if sha in refused), images[0])
            raise _at_part(exc, first, plan.model.name) from None
        fields = {"ec_transfer_params": primed.transfer_params} if primed.transfer_params else {}
        located = [(image.original, sha) for image, sha in zip(images, shas, strict=True)]
        return epd.parts_for_consumer(located, primed), fields

    async def _load_all(self, images: list[Image], model: str, media: MediaConfig) -> list[bytes]:
        # Each distinct fetched URL once. Data URLs are not compared (hashing a 30 MB string holds
        # the event loop for 30 ms); identical images are merged by their sha256 anyway. A video's
        # frames are not loaded: their bytes are at hand.
        loads: list[Image] = []  # per load, the first image it is for (its error names that part)
        slots: list[int] = []  # per image to load, its index in loads
        fetched: dict[str, int] = {}
        for image in images:
            if image.data is not None:
                continue
            url = image.url
            if not is_data_url(url):
                if url in fetched:
                    slots.append(fetched[url])
                    continue
                fetched[url] = len(loads)
            slots.append(len(loads))
            loads.append(image)
        limit = asyncio.Semaphore(PER_REQUEST_CONCURRENCY)
        # an image refused (too large, unreachable, not allowed) stops the other fetches at once
        loaded = await gather_all(
            *(self._bounded(limit, functools.partial(self._load, image, model, media)) for image in loads)
        )
        slot = iter(slots)
        return [image.data if image.data is not None else loaded[next(slot)] for image in images]

    async def _load(self, image: Image, model: str, media: MediaConfig) -> bytes:
        try:
            return await self.fetcher.load(image.url, "image", media)
        except GatewayError as exc:
            raise _at_part(exc, image, model) from None

    @staticmethod
    async def _bounded(limit: asyncio.Semaphore, work: Callable[[], Awaitable[T]]) -> T:
        """``work()`` once one of the request's places is free: its coroutine made only then, so a
        place given up (a sibling failed) leaves no coroutine that was never awaited."""
        async with limit:
            return await work()

    async def _encode_one(self, job: _Job, data: bytes, image: Image) -> Any:
        assert self._session is not None, "EncoderClient.start() was not called"
        name, spec = job.spec.name, job.spec
        # a backend that does not accept the connection is skipped, like an upstream replica
        timeout = aiohttp.ClientTimeout(total=spec.timeout_s, sock_connect=self._connect_timeout_s)
        headers = {"Content-Type": OCTETS, "X-Request-Id": job.request_id}
        inject(self._tracing, headers)
        # encoding is idempotent: every backend may be tried once. With every backend skipped the
        # first try goes anyway: one URL may be a whole fleet behind a Service, which one pod's
        # failure must not take out of use
        attempts = Attempts(job.pool, panic=True)
        last_status: tuple[int, bytes] | None = None
        started = time.perf_counter()
        try:
            while (lease := await attempts.next()) is not None:
                attempt = time.perf_counter()
                with lease:
                    try:
                        async with self._session.post(
                            f"{lease.replica.url}/v1/encode",
                            data=whole_body(data, OCTETS),
                            headers=headers,
                            timeout=timeout,
                        ) as resp:
                            payload = await resp.read()
                            status = resp.status
                    except CLIENT_ERRORS as exc:
                        failure = attempts.failed(lease, exc)
                        outcome = "error" if failure.kind in ("reset", "protocol") else failure.outcome
                        self._count(name, outcome)
                        self._instance(name, lease.replica.url, outcome, attempt)
                        if failure.kind in ("connect", "reset"):  # encoding is idempotent: the next backend
                            continue
                        if failure.kind == "timeout":
                            raise EncoderError(f"Encoder '{name}' did not answer within {spec.timeout_s:g}s") from None
                        raise EncoderError(f"Encoder '{name}' failed: {failure.reason}") from None
                    if status >= 500:  # overloaded or failing: try another backend
                        lease.failure(f"HTTP {status}")
                        last_status = (status, payload)
                        outcome = "overloaded" if status == 503 else "error"
                        self._count(name, outcome)
                        self._instance(name, lease.replica.url, outcome, attempt)
                        continue
                    lease.success()
                    outcome = "ok" if status == 200 else "invalid" if status in (400, 413) else "error"
                    self._instance(name, lease.replica.url, outcome, attempt)
                return self._reply(name, status, payload, image, job.model)
        finally:
            self._metrics.encoder_seconds.labels(name).observe(time.perf_counter() - started)
        self._count(name, "unavailable")
        retry_after = {"Retry-After": str(job.pool.retry_after())}
        if last_status is not None:
            status, payload = last_status
            raise EncoderError(f"Encoder '{name}' answered {status}{error_detail(payload)}", headers=retry_after)
        if not attempts.tried:
            raise EncoderError(f"Encoder '{name}' has no healthy backend", headers=retry_after)
        raise EncoderError(f"Encoder '{name}' has no reachable backend", headers=retry_after)

    @staticmethod
    def _ejected(encoder: str, url: str) -> None:
        log.warning("encoder %s backend %s: circuit breaker open, skipped until a probe succeeds", encoder, url)

    def _reply(self, name: str, status: int, payload: bytes, image: Image, model: str) -> Any:
        try:
            reply = orjson.loads(payload)
        except orjson.JSONDecodeError:
            reply = None
        if status == 200 and isinstance(reply, dict) and _is_embeds(reply.get("image_embeds")):
            self._count(name, "cached" if reply.get("cached") else "ok")
            return reply["image_embeds"]
        if status in (400, 413):  # the backend refused this image: the client's fault, located at the part
            self._count(name, "invalid")
            refused: GatewayError = (
                InvalidImageError(f"the image cannot be encoded{error_detail(payload)}")
                if status == 400
                else MediaRefusedError(f"the image is larger than encoder '{name}' takes")
            )
            raise _at_part(refused, image, model)
        self._count(name, "error")
        raise EncoderError(f"Encoder '{name}' answered {status}{error_detail(payload)}", headers={"Retry-After": "1"})

    def _count(self, name: str, outcome: str) -> None:
        self._metrics.encoder_requests.labels(name, outcome).inc()

    def _instance(self, name: str, url: str, outcome: str, started: float) -> None:
        metrics = self._metrics
        metrics.child(metrics.encoder_backend_requests, name, url, outcome).inc()
        metrics.child(metrics.encoder_backend_seconds, name, url).observe(time.perf_counter() - started)


class _Job(NamedTuple):
    """What each image of one request is encoded with, and for whom."""

    spec: EncoderConfig
    pool: Pool  # the encoder's backends, as of the request's generation
    model: str  # the requested model, which errors name
    request_id: str


def _breaker(open_s: float) -> BreakerConfig:
    """An encoder backend is skipped after one failure (the image goes to the next backend at once,
    so acting on one failure costs nothing) and let back after one successful probe."""
    return BreakerConfig(failures=1, open_s=open_s, successes=1)


def _is_embeds(value: object) -> bool:
    if isinstance(value, str):
        return bool(value)
    return isinstance(value, dict) and bool(value) and all(isinstance(v, str) for v in value.values())


def _at_part(error: GatewayError, image: Image, model: str) -> GatewayError:
    """The same error, said at the image's part (a frame: at its video) and counted as refused media."""
    frame = image.frame is not None
    return error.located_at(
        image.part.location,
        what="a frame of the video" if frame else "",
        rejection=Rejection(model, "video" if frame else "image", "media_refused"),
    )

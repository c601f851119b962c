"""The encoder backend's HTTP face: POST /v1/encode, GET /health, GET /metrics.

``POST /v1/encode``: the body is the image file's bytes (any Content-Type). The reply is JSON::

    {"model": "<fingerprint>", "sha256": "<hex of the body>", "tokens": 196, "hidden": 384,
     "dtype": "float32", "image_grid_thw": null | [t, h, w], "cached": false,
     "image_embeds": "<base64 of torch.save(tensor (tokens, hidden))>" | {"image_embeds": ..., "image_grid_thw": ...}}

Errors use the gateway's shape, ``{"error": {"message", "type", "param", "code"}}``: 400
``invalid_image`` (images over the pixel or aspect-ratio cap too), 413 ``payload_too_large``, 503
``encoder_overloaded`` (with Retry-After), 504 ``encoder_timeout``.
"""

from __future__ import annotations

import asyncio
import io
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

import orjson
from aiohttp import web
from aiohttp.typedefs import Handler
from PIL import Image
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.aiohttp import make_aiohttp_handler

from gateway.errors import GatewayError, render

from .batching import BatchStats, DynamicBatcher, QueueFullError
from .errors import (
    BackendError,
    EncodeTimeoutError,
    HTTPStatusError,
    ImageTooLargeError,
    InvalidImageError,
    OverloadedError,
    UnhealthyError,
)
from .limits import DECODE_BUDGET_PIXELS, MAX_ASPECT_RATIO, MAX_PIXELS, DecodeLimits
from .preprocess import ImageError
from .service import EncoderService

log = logging.getLogger(__name__)

BATCH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128)
SECONDS_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)
RESULTS = ("ok", "cached", "invalid", "overloaded", "timeout", "error")


class EncoderMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.images = Counter("vision_encoder_images", "Images answered, by result.", ["result"], registry=registry)
        for result in RESULTS:
            self.images.labels(result)
        self.batch_size = Histogram(
            "vision_encoder_batch_size", "Images per forward pass.", buckets=BATCH_BUCKETS, registry=registry
        )
        self.queue_seconds = Histogram(
            "vision_encoder_queue_seconds", "Time an image waited for its batch.", buckets=SECONDS_BUCKETS,
            registry=registry,
        )  # fmt: skip
        self.forward_seconds = Histogram(
            "vision_encoder_forward_seconds", "Time of one forward pass.", buckets=SECONDS_BUCKETS, registry=registry
        )
        self.cache_hits = Counter("vision_encoder_cache_hits", "Images answered from the cache.", registry=registry)
        self.cache_misses = Counter("vision_encoder_cache_misses", "Images that needed encoding.", registry=registry)
        self.decode_pixels = Gauge(
            "vision_encoder_decode_pixels", "Pixels being decoded now (held in the decode budget).", registry=registry
        )
        self.decode_waiting = Gauge(
            "vision_encoder_decode_waiting", "Images waiting for room in the decode budget.", registry=registry
        )

    def watch(self, service: EncoderService) -> None:
        budget = service.decode_budget
        self.decode_pixels.set_function(lambda: budget.in_flight)
        self.decode_waiting.set_function(lambda: budget.waiting)

    def batch_stats(self) -> BatchStats:
        def on_batch(size: int, seconds: float) -> None:
            self.batch_size.observe(size)
            self.forward_seconds.observe(seconds)

        return BatchStats(on_batch=on_batch, on_queue_wait=self.queue_seconds.observe)


SERVICE_KEY = web.AppKey("service", EncoderService)
METRICS_KEY = web.AppKey("metrics", EncoderMetrics)


@web.middleware
async def _errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except GatewayError as exc:
        return render(exc)
    except web.HTTPRequestEntityTooLarge as exc:
        return render(ImageTooLargeError(f"image is larger than the limit ({exc.text})"))
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return render(HTTPStatusError(exc.status, exc.reason))
    except asyncio.CancelledError:
        raise
    except Exception:
        log.exception("unhandled error in %s %s", request.method, request.path)
        return render(BackendError("internal error in the encoder"))


async def encode(request: web.Request) -> web.Response:
    service, metrics = request.app[SERVICE_KEY], request.app[METRICS_KEY]
    data = await request.read()
    try:
        reply, cached = await asyncio.wait_for(service.encode(data), service.timeout_s)
    except ImageError as exc:
        metrics.images.labels("invalid").inc()
        raise InvalidImageError(str(exc)) from None
    except QueueFullError as exc:
        metrics.images.labels("overloaded").inc()
        raise OverloadedError(str(exc), headers={"Retry-After": "1"}) from None
    except TimeoutError:
        metrics.images.labels("timeout").inc()
        raise EncodeTimeoutError(f"encoding took longer than {service.timeout_s:g}s") from None
    except Exception:
        metrics.images.labels("error").inc()
        raise
    (metrics.cache_hits if cached else metrics.cache_misses).inc()
    metrics.images.labels("cached" if cached else "ok").inc()
    info = service.tower.info
    return web.Response(
        body=orjson.dumps(reply.to_json(model=info.fingerprint, dtype=service.dtype, cached=cached)),
        content_type="application/json",
    )


def _probe_image() -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (32, 32), (127, 127, 127)).save(buffer, "PNG")
    return buffer.getvalue()


PROBE = _probe_image()


async def health(request: web.Request) -> web.Response:
    service = request.app[SERVICE_KEY]
    info = service.tower.info
    body: dict[str, Any] = {
        "status": "ok",
        "model": info.name,
        "source": info.source,
        "fingerprint": info.fingerprint,
        "demo_weights": info.demo_weights,
        "device": str(service.tower.device),
        "dtype": service.dtype,
        "hidden_size": info.hidden_size,
        "queued": service.batcher.queued,
        "decode": {
            "pixels": service.decode_budget.in_flight,
            "budget_pixels": service.decode_budget.limit,
            "waiting": service.decode_budget.waiting,
        },
        "cache": {"entries": len(service.cache), "bytes": service.cache.bytes, "max_bytes": service.cache.max_bytes},
    }
    if info.demo_weights:
        body["note"] = "random demo weights: the embeddings mean nothing"
    batcher = service.batcher
    if not batcher.alive:
        raise UnhealthyError("the batcher has stopped")
    if batcher.stalled_for() > service.timeout_s:
        raise UnhealthyError(f"no batch has finished for {batcher.stalled_for():.0f}s while images wait")
    if batcher.busy:
        body["check"] = "skipped: busy (batches are finishing, which shows it is alive)"
        return web.json_response(body, dumps=lambda o: orjson.dumps(o).decode())
    started = time.perf_counter()
    try:
        reply = await asyncio.wait_for(service.encode_uncached(PROBE), service.timeout_s)
    except Exception as exc:  # any failure of the real encode is unhealthy
        log.error("health check encode failed: %r", exc)
        raise UnhealthyError(f"health check encode failed: {type(exc).__name__}: {exc}") from None
    body["check"] = (
        f"encoded a 32x32 image to {reply.tokens}x{reply.hidden} in {(time.perf_counter() - started) * 1000:.1f} ms"
    )
    return web.json_response(body, dumps=lambda o: orjson.dumps(o).decode())


def create_app(
    service: EncoderService, *, registry: CollectorRegistry, metrics: EncoderMetrics, max_image_bytes: int
) -> web.Application:
    app = web.Application(client_max_size=max_image_bytes, middlewares=[_errors])
    app[SERVICE_KEY] = service
    app[METRICS_KEY] = metrics
    metrics.watch(service)
    app.router.add_post("/v1/encode", encode)
    app.router.add_get("/health", health)

    app.router.add_get("/metrics", make_aiohttp_handler(registry))

    async def lifecycle(app: web.Application) -> AsyncIterator[None]:
        service.batcher.start()
        yield
        await service.batcher.stop()
        service.close()

    app.cleanup_ctx.append(lifecycle)
    return app


def build(
    model: str = "builtin:vit-small",
    *,
    device: str = "auto",
    max_batch_size: int = 32,
    max_batch_tokens: int = 65536,
    max_batch_delay_ms: float = 0.0,
    max_queue: int = 1024,
    cache_bytes: int = 1 << 30,
    max_pixels: int = MAX_PIXELS,
    max_aspect_ratio: float = MAX_ASPECT_RATIO,
    decode_budget_pixels: int = DECODE_BUDGET_PIXELS,
    max_image_bytes: int = 20 * 1024 * 1024,
    timeout_s: float = 30.0,
    registry: CollectorRegistry | None = None,
) -> web.Application:
    """Load the tower and wire the backend (used by the CLI and the tests)."""
    from .towers import load_tower, resolve_device

    registry = registry if registry is not None else CollectorRegistry()
    metrics = EncoderMetrics(registry)
    dev, dtype = resolve_device(device)
    tower = load_tower(model, device=dev, dtype=dtype)
    batcher = DynamicBatcher(
        tower,
        max_batch_size=max_batch_size,
        max_batch_tokens=max_batch_tokens,
        max_batch_delay_ms=max_batch_delay_ms,
        max_queue=max_queue,
        stats=metrics.batch_stats(),
    )
    service = EncoderService(
        tower,
        batcher,
        cache_bytes=cache_bytes,
        timeout_s=timeout_s,
        limits=DecodeLimits(max_pixels, max_aspect_ratio, decode_budget_pixels),
    )
    return create_app(service, registry=registry, metrics=metrics, max_image_bytes=max_image_bytes)

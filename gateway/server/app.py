"""The application factory: wiring only."""

from __future__ import annotations

import asyncio
import contextlib
import importlib.metadata
import logging
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from types import MappingProxyType
from typing import Any

from aiohttp import web
from prometheus_client import CollectorRegistry
from prometheus_client.aiohttp import make_aiohttp_handler

from ..admission.shared import SharedLimits
from ..config import GatewayConfig
from ..encode.client import EncoderClient
from ..encode.supervisor import Supervisor
from ..media.conversions import ConversionCache
from ..media.decoders import DecoderPool
from ..media.describe import Describer
from ..media.documents import Documents
from ..media.fetch import MediaFetcher
from ..media.speak import Speaker
from ..media.transcribe import Transcriber
from ..meters import WorkersCollector
from ..metrics import GatewayMetrics
from ..tracing import Tracing
from ..upstream.client import UpstreamClient
from ..upstream.collector import PoolCollector
from ..upstream.concurrency import Gates
from ..upstream.health import HealthChecker
from ..upstream.replicas import ReplicaSet
from . import doors, handlers, status
from .access_log import quiet_parser_errors
from .middlewares import add_routes
from .state import SERVICES_KEY, Services
from .store import ConfigStore

# How the gateway must be served (web.run_app, AppRunner, TestServer): a client that leaves cancels
# its handler, which closes the upstream request; bodies come as sent, Content-Encoding decoded by
# gateway.admission.body within the gateway's limits.
log = logging.getLogger(__name__)

SERVER_OPTIONS: Mapping[str, Any] = MappingProxyType({"handler_cancellation": True, "auto_decompress": False})
TRACES_STOP_S = 2.0  # the longest a stopping gateway waits for its last spans to be sent


def create_app(
    config: GatewayConfig,
    *,
    registry: CollectorRegistry | None = None,
    config_path: str | None = None,
    watch: bool = True,
    supervisor: Supervisor | None = None,
    multiprocess_dir: str | None = None,
) -> web.Application:
    """Build the gateway, to be served with :data:`SERVER_OPTIONS`.

    ``config_path`` enables reloads (``watch`` also polls the file for edits). ``supervisor``
    runs the local encoder backends (default: one of this process's own, on ``config``; tests
    give one with another command line or watch); a worker of ``serve --workers N`` passes the
    master's view of its, and the
    ``multiprocess_dir`` its metrics go to (``PROMETHEUS_MULTIPROC_DIR``): /metrics sums every worker's."""
    quiet_parser_errors()  # no header a client sent (its key) in an ERROR traceback
    registry = registry if registry is not None else CollectorRegistry()
    metrics = GatewayMetrics(registry, multiprocess=multiprocess_dir is not None)
    scrape = registry
    if multiprocess_dir is not None:
        scrape = CollectorRegistry()
        scrape.register(WorkersCollector(multiprocess_dir))
    replicas = ReplicaSet(on_open=lambda model, url: _ejected(metrics, model, url))
    store = ConfigStore(config, metrics=metrics, path=config_path, replicas=replicas)
    shared = _shared_limits(config, metrics)
    gates = Gates(
        on_shed=lambda model, reason, priority: metrics.child(metrics.shed, model, reason, priority).inc(),
        on_wait=lambda model, priority, waited: metrics.child(metrics.queue_wait, model, priority).observe(waited),
        # with a store, a model's max_concurrency is divided among the live gateway processes
        slots=shared.slots if shared is not None else lambda limit: limit,
    )
    scrape.register(PoolCollector(lambda: store.live.pools, gates))  # this process's pools, also in a worker
    if supervisor is None:
        supervisor = Supervisor(config)
    tracing = _tracing(config)
    encoder = EncoderClient(metrics, MediaFetcher(config.media), supervisor.url, tracing=tracing)
    conversions = ConversionCache(config.media.cache_bytes, metrics)
    store.subscribe(encoder.update)
    store.subscribe(supervisor.update)
    store.subscribe(lambda new: conversions.resize(new.media.cache_bytes))
    upstream = UpstreamClient(metrics, tracing=tracing)
    decoders = DecoderPool()
    services = Services(
        store,
        metrics,
        upstream,
        encoder,
        supervisor,
        config.server.max_body_bytes,
        gates,
        transcriber=Transcriber(metrics, encoder.fetcher, upstream.retries, conversions, tracing=tracing),
        describer=Describer(metrics, encoder.fetcher, upstream.retries, conversions, tracing=tracing),
        speaker=Speaker(metrics, encoder.fetcher, upstream.retries, tracing=tracing),
        documents=Documents(metrics, encoder.fetcher, decoders, conversions),
        conversions=conversions,
        decoders=decoders,
        shared_limits=shared,
        tracing=tracing,
    )

    store.subscribe(services.key_limits.reloaded)  # a key's rate changed: from the reload on
    app = web.Application(client_max_size=config.server.max_body_bytes)  # no middleware: see add_routes
    app[SERVICES_KEY] = services
    for lifetime in _lifetimes(services):  # each its own: one that fails to start stops those started
        app.cleanup_ctx.append(lifetime)
    app.cleanup_ctx.append(_health_checks)
    app.cleanup_ctx.append(_realtime)
    if config_path is not None and watch:
        app.cleanup_ctx.append(_config_watcher)

    gets = {
        "/": status.page,
        "/status": status.endpoint(scrape),
        "/v1/models": handlers.list_models,
        "/healthz": handlers.healthz,
        "/readyz": handlers.readyz,
        "/admin/config": handlers.admin_config,
        "/metrics": handlers.metrics_endpoint(make_aiohttp_handler(scrape)),
    }
    # every API's routes (gateway.admission.apis.catalog): a WebSocket session's a GET
    gets |= {path: handler for path, (handler, api) in doors.ROUTES.items() if api.method == "GET"}
    posts = {path: handler for path, (handler, api) in doors.ROUTES.items() if api.method == "POST"}
    posts["/admin/reload"] = handlers.admin_reload
    add_routes(app, gets, posts)
    return app


def _shared_limits(config: GatewayConfig, metrics: GatewayMetrics) -> SharedLimits | None:
    """The key limits' shared store (``server.limits_store``), read at start: a reload that
    changes it is said to need a restart."""
    spec = config.server.limits_store
    if spec is None:
        return None
    for op in ("admit", "visual", "finish", "members"):
        metrics.limits_store_errors.labels(op)
    return SharedLimits(spec, metrics)


def _tracing(config: GatewayConfig) -> Tracing | None:
    """The tracer (``server.tracing``), read at start: a reload that changes it is said to need
    a restart."""
    spec = config.server.tracing
    if spec is None:
        return None
    try:
        version = importlib.metadata.version("modality-gateway")
    except importlib.metadata.PackageNotFoundError:  # run from a checkout that was never installed
        version = ""
    return Tracing(
        spec.otlp_endpoint,
        spec.sample_ratio,
        service=spec.service_name,
        version=version,
        trust_client_sampling=spec.trust_client_sampling,
    )


Lifetime = Callable[[web.Application], AsyncIterator[None]]


def _lifetimes(services: Services) -> list[Lifetime]:
    """What the gateway starts and stops, in the order it starts them; aiohttp stops them in the
    reverse order (the upstream client first, the supervised encoders next to last, the tracer
    last: the spans of the drain go too), and only those that started. The supervisor, the
    encoder client and the upstream client are looked up when their lifetime runs (a test may
    stand one in); the others are those of the app as it was made."""
    s = services
    config = s.store.current
    tracing, transcriber, describer, documents, speaker = s.tracing, s.transcriber, s.describer, s.documents, s.speaker
    lifetimes = [
        _lifetime(None, lambda: _stop_tracing(tracing)) if tracing is not None else None,
        _lifetime(lambda: s.supervisor.start(), lambda: s.supervisor.close()),
        _shared_limits_lifetime,
        _lifetime(None, lambda: _close_decoding(s.decoders, documents)),
        _lifetime(lambda: describer.start(), lambda: describer.close()) if describer else None,
        _lifetime(lambda: speaker.start(), lambda: speaker.close()) if speaker else None,
        _lifetime(lambda: transcriber.start(), lambda: transcriber.close()) if transcriber else None,
        _lifetime(lambda: s.encoder.start(config), lambda: s.encoder.close()),
        _lifetime(lambda: s.upstream.start(), lambda: s.upstream.close()),
    ]
    return [lifetime for lifetime in lifetimes if lifetime is not None]


def _lifetime(
    start: Callable[[], Awaitable[None]] | None, stop: Callable[[], Awaitable[None] | None] | None
) -> Lifetime:
    async def lifetime(app: web.Application) -> AsyncIterator[None]:
        if start is not None:
            await start()
        yield
        if stop is not None and (stopping := stop()) is not None:
            await stopping

    return lifetime


def _close_decoding(decoders: DecoderPool, documents: Documents | None) -> None:
    decoders.close()
    if documents is not None:
        documents.close()


async def _shared_limits_lifetime(app: web.Application) -> AsyncIterator[None]:
    """Counted among the live processes before the first request, then every second."""
    shared = app[SERVICES_KEY].shared_limits
    if shared is None:
        yield
        return
    await shared.heartbeat()
    members = asyncio.create_task(shared.keep_alive(), name="limits store heartbeat")
    yield
    members.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await members
    await shared.close()


async def _stop_tracing(tracing: Tracing) -> None:
    """The spans left sent, waited for TRACES_STOP_S at most: the SDK's shutdown blocks while a
    collector does not answer (its exporter retries for 10 s a batch), which must not eat the
    drain's time. It goes on in a daemon thread; what it has not sent when the process ends is lost."""
    stopping = threading.Thread(target=tracing.shutdown, name="trace export shutdown", daemon=True)
    stopping.start()
    await asyncio.to_thread(stopping.join, TRACES_STOP_S)
    if stopping.is_alive():
        log.warning("the trace collector did not take the last spans within %gs; they may be lost", TRACES_STOP_S)


async def _realtime(app: web.Application) -> AsyncIterator[None]:
    """Realtime sessions still open when the app stops are closed, said why; then their client."""
    hub = app[SERVICES_KEY].realtime
    yield
    hub.stop_all()
    await hub.close()


async def _health_checks(app: web.Application) -> AsyncIterator[None]:
    services = app[SERVICES_KEY]
    task = asyncio.create_task(HealthChecker(lambda: services.store.live, services.metrics).run(), name="health checks")
    yield
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


async def _config_watcher(app: web.Application) -> AsyncIterator[None]:
    task = asyncio.create_task(app[SERVICES_KEY].store.watch(), name="routing.yaml watcher")
    yield
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


def _ejected(metrics: GatewayMetrics, model: str, url: str) -> None:
    log.warning("upstream %s of model %s: circuit breaker open, skipped until a probe succeeds", url, model)
    metrics.upstream_ejections.labels(model, url).inc()

"""The running config, and how a new routing.yaml takes its place without a restart.

:class:`ConfigStore` holds the live :class:`~gateway.config.generation.Generation`: a
:class:`~gateway.config.GatewayConfig` and what is made from it (the upstream pools, the keys). A
request takes ``store.live`` once, at admission, and works with it to its last byte. A reload (the
file changed, ``POST /admin/reload``, or SIGHUP) builds and validates a whole new config and its
pools, and swaps them in at once; requests in flight keep the generation they started with, whose
pools and replicas stay valid for them. An invalid file changes nothing: the old config stays, the
problems are logged, and ``gateway_config_reloads_total{result="failure"}`` counts it. ``server.host``, ``port``,
``max_body_bytes``, ``client_idle_timeout_s``, ``drain_grace_s``, ``drain_timeout_s``, ``access_log``,
``upstream_client``, ``admin_listen`` and ``limits_store`` take effect at the next start.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import time
from collections.abc import Callable

from ..admission.apis import CHAT
from ..admission.apis.catalog import BY_NAME
from ..config import PRIORITIES, GatewayConfig, load_config, missing_software
from ..config.generation import Generation
from ..errors import ConfigError, ConfigProblem
from ..metrics import NO_KEY, REJECTION_REASONS, SHED_REASONS, TOKEN_KINDS, GatewayMetrics
from ..modalities import MODALITY_NAMES
from ..upstream.replicas import Pool, ReplicaSet

log = logging.getLogger(__name__)

_RESTART_ONLY = (
    "host",
    "upstream_client",
    "port",
    "max_body_bytes",
    "client_idle_timeout_s",
    "drain_grace_s",
    "drain_timeout_s",
    "admin_listen",
    "limits_store",
    "tracing",
    "access_log",
)


class ConfigStore:
    def __init__(
        self,
        config: GatewayConfig,
        *,
        metrics: GatewayMetrics,
        path: str | None = None,
        replicas: ReplicaSet | None = None,
    ) -> None:
        self.path = path
        self.replicas = replicas or ReplicaSet()
        self.live = self._generation(config, 1)
        self.loaded_at = time.time()
        self._metrics = metrics
        self._listeners: list[Callable[[GatewayConfig], None]] = []
        self._signature = self._stat()
        self._lock = asyncio.Lock()
        declare(metrics, config)
        metrics.config_generation.set(1)

    @property
    def current(self) -> GatewayConfig:
        return self.live.config

    @property
    def generation(self) -> int:
        return self.live.number

    def _generation(self, config: GatewayConfig, number: int) -> Generation[Pool]:
        missing = missing_software(config)  # a file's were refused with its lines; one built in code here
        if missing:
            raise ConfigError([ConfigProblem(config.source or "config", 0, 0, path, why) for path, why in missing])
        pools = {
            m.name: self.replicas.pool(m.name, m.upstreams, weights=m.weights, balance=m.balance, breaker=m.breaker)
            for m in config.models
        }
        self.replicas.retain(u for m in config.models for u in m.upstreams)
        checked = {u for m in config.models if m.health_check is not None for u in m.upstreams}
        for pool in pools.values():
            for replica in pool.replicas:
                if replica.url not in checked:  # no probe will ever bring it back: back in now
                    replica.checked_down, replica.probe_failures = False, 0
        return Generation.build(config, number, pools)

    def subscribe(self, listener: Callable[[GatewayConfig], None]) -> None:
        """Call ``listener(new_config)`` after every successful swap."""
        self._listeners.append(listener)

    async def reload(self) -> GatewayConfig:
        """Load the file again and swap it in; raise ConfigError (keeping the old config) if invalid."""
        if self.path is None:
            raise ConfigError([])
        async with self._lock:
            self._signature = self._stat()
            try:
                new = await asyncio.to_thread(functools.partial(load_config, self.path, here=True))
            except ConfigError as exc:
                self._metrics.config_reloads.labels("failure").inc()
                log.error("routing.yaml reload failed; keeping generation %d:\n%s", self.generation, exc)
                raise
            self._swap(new)
            return new

    def _swap(self, new: GatewayConfig) -> None:
        old = self.current
        for key in _RESTART_ONLY:
            if getattr(old.server, key) != getattr(new.server, key):
                log.warning("server.%s changed; it takes effect at the next restart", key)
        self.live = self._generation(new, self.generation + 1)
        self.loaded_at = time.time()
        declare(self._metrics, new)
        self._metrics.config_reloads.labels("success").inc()
        self._metrics.config_generation.set(self.generation)
        for listener in self._listeners:
            listener(new)
        log.info("routing.yaml generation %d in effect: %d models", self.generation, len(new.models))

    async def watch(self) -> None:
        """Poll the file every ``server.reload_interval_s`` and reload when it changes."""
        while (interval := self.current.server.reload_interval_s) > 0:
            await asyncio.sleep(interval)
            signature = self._stat()
            if signature is not None and signature != self._signature:
                try:
                    await self.reload()
                except ConfigError:
                    pass  # logged and counted; wait for the next edit

    def _stat(self) -> tuple[int, int, int] | None:
        if self.path is None:
            return None
        try:
            st = os.stat(self.path)
        except OSError:
            return None
        return (st.st_mtime_ns, st.st_size, st.st_ino)


def declare(metrics: GatewayMetrics, config: GatewayConfig) -> None:
    """Create the series a config can produce at 0, so rate() and alerts see them from the start;
    say which config is live."""
    metrics.live_config(config.sha256 or "none")
    for key in config.auth.keys if config.auth is not None else ():
        for reason in ("rate", "concurrency", "tokens", "visual_tokens"):
            metrics.rate_limited.labels(key.name, reason)
    for model in config.models:
        for modality in MODALITY_NAMES:
            for reason in REJECTION_REASONS:
                metrics.rejections.labels(model.name, modality, reason, CHAT.name)
        metrics.retries_refused.labels(model.name)
        if config.auth is None:  # with keys, a key's series begin with its first reply
            for kind in TOKEN_KINDS:
                metrics.tokens.labels(model.name, NO_KEY, kind)
        if any(BY_NAME[api].stores for api in model.apis):
            for result in ("holder", "elsewhere", "unknown"):
                metrics.stored_responses.labels(model.name, result)
        if model.encode:
            for decision in ("encoded", "direct"):
                metrics.encode_decisions.labels(model.name, decision)
        if model.max_concurrency is not None:
            for priority in PRIORITIES:
                metrics.queue_wait.labels(model.name, priority)
                for reason in SHED_REASONS:
                    metrics.shed.labels(model.name, reason, priority)
        for url in model.upstreams:
            metrics.upstream_ejections.labels(model.name, url)
        for modality, policy in model.on_unsupported.items():
            if policy.action == "redirect" and policy.target:
                metrics.redirects.labels(model.name, modality.value, policy.target)
            elif policy.action == "strip":
                metrics.stripped_parts.labels(model.name, modality.value)
            elif policy.action == "transcribe":
                metrics.audio_transcribed_seconds.labels(model.name)
            elif policy.action == "describe":
                metrics.images_described.labels(model.name)
                metrics.image_describe_seconds.labels(model.name)
            elif policy.action == "frames":
                metrics.video_frames.labels(model.name)
        if model.video_sample is not None or any(p.action == "frames" for p in model.on_unsupported.values()):
            for reason in ("queue_full", "queue_timeout"):
                metrics.video_decode_shed.labels(model.name, reason)

"""The running config, and how a new routing.yaml takes its place without a restart.

:class:`ConfigStore` holds the current :class:`~gateway.config.GatewayConfig`. A reload (the file
changed, ``POST /admin/reload``, or SIGHUP) builds and validates a whole new config and swaps it in
at once; requests in flight keep the config they started with. An invalid file changes nothing: the
old config stays, the problems are logged, and ``gateway_config_reloads_total{result="failure"}``
counts it. ``server.host``, ``server.port`` and ``server.max_body_bytes`` take effect at the next start.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import time
from collections.abc import Callable

from .config import GatewayConfig, load_config
from .errors import ConfigError
from .metrics import GatewayMetrics

log = logging.getLogger(__name__)

_RESTART_ONLY = ("host", "port", "max_body_bytes")


class ConfigStore:
    def __init__(self, config: GatewayConfig, *, metrics: GatewayMetrics, path: str | None = None) -> None:
        self.path = path
        self.current = config
        self.generation = 1
        self.loaded_at = time.time()
        self._metrics = metrics
        self._listeners: list[Callable[[GatewayConfig], None]] = []
        self._signature = self._stat()
        self._lock = asyncio.Lock()
        metrics.declare(config)
        metrics.config_generation.set(1)

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
        self.current = new
        self.generation += 1
        self.loaded_at = time.time()
        self._metrics.declare(new)
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

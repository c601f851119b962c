"""Active health checks: each replica of a model with ``health_check`` is probed on its own.

Every ``interval_s`` a replica gets ``GET {url}{path}`` (vLLM and SGLang answer ``/health`` with
200 once the engine is up); a 2xx within ``timeout_s`` is a pass. After ``failures`` consecutive
failed probes the replica takes no requests (``Replica.checked_down``), whatever its breaker
says, until one probe passes. This finds a replica that died while idle, and keeps traffic off a
replica that is starting, before any request pays for it; the breaker (passive health) still
catches what probes miss. Probes are counted in ``gateway_health_checks_total``.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Awaitable, Callable

import aiohttp

from ..config import HealthCheckConfig
from ..config.generation import Generation
from ..metrics import GatewayMetrics
from .failures import CLIENT_ERRORS, failure_of
from .replicas import Pool, Replica

log = logging.getLogger(__name__)

TICK_S = 0.25  # how often due probes are looked for (an interval_s below it is probed every tick)


class HealthChecker:
    def __init__(
        self,
        live: Callable[[], Generation[Pool]],
        metrics: GatewayMetrics,
        *,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        self._live, self._metrics, self._clock, self._sleep = live, metrics, clock, sleep
        self._due: dict[str, float] = {}  # by URL: when its next probe is due
        self._probing: dict[str, asyncio.Task[None]] = {}  # by URL: the probe running now

    async def run(self) -> None:
        """Probe until cancelled (an app cleanup context runs it)."""
        timeout = aiohttp.ClientTimeout(total=None)
        async with aiohttp.ClientSession(timeout=timeout, cookie_jar=aiohttp.DummyCookieJar()) as session:
            try:
                while True:
                    self.start_due(session)
                    await self._sleep(TICK_S)
            finally:
                for task in self._probing.values():
                    task.cancel()

    def start_due(self, session: aiohttp.ClientSession) -> list[asyncio.Task[None]]:
        """Start a probe of every replica whose probe is due and not already running (a replica
        slow to answer its probe delays no other); the tasks started."""
        live = self._live()
        now = self._clock()
        started = []
        checked = {u for m in live.config.models if m.health_check is not None for u in m.upstreams}
        self._due = {u: due for u, due in self._due.items() if u in checked}  # forget URLs gone in a reload
        for model in live.config.models:
            check = model.health_check
            if check is None:
                continue
            for replica in live.pools[model.name].replicas:
                if self._due.get(replica.url, 0.0) <= now and replica.url not in self._probing:
                    self._due[replica.url] = now + check.interval_s
                    task = asyncio.create_task(self._probe(session, model.name, replica, check))
                    self._probing[replica.url] = task
                    task.add_done_callback(functools.partial(self._done, replica.url))
                    started.append(task)
        return started

    def _done(self, url: str, task: asyncio.Task[None]) -> None:
        self._probing.pop(url, None)
        if not task.cancelled() and (exc := task.exception()) is not None:
            log.error("health check of %s failed unexpectedly: %r", url, exc)  # and the loop goes on

    async def check_due(self, session: aiohttp.ClientSession) -> None:
        """Probe every replica that is due, and wait for the probes (tests)."""
        await asyncio.gather(*self.start_due(session))

    async def _probe(
        self, session: aiohttp.ClientSession, model: str, replica: Replica, check: HealthCheckConfig
    ) -> None:
        try:
            async with asyncio.timeout(check.timeout_s):
                async with session.get(replica.url + check.path, allow_redirects=False) as resp:
                    await resp.read()
                    passed, why = 200 <= resp.status < 300, f"HTTP {resp.status}"
        except CLIENT_ERRORS as exc:
            passed, why = False, failure_of(exc).reason
        self._metrics.health_checks.labels(model, replica.url, "pass" if passed else "fail").inc()
        if passed:
            if replica.checked_down:
                log.info("upstream %s of model %s passed its health check; back in", replica.url, model)
            replica.probe_failures, replica.checked_down = 0, False
            return
        replica.probe_failures += 1
        if not replica.checked_down and replica.probe_failures >= check.failures:
            replica.checked_down = True
            replica.last_error = f"health check: {why}"
            log.warning("upstream %s of model %s failed %d health checks (%s); out", replica.url, model,
                        replica.probe_failures, why)  # fmt: skip

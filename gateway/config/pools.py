"""The keys of a model that say how its replicas are used: upstreams and their weights,
``balance``, ``retries``, ``breaker``, ``timeouts``, ``max_concurrency`` and its ``queue``,
``health_check``, the bounds of its realtime sessions (``realtime``), and the upstream key
(``api_key_env``). Defaults that come from the ``server:``
section are resolved here, so a model's config holds every value it runs with."""

from __future__ import annotations

from typing import Any

from .keys import (
    BALANCE_POLICIES,
    BREAKER_KEYS,
    HEALTH_CHECK_KEYS,
    QUEUE_KEYS,
    REALTIME_KEYS,
    RETRY_KEYS,
    RETRYABLE_STATUSES,
    TIMEOUT_KEYS,
    UPSTREAM_KEYS,
)
from .loader import MISSING
from .readers import Readers, fields, show, unknown_message
from .types import (
    BreakerConfig,
    HealthCheckConfig,
    QueueConfig,
    RealtimeConfig,
    RetryConfig,
    ServerConfig,
    TimeoutConfig,
)

MAX_WEIGHT = 100  # affinity places 64 ring points per unit of weight; a ratio of 100 is plenty


class PoolReaders(Readers):
    def pool(self, raw: dict[str, Any], path: str, server: ServerConfig) -> dict[str, Any]:
        """A model's pool keys, as ModelConfig keyword arguments (all but upstreams and weights)."""
        api_key_env = raw.get("api_key_env", MISSING)
        balance = raw.get("balance", "p2c")
        if balance not in BALANCE_POLICIES:
            self.problem(f"{path}.balance", unknown_message(balance, BALANCE_POLICIES, "balance policy"))
            balance = "p2c"
        max_concurrency = raw.get("max_concurrency", MISSING)
        limit = (
            None
            if max_concurrency is MISSING
            else self.integer(max_concurrency, f"{path}.max_concurrency", 0, minimum=1) or None
        )
        queue = self.queue(raw.get("queue", {}), f"{path}.queue")
        if queue.reserved and (limit is None or queue.reserved >= limit):
            self.problem(
                f"{path}.queue.reserved",
                f"{queue.reserved} slots reserved for the system class need a max_concurrency above it "
                f"({'none is set' if limit is None else limit}): the other classes would never get one",
            )
        health_check = raw.get("health_check", MISSING)
        return {
            "api_key_env": None if api_key_env is MISSING else self.env_name(api_key_env, f"{path}.api_key_env"),
            "balance": balance,
            "retries": self.retries(raw.get("retries", {}), f"{path}.retries"),
            "breaker": self.breaker(raw.get("breaker", {}), f"{path}.breaker", server),
            "timeouts": self.timeouts(raw.get("timeouts", {}), f"{path}.timeouts", server),
            "max_concurrency": limit,
            "queue": queue,
            "realtime": self.realtime(raw.get("realtime", MISSING), f"{path}.realtime"),
            "health_check": None
            if health_check is MISSING
            else self.health_check(health_check, f"{path}.health_check"),
        }

    def upstreams(self, value: Any, path: str) -> tuple[list[str], tuple[int, ...]]:
        """The URLs, and their weights: an item is a URL, or ``{url: URL, weight: N}``."""
        weights: dict[int, int] = {}
        if isinstance(value, list):
            plain = []
            for i, item in enumerate(value):
                if isinstance(item, dict):
                    entry = self.mapping(item, f"{path}[{i}]", UPSTREAM_KEYS, what="an upstream")
                    assert entry is not None
                    weights[i] = self.integer(
                        entry.get("weight", MISSING), f"{path}[{i}].weight", 1, minimum=1, maximum=MAX_WEIGHT
                    )
                    item = self.string(entry.get("url", MISSING), f"{path}[{i}].url")
                    if item is None:
                        item = MISSING  # said; keep the positions of the others
                plain.append(item)
            value = [v for v in plain if v is not MISSING]
        urls = self.url_list(
            value,
            path,
            missing=(path, "is required: list the model's OpenAI-compatible servers"),
            empty="must list at least one upstream URL",
            what="upstream",
        )
        return urls, tuple(weights.get(i, 1) for i in range(len(urls)))

    def retries(self, value: Any, path: str) -> RetryConfig:
        d = RetryConfig()
        raw = self.mapping(value, path, RETRY_KEYS, what="retries")
        if raw is None:
            return d
        get = fields(raw, path, d)
        on = raw.get("on_status", MISSING)
        statuses = d.on_status
        if on is not MISSING:
            if isinstance(on, list) and all(s in RETRYABLE_STATUSES and type(s) is int for s in on):
                statuses = tuple(sorted(set(on)))
            else:
                listed = ", ".join(map(str, RETRYABLE_STATUSES))
                self.problem(f"{path}.on_status", f"must be a list of statuses among {listed}, not {show(on)}")
        return RetryConfig(
            attempts=self.integer(*get("attempts"), minimum=0, maximum=10),
            on_status=statuses,
            budget=self.number(*get("budget"), positive=False),
            min_per_s=self.number(*get("min_per_s"), positive=False),
            backoff_s=self.number(*get("backoff_s"), positive=False),
            max_backoff_s=self.number(*get("max_backoff_s"), positive=False),
        )

    def timeouts(self, value: Any, path: str, server: ServerConfig) -> TimeoutConfig:
        d = TimeoutConfig(
            connect_s=server.upstream_connect_timeout_s,
            first_byte_s=server.upstream_read_timeout_s,
            idle_s=server.upstream_stream_idle_timeout_s,
        )
        raw = self.mapping(value, path, TIMEOUT_KEYS, what="timeouts")
        if raw is None:
            return d
        get = fields(raw, path, d)
        total, total_path, _ = get("total_s")
        return TimeoutConfig(
            connect_s=self.number(*get("connect_s")),
            first_byte_s=self.number(*get("first_byte_s")),
            idle_s=self.number(*get("idle_s")),
            total_s=None if total is MISSING else self.number(total, total_path, 0.0, positive=False) or None,
        )

    def realtime(self, value: Any, path: str) -> RealtimeConfig:
        """``realtime:``, the bounds of a model's WebSocket sessions."""
        d = RealtimeConfig()
        if value is MISSING:
            return d
        raw = self.mapping(value, path, REALTIME_KEYS, what="realtime")
        if raw is None:
            return d
        get = fields(raw, path, d)
        return RealtimeConfig(
            max_session_s=self.number(*get("max_session_s")),
            idle_s=self.number(*get("idle_s")),
            max_append_bytes=self.integer(*get("max_append_bytes"), minimum=2, maximum=64 << 20),
            audio_speed=self.number(*get("audio_speed")),
            audio_burst_s=self.number(*get("audio_burst_s")),
        )

    def health_check(self, value: Any, path: str) -> HealthCheckConfig | None:
        raw = self.mapping(value, path, HEALTH_CHECK_KEYS, what="health_check")
        if raw is None:
            return None
        get = fields(raw, path, HealthCheckConfig())
        probe = self.string(*get("path"))
        if isinstance(probe, str) and not probe.startswith("/"):
            self.problem(f"{path}.path", f"must start with '/', not {show(probe)}")
        return HealthCheckConfig(
            path=probe,
            interval_s=self.number(*get("interval_s")),
            timeout_s=self.number(*get("timeout_s")),
            failures=self.integer(*get("failures"), minimum=1),
        )

    def queue(self, value: Any, path: str) -> QueueConfig:
        raw = self.mapping(value, path, QUEUE_KEYS, what="queue")
        if raw is None:
            return QueueConfig()
        get = fields(raw, path, QueueConfig())
        return QueueConfig(
            size=self.integer(*get("size"), minimum=0),
            timeout_s=self.number(*get("timeout_s")),
            reserved=self.integer(*get("reserved"), minimum=0),
        )

    def breaker(self, value: Any, path: str, server: ServerConfig) -> BreakerConfig:
        d = BreakerConfig(open_s=server.upstream_cooldown_s)
        raw = self.mapping(value, path, BREAKER_KEYS, what="breaker")
        if raw is None:
            return d
        get = fields(raw, path, d)
        return BreakerConfig(
            failures=self.integer(*get("failures"), minimum=1),
            open_s=self.number(*get("open_s"), positive=False),
            successes=self.integer(*get("successes"), minimum=1),
        )

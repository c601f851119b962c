"""The gateway's own endpoints: the model list, health and readiness, /metrics, the admin API
(the API's doors are gateway.server.doors, on gateway.server.exchange)."""

from __future__ import annotations

import logging
import os
from collections.abc import Awaitable, Callable
from typing import Any

import orjson
from aiohttp import hdrs, web

from ..config import as_dict, env_secret
from ..config.generation import is_bearer
from ..errors import (
    AuthenticationError,
    ConfigError,
    InvalidConfigError,
    InvalidRequestError,
    PermissionDeniedError,
)
from .state import SERVICES_KEY, Services
from .state import visible as visible_models

log = logging.getLogger(__name__)
JSON = "application/json"
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


async def list_models(request: web.Request) -> web.Response:
    store = request.app[SERVICES_KEY].store
    created = int(store.loaded_at)
    visible = visible_models(request)
    data = [
        {
            "id": m.name,
            "object": "model",
            "created": created,
            "owned_by": "modality-gateway",
            "input_modalities": (taken := [str(x) for x in m.accepts]),
            "output_modalities": (made := [str(x) for x in m.produces]),
            "architecture": {"input_modalities": taken, "output_modalities": made},  # as OpenRouter says them
            "apis": list(m.apis),
        }
        for m in store.current.models
        if visible is None or visible(m.name)
    ]
    return json_response({"object": "list", "data": data})


async def healthz(request: web.Request) -> web.Response:
    return json_response({"status": "ok"})


async def readyz(request: web.Request) -> web.Response:
    """Ready when every local encoder is (upstreams are reported, not required: they fail over),
    until SIGTERM: then 503 ``draining``, so that load balancers stop sending new requests.

    Probes get the status alone. With the admin token, the report also names the models, the
    encoders and every upstream replica with its health and last error: addresses and errors are
    for operators, never for clients (the port is public)."""
    services = request.app[SERVICES_KEY]
    state = readiness(services)
    payload: dict[str, Any] = {"status": state, "config_generation": services.store.generation}
    if is_admin(request, services):
        encoders: dict[str, Any] = {
            name: {"kind": spec.kind, "urls": list(spec.urls), "backends": services.encoder.backends(spec.urls)}
            for name, spec in services.store.current.encoders.items()
            if spec.kind in ("http", "vllm")
        }
        encoders.update({name: e.status() for name, e in services.supervisor.encoders.items()})
        payload["models"] = [m.name for m in services.store.current.models]
        payload["encoders"] = encoders
        payload["upstreams"] = services.store.replicas.snapshot()
        if services.lifecycle.worker is not None:  # serve --workers N: which one answered
            payload["worker"] = {"index": services.lifecycle.worker, "pid": os.getpid()}
    return json_response(payload, status=200 if state == "ready" else 503)


def readiness(services: Services) -> str:
    """``draining`` from SIGTERM on, ``ready`` while every local encoder is, else ``starting``."""
    if services.lifecycle.draining:
        return "draining"
    return "ready" if services.supervisor.ready else "starting"


async def admin_reload(request: web.Request) -> web.Response:
    services = request.app[SERVICES_KEY]
    check_admin(request, services)
    if services.store.path is None:
        raise InvalidRequestError("This gateway was started without a config file; there is nothing to reload")
    try:
        config = await services.store.reload()
    except ConfigError as exc:
        raise InvalidConfigError(f"routing.yaml is invalid; the running config is unchanged:\n{exc}") from None
    if services.lifecycle.reload_others is not None:  # serve --workers N: the other workers too
        services.lifecycle.reload_others()
    return json_response(
        {"status": "reloaded", "config_generation": services.store.generation, "models": len(config.models)}
    )


async def admin_config(request: web.Request) -> web.Response:
    """The live config as the gateway understood it, every default filled in. It holds no secret
    (keys are named by their environment variables, never read into the config)."""
    services = request.app[SERVICES_KEY]
    check_admin(request, services)
    live = services.store.live
    return json_response(
        {
            "config_generation": live.number,
            "sha256": live.config.sha256,
            "source": live.config.source,
            "loaded_at": services.store.loaded_at,
            "config": as_dict(live.config),
        }
    )


def metrics_endpoint(scrape: Handler) -> Handler:
    """``GET /metrics``. It names every model (those a key may not see too), every key's name and
    the upstream URLs, and each scrape costs ~10 ms of the event loop: with ``auth:`` on it needs
    the admin token, as ``/admin/*`` does, on the main port and on ``server.admin_listen`` alike
    (a port apart is often reachable from a whole cluster); a refusal costs what a 401 costs.
    Without ``auth:`` the gateway is open, /metrics too."""

    async def metrics(request: web.Request) -> web.StreamResponse:
        check_operator(request, request.app[SERVICES_KEY], "/metrics needs", "scrape with it")
        return await scrape(request)

    return metrics


def check_operator(request: web.Request, services: Services, needs: str, use: str) -> None:
    """What names every model, key and replica (/metrics, /status): open without ``auth:``; with
    it, the admin token's (403 ``needs`` while none is set, saying to ``use`` it; 401 without it)."""
    if services.store.live.keyring is not None:
        env = services.store.current.server.admin_token_env
        check_admin(
            request,
            services,
            disabled=f"With auth: on, {needs} the admin token: set the {env} environment variable "
            f"and {use} ('Authorization: Bearer <token>')",
        )


def _admin_token(services: Services) -> str:
    return env_secret(services.store.current.server.admin_token_env)


def is_admin(request: web.Request, services: Services) -> bool:
    token = _admin_token(services)
    return bool(token) and is_bearer(request.headers.get(hdrs.AUTHORIZATION), token)


def check_admin(request: web.Request, services: Services, *, disabled: str | None = None) -> None:
    """401 unless the request carries the admin token; 403 ``disabled`` while none is set."""
    if not _admin_token(services):
        env = services.store.current.server.admin_token_env
        raise PermissionDeniedError(
            disabled or f"Admin endpoints are disabled: set the {env} environment variable to enable them"
        )
    if not is_admin(request, services):
        raise AuthenticationError("Missing or wrong admin token (send 'Authorization: Bearer <token>')")


def json_response(payload: Any, status: int = 200) -> web.Response:
    return web.Response(status=status, body=orjson.dumps(payload), content_type=JSON)

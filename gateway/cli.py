"""modality-gateway serve | check | explain.

Exit codes: 0 success; 1 ``explain`` decided to reject the request; 2 bad config, bad input or usage.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import sys
from collections.abc import AsyncIterator, Coroutine, Sequence
from pathlib import Path
from typing import Any

import orjson
from aiohttp import web

from .admission import admit
from .app import create_app
from .config import GatewayConfig, load_config
from .errors import ConfigError, GatewayError
from .lifecycle import serve
from .state import SERVICES_KEY

DEFAULT_CONFIG = "routing.yaml"
# One line a request, with what the gateway decided: the request id ties it to the upstream's logs.
ACCESS_LOG = (
    '%a "%r" %s %b %Tfs rid=%{X-Request-Id}o model=%{X-Gateway-Model}o route=%{X-Gateway-Route}o '
    'encoded=%{X-Gateway-Encoded}o "%{User-Agent}i"'
)
log = logging.getLogger("gateway")


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    command: Any = args.command
    return int(command(args))


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="modality-gateway", description="OpenAI-compatible gateway that routes requests by modality."
    )
    sub = parser.add_subparsers(required=True, metavar="COMMAND")

    serve = sub.add_parser("serve", help="run the gateway")
    serve.add_argument("--config", default=DEFAULT_CONFIG, help="routing.yaml (default: %(default)s)")
    serve.add_argument("--host", help="listen address (default: server.host, then 127.0.0.1)")
    serve.add_argument("--port", type=int, help="listen port (default: server.port, then 8080)")
    serve.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    serve.set_defaults(command=_serve)

    check = sub.add_parser("check", help="validate routing.yaml files; exit 2 listing every problem")
    check.add_argument("files", nargs="+", metavar="FILE")
    check.add_argument(
        "--here",
        action="store_true",
        help="also check what only this machine can: local encoders' model directories (serve always does)",
    )
    check.set_defaults(command=_check)

    explain = sub.add_parser("explain", help="print the routing decision for a request, sending nothing")
    explain.add_argument("--config", default=DEFAULT_CONFIG, help="routing.yaml (default: %(default)s)")
    explain.add_argument("request", metavar="REQUEST.json", help="a chat completions body ('-' for stdin)")
    explain.set_defaults(command=_explain)
    return parser


def _load(path: str, *, here: bool = False) -> GatewayConfig | None:
    try:
        return load_config(path, here=here)
    except ConfigError as exc:
        print(exc, file=sys.stderr)
        return None


def _check(args: argparse.Namespace) -> int:
    status = 0
    for path in args.files:
        if _load(path, here=args.here) is None:
            status = 2
        else:
            print(f"{path}: ok")
    return status


def _explain(args: argparse.Namespace) -> int:
    config = _load(args.config)
    if config is None:
        return 2
    try:
        raw = sys.stdin.buffer.read() if args.request == "-" else Path(args.request).read_bytes()
        body = orjson.loads(raw)
    except (OSError, orjson.JSONDecodeError) as exc:
        print(f"{args.request}: cannot read the request: {exc}", file=sys.stderr)
        return 2
    if not isinstance(body, dict):
        print(f"{args.request}: the request must be a JSON object", file=sys.stderr)
        return 2
    try:
        decision = admit(config, body).explain()
        status = 0
    except GatewayError as exc:
        decision = {"decision": "reject", "status": exc.status, **exc.to_dict()}
        status = 1
    sys.stdout.buffer.write(orjson.dumps(decision, option=orjson.OPT_INDENT_2) + b"\n")
    return status


def run(main: Coroutine[Any, Any, None]) -> None:
    """Run the server on uvloop where it is installed (libuv's loop: less CPU per request than
    asyncio's own), else on asyncio's."""
    try:
        import uvloop
    except ImportError:
        asyncio.run(main)
        return
    uvloop.run(main)


def _serve(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    config = _load(args.config, here=True)
    if config is None:
        return 2
    app = create_app(config, config_path=args.config)
    app.cleanup_ctx.append(_reload_on_sighup)
    host = args.host or config.server.host
    port = args.port if args.port is not None else config.server.port
    admin = config.server.admin_address
    if admin is not None and admin[1] == port:
        print(f"server.admin_listen ({config.server.admin_listen}) must use another port than {port}", file=sys.stderr)
        return 2
    if config.auth is None:
        log.warning(
            "no 'auth:' section: anyone who reaches http://%s:%d can use every model (docs/security.md)", host, port
        )
    log.info("serving %d models from %s on http://%s:%d", len(config.models), args.config, host, port)
    access_log = ACCESS_LOG if config.server.access_log else None
    run(serve(app, host, port, config.server, access_log_format=access_log))
    return 0


async def _reload_on_sighup(app: web.Application) -> AsyncIterator[None]:
    store = app[SERVICES_KEY].store
    loop = asyncio.get_running_loop()
    tasks: set[asyncio.Task[Any]] = set()

    def reload() -> None:
        task = loop.create_task(_reload_quietly(store.reload()))
        tasks.add(task)
        task.add_done_callback(tasks.discard)

    with contextlib.suppress(NotImplementedError):  # no signals on Windows
        loop.add_signal_handler(signal.SIGHUP, reload)
    yield
    with contextlib.suppress(NotImplementedError):
        loop.remove_signal_handler(signal.SIGHUP)


async def _reload_quietly(reload: Any) -> None:
    with contextlib.suppress(ConfigError):  # logged and counted by the store
        await reload


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())

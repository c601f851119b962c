"""modality-gateway serve | check | explain.

Exit codes: 0 success; 1 ``explain`` decided to reject the request; 2 bad config, bad input or usage.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import logging
import os
import sys
from collections.abc import Coroutine, Sequence
from importlib import metadata
from pathlib import Path
from typing import Any, TypeVar

import orjson

from ..admission.apis import CHAT, Api
from ..admission.apis.catalog import BY_NAME, BY_PATH
from ..admission.plan import admit, admit_output, lookup
from ..admission.route import RoutePlan
from ..config import GatewayConfig, extras, load_config
from ..encode import epd
from ..encode.client import image_url
from ..errors import ConfigError, GatewayError
from ..media.fetch import decode_data_url, is_data_url
from .app import create_app
from .lifecycle import CannotListen, reload_on_sighup, serve
from .workers import MULTIPROC_ENV, Master, worker_app, worker_config

DEFAULT_CONFIG = "routing.yaml"
log = logging.getLogger("gateway")
T = TypeVar("T")


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    command: Any = args.command
    try:
        return int(command(args))
    except CannotListen as exc:  # serve's port in use: one line, not a traceback
        print(f"modality-gateway: {exc}", file=sys.stderr)
        return 1


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="modality-gateway",
        description="The front door of multimodal inference clusters: every content part of every request checked "
        "against routing.yaml's table of what each model takes, before any engine sees it.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = parser.add_subparsers(required=True, metavar="COMMAND")

    serve = sub.add_parser("serve", help="run the gateway")
    serve.add_argument("--config", default=DEFAULT_CONFIG, help="routing.yaml (default: %(default)s)")
    serve.add_argument("--host", help="listen address (default: server.host, then 127.0.0.1)")
    serve.add_argument("--port", type=int, help="listen port (default: server.port, then 8080)")
    serve.add_argument(
        "--workers",
        type=_positive,
        default=1,
        metavar="N",
        help="gateway processes sharing the port (SO_REUSEPORT), about one per core (default: %(default)s)",
    )
    serve.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    # internal: how `serve --workers N` starts its workers (gateway.server.workers)
    serve.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    serve.add_argument("--run-dir", help=argparse.SUPPRESS)
    serve.add_argument("--control-fd", type=int, help=argparse.SUPPRESS)
    serve.add_argument("--master-pid", type=int, help=argparse.SUPPRESS)  # not getppid(): the master may be gone
    serve.set_defaults(command=_serve)

    check = sub.add_parser("check", help="validate routing.yaml files; exit 2 listing every problem")
    check.add_argument("files", nargs="+", metavar="FILE")
    check.add_argument(
        "--here",
        action="store_true",
        help="also check what only this machine can: local encoders' model directories (serve always does)",
    )
    check.add_argument(
        "--extras",
        action="store_true",
        help="print only the pip extras the files need (encoder, video, tracing), as `make serve` installs them",
    )
    check.set_defaults(command=_check)

    explain = sub.add_parser("explain", help="print the routing decision for a request, sending nothing")
    explain.add_argument("--config", default=DEFAULT_CONFIG, help="routing.yaml (default: %(default)s)")
    explain.add_argument("request", metavar="REQUEST.json", help="a request body ('-' for stdin)")
    explain.add_argument(
        "--api",
        choices=[name for name, api in BY_NAME.items() if api.door in ("parts", "output")],
        help="the API the body is for, or its path (/v1/responses); default: read from the body (input: responses; "
        "messages with Anthropic's blocks or a top-level system: messages; else chat)",
        type=_api_name,
    )
    explain.set_defaults(command=_explain)
    return parser


EXAMPLES = """examples:
  modality-gateway serve --config routing.yaml            # the gateway, its status page at http://127.0.0.1:8080/
  modality-gateway serve --workers 4                      # four processes on one port, about one per core
  modality-gateway check routing.yaml                     # every problem of a table, with its file:line
  modality-gateway explain --config routing.yaml req.json # what would happen to a request, sending nothing
  modality-gateway explain --api responses - < body.json  # a Responses body from stdin

docs: README.md, docs/routing.md (the table), docs/reference.md (endpoints, errors, metrics),
      docs/operations.md (running it)"""


def _version() -> str:
    try:
        return metadata.version("modality-gateway")
    except metadata.PackageNotFoundError:  # run from a checkout that was never installed
        return "unknown"


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a whole number of at least 1, not {text!r}")
    return value


def _load(path: str, *, here: bool = False, worker_of: str | None = None) -> GatewayConfig | None:
    """The config at ``path``, or None with its problems printed. ``worker_of``: a worker's run
    directory (its master's last loaded routing.yaml stands in for an invalid file)."""
    try:
        return load_config(path, here=here) if worker_of is None else worker_config(worker_of, path)
    except ConfigError as exc:
        print(exc, file=sys.stderr)
        return None


def _check(args: argparse.Namespace) -> int:
    status, needed = 0, []
    for path in args.files:
        config = _load(path, here=args.here)
        if config is None:
            status = 2
        elif args.extras:
            needed += [extra for extra in extras(config) if extra not in needed]
        else:
            print(f"{path}: ok")
    if args.extras and status == 0:
        print(" ".join(needed))
    return status


def _api_name(value: str) -> str:
    """An API by its name or by any of its paths (``--api /v1/messages/count_tokens``)."""
    api = BY_PATH.get(value)
    return api.name if api is not None else value


# the content blocks of one of the two APIs with "messages" that the other has no part of that name for
MESSAGES_ONLY = frozenset({*BY_NAME["messages"].table.types, "tool_use", "tool_result"} - set(CHAT.table.types))
CHAT_ONLY = frozenset(set(CHAT.table.types) - set(BY_NAME["messages"].table.types))


def guess_api(body: dict[str, Any]) -> str:
    """The API a request body is for, read from its shape: ``input`` without ``messages`` is a
    Responses body; ``messages`` with a part only chat has (``image_url``, ``input_audio``...) is
    a chat body, with a top-level ``system`` or a block only Anthropic's Messages API has
    (``image`` with its ``source``, ``document``, ``tool_result``...) a Messages body; anything
    else, chat."""
    messages = body.get("messages")
    if messages is None and "voice" in body and isinstance(body.get("input"), str):
        return "speech"  # OpenAI's speech body: input and voice
    if messages is None and "input" in body:
        return "responses"
    types = {
        block.get("type")
        for message in (messages if isinstance(messages, list) else ())
        if isinstance(message, dict) and isinstance(message.get("content"), list)
        for block in message["content"]
        if isinstance(block, dict)
    }
    if types & CHAT_ONLY:
        return CHAT.name
    return "messages" if "system" in body or types & MESSAGES_ONLY else CHAT.name


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
        api = BY_NAME[args.api or guess_api(body)]
        setting: dict[str, str] = {}
        if api.door == "output":  # images, speech: the model that makes the output, the fields set
            plan, setting = admit_output(config, body, None, requested=lookup(config, body, None, api.name), api=api)
        else:
            plan = admit(config, body, api=api)
        decision = {"api": api.name, "outputs": _outputs(api, body), **plan.explain()}
        if setting:
            decision["sets"] = setting
        if plan.encoder is not None:
            decision["encoding"] = _encoding(config, plan, body)
        status = 0
    except GatewayError as exc:
        decision = {"decision": "reject", "status": exc.status, **exc.to_dict()}
        status = 1
    sys.stdout.buffer.write(orjson.dumps(decision, option=orjson.OPT_INDENT_2) + b"\n")
    return status


def _outputs(api: Api, body: dict[str, Any]) -> list[str]:
    """What the request asks to be answered with: its API's one output (images, speech), or text
    and what it asks beside (chat's modalities, a Responses image_generation tool)."""
    if api.makes is not None:
        return [str(api.makes)]
    asked = [str(m) for m, _ in api.outputs(body)] if api.outputs is not None else []
    modalities = body.get("modalities")
    said_text = not isinstance(modalities, list) or "text" in modalities
    return (["text"] if said_text else []) + asked


def _encoding(config: GatewayConfig, plan: RoutePlan, body: dict[str, Any]) -> dict[str, Any]:
    """The encoder of an explained request: its kind and, for vLLM's encoder instances, the
    priming plan (where each image would go)."""
    assert plan.encoder is not None
    spec = config.encoders[plan.encoder]
    encoding: dict[str, Any] = {"encoder": spec.name, "kind": spec.kind}
    if spec.kind == "vllm":
        images: list[tuple[str, str | None]] = []
        for part in plan.encode_parts:
            assert part.index is not None
            url = image_url(body["messages"][part.message]["content"][part.index])
            uuid = None
            if url is not None and is_data_url(url):
                try:
                    uuid = hashlib.sha256(decode_data_url(url, max_bytes=config.media.max_image_bytes)).hexdigest()
                except GatewayError:
                    uuid = None
            images.append((part.location, uuid))
        encoding["priming"] = epd.plan(spec, images)
    if plan.encodes_frames:  # where each frame goes depends on its bytes: known once the video is sampled
        encoding["frames"] = plan.frames_per_video * len(plan.frame_parts)
    return encoding


def run(main: Coroutine[Any, Any, T]) -> T:
    """Run the server on uvloop where it is installed (libuv's loop: less CPU per request than
    asyncio's own), else on asyncio's."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    return uvloop.run(main)


def _serve(args: argparse.Namespace) -> int:
    worker: int | None = args.worker
    role = "" if worker is None and args.workers == 1 else "master " if worker is None else f"worker {worker} "
    logging.basicConfig(level=args.log_level.upper(), format=f"%(asctime)s %(levelname)s {role}%(name)s: %(message)s")
    config = _load(args.config, here=True, worker_of=args.run_dir if worker is not None else None)
    if config is None:
        return 2
    host = args.host or config.server.host
    port = args.port if args.port is not None else config.server.port
    admin = config.server.admin_address
    if admin is not None and admin[1] == port:
        print(f"server.admin_listen ({config.server.admin_listen}) must use another port than {port}", file=sys.stderr)
        return 2
    if worker is not None:
        return _serve_worker(args, config, worker, host, port)
    if config.auth is None:
        log.warning(
            "no 'auth:' section: anyone who reaches http://%s:%d can use every model (docs/security.md)", host, port
        )
    if args.workers > 1:
        return _serve_master(args, config, host, port)
    app = create_app(config, config_path=args.config)
    app.cleanup_ctx.append(reload_on_sighup)
    run(serve(app, (host, port), config.server, access_log=config.server.access_log))
    return 0


def _serve_master(args: argparse.Namespace, config: GatewayConfig, host: str, port: int) -> int:
    """``serve --workers N``: this process runs the workers (gateway.server.workers)."""
    admin = config.server.admin_address
    if admin is not None and admin[1] == 0:
        print("server.admin_listen needs a fixed port with --workers", file=sys.stderr)
        return 2
    master = Master(
        config, config_path=args.config, host=host, port=port, workers=args.workers, log_level=args.log_level
    )
    return run(master.run())


def _serve_worker(args: argparse.Namespace, config: GatewayConfig, index: int, host: str, port: int) -> int:
    """One worker of ``serve --workers N``, started by its master (gateway.server.workers)."""
    if args.run_dir is None or args.control_fd is None or args.master_pid is None or MULTIPROC_ENV not in os.environ:
        print("--worker is internal to serve --workers N", file=sys.stderr)
        return 2
    app = worker_app(config, config_path=args.config, index=index, run_dir=args.run_dir, control_fd=args.control_fd)
    access_log = config.server.access_log
    run(serve(app, (host, port), config.server, access_log=access_log, reuse_port=True, parent_pid=args.master_pid))
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())

"""python -m backends.vision_encoder serve --model SPEC [--host H] [--port P] [--device auto]"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
from collections.abc import Awaitable, Callable

from aiohttp import web
from aiohttp.web_log import AccessLogger
from aiohttp.web_request import BaseRequest
from aiohttp.web_response import StreamResponse

from .limits import DECODE_BUDGET_PIXELS, MAX_ASPECT_RATIO, MAX_PIXELS


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m backends.vision_encoder")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="run the encoder backend")
    serve.add_argument("--model", default="builtin:vit-small", help="builtin:vit-small or a local model directory")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=9001)
    serve.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N (default: %(default)s)")
    serve.add_argument("--max-batch-size", type=int, default=32)
    serve.add_argument("--max-batch-tokens", type=int, default=65536)
    serve.add_argument("--max-batch-delay-ms", type=float, default=0.0)
    serve.add_argument("--max-queue", type=int, default=1024)
    serve.add_argument("--cache-bytes", type=int, default=1 << 30)
    serve.add_argument("--max-image-bytes", type=int, default=20 * 1024 * 1024)
    serve.add_argument(
        "--max-pixels", type=_positive_int, default=MAX_PIXELS, help="refuse larger images (default: %(default)s)"
    )
    serve.add_argument(
        "--max-aspect-ratio",
        type=_at_least_one,
        default=MAX_ASPECT_RATIO,
        help="refuse images with a long side over this many times the short side (default: %(default)g)",
    )
    serve.add_argument(
        "--decode-budget-pixels",
        type=_positive_int,
        default=DECODE_BUDGET_PIXELS,
        help="pixels decoded at once over all requests; more wait (default: %(default)s)",
    )
    serve.add_argument("--timeout-s", type=float, default=30.0)
    serve.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    serve.add_argument(
        "--parent-pid", type=int, default=None, help="exit when this process is no longer the parent (supervised runs)"
    )
    args = parser.parse_args(argv)

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # OpenMP's worker threads spin after each parallel region by default; on CPU they then starve
    # the decode threads and the event loop (measured: -25% images/s, docs/benchmarks.md). Must be
    # set before torch loads OpenMP.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    import torch

    from .server import build
    from .towers import TowerError

    torch.set_num_threads(os.cpu_count() or 1)
    try:
        app = build(
            args.model,
            device=args.device,
            max_batch_size=args.max_batch_size,
            max_batch_tokens=args.max_batch_tokens,
            max_batch_delay_ms=args.max_batch_delay_ms,
            max_queue=args.max_queue,
            cache_bytes=args.cache_bytes,
            max_pixels=args.max_pixels,
            max_aspect_ratio=args.max_aspect_ratio,
            decode_budget_pixels=args.decode_budget_pixels,
            max_image_bytes=args.max_image_bytes,
            timeout_s=args.timeout_s,
        )
    except TowerError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    logging.getLogger("backends.vision_encoder").info(
        "vision encoder %s on http://%s:%d", args.model, args.host, args.port
    )
    if args.parent_pid is not None:
        app.on_startup.append(_exit_with_parent(args.parent_pid))
    web.run_app(
        app, host=args.host, port=args.port, print=None, handler_cancellation=True, access_log_class=_QuietProbes
    )
    return 0


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _at_least_one(text: str) -> float:
    value = float(text)
    if not value >= 1:  # also refuses nan
        raise argparse.ArgumentTypeError(f"must be at least 1, got {text}")
    return value


class _QuietProbes(AccessLogger):
    """The access log without successful health checks and scrapes (the supervisor probes every 5 s)."""

    def log(self, request: BaseRequest, response: StreamResponse, time: float) -> None:
        if response.status == 200 and request.path in ("/health", "/metrics"):
            return
        super().log(request, response, time)


def _exit_with_parent(parent_pid: int) -> Callable[[web.Application], Awaitable[None]]:
    """A supervised backend must not outlive its gateway, even one killed with SIGKILL."""

    async def watch() -> None:
        while os.getppid() == parent_pid:
            await asyncio.sleep(1.0)
        logging.getLogger("backends.vision_encoder").warning("parent %d is gone; exiting", parent_pid)
        os.kill(os.getpid(), signal.SIGTERM)

    tasks: list[asyncio.Task[None]] = []  # holds the task so it is not collected

    async def start(app: web.Application) -> None:
        tasks.append(asyncio.create_task(watch()))

    return start


if __name__ == "__main__":
    sys.exit(main())

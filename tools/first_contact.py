"""A new team's first contact, timed: a fresh clone, ``make serve``, and the seconds until the
gateway answers (``/healthz``) and is ready (``/readyz``: its local encoders up, where the table
has one). Nothing else runs: the clone has no ``.venv``, so ``make serve`` creates it and installs
what the table needs, from the package indexes this machine's pip is set up for.

    .venv/bin/python -m tools.first_contact                        # the shipped routing.yaml
    .venv/bin/python -m tools.first_contact --config docs/examples/text-and-images.yaml

Only 127.0.0.1 is asked; the clone is removed at the end (``--keep`` keeps it).
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _status(url: str) -> int | None:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return int(response.status)
    except urllib.error.HTTPError as exc:
        return exc.code
    except OSError:
        return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="routing.yaml", help="the table, relative to the clone")
    parser.add_argument("--source", default=str(ROOT), help="the repository to clone (default: this one)")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds before giving up")
    parser.add_argument("--keep", action="store_true", help="keep the clone")
    args = parser.parse_args(argv)
    folder = Path(tempfile.mkdtemp(prefix="first-contact-"))
    clone = folder / "modality-gateway"
    subprocess.run(["git", "clone", "--quiet", args.source, str(clone)], check=True)
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
    started = time.monotonic()
    make = subprocess.Popen(
        ["make", "serve", f"CONFIG={args.config}", f"PORT={port}"],
        cwd=clone,
        env=env,
        start_new_session=True,  # its group: make, pip, the gateway and its encoder, stopped as one
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    base, answered, ready = f"http://127.0.0.1:{port}", None, None
    try:
        while time.monotonic() - started < args.timeout and make.poll() is None:
            if answered is None and _status(f"{base}/healthz") == 200:
                answered = time.monotonic() - started
            if answered is not None and _status(f"{base}/readyz") == 200:
                ready = time.monotonic() - started
                break
            time.sleep(0.2)
    finally:
        if make.poll() is None:
            os.killpg(make.pid, signal.SIGINT)
            try:
                make.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(make.pid, signal.SIGKILL)
        output = make.stdout.read() if make.stdout else ""
        size = subprocess.run(["du", "-sh", str(clone / ".venv")], capture_output=True, text=True).stdout.split()
        if not args.keep:
            shutil.rmtree(folder, ignore_errors=True)
    print(f"make serve CONFIG={args.config}, from a fresh clone (no .venv):")
    print(f"  answers /healthz after {answered:.0f} s" if answered is not None else "  never answered")
    print(f"  ready (/readyz 200) after {ready:.0f} s" if ready is not None else "  never ready")
    print(f"  .venv: {size[0] if size else '?'}")
    if answered is None or ready is None:
        print(output[-4000:], file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

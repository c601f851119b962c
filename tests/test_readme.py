"""The README's quick start, run as a user would after ``make demo``: the shipped routing.yaml (its
local encoder started for real), stand-in engines where it points (vLLM, SGLang, Whisper), and
every command of the "Then try" block run by bash with curl, each held to what its comment says:
the X-Gateway-* headers it names, the status and error code it names, and never a 5xx."""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import sys
import time
from pathlib import Path

import aiohttp
import pytest

from tests.conftest import needs_encoder

ROOT = Path(__file__).resolve().parent.parent
pytestmark = [
    needs_encoder,
    pytest.mark.timeout(180),
    pytest.mark.skipif(shutil.which("curl") is None, reason="the README's commands need curl"),
]

# the stand-ins take the ports the shipped routing.yaml names
ENGINES = {"vllm": "http://127.0.0.1:8000", "sglang": "http://127.0.0.1:30000", "whisper": "http://127.0.0.1:8001"}


def examples() -> list[tuple[str, str]]:
    """(comment, command) for each example of the README's "Then try" block."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    block = readme.split("Then try, from another shell:", 1)[1].split("```bash\n", 1)[1].split("```", 1)[0]
    out = []
    for chunk in block.strip().split("\n\n"):
        lines = chunk.splitlines()
        comment = " ".join(line.lstrip("# ") for line in lines if line.startswith("#"))
        command = "\n".join(line for line in lines if not line.startswith("#"))
        out.append((comment, command))
    return out


def test_the_block_is_found_and_says_what_to_expect() -> None:
    found = examples()
    assert len(found) >= 8
    assert all(command.startswith(("curl ", "echo ")) for _, command in found)
    assert sum("X-Gateway-Route:" in comment for comment, _ in found) >= 4


async def test_every_quick_start_command_does_what_its_comment_says(
    gateway_factory, upstream_factory, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("GATEWAY_ADMIN_TOKEN", "s3cret")
    yaml_text = (ROOT / "routing.yaml").read_text(encoding="utf-8")
    for name, url in ENGINES.items():
        assert url in yaml_text, f"routing.yaml no longer points at {url}"
        yaml_text = yaml_text.replace(url, (await upstream_factory(name)).url)
    gw = await gateway_factory(yaml_text, write_file=True)
    await _ready(gw.url)
    config = tmp_path / "routing.yaml"
    for comment, command in examples():
        command = command.replace("localhost:8080", gw.url.removeprefix("http://"))
        command = command.replace("--config routing.yaml", f"--config {config}")
        command = command.replace(".venv/bin/", f"{Path(sys.executable).parent}/")  # the venv running the tests
        piped = "|" in command
        if not piped:
            command = re.sub(r"curl -s(N?) ", r"curl -si\1 ", command)  # the status and headers, always
        process = await asyncio.create_subprocess_exec(
            "bash",
            "-c",
            f"set -o pipefail\n{command}",
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env={**os.environ, "NO_PROXY": "*", "no_proxy": "*"},  # loopback, whatever proxy the machine has
        )
        out, err = await asyncio.wait_for(process.communicate(), timeout=60)
        text = out.decode()
        assert process.returncode in (0, 1), f"{command}\n{err.decode()}"  # explain exits 1 for a rejection
        if piped:  # curl | grep, echo | explain: it ran, and said something
            assert text.strip(), f"{command}\n{err.decode()}"
            continue
        head, _, body = text.replace("\r\n", "\n").partition("\n\n")
        status = int(head.split()[1])
        assert status < 500, f"{comment}\n{command}\n{text}"
        headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in head.splitlines()[1:])}
        for name, value in re.findall(r"(X-Gateway-[A-Za-z]+): ([\w ,]+?)[;)]", comment):
            assert headers.get(name.lower()) == value, f"{comment}\n{text}"
        said = re.search(r"\b([45]\d\d) ([a-z_]+)", comment)
        if said:
            assert (status, f'"code":"{said[2]}"' in body.replace(" ", "")) == (int(said[1]), True), text
        else:
            assert status == 200, f"{comment}\n{text}"


async def _ready(url: str) -> None:
    """Until /readyz says 200: the local encoder is up."""
    deadline = time.monotonic() + 150
    async with aiohttp.ClientSession() as session:
        while True:
            async with session.get(f"{url}/readyz") as resp:
                if resp.status == 200:
                    return
            assert time.monotonic() < deadline, "the local encoder never became ready"
            await asyncio.sleep(0.2)

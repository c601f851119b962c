"""The README's commands, run as a user would. ``make serve`` on a table, until it answers and shows
its status page. The tour, as after ``make demo``: the shipped routing.yaml (its local encoder
started for real), stand-in engines where it points (vLLM, SGLang, Whisper), and every command of
the "Then try" block run by bash with curl, each held to what its comment says: the X-Gateway-*
headers it names, the status and error code it names, and never a 5xx. "Add your first model",
step by step: its snippet edited into a running gateway's table, checked, live, explained, and
seen on the status page and in the metrics. (``make test`` runs these; the other targets the
README names are CI's own steps.)"""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import signal
import socket
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

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


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
async def test_make_serve_serves_a_table_on_the_port_asked_and_its_status_page() -> None:
    """``make serve CONFIG=... PORT=...``, as the quick start says, with the venv running the tests
    (its gateway installed: nothing is downloaded), until the gateway answers; then Ctrl-C."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert "make serve CONFIG=docs/examples/text-and-images.yaml PORT=8081" in readme
    port, venv = _free_port(), Path(sys.executable).parent.parent
    process = await asyncio.create_subprocess_exec(
        "make", "--no-print-directory", "serve", "CONFIG=docs/examples/text-and-images.yaml", f"PORT={port}",
        f"VENV={venv}", cwd=ROOT, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
        start_new_session=True,  # make and the gateway, stopped as one
    )  # fmt: skip
    try:
        page = await _until_answered(f"http://127.0.0.1:{port}/", process)
        assert "<title>modality-gateway</title>" in page
        async with aiohttp.ClientSession() as session, session.get(f"http://127.0.0.1:{port}/status") as resp:
            names = [m["name"] for m in (await resp.json())["models"]]
        assert names == ["qwen-vl", "llama-text"]
    finally:
        if process.returncode is None:
            os.killpg(process.pid, signal.SIGINT)
        out = (await asyncio.wait_for(process.communicate(), timeout=60))[0].decode()
    assert f"serving 2 models from docs/examples/text-and-images.yaml on http://127.0.0.1:{port}" in out, out[-3000:]


async def _until_answered(url: str, process: asyncio.subprocess.Process) -> str:
    """The page at ``url`` once the gateway answers (it installs what is missing first: at most
    a few minutes), or the failure of the process that was to serve it."""
    deadline = time.monotonic() + 300
    async with aiohttp.ClientSession() as session:
        while True:
            assert process.returncode is None, (await process.stdout.read()).decode()[-3000:] if process.stdout else ""
            try:
                async with session.get(url) as resp:
                    if resp.status == 200:
                        return await resp.text()
            except aiohttp.ClientConnectionError:
                pass
            assert time.monotonic() < deadline, "make serve never answered"
            await asyncio.sleep(0.2)


def first_model() -> str:
    """The YAML of the README's "Add your first model" (its step 1), as it is indented there."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    step = readme.split("## Add your first model", 1)[1].split("1. **Edit**", 1)[1].split("2. **Check**", 1)[0]
    block = step.split("```yaml\n", 1)[1].split("```", 1)[0]
    return "\n".join(line.removeprefix("   ") for line in block.splitlines()) + "\n"


async def test_add_your_first_model_step_by_step(
    gateway_factory, upstream_factory, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    snippet = first_model()
    assert snippet.startswith("  - name: llama-vision\n")
    yaml_text = (ROOT / "routing.yaml").read_text(encoding="utf-8")
    for name, url in ENGINES.items():
        yaml_text = yaml_text.replace(url, (await upstream_factory(name)).url)
    engine = await upstream_factory("llama")
    gw = await gateway_factory(yaml_text, write_file=True, watch=True)
    await _ready(gw.url)
    table = tmp_path / "routing.yaml"  # the running gateway's file
    edited = yaml_text.rstrip("\n") + "\n\n" + snippet.replace("http://10.0.0.7:8000", engine.url)
    # 1. edit, 2. check
    checked = await _run(f"{Path(sys.executable).parent}/modality-gateway", "check", str(_written(tmp_path, edited)))
    assert checked == (0, f"{tmp_path / 'edited.yaml'}: ok\n")
    table.write_text(edited)
    # 3. live: the running gateway reads it again
    status = await _until(gw.url, lambda s: "llama-vision" in [m["name"] for m in s["models"]])
    row = next(m for m in status["models"] if m["name"] == "llama-vision")
    assert row["in"]["video"]["text"] == "redirected to qwen-omni" and row["in"]["image"]["notes"] == [
        "at most 1 a request"
    ]
    # 4. explain
    request = tmp_path / "request.json"
    request.write_text(
        '{"model": "llama-vision", "messages": [{"role": "user", "content": '
        '[{"type": "video_url", "video_url": {"url": "data:video/mp4;base64,AAAA"}}]}]}'
    )
    code, said = await _run(
        f"{Path(sys.executable).parent}/modality-gateway", "explain", "--config", str(table), str(request)
    )
    assert code == 0 and "qwen-omni" in said, said
    # 5. see it: a request served by it, on the page's counts and in the metrics
    async with aiohttp.ClientSession() as session:
        body = {"model": "llama-vision", "messages": [{"role": "user", "content": "hi"}]}
        async with session.post(f"{gw.url}/v1/chat/completions", json=body) as resp:
            assert resp.status == 200 and resp.headers["X-Gateway-Model"] == "llama-vision"
    status = await _until(gw.url, lambda s: s["counts"]["llama-vision"]["answered"] == 1)
    assert gw.sample("gateway_requests_total", model="llama-vision", code="200") == 1


def _written(folder: Path, text: str) -> Path:
    path = folder / "edited.yaml"
    path.write_text(text)
    return path


async def _run(*argv: str) -> tuple[int, str]:
    process = await asyncio.create_subprocess_exec(
        *argv, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT
    )
    out, _ = await asyncio.wait_for(process.communicate(), timeout=60)
    assert process.returncode is not None
    return process.returncode, out.decode()


async def _until(url: str, done: Callable[[dict[str, Any]], bool]) -> dict[str, Any]:
    """``/status`` once ``done`` says so of it (a reload is seen within reload_interval_s)."""
    deadline = time.monotonic() + 60
    async with aiohttp.ClientSession() as session:
        while True:
            async with session.get(f"{url}/status") as resp:
                status = await resp.json()
            if done(status):
                return status
            assert time.monotonic() < deadline, status
            await asyncio.sleep(0.1)


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
async def test_make_demo_moves_to_the_ports_it_is_given() -> None:
    """``make demo`` with every port its own (the gateway's and the three stand-ins'): the table
    served points at the stand-ins where they are, so a request to each engine is answered."""
    ports = {name: _free_port() for name in ("PORT", "VLLM_PORT", "SGLANG_PORT", "WHISPER_PORT")}
    venv = Path(sys.executable).parent.parent
    process = await asyncio.create_subprocess_exec(
        "make", "--no-print-directory", "demo", *(f"{k}={v}" for k, v in ports.items()), f"VENV={venv}",
        cwd=ROOT, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    url = f"http://127.0.0.1:{ports['PORT']}"
    try:
        await _until_answered(f"{url}/v1/models", process)
        async with aiohttp.ClientSession() as session:
            for model in ("kimi-k3", "qwen-omni"):  # SGLang's stand-in, vLLM's
                body = {"model": model, "messages": [{"role": "user", "content": "hi"}]}
                for _ in range(600):  # the stand-ins may start after the gateway: bounded
                    async with session.post(f"{url}/v1/chat/completions", json=body) as resp:
                        if resp.status != 502:
                            break
                    await asyncio.sleep(0.1)
                assert resp.status == 200, (model, await resp.text())
    finally:
        if process.returncode is None:
            os.killpg(process.pid, signal.SIGINT)
        await asyncio.wait_for(process.communicate(), timeout=60)
    assert not (venv / "demo-routing.yaml").read_text().count("127.0.0.1:8000")


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_every_make_target_the_readme_names_is_one_make_help_lists() -> None:
    """The targets the README names (`make test`, `make conformance`, ...) exist: what CI and the
    tests above do not run here (the suite, conformance, the benchmarks) is at least a real target."""
    import subprocess

    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    named = set(re.findall(r"\bmake ([a-z][a-z-]*)\b", readme))
    assert {"serve", "test", "demo", "check", "conformance", "bench", "help", "test-minimal"} <= named
    listed = subprocess.run(
        ["make", "--no-print-directory", "help"], cwd=ROOT, capture_output=True, text=True, check=True
    )
    targets = set(re.findall(r"^  make ([a-z-]+) ", listed.stdout, flags=re.M))
    assert named <= targets, named - targets

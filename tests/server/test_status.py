"""The status page (gateway.server.status): what each cell of the table says, the JSON behind the
page and who may see what of it, and the page itself in a real browser (Debian's headless
Chromium): its DOM after its script ran against a live gateway, and a screenshot checked for the
table's colours (kept in docs/status-page.png when MODALITY_GATEWAY_SCREENSHOT names it)."""

from __future__ import annotations

import asyncio
import hashlib
import os
import shutil
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from PIL import Image

from gateway.config import parse_config
from gateway.server.status import capabilities

KEY = "sk-status-0123456789"


def table(upstream: str, extra: str = "") -> str:
    return f"""
version: 1
models:
  - name: vision
    upstreams: [{upstream}]
    upstream_model: org/vision-7b
    accepts: [text, image]
    limits: {{image: 4, image_pixels: 1000000}}
    on_oversize: downscale
    on_unsupported:
      video: {{redirect: omni}}
      audio: {{transcribe: ears}}
      file: {{extract: {{max_pages: 4, page_images: true, dpi: 72}}}}
  - name: omni
    upstreams: [{upstream}, http://127.0.0.1:9]
    accepts: [text, image, video, audio]
    limits: {{video: 1}}
  - name: ears
    upstreams: [{upstream}]
    accepts: [text, audio]
    produces: [text, audio]
    apis: [chat, transcriptions]
  - name: texty
    upstreams: [{upstream}]
    accepts: [text]
    on_unsupported:
      image: {{describe: vision}}
      audio: strip
      video: {{history: strip}}
    on_unsupported_output:
      audio: {{redirect: ears}}
{extra}"""


def test_each_cell_says_what_becomes_of_such_a_part() -> None:
    rows = {row["name"]: row for row in capabilities(parse_config(table("http://127.0.0.1:1")))}
    vision, omni, texty = rows["vision"]["in"], rows["omni"]["in"], rows["texty"]["in"]
    assert vision["text"] == {"verdict": "accepted", "text": "accepted", "notes": []}
    assert vision["image"]["verdict"] == "accepted"
    assert vision["image"]["notes"] == ["at most 4 a request", "at most 1.0 MP each", "downscaled past its limits"]
    assert vision["video"] == {"verdict": "converted", "text": "redirected to omni", "target": "omni", "notes": []}
    assert vision["audio"]["text"] == "transcribed by ears" and vision["audio"]["verdict"] == "converted"
    assert vision["file"]["text"] == "text and page images (72 dpi)"
    # vLLM's Responses API has no video and no audio part: what becomes of one sent there
    there = "on responses (no such part there): rejected (400)"
    assert omni["video"] == {"verdict": "accepted", "text": "accepted", "notes": ["at most 1 a request", there]}
    assert omni["audio"]["notes"] == [there]
    assert omni["file"]["verdict"] == "rejected" and omni["file"]["text"] == "rejected (400)"
    assert texty["image"]["text"] == "described by vision" and texty["audio"]["text"] == "stripped"
    assert texty["video"]["verdict"] == "rejected"
    assert texty["video"]["notes"] == ["in earlier turns and tool results: stripped"]
    assert rows["ears"]["apis"] == ["chat", "transcriptions"] and rows["vision"]["upstream_model"] == "org/vision-7b"
    produced, rejected = {"verdict": "accepted", "text": "produced", "notes": []}, "rejected (400)"
    assert rows["ears"]["out"] == {
        "text": produced,
        "audio": produced,
        "image": {**produced, "verdict": "rejected", "text": rejected},
    }
    assert rows["texty"]["out"]["audio"] == {
        "verdict": "converted",
        "text": "redirected to ears",
        "target": "ears",
        "notes": ["asked by chat's modalities or audio, or on the speech API"],
    }
    assert rows["vision"]["out"]["audio"]["text"] == rejected and rows["vision"]["out"]["text"] == produced


async def _get(url: str, token: str | None = None) -> tuple[int, dict[str, str], Any]:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    async with aiohttp.ClientSession() as session, session.get(url, headers=headers) as resp:
        body = await resp.json() if resp.content_type == "application/json" else await resp.text()
        return resp.status, dict(resp.headers), body


async def _reject_a_file(url: str, n: int, headers: dict[str, str] | None = None) -> None:
    body = {"model": "omni", "messages": [{"role": "user", "content": [{"type": "file", "file": {"file_data": "x"}}]}]}
    async with aiohttp.ClientSession() as session:
        for _ in range(n):
            async with session.post(f"{url}/v1/chat/completions", json=body, headers=headers or {}) as resp:
                assert resp.status == 400


async def test_the_page_and_its_data_without_auth(gateway_factory, upstream_factory, monkeypatch) -> None:
    """Without auth: open, as /metrics is; a replica's address and error only with the admin
    token, as /readyz says them."""
    monkeypatch.setenv("GATEWAY_ADMIN_TOKEN", "s3cret")
    up = await upstream_factory()
    gw = await gateway_factory(table(up.url))
    status, headers, page = await _get(f"{gw.url}/")
    assert status == 200 and headers["Content-Type"] == "text/html; charset=utf-8"
    assert "default-src 'none'" in headers["Content-Security-Policy"] and '<table id="matrix"' in page
    assert "http" not in page.split("<script>")[1].replace('"status"', "")  # its one fetch is its own /status
    await _reject_a_file(gw.url, 3)
    async with aiohttp.ClientSession() as session:
        body = {"model": "omni", "messages": [{"role": "user", "content": "hi"}]}
        async with session.post(f"{gw.url}/v1/chat/completions", json=body) as resp:
            assert resp.status == 200
    status, _, data = await _get(f"{gw.url}/status")
    assert status == 200 and data["status"] == "ready" and data["admin"] is False
    assert [m["name"] for m in data["models"]] == ["vision", "omni", "ears", "texty"]
    assert data["modalities"] == ["text", "image", "video", "audio", "file"] and data["outputs"] == [
        "text",
        "audio",
        "image",
    ]
    assert data["counts"]["omni"] == {
        "answered": 1, "refused": 3, "failed": 0, "rejected_for_content": 3, "redirected": 0, "converted": 0,
    }  # fmt: skip
    omni = data["replicas"]["omni"]
    assert [r["replica"] for r in omni] == [1, 2] and all("url" not in r and "last_error" not in r for r in omni)
    _, _, seen = await _get(f"{gw.url}/status", token="s3cret")
    assert seen["admin"] is True and [r["url"] for r in seen["replicas"]["omni"]] == [up.url, "http://127.0.0.1:9"]


async def test_with_auth_the_data_needs_the_admin_token(gateway_factory, upstream_factory, monkeypatch) -> None:
    """With auth: on, as /metrics: 403 while no admin token is set, 401 without it or with a
    client's key; the page itself (no data in it) is served, and asks for the token."""
    up = await upstream_factory()
    auth = f"auth:\n  keys:\n    - {{name: team, key_sha256: {hashlib.sha256(KEY.encode()).hexdigest()}}}\n"
    gw = await gateway_factory(table(up.url, auth))
    monkeypatch.delenv("GATEWAY_ADMIN_TOKEN", raising=False)
    status, _, body = await _get(f"{gw.url}/status")
    assert status == 403 and "GATEWAY_ADMIN_TOKEN" in body["error"]["message"]
    monkeypatch.setenv("GATEWAY_ADMIN_TOKEN", "s3cret")
    assert (await _get(f"{gw.url}/status"))[0] == 401
    assert (await _get(f"{gw.url}/status", token=KEY))[0] == 401  # a client's key is not the admin's
    status, _, data = await _get(f"{gw.url}/status", token="s3cret")
    assert status == 200 and data["admin"] is True
    status, _, page = await _get(f"{gw.url}/")
    assert status == 200 and 'id="gate"' in page


# -- in a real browser --------------------------------------------------------------------------

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
needs_chromium = pytest.mark.skipif(CHROMIUM is None, reason="needs Debian's chromium (make test-deps)")
# the cells' colours (status.html's --ok, --conv, --no)
COLOURS = {"accepted": (0xD7, 0xF2, 0xDC), "converted": (0xFD, 0xEC, 0xC8), "rejected": (0xF9, 0xD6, 0xD5)}


async def _chromium(url: str, profile: Path, *flags: str) -> bytes:
    """Headless Chromium on ``url``, its script given 3 s of virtual time (its fetch of /status and
    the render, not a wait on the wall clock): what it prints."""
    process = await asyncio.create_subprocess_exec(
        CHROMIUM or "chromium",
        "--headless",
        "--no-sandbox",  # as root in CI
        "--disable-gpu",
        "--no-first-run",
        "--hide-scrollbars",
        f"--user-data-dir={profile}",
        "--virtual-time-budget=3000",
        "--window-size=1400,1000",
        *flags,
        url,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env={**os.environ, "NO_PROXY": "*", "no_proxy": "*"},
    )
    out, err = await asyncio.wait_for(process.communicate(), timeout=120)
    assert process.returncode == 0, err.decode(errors="replace")[-2000:]
    return out


@needs_chromium
async def test_the_page_in_a_browser_shows_the_table_and_the_counts(
    gateway_factory, upstream_factory, tmp_path: Path
) -> None:
    up = await upstream_factory()
    gw = await gateway_factory(table(up.url))
    await _reject_a_file(gw.url, 2)
    dom = (await _chromium(f"{gw.url}/", tmp_path / "profile", "--dump-dom")).decode()
    # the DOM after the script ran: the matrix, cell by cell, and the counts
    assert '<span id="state" class="state ready" role="status" aria-live="polite">ready</span>' in dom
    for model in ("vision", "omni", "ears", "texty"):
        assert f'<th scope="row">{model}' in dom
    for said in ("redirected to omni", "transcribed by ears", "described by vision", "text and page images (72 dpi)",
                 "stripped", "on responses (no such part there): rejected (400)", "at most 1.0 MP each"):  # fmt: skip
        assert said in dom, said
    # in: 6 rejected, 5 converted; out (audio, image): 6 rejected, texty's audio redirected
    assert dom.count('<td class="rejected">') == 12 and dom.count('<td class="converted">') == 6
    omni = dom.split('<th scope="row">omni</th>', 1)[1].split("</tr>", 1)[0]  # its row of counts
    assert omni.count('<td class="num">2</td>') == 2  # refused, of them for content
    assert "replica 2 healthy" in omni and "127.0.0.1" not in omni  # no address without the admin token
    assert '<form id="gate" aria-label="Admin token">' in dom  # not shown (its style): nothing asks for it
    assert '<button id="ask" type="button">admin token</button>' in dom  # offered, for the replicas' addresses
    # the screenshot: the table drawn, each kind of cell in its colour
    shot = tmp_path / "status.png"
    await _chromium(f"{gw.url}/", tmp_path / "profile2", f"--screenshot={shot}")
    with Image.open(shot) as image:
        assert image.size == (1400, 1000)
        colours = {colour: n for n, colour in image.convert("RGB").getcolors(maxcolors=1 << 20) or []}
    seen = {verdict: colours.get(colour, 0) for verdict, colour in COLOURS.items()}
    assert all(n > 5_000 for n in seen.values()), seen  # cells, not a legend's swatch (11x11)
    keep = os.environ.get("MODALITY_GATEWAY_SCREENSHOT")
    if keep:
        shutil.copy(shot, keep)


def test_a_spoken_output_is_drawn_as_its_speaker() -> None:
    from gateway.config import parse_config
    from gateway.modalities import Modality
    from gateway.server.status import output_cell
    from tests.conftest import routing

    config = parse_config(
        routing(
            "  - {name: t, upstreams: ['http://h:1'], accepts: [text], on_unsupported_output: {audio: {speak: s}}}",
            "  - {name: s, upstreams: ['http://h:1'], accepts: [text], produces: [audio], apis: [speech]}",
        )
    )
    model = config.model("t")
    assert model is not None
    assert output_cell(model, Modality.AUDIO) == {
        "verdict": "converted",
        "text": "spoken by s",
        "target": "s",
        "notes": ["asked by chat's modalities or audio, not streamed; on the speech API: rejected (400)"],
    }

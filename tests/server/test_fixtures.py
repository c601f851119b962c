"""Bodies in the shapes the vendors' and engines' own docs give (tests/fixtures/api_bodies.json,
each with its source): every one gets the status the table implies, to a model that takes
images and to one that takes text only, and nothing refused reaches an engine."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.conftest import routing

FIXTURES = json.loads((Path(__file__).resolve().parent.parent / "fixtures" / "api_bodies.json").read_text())
PNG_B64 = "iVBORw0KGgo="
APIS = "apis: [chat, responses, messages, embeddings, score, rerank]"


def filled(value: Any, model: str) -> Any:
    """The body with its placeholders: the model, a small data URL (or its base64) for each image."""
    text = json.dumps(value).replace('"MODEL"', json.dumps(model))
    return json.loads(
        text.replace("IMAGE_B64", PNG_B64).replace('"IMAGE"', json.dumps(f"data:image/png;base64,{PNG_B64}"))
    )


@pytest.mark.parametrize("case", FIXTURES["cases"], ids=lambda c: f"{c['path']} {c['source'][:48]}")
async def test_each_documented_body_gets_the_status_its_table_implies(gateway_factory, upstream_factory, case) -> None:
    up = await upstream_factory("up")
    gw = await gateway_factory(
        routing(
            f"  - {{name: vision, upstreams: [{up.url}], accepts: [text, image], {APIS}}}",
            f"  - {{name: texty, upstreams: [{up.url}], accepts: [text], {APIS}}}",
        )
    )
    async with aiohttp.ClientSession() as session:
        for model, status in case["status"].items():
            sent = len(up.received)
            async with session.post(gw.url + case["path"], json=filled(case["body"], model)) as resp:
                answer = await resp.json()
                assert resp.status == status, (model, answer)
            assert len(up.received) == sent + (status == 200), "a refused body reached the engine"
            if status == 400 and case["path"] == "/v1/messages":
                assert answer["type"] == "error" and answer["error"]["type"] == "invalid_request_error"
            elif status == 400:
                assert answer["error"]["code"] == "unsupported_modality"

"""A realtime session through the gateway, held to vLLM 0.33's own realtime protocol
(``vllm/entrypoints/speech_to_text/realtime``): every client event the engine receives is one
vLLM's ``RealtimeConnection`` takes (its models of ``session.update``, ``input_audio_buffer.append``
and ``commit``), with the model renamed for the upstream; every event the client reads is one of
vLLM's server event models; the events the gateway refuses itself never reach the engine."""

from __future__ import annotations

import base64
import json
from typing import Any

import pytest

from tests.conformance.conftest import Engine
from tests.conftest import routing

pytestmark = pytest.mark.timeout(180)
TENTH = b"\x01\x00" * 1600  # a tenth of a second of PCM16 at 16 kHz


async def test_a_session_is_what_vllms_realtime_connection_takes(gateway_factory, vllm) -> None:
    from tests.conformance.engines import vllm_side

    engine: Engine = await vllm()
    gw = await gateway_factory(
        routing(
            f"  - {{name: asr, upstream_model: mistralai/Voxtral-Mini-4B-Realtime, upstreams: [{engine.url}],"
            " accepts: [text, audio], apis: [realtime]}"
        )
    )
    audio = {"type": "input_audio_buffer.append", "audio": base64.b64encode(TENTH).decode()}
    read: list[dict[str, Any]] = []
    async with gw.client().realtime.connect(model="asr") as connection:
        read.append(json.loads(await connection.recv_bytes()))
        for event in (
            {"type": "session.update", "model": "asr"},
            {"type": "session.update", "model": "another"},  # refused by the gateway: never sent
            {"type": "input_audio_buffer.commit"},
            audio,
            audio,
            {"type": "input_audio_buffer.commit", "final": True},
        ):
            await connection.send(event)
        while not read or read[-1]["type"] != "transcription.done":
            read.append(json.loads(await connection.recv_bytes()))
    sent = [c for c in engine.checked if c.path == "/v1/realtime"]
    assert [c.refused for c in sent] == [None] * 5
    assert [c.body["type"] for c in sent] == ["session.update", "input_audio_buffer.commit",
                                             "input_audio_buffer.append", "input_audio_buffer.append",
                                             "input_audio_buffer.commit"]  # fmt: skip
    assert sent[0].found.request.model == "mistralai/Voxtral-Mini-4B-Realtime"
    assert [vllm_side.realtime_event(e).model_dump()["type"] for e in read] == [
        "session.created", "error", "transcription.delta", "transcription.delta", "transcription.done"
    ]  # fmt: skip
    assert read[1]["code"] == "model_not_allowed" and read[1]["param"] == "model"

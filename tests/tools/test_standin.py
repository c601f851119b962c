"""The stand-in engine's agent driving (``@read PATH``), read by the real SDKs as Claude Code and
Codex read it: a tool call where the request offers the tool, the usual reply once its result is back."""

from __future__ import annotations

import json
from typing import Any

import anthropic
import openai

READ_TOOL = {"name": "Read", "description": "read a file", "input_schema": {"type": "object", "properties": {}}}
VIEW_TOOL = {"type": "function", "name": "view_image", "parameters": {"type": "object", "properties": {}}}


async def test_it_asks_claude_codes_read_tool_for_the_file_and_then_answers(upstream) -> None:
    async with anthropic.AsyncAnthropic(base_url=upstream.url, api_key="k", max_retries=0) as c:
        ask: list[Any] = [{"role": "user", "content": "@read /tmp/x.png"}]
        async with c.messages.stream(model="m", max_tokens=8, messages=ask, tools=[READ_TOOL]) as stream:
            call = await stream.get_final_message()
        assert call.stop_reason == "tool_use"
        (block,) = call.content
        assert block.type == "tool_use" and block.name == "Read" and block.input == {"file_path": "/tmp/x.png"}
        result = {"type": "tool_result", "tool_use_id": block.id, "content": [{"type": "text", "text": "png"}]}
        after = [*ask, {"role": "assistant", "content": [block.model_dump()]}, {"role": "user", "content": [result]}]
        reply = await c.messages.create(model="m", max_tokens=8, messages=after, tools=[READ_TOOL])
        assert reply.stop_reason == "end_turn"
        untooled = await c.messages.create(model="m", max_tokens=8, messages=ask)  # no Read offered
        assert untooled.stop_reason == "end_turn"


async def test_it_asks_codexs_view_image_for_the_file_and_then_answers(upstream) -> None:
    async with openai.AsyncOpenAI(base_url=f"{upstream.url}/v1", api_key="k", max_retries=0) as c:
        ask: list[Any] = [{"role": "user", "content": "look: @read /tmp/x.png"}]
        stream: Any = await c.responses.create(model="m", input=ask, tools=[VIEW_TOOL], stream=True)
        done: Any = [e async for e in stream][-1]
        assert done.type == "response.completed"
        (call,) = done.response.output
        assert call.type == "function_call" and call.name == "view_image"
        assert json.loads(call.arguments) == {"path": "/tmp/x.png"}
        output = {"type": "function_call_output", "call_id": call.call_id, "output": "seen"}
        reply = await c.responses.create(model="m", input=[*ask, call.model_dump(), output], tools=[VIEW_TOOL])
        assert reply.output_text.startswith("[up] model=m")

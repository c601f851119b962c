"""gateway.upstream.usage: every API's usage read from its replies, whole and streamed, split anywhere."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from gateway.upstream.usage import TAIL_BYTES, BodyTail, StreamUsage, Usage, usage_in_body, usage_of

CHAT = {
    "prompt_tokens": 120,
    "completion_tokens": 30,
    "total_tokens": 150,
    "prompt_tokens_details": {"cached_tokens": 64},
}
RESPONSES = {"input_tokens": 90, "input_tokens_details": {"cached_tokens": 10}, "output_tokens": 7,
             "output_tokens_details": {"reasoning_tokens": 2}, "total_tokens": 97}  # fmt: skip
MESSAGES = {"input_tokens": 5, "output_tokens": 40, "cache_read_input_tokens": 100, "cache_creation_input_tokens": 20}


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        (CHAT, Usage(120, 30, 64)),
        ({"prompt_tokens": 10, "total_tokens": 10}, Usage(10, 0, 0)),  # embeddings, score, rerank
        (RESPONSES, Usage(90, 7, 10)),
        (MESSAGES, Usage(125, 40, 100)),  # Anthropic's input_tokens leaves the cache out
        ({"input_tokens": 10, "output_tokens": 3}, Usage(10, 3, 0)),
        ({"type": "tokens", "input_tokens": 4, "output_tokens": 9}, Usage(4, 9, 0)),  # a transcription
        ({"type": "duration", "seconds": 12}, None),  # vLLM's transcription: seconds, not tokens
        ({"total_tokens": 5}, None),
        ({"prompt_tokens": -3, "completion_tokens": "9", "prompt_tokens_details": None}, Usage(0, 0, 0)),
        ({"prompt_tokens": True, "completion_tokens": 1.5}, Usage(0, 0, 0)),  # only ints count
    ],
)
def test_every_apis_usage_reads_as_one(fields, expected) -> None:
    assert usage_of(fields) == expected


def test_a_body_s_last_usage_object_is_read_without_parsing_the_body() -> None:
    reply = {"id": "x", "choices": [{"message": {"content": 'he said "usage": {"prompt_tokens": 9}'}}], "usage": CHAT}
    assert usage_in_body(orjson.dumps(reply)) == Usage(120, 30, 64)
    spaced = b'{"data": [1, 2],\n  "usage" :\t{ "prompt_tokens": 7, "total_tokens": 7 }\n}'
    assert usage_in_body(spaced) == Usage(7, 0, 0)
    # a string "usage" after the real one, and a key named so with a value of another kind
    tricky = b'{"usage": {"prompt_tokens": 3}, "tags": ["usage"], "x": {"usage": null}}'
    assert usage_in_body(tricky) == Usage(3, 0, 0)


@pytest.mark.parametrize(
    "body",
    [
        b"",
        b"not json",
        b'{"usage": 5}',
        b'{"usage": {"prompt_tokens": 1',
        b'{"usage": {"a": "}"',
        b'{"usage"',
        b'{"count": 3}',
        b'{"input_tokens": 12}',
    ],
)
def test_a_body_without_a_readable_usage_says_none(body) -> None:
    assert usage_in_body(body) is None


def test_a_usage_whose_strings_hold_braces_is_not_misread() -> None:
    # usages hold numbers; one with a brace in a string is let go rather than cut wrong
    body = b'{"usage": {"note": "a } and \\" then {", "prompt_tokens": 4, "completion_tokens": 2}}'
    assert usage_in_body(body) is None
    nested = b'{"usage": {"a": {"b": {"c": 1}}, "prompt_tokens": 4, "x": {}}}'
    assert usage_in_body(nested) == Usage(4, 0, 0)


def _sse(events: list[dict[str, Any]], named: bool = False) -> bytes:
    lines = b""
    for e in events:
        if named:
            lines += f"event: {e['type']}\n".encode()
        lines += b"data: " + orjson.dumps(e) + b"\n\n"
    return lines


CHAT_STREAM = _sse([{"choices": [{"delta": {"content": "hi"}}]}, {"choices": [], "usage": CHAT}]) + b"data: [DONE]\n\n"
RESPONSES_STREAM = _sse(
    [
        {"type": "response.created", "response": {"id": "r", "usage": None}},
        {"type": "response.output_text.delta", "delta": "a usage of words"},
        {"type": "response.completed", "response": {"id": "r", "usage": RESPONSES}},
    ],
    named=True,
)
MESSAGES_STREAM = _sse(
    [
        {"type": "message_start", "message": {"id": "m", "usage": {"input_tokens": 5, "output_tokens": 1,
                                                                    "cache_read_input_tokens": 100}}},
        {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "x"}},
        {"type": "message_delta", "delta": {"stop_reason": "end_turn"}, "usage": {"output_tokens": 40}},
        {"type": "message_stop"},
    ],
    named=True,
)  # fmt: skip


@pytest.mark.parametrize(
    ("stream", "expected"),
    [(CHAT_STREAM, Usage(120, 30, 64)), (RESPONSES_STREAM, Usage(90, 7, 10)), (MESSAGES_STREAM, Usage(105, 40, 100))],
)
def test_a_streams_usage_is_read_however_its_chunks_split(stream, expected) -> None:
    for size in (1, 3, 7, 64, len(stream)):
        reader = StreamUsage()
        for at in range(0, len(stream), size):
            reader.feed(stream[at : at + size])
        assert reader.usage == expected, size


def test_continuous_usage_stats_the_last_chunk_holds() -> None:
    chunks = [{"choices": [], "usage": {"prompt_tokens": 10, "completion_tokens": n}} for n in (1, 2, 3)]
    reader = StreamUsage()
    reader.feed(_sse(chunks))
    assert reader.usage == Usage(10, 3, 0)


def test_a_stream_without_usage_or_with_broken_events_says_none() -> None:
    reader = StreamUsage()
    reader.feed(_sse([{"choices": [{"delta": {"content": "usage"}}]}]))
    reader.feed(b'data: {"usage": {broken\n\ndata: [1, "usage"]\n\n: comment "usage"\n\n')
    assert reader.usage is None
    reader.feed(b"data: " + b"x" * (TAIL_BYTES + 10))  # a line too long to be a usage event is let go
    reader.feed(b'"usage": {"prompt_tokens": 1}}\n\n')
    assert reader.usage is None


def test_a_large_body_relayed_in_chunks_keeps_only_its_end() -> None:
    body = orjson.dumps({"data": [{"embedding": [0.5] * 50_000}], "usage": {"prompt_tokens": 42, "total_tokens": 42}})
    tail = BodyTail()
    for at in range(0, len(body), 1000):
        tail.feed(body[at : at + 1000])
    assert tail.usage == Usage(42, 0, 0)
    assert sum(len(c) for c in tail._chunks) < TAIL_BYTES + 1000

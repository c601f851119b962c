"""gateway.upstream.relay's pieces that stand alone: a stream less the usage chunk the gateway
asked for on a key's behalf."""

from __future__ import annotations

import itertools

import hypothesis
from hypothesis import strategies as st

from gateway.upstream.relay import UsageHidden

EVENTS = [
    b'data: {"id":"c","choices":[{"index":0,"delta":{"content":"hi"}}],"usage":null}\n\n',
    b'data: {"id":"c","choices":[{"index":0,"delta":{},"finish_reason":"stop"}],"usage":null}\n\n',
    b'data: {"id":"c","choices":[],"usage":{"prompt_tokens":3,"completion_tokens":1,"total_tokens":4}}\n\n',
    b"data: [DONE]\n\n",
]


@hypothesis.settings(max_examples=200, derandomize=True, database=None, deadline=None)
@hypothesis.given(cuts=st.lists(st.integers(0, sum(map(len, EVENTS))), max_size=8))
def test_the_usage_chunk_is_left_out_wherever_the_stream_is_cut(cuts: list[int]) -> None:
    stream = b"".join(EVENTS)
    points = sorted({0, *cuts, len(stream)})
    hidden = UsageHidden()
    out = b"".join(hidden.feed(stream[a:b]) for a, b in itertools.pairwise(points)) + hidden.rest
    assert out == EVENTS[0] + EVENTS[1] + EVENTS[3]

"""gateway.admission.strings: a body parsed with its long media strings read aside is the very dict
orjson gives, for every body; and a body orjson refuses is refused the same."""

from __future__ import annotations

import base64
import json
import random
from typing import Any

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.admission.strings import LONG_STRING, loads

B64 = base64.b64encode(random.Random(0).randbytes(3 * LONG_STRING)).decode()  # longer than LONG_STRING


def chat(*urls: str, text: str = "what is this?") -> dict[str, Any]:
    parts = [{"type": "image_url", "image_url": {"url": u}} for u in urls]
    return {"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": text}, *parts]}]}


def same(raw: bytes) -> Any:
    found = loads(raw)
    assert found == orjson.loads(raw) and type(found) is type(orjson.loads(raw))
    return found


def test_data_urls_and_data_keys_are_read_aside_and_put_back(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    real = orjson.loads

    def counted(raw: bytes) -> Any:
        calls.append(len(raw))
        return real(raw)

    monkeypatch.setattr(orjson, "loads", counted)
    audio = {"type": "input_audio", "input_audio": {"data": B64, "format": "wav"}}
    block = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": B64}}
    body = chat("data:image/png;base64," + B64, "data:image/jpeg;base64," + B64[:-8])
    body["messages"].append({"role": "user", "content": [audio, block]})
    raw = orjson.dumps(body)
    assert loads(raw) == body
    assert calls == [calls[0]] and calls[0] < 1000  # one parse, of what was left: four strings aside


@pytest.mark.parametrize(
    "raw",
    [
        json.dumps(chat("data:image/png;base64," + B64), indent=2).encode(),  # spaces, line breaks between
        json.dumps(chat("data:image/png;base64," + B64.replace("/", "\\/"))).encode(),  # an escaped slash
        orjson.dumps(chat("data:image/png;base64," + B64[:100] + "\n" + B64)),  # base64 in lines: \n escaped
        orjson.dumps(chat("data:image/png;base64," + B64, text="\x00gw0")),  # a string like a placeholder
        orjson.dumps(chat("data:image/png;base64,é" + B64)),  # not ASCII
        orjson.dumps({"data:image/png;base64," + B64: 1, "model": "m"}),  # a key, not a value
        orjson.dumps(chat("data:image/png;base64," + B64, text='say "data:' + B64 + '" twice')),  # inside a text
        orjson.dumps({"data": "data", "x": {"data": B64}, "y": ["data", {"data": B64}]}),
        orjson.dumps({"model": "m", "data": B64, "data2": "x"}),
        b'{"model": "m", "data" :  "' + B64.encode() + b'"}',
        b'{"a": "data:' + B64.encode() + b'", "a": "short"}',  # a duplicate key: the last wins
    ],
    ids=[
        "indented",
        "escaped-slash",
        "lines",
        "placeholder-like",
        "non-ascii",
        "key",
        "in-text",
        "nested",
        "plain-data",
        "spaced-colon",
        "duplicate-key",
    ],
)
def test_every_shape_parses_as_orjson_parses_it(raw: bytes) -> None:
    same(raw)


@pytest.mark.parametrize(
    "raw",
    [
        b'{"model": "m", "u": "data:' + B64.encode() + b'"',  # unterminated object
        b'{"model": "m", "u": "data:' + B64.encode(),  # unterminated string
        b'{"model": "m", "u": "data:' + B64.encode() + b'" "v": 1}',  # a missing comma
        b'["data:' + B64.encode() + b'", 1,]',  # a trailing comma
    ],
)
def test_what_orjson_refuses_is_refused_with_its_own_error(raw: bytes) -> None:
    with pytest.raises(orjson.JSONDecodeError) as theirs:
        orjson.loads(raw)
    with pytest.raises(orjson.JSONDecodeError) as ours:
        loads(raw)
    assert str(ours.value) == str(theirs.value)


pieces = st.sampled_from(['"data:', '"data"', ":", " ", ",", "[", "]", "{", "}", '"', "\\", "\\u0000", "é", "x", B64])


@settings(max_examples=400, deadline=None)
@given(st.lists(pieces, max_size=12))
def test_any_bytes_parse_or_fail_as_orjson_does(parts: list[str]) -> None:
    raw = "".join(parts).encode()
    try:
        expected = orjson.loads(raw)
    except orjson.JSONDecodeError:
        with pytest.raises(orjson.JSONDecodeError):
            loads(raw)
        return
    assert loads(raw) == expected


@settings(max_examples=200, deadline=None)
@given(
    st.recursive(
        st.one_of(
            st.none(),
            st.booleans(),
            st.integers(-(2**63), 2**63 - 1),
            st.text(max_size=8),
            st.just("data:x," + B64),
            st.just(B64),
        ),
        lambda inner: (
            st.lists(inner, max_size=4) | st.dictionaries(st.sampled_from(["data", "url", "x"]), inner, max_size=3)
        ),
        max_leaves=12,
    )
)
def test_any_json_document_round_trips(document: Any) -> None:
    raw = orjson.dumps(document)
    assert loads(raw) == orjson.loads(raw)

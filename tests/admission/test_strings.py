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

from gateway.admission.strings import LONG_STRING, PREFIX, Deferred, cut, loads, parse
from gateway.errors import InvalidRequestError

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


def deferred(raw: bytes) -> tuple[Any, Deferred]:
    skeleton, spans = cut(raw)
    parsed = parse(skeleton, raw, spans, defer=True)
    assert parsed is not None and parsed[1] is not None
    return parsed[0], parsed[1]


def test_an_images_data_url_is_held_back_past_its_header_and_put_back_whole() -> None:
    """Where an image's data lies (a chat image_url, a Responses input_image, an Anthropic base64
    image) its first PREFIX characters are read; every other long string is read whole."""
    image = "data:image/png;base64," + B64
    audio = {"type": "input_audio", "input_audio": {"data": B64, "format": "wav"}}
    block = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": B64}}
    document = {"type": "document", "source": {"type": "base64", "media_type": "application/pdf", "data": B64}}
    body = chat(image, text="data:" + B64)  # a text that looks like a data URL stays a text
    body["messages"][0]["content"].append({"type": "text", "text": "data:" + B64})
    body["messages"].append({"role": "user", "content": [audio, block, document]})
    body["input"] = [{"role": "user", "content": [{"type": "input_image", "image_url": image}]}]
    body["untyped"] = {"image_url": {"url": image}}  # not a part's: read whole
    raw = orjson.dumps(body)
    found, rest = deferred(raw)
    held = [
        found["messages"][0]["content"][1]["image_url"]["url"],
        found["messages"][1]["content"][1]["source"]["data"],
        found["input"][0]["content"][0]["image_url"],
    ]
    assert [len(s) for s in held] == [PREFIX] * 3 and all(rest.holds(s) for s in held)
    assert held[0] == image[:PREFIX] and held[1] == B64[:PREFIX]
    assert found["untyped"]["image_url"]["url"] == image and found["messages"][0]["content"][2]["text"] == "data:" + B64
    assert found["messages"][1]["content"][0]["input_audio"]["data"] == B64
    assert found["messages"][1]["content"][2]["source"]["data"] == B64
    rest.restore()
    assert found == body and not rest and not any(rest.holds(s) for s in held)
    rest.restore()  # once: nothing more to do
    assert found == body


@pytest.mark.parametrize(
    "tail",
    ["\\/" + B64[:100], "\\n" + B64[:100], "é" + B64[:100], "\\u00e9\\ud83d\\ude00"],
    ids=["escaped-slash", "escaped-newline", "not-ascii", "unicode-escapes"],
)
def test_a_held_back_string_is_put_back_as_orjson_reads_it(tail: str) -> None:
    """What lies past the first PREFIX characters is read as it is put back: escapes decoded, not
    ASCII read as UTF-8, as orjson reads them."""
    image = "data:image/png;base64," + B64
    raw = orjson.dumps(chat(image)).replace(B64[-10:].encode(), B64[-10:].encode() + tail.encode())
    found, rest = deferred(raw)
    assert rest and len(found["messages"][0]["content"][1]["image_url"]["url"]) == PREFIX
    rest.restore()
    assert found == orjson.loads(raw)


@pytest.mark.parametrize(
    "tail", [b"\n", b"\t", b"\xff\xfe", b"\x01", b"\x1f"], ids=["line-break", "tab", "not-utf8", "soh", "us"]
)
def test_a_held_back_string_orjson_refuses_is_a_400_when_it_is_put_back(tail: bytes) -> None:
    """Past its first PREFIX characters a string is not looked at until it is put back: then
    what orjson refuses is refused (a request sent on as it came is the engine's to refuse),
    control bytes included (issue 40: they were written out escaped, as valid JSON)."""
    raw = orjson.dumps(chat("data:image/png;base64," + B64)).replace(B64[-10:].encode(), tail + B64[-10:].encode())
    with pytest.raises(orjson.JSONDecodeError):
        orjson.loads(raw)
    _, rest = deferred(raw)
    with pytest.raises(InvalidRequestError, match="not valid JSON") as caught:
        rest.restore()
    assert caught.value.status == 400


@pytest.mark.parametrize("at", [10, PREFIX + 10], ids=["in-its-head", "past-its-head"])
def test_a_control_byte_in_a_string_read_aside_whole_is_a_400_before_a_rewrite(at: int) -> None:
    """Not an image's (an audio clip's data): read aside whole at once; its control bytes are
    looked at when the body is to be written again (restore), as orjson would have refused them."""
    data = B64[:at] + "\x01" + B64[at:]
    raw = orjson.dumps({"model": "m", "input_audio": {"data": B64, "format": "wav"}}).replace(
        B64.encode(), data.encode()
    )
    with pytest.raises(orjson.JSONDecodeError):
        orjson.loads(raw)
    found, rest = deferred(raw)
    assert rest and found["input_audio"]["data"] == data  # taken as it came: the engine refuses it
    with pytest.raises(InvalidRequestError, match=r"control character \(\\u0001\)") as caught:
        rest.restore()
    control = raw.index(b"\x01")
    assert caught.value.status == 400 and f"at char {control}" in caught.value.message


def test_an_escape_in_the_first_characters_or_before_the_closing_quote_reads_it_whole() -> None:
    for url in ("data:image/png;base64,\\/" + B64, "data:image/png;base64," + B64 + "\\\\"):
        raw = orjson.dumps(chat(url)).replace(b"\\\\", b"\\")  # a JSON escape in the client's bytes
        found, rest = deferred(raw)
        assert not rest and found == orjson.loads(raw)


images = st.sampled_from(
    [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64," + B64}},
        {"type": "input_image", "image_url": "data:image/png;base64," + B64},
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": B64}},
    ]
)


@settings(max_examples=200, deadline=None)
@given(
    st.recursive(
        st.one_of(st.none(), st.integers(-5, 5), st.text(max_size=8), st.just("data:x," + B64), images),
        lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.sampled_from(["data", "url", "x"]), inner),
        max_leaves=10,
    )
)
def test_any_document_held_back_and_put_back_is_orjsons(document: Any) -> None:
    raw = orjson.dumps({"model": "m", "d": document})
    found, rest = deferred(raw)
    rest.restore()
    assert found == orjson.loads(raw)


def test_a_string_refused_as_it_is_put_back_stays_held_back() -> None:
    """Asked again, the same 400: a prefix is never taken for the whole string."""
    raw = orjson.dumps(chat("data:image/png;base64," + B64, "data:image/png;base64," + B64[::-1]))
    raw = raw.replace(B64[-10:].encode(), b"\xff" + B64[-10:].encode())
    found, rest = deferred(raw)
    held = found["messages"][0]["content"][1]["image_url"]["url"]
    for _ in range(2):
        with pytest.raises(InvalidRequestError):
            rest.restore()
        assert rest and rest.holds(held) and found["messages"][0]["content"][1]["image_url"]["url"] is held


def test_a_data_url_just_past_the_long_mark_is_read_aside_in_an_indented_body() -> None:
    """A string of fewer than PREFIX bytes is looked at whole, not past its closing quote: the
    line breaks of an indented body after it do not keep it in the skeleton."""
    url = "data:image/png;base64," + B64[: LONG_STRING + 100]
    raw = json.dumps(chat(url), indent=2).encode()
    assert cut(raw)[1] and same(raw)

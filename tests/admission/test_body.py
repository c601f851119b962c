"""gateway.admission.body: bounds before parsing, nesting, exact integers."""

from __future__ import annotations

import json
import random
import time
import tracemalloc

import orjson
import pytest

from gateway.admission.body import dump_body, exact, parse_body
from gateway.config import ServerConfig
from gateway.errors import InvalidRequestError

SERVER = ServerConfig()


def chat(*extra: str) -> bytes:
    return ('{"model":"m","messages":[{"role":"user","content":"hi"}]' + "".join(extra) + "}").encode()


def nested(depth: int) -> str:
    return "[" * depth + "]" * depth


def test_a_plain_body_parses() -> None:
    assert parse_body(chat(), SERVER)["model"] == "m"


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (b"{", "Request body is not valid JSON: "),
        (b"[1, 2]", "Request body must be a JSON object"),
        (b'"text"', "Request body must be a JSON object"),
        (b"", "Request body is not valid JSON: "),
        (b'{"a": NaN}', "Request body is not valid JSON: "),
        (b'{"a": "\\ud800"}', "Request body is not valid JSON: "),
    ],
)
def test_what_is_not_a_json_object_is_a_400(raw: bytes, message: str) -> None:
    with pytest.raises(InvalidRequestError) as info:
        parse_body(raw, SERVER)
    assert info.value.message.startswith(message)
    assert info.value.status == 400


def test_too_many_values_are_refused_before_parsing_at_little_cost() -> None:
    # 30 MB of empty strings: 10 million values, ~900 MB and seconds once parsed
    raw = b'{"model":"m","messages":[{"role":"user","content":[' + b'"",' * 10_000_000 + b'{"type":"x"}]}]}'
    tracemalloc.start()
    started = time.perf_counter()
    try:
        with pytest.raises(InvalidRequestError) as info:
            parse_body(raw, SERVER)
        elapsed = time.perf_counter() - started
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert info.value.message == (
        "Request body has more than 262144 JSON values (server.max_json_values; counted before parsing as its "
        "',', '[' and '{' bytes)"
    )
    assert peak < 3 << 20  # nothing was built: a slice of the body at a time was looked at
    assert elapsed < 2.0  # three bytes.count scans: ~30 ms here; 16 s before the bound


def test_the_value_limit_is_configurable() -> None:
    server = ServerConfig(max_json_values=16)
    parse_body(chat(',"stop":[' + ",".join(['"a"'] * 10) + "]"), server)
    with pytest.raises(InvalidRequestError, match="more than 16 JSON values"):
        parse_body(chat(',"stop":[' + ",".join(['"a"'] * 14) + "]"), server)


@pytest.mark.parametrize("depth", [127, 128])
def test_nesting_up_to_the_limit_is_accepted(depth: int) -> None:
    # the body object is level 1
    assert "x" in parse_body(chat(f',"x":{nested(depth - 1)}'), SERVER)


@pytest.mark.parametrize("depth", [129, 300, 1100])
def test_deeper_nesting_is_a_400_naming_the_field(depth: int) -> None:
    with pytest.raises(InvalidRequestError) as info:
        parse_body(chat(f',"tools":{nested(depth - 1)}'), SERVER)
    if depth > 1024:  # orjson's own limit comes first
        assert "not valid JSON" in info.value.message
    else:
        assert info.value.message == (
            "Request body nests arrays and objects deeper than 128 levels in 'tools' (server.max_json_depth)"
        )
        assert info.value.param == "tools"


WIDE = ',"pad":[' + ",".join(["[]"] * 5000) + "]"  # enough containers for orjson to measure the nesting


@pytest.mark.parametrize(("depth", "deep"), [(127, False), (128, False), (129, True), (254, True)])
@pytest.mark.parametrize("pad", ["", WIDE], ids=["walked", "measured by orjson"])
def test_both_ways_of_measuring_nesting_agree(depth: int, deep: bool, pad: str) -> None:
    raw = chat(f',"x":{nested(depth - 1)}', pad)
    if deep:
        with pytest.raises(InvalidRequestError, match="deeper than 128 levels in 'x'"):
            parse_body(raw, SERVER)
    else:
        assert "x" in parse_body(raw, SERVER)


@pytest.mark.parametrize("limit", [4, 100, 254])
def test_the_depth_limit_is_exact_at_any_setting(limit: int) -> None:
    server = ServerConfig(max_json_depth=limit)
    for pad in ("", WIDE):
        assert "x" in parse_body(chat(f',"x":{nested(limit - 1)}', pad), server)
        with pytest.raises(InvalidRequestError):
            parse_body(chat(f',"x":{nested(limit)}', pad), server)


def test_deep_objects_count_like_deep_arrays() -> None:
    deep = '{"a":' * 130 + "1" + "}" * 130
    with pytest.raises(InvalidRequestError, match="deeper than 128 levels in 'response_format'"):
        parse_body(chat(f',"response_format":{deep}'), SERVER)


def test_nesting_spread_wide_is_not_deep() -> None:
    wide = "[" + ",".join([nested(10)] * 200) + "]"
    assert len(parse_body(chat(f',"x":{wide}'), SERVER)["x"]) == 200


@pytest.mark.parametrize(
    "number",
    [2**64, 2**70, -(2**63) - 1, 123456789012345678901234567890, -(10**30)],
)
def test_integers_beyond_64_bits_survive_a_rewrite(number: int) -> None:
    raw = chat(f',"seed":{number},"n":1,"temperature":0.5,"big_float":1e300')
    body = exact(raw, parse_body(raw, SERVER))
    body["model"] = "renamed"
    written = json.loads(dump_body(body))
    assert written["seed"] == number
    assert written["model"] == "renamed"
    assert written["temperature"] == 0.5
    assert written["big_float"] == 1e300


@pytest.mark.parametrize("number", [2**63 - 1, 2**64 - 1, -(2**63)])
def test_integers_within_64_bits_stay_on_orjson(number: int) -> None:
    raw = chat(f',"seed":{number}')
    body = parse_body(raw, SERVER)
    assert exact(raw, body) is body
    assert orjson.loads(dump_body(body))["seed"] == number


def test_a_large_whole_float_is_read_again_but_stays_a_float() -> None:
    raw = chat(',"x":1e19')
    body = exact(raw, parse_body(raw, SERVER))
    assert body["x"] == 1e19
    assert isinstance(body["x"], float)


@pytest.mark.parametrize("size", [0, 200, 2048, 2049, 40_000, (1 << 20) + 4096])
def test_structure_bytes_are_counted_alike_at_every_size(size: int) -> None:
    """Counted whole (a small body), found one by one (few), or kept by translate (many): the
    same count of ',' '[' '{' and of '[' '{' among them."""
    from gateway.admission.body import _structure

    rng = random.Random(size)
    for few in (True, False):
        alphabet = b"a" * 200 + b",[{" if few else b"a,[{}]"
        raw = bytes(rng.choices(alphabet, k=size))
        values = raw.count(b",") + raw.count(b"[") + raw.count(b"{")
        assert _structure(raw, 10**9) == (values, values - raw.count(b","))

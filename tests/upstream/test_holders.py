"""gateway.upstream.holders: which replica holds a stored response, bounded in count and age."""

from __future__ import annotations

from gateway.upstream.holders import Holders, id_of_response, id_of_stream
from tests.upstream.test_replicas import Clock


def url(holders: Holders, response_id: str) -> str | None:
    held = holders.find(response_id)
    return held[0] if held is not None else None


def test_ids_are_kept_for_the_most_recent_half_of_the_count_and_never_longer_than_their_age() -> None:
    clock = Clock()
    holders = Holders(clock=clock, max_ids=4, max_age_s=60)  # generations of 2 ids, 30 s each
    holders.remember("resp_1", "http://a")
    holders.remember("resp_2", "http://b")
    holders.remember("resp_3", "http://a")  # the young generation was full: 1 and 2 are old now
    assert (url(holders, "resp_1"), len(holders)) == ("http://a", 3)
    holders.remember("resp_4", "http://b")
    holders.remember("resp_5", "http://a")  # 3 and 4 turn old, 1 and 2 are let go
    assert [url(holders, f"resp_{i}") for i in range(1, 6)] == [None, None, "http://a", "http://b", "http://a"]
    clock.now += 31  # half the age: the young (5) turn old, the old (3, 4) are let go
    holders.remember("resp_6", "http://b")
    assert [url(holders, f"resp_{i}") for i in range(3, 7)] == [None, None, "http://a", "http://b"]
    clock.now += 61  # past the age: none of the old is kept, nor the young that began 61 s ago
    assert [url(holders, f"resp_{i}") for i in range(1, 7)] == [None] * 6 and len(holders) == 0


def test_no_id_outlives_the_age_however_seldom_the_table_is_used() -> None:
    clock = Clock()
    holders = Holders(clock=clock, max_ids=100, max_age_s=60)
    holders.remember("resp_1", "http://a")
    clock.now += 29
    holders.remember("resp_2", "http://a")  # the same generation: begun 29 s ago
    clock.now += 29
    assert url(holders, "resp_2") == "http://a"  # its generation old now, begun 58 s ago
    clock.now += 3  # resp_1 is 61 s old: its generation is let go whole, resp_2 (32 s old) with it
    assert (url(holders, "resp_1"), url(holders, "resp_2")) == (None, None)
    for _ in range(0, 300, 7):  # whenever asked, nothing older than 60 s answers
        clock.now += 7
        holders.remember(f"resp_at_{clock.now}", "http://b")
        assert url(holders, f"resp_at_{clock.now - 63}") is None


def test_the_id_is_read_from_a_reply_and_from_a_streams_opening() -> None:
    assert id_of_response(b'{"id": "resp_1", "object": "response", "previous_response_id": "resp_0"}') == "resp_1"
    assert id_of_response(b"[1]") is None and id_of_response(b"not json") is None
    assert id_of_response(b'{"id": "' + b"x" * 300 + b'"}') is None  # not an id an engine makes
    created = b'event: response.created\ndata: {"type":"response.created","response":{"id":"resp_9"}}\n\n'
    assert id_of_stream(created) == "resp_9"
    assert id_of_stream(created[:40]) is None  # its data not there yet
    assert id_of_stream(b'event: response.in_progress\ndata: {"type":"response.in_progress"}\n\n') is None


def test_a_stored_response_is_its_keys() -> None:
    holders = Holders()
    holders.remember("resp_1", "http://a", "team-a")
    holders.remember("resp_2", "http://b")
    assert holders.find("resp_1") == ("http://a", "team-a") and holders.find("resp_2") == ("http://b", None)

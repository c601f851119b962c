"""gateway.upstream.holders: which replica holds a stored response, bounded in count and age."""

from __future__ import annotations

from gateway.upstream.holders import Holders, id_of_response, id_of_stream
from tests.upstream.test_replicas import Clock


def test_ids_are_kept_least_recently_used_first_out_and_no_longer_than_their_age() -> None:
    clock = Clock()
    holders = Holders(clock=clock, max_ids=2, max_age_s=60)
    holders.remember("resp_1", "http://a")
    holders.remember("resp_2", "http://b")
    assert holders.find("resp_1") == "http://a"  # used: now the most recent
    holders.remember("resp_3", "http://a")
    assert (holders.find("resp_2"), holders.find("resp_1"), len(holders)) == (None, "http://a", 2)
    clock.now += 61
    assert holders.find("resp_1") is None and len(holders) == 1


def test_the_id_is_read_from_a_reply_and_from_a_streams_opening() -> None:
    assert id_of_response(b'{"id": "resp_1", "object": "response", "previous_response_id": "resp_0"}') == "resp_1"
    assert id_of_response(b"[1]") is None and id_of_response(b"not json") is None
    assert id_of_response(b'{"id": "' + b"x" * 300 + b'"}') is None  # not an id an engine makes
    created = b'event: response.created\ndata: {"type":"response.created","response":{"id":"resp_9"}}\n\n'
    assert id_of_stream(created) == "resp_9"
    assert id_of_stream(created[:40]) is None  # its data not there yet
    assert id_of_stream(b'event: response.in_progress\ndata: {"type":"response.in_progress"}\n\n') is None

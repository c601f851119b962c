"""gateway.server.exchange: what one request is, read once as it begins."""

from __future__ import annotations

from aiohttp.test_utils import make_mocked_request

from gateway.config.types import ApiKey
from gateway.server.exchange import _admitted_as
from gateway.server.state import API_KEY_KEY


def test_a_request_keeps_the_key_it_was_let_in_with() -> None:
    """The front middleware found its key; a reload since that took ``auth:`` off does not
    unkey it (its budgets and its tokens' key label stay its key's)."""
    keyed = make_mocked_request("POST", "/v1/chat/completions", headers={"x-priority": "bulk"})
    keyed[API_KEY_KEY] = key = ApiKey("team-a", key_env="UNUSED")
    assert _admitted_as(keyed)[0] is key
    anonymous = make_mocked_request("POST", "/v1/chat/completions")
    assert _admitted_as(anonymous)[0] is None

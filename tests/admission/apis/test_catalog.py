"""gateway.admission.apis.catalog: each API one table (its Api), and everything per API read from
it: the server's routes, routing.yaml's API names, the shape of an error on any path. An ``ast``
walk holds the rest of the gateway to it: no API named by a string outside its own module (issue
41: adding an API touched seven string-keyed tables)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from gateway.admission.apis.catalog import APIS, BY_NAME, BY_PATH, UNVERSIONED, is_api, shape_of
from gateway.config.keys import API_NAMES
from gateway.server.doors import ROUTES

GATEWAY = Path(__file__).resolve().parents[3] / "gateway"


def test_routing_yamls_api_names_are_the_catalogs() -> None:
    assert set(API_NAMES) == set(BY_NAME)


def test_the_routes_are_every_apis_paths_and_no_other() -> None:
    assert set(ROUTES) == set(BY_PATH) == {p for api in APIS for p in api.paths}
    assert all(ROUTES[path][1] is api for path, api in BY_PATH.items())
    assert UNVERSIONED == {"/score", "/rerank", "/v2/rerank"} and all(is_api(p) for p in BY_PATH)


@pytest.mark.parametrize(
    ("path", "shape"),
    [("/v1/messages", "anthropic"), ("/v1/messages/count_tokens", "anthropic"), ("/v1/messages/batches", "anthropic"),
     ("/v1/chat/completions", "openai"), ("/v1/nothing", "openai"), ("/rerank", "openai")],
)  # fmt: skip
def test_an_errors_shape_is_its_apis(path: str, shape: str) -> None:
    assert shape_of(path) == shape


def _named_by_string(path: Path) -> list[str]:
    """Where a module compares something with an API's name written as a string."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Compare):
            for side in (node.left, *node.comparators):
                if isinstance(side, ast.Constant) and side.value in BY_NAME:
                    found.append(f"{path.relative_to(GATEWAY)}:{node.lineno}: {side.value!r}")
    return found


def test_no_api_is_named_by_a_string_outside_its_own_module() -> None:
    """routing.yaml's own checks (gateway/config/) read its names as names: the rest asks the Api."""
    modules = [p for p in GATEWAY.rglob("*.py") if not p.is_relative_to(GATEWAY / "admission" / "apis")]
    found = [f for p in modules if not p.is_relative_to(GATEWAY / "config") for f in _named_by_string(p)]
    assert not found, "\n".join(found)

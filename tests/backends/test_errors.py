"""Every error of the encoder backend: a status, a type and a code, rendered in the gateway's shape."""

from __future__ import annotations

import inspect

import orjson
import pytest

from backends.vision_encoder import errors
from backends.vision_encoder.errors import BackendError
from gateway.errors import render

CLASSES = [c for _, c in inspect.getmembers(errors, inspect.isclass) if issubclass(c, BackendError)]
assert CLASSES


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_each_error_renders_in_the_gateways_shape(cls: type[BackendError]) -> None:
    response = render(cls("it went wrong", headers={"Retry-After": "1"}))
    assert response.status == cls.status
    assert (cls.type == "server_error") == (cls.status >= 500)
    assert response.headers["Retry-After"] == "1"
    assert response.body is not None
    body = orjson.loads(response.body)
    assert body == {"error": {"message": "it went wrong", "type": cls.type, "param": None, "code": cls.code}}


def test_every_error_is_in_the_docstring_tree() -> None:
    doc = errors.__doc__ or ""
    for cls in CLASSES:
        assert f"{cls.__name__}" in doc and f"{cls.status} " in doc and cls.code in doc, cls.__name__


def test_aiohttps_own_statuses_take_the_same_shape() -> None:
    error = errors.HTTPStatusError(405, "Method Not Allowed")
    assert (error.status, error.type, error.code) == (405, "invalid_request_error", "http_405")

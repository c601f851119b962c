"""Every GatewayError: its status, type and code, the tree in gateway/errors.py's docstring, and its
one rendering (as httpx's tests check that every exception is mapped)."""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import re

import orjson
import pytest

import gateway
from gateway import errors
from gateway.errors import GatewayError, Rejection, render

CLASSES = sorted(
    (
        c
        for _, c in inspect.getmembers(errors, inspect.isclass)
        if issubclass(c, GatewayError) and c is not errors.HTTPStatusError  # its status is aiohttp's
    ),
    key=lambda c: c.__name__,
)
TYPES = {"invalid_request_error", "authentication_error", "permission_error", "rate_limit_error", "server_error"}
# One line of the docstring's tree: name, status, type (children may leave it to their parent), code.
TREE_LINE = re.compile(r"^\s*[├└│─ ]*(\w+Error)\s+(\d{3})\s+(?:(\w+_error)\s+)?(\w+)$", re.M)


OPTIONAL = ("opentelemetry", "av", "torch")  # the extras' packages: a module of one is imported only with it


def _every_error_anywhere() -> set[type[GatewayError]]:
    """Every GatewayError subclass of every gateway module (each imported), wherever defined."""
    for info in pkgutil.walk_packages(gateway.__path__, "gateway."):
        if info.name != "gateway.__main__":
            try:
                importlib.import_module(info.name)
            except ModuleNotFoundError as exc:  # an extra's module (gateway.otlp: the SDK) without it
                if (exc.name or "").split(".")[0] not in OPTIONAL:
                    raise
    found, stack = set(), [GatewayError]
    while stack:
        for sub in stack.pop().__subclasses__():
            if sub.__module__.startswith("gateway."):
                found.add(sub)
            stack.append(sub)
    return found


def test_every_error_is_defined_in_the_one_tree() -> None:
    """Errors defined elsewhere (video's, audio's, the EPD's) were outside the tree and this check."""
    outside = sorted(f"{c.__module__}.{c.__name__}" for c in _every_error_anywhere() if c.__module__ != errors.__name__)
    assert not outside, f"GatewayErrors outside gateway/errors.py: {outside}"


def test_every_error_class_is_in_the_tree_with_its_status_and_code() -> None:
    tree = {name: (int(status), kind, code) for name, status, kind, code in TREE_LINE.findall(errors.__doc__ or "")}
    assert set(tree) == {c.__name__ for c in CLASSES}
    for cls in CLASSES:
        status, kind, code = tree[cls.__name__]
        assert (status, code) == (cls.status, cls.code), cls.__name__
        assert kind in ("", cls.type), cls.__name__


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_each_error_has_a_status_type_and_code(cls: type[GatewayError]) -> None:
    assert 400 <= cls.status <= 599
    assert cls.type in TYPES
    assert (cls.type == "server_error") == (cls.status >= 500)
    assert re.fullmatch(r"[a-z][a-z0-9_]*", cls.code)


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_each_error_renders_in_the_openai_shape(cls: type[GatewayError]) -> None:
    error = cls("it went wrong", param="messages[0]", headers={"Retry-After": "1"})
    response = render(error)
    assert response.status == cls.status
    assert response.content_type == "application/json"
    assert response.headers["Retry-After"] == "1"
    assert response.body is not None
    body = orjson.loads(response.body)
    assert body == {"error": {"message": "it went wrong", "type": cls.type, "param": "messages[0]", "code": cls.code}}
    assert response.keep_alive is (False if cls.closes_connection else None)
    # a retry would get the same answer: the SDKs and Claude Code stop at once
    final = cls.status < 500 and cls.status not in (408, 409, 429)
    assert response.headers.get("x-should-retry") == ("false" if final else None)


def test_codes_name_one_meaning_each() -> None:
    by_code: dict[str, set[int]] = {}
    for cls in CLASSES:
        by_code.setdefault(cls.code, set()).add(cls.status)
    assert all(len(statuses) == 1 for statuses in by_code.values()), by_code


def test_a_rejection_rides_along_and_param_defaults_to_none() -> None:
    error = errors.UnsupportedModalityError("no", rejection=Rejection("m", "video", "unsupported"))
    assert error.rejection == Rejection("m", "video", "unsupported")
    assert error.to_dict()["error"]["param"] is None


@pytest.mark.parametrize(
    ("status", "kind"), [(404, "invalid_request_error"), (417, "invalid_request_error"), (500, "server_error")]
)
def test_aiohttps_own_statuses_take_the_same_shape(status: int, kind: str) -> None:
    error = errors.HTTPStatusError(status, "said aiohttp")
    assert error.to_dict() == {
        "error": {"message": "said aiohttp", "type": kind, "param": None, "code": f"http_{status}"}
    }
    assert render(error).status == status


def test_clip_keeps_client_text_short() -> None:
    assert errors.clip("short") == "short"
    assert errors.clip("x" * 100) == "x" * 64 + "... (100 characters)"

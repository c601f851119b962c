"""docs/openapi.yaml: valid OpenAPI 3.1, in sync with the routes and the errors of the code, and what a
live gateway with API keys on answers, property-tested by schemathesis.

The live tests start the gateway as `modality-gateway serve` does (``python -m gateway serve``) and a
stand-in upstream (``python -m tools.standin``), both on 127.0.0.1, with an ``auth:`` section (a key
from an environment variable) and an admin token. Schemathesis sends every documented operation the
examples of the description, its boundary cases and ``MAX_EXAMPLES`` drawn ones, valid and invalid
(derandomized, no example database), with the credentials its security scheme names, and checks every
answer: no 5xx, a documented status, content type, headers and body (each event of a stream too),
auth enforced (each operation is also sent without credentials and with wrong ones), a 405 with
``Allow`` for undocumented methods, and every valid request accepted (2xx, or 404 for a model not in
the table). What drawn cases cannot provoke (a spent rate limit, bodies too large or badly encoded,
an invalid routing.yaml) is sent once and checked against the description too.
"""

from __future__ import annotations

import gzip
import hashlib
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import hypothesis
import jsonschema
import pytest
import requests
import schemathesis
import yaml
from hypothesis import strategies as st
from schemathesis.core.result import Err
from schemathesis.specs.openapi import definitions
from schemathesis.specs.openapi.checks import negative_data_rejection

from gateway import errors
from gateway.admission.apis.catalog import is_api
from gateway.config import parse_config
from gateway.server.app import create_app
from tests.conftest import free_port, routing

SPEC_PATH = Path(__file__).resolve().parent.parent / "docs" / "openapi.yaml"
SPEC: dict[str, Any] = yaml.safe_load(SPEC_PATH.read_text())
METHODS = ("get", "put", "post", "delete", "options", "head", "patch", "trace")

API_KEY_ENV, API_KEY = "OPENAPI_TEST_API_KEY", "sk-openapi-test-0123456789"
ADMIN_TOKEN_ENV, ADMIN_TOKEN = "OPENAPI_TEST_ADMIN_TOKEN", "admin-openapi-test-0123456789"
# The examples in docs/openapi.yaml name these models; drawn bodies name one of them half the time.
MODELS = ("qwen-omni", "kimi-k3", "kimi-k3-text")
MAX_EXAMPLES = 40  # drawn cases per operation, after the examples and boundary cases
LIMITED_KEY = "sk-openapi-test-limited"  # one request a minute
MAX_BODY_BYTES = 1 << 20
# every door
APIS = (
    "[chat, completions, responses, messages, embeddings, score, rerank, transcriptions, translations, images, edits, "
    "speech]"
)
PRODUCES = "[text, audio, image]"  # every output: a schema-valid request to images or speech is served
# (with its images' URLs shared: a schema-valid response_format, url too, is served)


# --- the description itself ---------------------------------------------------------------------


def test_the_description_is_valid_openapi_3_1() -> None:
    assert SPEC["openapi"].startswith("3.1.")
    # the OpenAPI 3.1 meta-schema schemathesis validates descriptions with
    problems = [
        f"{'/'.join(map(str, e.instance_path))}: {e.message}"
        for e in definitions.OPENAPI_31_VALIDATOR.iter_errors(SPEC)
    ]
    assert problems == []
    assert list(definitions.OPENAPI_31_VALIDATOR.iter_errors({**SPEC, "paths": []}))  # it does catch problems
    for name, schema in SPEC["components"]["schemas"].items():  # and each schema is valid JSON Schema 2020-12
        try:
            jsonschema.Draft202012Validator.check_schema(schema)
        except jsonschema.SchemaError as exc:
            pytest.fail(f"components.schemas.{name}: {exc.message}")
    loaded = schemathesis.openapi.from_path(SPEC_PATH)
    assert [str(result.err()) for result in loaded.get_all_operations() if isinstance(result, Err)] == []


def _documented_routes() -> set[tuple[str, str]]:
    return {(method.upper(), path) for path, item in SPEC["paths"].items() for method in item if method in METHODS}


def test_every_route_of_the_app_is_documented_and_every_documented_route_exists() -> None:
    config = parse_config(routing("  - {name: m, upstreams: ['http://127.0.0.1:9'], accepts: [text]}"))
    app = create_app(config, watch=False)
    routes = {(route.method, route.resource.canonical) for route in app.router.routes() if route.resource is not None}
    assert ("*", "/{path}") in routes  # the last: every other path and method, 404 or 405 (middlewares.unmatched)
    routes.discard(("*", "/{path}"))
    # aiohttp answers HEAD on every GET route (the description says so once, in info)
    heads = {path for method, path in routes if method == "HEAD"}
    assert heads == {path for method, path in routes if method == "GET"}
    assert {r for r in routes if r[0] != "HEAD"} == _documented_routes()


def _security(path: str) -> list[dict[str, list[str]]]:
    if is_api(path):
        return [{"bearerAuth": []}]
    if path in ("/metrics", "/status"):  # open, or the admin token with auth on
        return [{}, {"adminAuth": []}]
    return [{"adminAuth": []}] if path.startswith("/admin/") else []


def test_every_operation_documents_its_security_and_the_request_id() -> None:
    for path, item in SPEC["paths"].items():
        for method, operation in item.items():
            assert operation["security"] == _security(path), f"{method} {path}"
            for status, response in operation["responses"].items():
                headers = _resolve(response).get("headers", {})
                assert "X-Request-Id" in headers, f"{method.upper()} {path} {status}: every answer carries X-Request-Id"


def _resolve(node: Any) -> Any:
    while isinstance(node, dict) and "$ref" in node:
        target: Any = SPEC
        for part in node["$ref"].removeprefix("#/").split("/"):
            target = target[part]
        node = target
    return node


def _error_fields(schema: Any, field: str) -> set[str]:
    """The values the ``error.<field>`` of an error response's schema may take (enum or const)."""
    found: set[str] = set()
    schema = _resolve(schema)
    if isinstance(schema, dict):
        error = schema.get("properties", {}).get("error", {})
        value = _resolve(error).get("properties", {}).get(field, {})
        found.update(value.get("enum", []))
        if "const" in value:
            found.add(value["const"])
        for key in ("allOf", "anyOf", "oneOf"):
            for sub in schema.get(key, []):
                found |= _error_fields(sub, field)
    return found


def _documented_errors() -> dict[int, tuple[set[str], set[str]]]:
    """status -> (codes, types) the description gives the gateway's own error answers of that status."""
    by_status: dict[int, tuple[set[str], set[str]]] = {}
    responses = [
        (int(status), response)
        for item in SPEC["paths"].values()
        for operation in item.values()
        for status, response in operation["responses"].items()
    ]
    # the one response of no operation: any undocumented method on any path
    responses.append((405, SPEC["components"]["responses"]["MethodNotAllowed"]))
    for status, response in responses:
        schema = _resolve(response).get("content", {}).get("application/json", {}).get("schema")
        if status < 400 or schema is None or (status == 503 and "Readiness" in str(schema)):
            continue
        codes, types = by_status.setdefault(status, (set(), set()))
        codes |= _error_fields(schema, "code")
        types |= _error_fields(schema, "type")
    return by_status


def _error_classes() -> list[type[errors.GatewayError]]:
    """Every error of gateway/errors.py with a fixed status and code (HTTPStatusError's are http_<status>)."""
    found, stack = [], [errors.GatewayError]
    while stack:
        cls = stack.pop()
        stack.extend(cls.__subclasses__())
        if cls.__module__ == errors.__name__ and not issubclass(cls, errors.HTTPStatusError):
            found.append(cls)
    return found


def test_every_error_of_the_code_is_documented_with_its_status_type_and_code() -> None:
    documented = _documented_errors()
    for cls in _error_classes():
        assert cls.status in documented, f"{cls.__name__}: no operation documents status {cls.status}"
        codes, types = documented[cls.status]
        assert cls.code in codes, f"{cls.__name__}: code {cls.code} is not among the {cls.status} codes {sorted(codes)}"
        assert cls.type in types, f"{cls.__name__}: type {cls.type} is not the {cls.status} type {sorted(types)}"


def test_every_documented_error_code_exists_and_the_error_code_table_lists_it() -> None:
    known = {cls.code: cls.status for cls in _error_classes()}
    error_code = SPEC["components"]["schemas"]["ErrorCode"]
    enum = set(error_code["anyOf"][0]["enum"])
    assert enum == set(known)  # no code the gateway lacks, none it answers missing
    pattern = re.compile(error_code["anyOf"][1]["pattern"])
    for status, (codes, _) in _documented_errors().items():
        for code in codes:
            if code in known:
                assert known[code] == status, f"{code} is documented under {status}, the code answers {known[code]}"
            else:  # HTTPStatusError, e.g. a 417 from the Expect handler
                assert pattern.fullmatch(code) and code == f"http_{status}", code
            assert f"| {status} |" in error_code["description"], f"the ErrorCode table has no row for {status}"
            assert f"`{code}`" in error_code["description"], f"the ErrorCode table does not list {code}"


# --- a live gateway against the description -----------------------------------------------------
#
# The routing table refuses no modality (each is accepted, redirected or stripped), and no shape:
# its engines are `openai`, which is sent every shape the description allows (vLLM and SGLang each
# read some pooling shapes alone: docs/engines.md), so that every request the description allows
# is accepted: a refusal is a 400 a description cannot foresee.


def _config(upstream: str) -> str:
    limited = hashlib.sha256(LIMITED_KEY.encode()).hexdigest()
    return f"""\
version: 1
server: {{reload_interval_s: 0, drain_grace_s: 0, max_body_bytes: {MAX_BODY_BYTES}, admin_token_env: {ADMIN_TOKEN_ENV}}}
auth:
  keys:
    - name: schemathesis
      key_env: {API_KEY_ENV}
      rate_limit: {{requests_per_minute: 6000000, burst: 1000000}}  # never spent: its headers are checked
    - {{name: limited, key_sha256: {limited}, rate_limit: {{requests_per_minute: 1}}}}
models:
  - {{name: qwen-omni, upstreams: ['{upstream}'], engine: openai, accepts: [text, image, video, audio, file],
     apis: {APIS}, produces: {PRODUCES}, image_urls: shared}}
  - name: kimi-k3
    upstreams: ['{upstream}']
    upstream_model: moonshotai/Kimi-K3
    engine: openai
    accepts: [text, image]
    apis: {APIS}
    produces: {PRODUCES}
    image_urls: shared
    on_unsupported: {{video: {{redirect: qwen-omni}}, audio: {{redirect: qwen-omni}}, file: {{redirect: qwen-omni}}}}
  - name: kimi-k3-text
    upstreams: ['{upstream}']
    upstream_model: moonshotai/Kimi-K3
    engine: openai
    accepts: [text]
    apis: {APIS}
    produces: {PRODUCES}
    image_urls: shared
    # an image to edit cannot be stripped: images go where they are taken (video and files are stripped)
    on_unsupported: {{image: {{redirect: qwen-omni}}, video: strip, audio: {{redirect: qwen-omni}}, file: strip}}
"""


def _spawn(args: list[str], log: Path, env: dict[str, str], health_url: str) -> subprocess.Popen[bytes]:
    """``python ARGS``, its output in ``log``, once ``health_url`` answers 200 (within 20 s)."""
    with log.open("wb") as out:
        process = subprocess.Popen([sys.executable, *args], stdout=out, stderr=subprocess.STDOUT, env=env)
    deadline = time.monotonic() + 20
    try:
        while time.monotonic() < deadline:
            assert process.poll() is None, f"{args!r} exited during start-up:\n{log.read_text()}"
            try:
                if requests.get(health_url, timeout=1).status_code == 200:
                    return process
            except requests.ConnectionError:
                pass
            time.sleep(0.05)
        raise AssertionError(f"{health_url} did not answer 200 within 20 s")
    except BaseException:
        _stop(process)
        raise


def _stop(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@dataclass(frozen=True)
class Live:
    url: str
    config: Path  # its routing.yaml


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Live]:
    """A gateway process with API keys on, and its stand-in upstream, on 127.0.0.1."""
    tmp = tmp_path_factory.mktemp("openapi")
    env = {**os.environ, API_KEY_ENV: API_KEY, ADMIN_TOKEN_ENV: ADMIN_TOKEN}
    upstream_port, port = free_port(), free_port()
    upstream_url, url = f"http://127.0.0.1:{upstream_port}", f"http://127.0.0.1:{port}"
    config = tmp / "routing.yaml"
    config.write_text(_config(upstream_url))
    processes: list[subprocess.Popen[bytes]] = []
    try:
        standin = ["-m", "tools.standin", "--port", str(upstream_port), "--name", "up"]
        processes.append(_spawn(standin, tmp / "standin.log", env, upstream_url + "/health"))
        serve = ["-m", "gateway", "serve", "--config", str(config), "--port", str(port), "--log-level", "warning"]
        processes.append(_spawn(serve, tmp / "gateway.log", env, url + "/healthz"))
        yield Live(url, config)
    finally:
        for process in reversed(processes):
            _stop(process)
    gateway_log = (tmp / "gateway.log").read_text()
    assert "Traceback" not in gateway_log and "unhandled error" not in gateway_log, gateway_log


RICH_BODIES = (
    "createChatCompletion",
    "createResponse",
    "createEmbedding",
    "createScore",
    "createScoreUnversioned",
    "createRerank",
    "createRerankUnversioned",
    "createRerankV2",
)
CONFIG = schemathesis.Config.from_dict(
    {
        # the credentials each security scheme of the description names
        "auth": {"openapi": {"bearerAuth": {"bearer": API_KEY}, "adminAuth": {"bearer": ADMIN_TOKEN}}},
        "phases": {"stateful": {"enabled": False}},  # no operation creates a resource to follow
        "generation": {"max-examples": MAX_EXAMPLES, "deterministic": True, "database": "none"},
        "request-timeout": 10,
        # Building the invalid boundary cases of the bodies with content parts and pooling shapes
        # takes 15 s an operation at collection (schemathesis 4's negative anyOf cases): these go
        # with the valid boundary cases only; their invalid drawn cases still run, and so does
        # tests/test_fuzz.py.
        "operations": [
            {
                "include-operation-id": operation,
                "phases": {"coverage": {"generation": {"mode": "positive"}}},
            }
            for operation in RICH_BODIES
        ],
    }
)
# GET /v1/realtime is a WebSocket upgrade: what follows the 101 is no HTTP answer to check, and a
# request drawn without a handshake is refused (400) by design; tests/server/test_realtime.py has it
schema = schemathesis.openapi.from_path(SPEC_PATH, config=CONFIG).exclude(path="/v1/realtime")


@schema.hook
def flatmap_body(context: schemathesis.HookContext, body: Any) -> st.SearchStrategy[Any]:
    """Three drawn bodies in four name a model of the table, so that admission, the rewrite and the
    relay are exercised, not only the 404 for a model that does not exist (a ``model`` that is not a
    string is left as drawn: it is what a negative case is about)."""
    if isinstance(body, dict) and isinstance(body.get("model"), str):
        return st.sampled_from([None, *MODELS]).map(lambda model: body if model is None else {**body, "model": model})
    return st.just(body)


@pytest.fixture(scope="module")
def session() -> Iterator[requests.Session]:
    with requests.Session() as s:
        yield s


@schema.parametrize()
@hypothesis.settings(
    max_examples=MAX_EXAMPLES,
    derandomize=True,
    database=None,
    deadline=None,  # a request's time is the network's, not the generator's
    suppress_health_check=[hypothesis.HealthCheck.too_slow],  # generating bodies this rich is slow on slow machines
)
def test_a_live_gateway_with_keys_answers_as_documented(
    case: schemathesis.Case[Any], live: Live, session: requests.Session
) -> None:
    # negative_data_rejection is left out: the gateway validates what it must (model, messages,
    # content parts) and passes every other field to the engine, which is the one to refuse a
    # "stream": "yes" (the stand-in refuses nothing). Every other check runs on negative cases too.
    case.call_and_validate(base_url=live.url, session=session, excluded_checks=[negative_data_rejection])


def _validator(pointer: str) -> jsonschema.Draft202012Validator:
    """A validator for the schema at ``pointer`` in the description, its $refs resolved within it."""
    return jsonschema.Draft202012Validator({**SPEC, "$ref": pointer})


def _validator_of(subschema: dict[str, Any]) -> jsonschema.Draft202012Validator:
    return jsonschema.Draft202012Validator({**SPEC, **subschema})


def _credentials(path: str) -> dict[str, str]:
    if is_api(path):
        return {"Authorization": f"Bearer {API_KEY}"}
    # /metrics too: with auth on and no admin_listen, it needs the admin token
    return {"Authorization": f"Bearer {ADMIN_TOKEN}"} if path.startswith("/admin/") or path == "/metrics" else {}


def test_an_undocumented_method_is_a_405_with_allow_on_every_path(live: Live) -> None:
    # Schemathesis sends these among the invalid boundary cases, which chat completions go without.
    error = _validator("#/components/responses/MethodNotAllowed/content/application~1json/schema")
    anthropic = _validator("#/components/schemas/AnthropicError")  # every error of /v1/messages and below
    request_id = _validator("#/components/headers/XRequestId/schema")
    for path, item in SPEC["paths"].items():
        documented = {method.upper() for method in item}
        allowed = documented | ({"HEAD"} if "GET" in documented else set())
        for method in ("GET", "POST", "PUT", "PATCH", "DELETE", "OPTIONS", "TRACE"):
            if method in documented:
                continue
            response = requests.request(method, live.url + path, headers=_credentials(path), timeout=10)
            assert response.status_code == 405, (method, path, response.text)
            assert set(response.headers["Allow"].split(", ")) == allowed, (method, path)
            (anthropic if path.startswith("/v1/messages") else error).validate(response.json())
            request_id.validate(response.headers["X-Request-Id"])


# --- what the drawn cases do not make the gateway answer, each once ------------------------------


def _too_large() -> bytes:
    content = "x" * MAX_BODY_BYTES
    return b'{"model": "qwen-omni", "messages": [{"role": "user", "content": "%s"}]}' % content.encode()


# (method, path, API key, headers, body, status, code)
ANSWERS: dict[str, tuple[str, str, str, dict[str, str], bytes | None, int, str]] = {
    "rate limit spent": ("GET", "/v1/models", LIMITED_KEY, {}, None, 429, "rate_limit_exceeded"),
    "body too large": ("POST", "/v1/chat/completions", API_KEY, {}, _too_large(), 413, "payload_too_large"),
    "gzip bomb": (
        "POST", "/v1/completions", API_KEY, {"Content-Encoding": "gzip"}, gzip.compress(_too_large()),
        413, "payload_too_large",
    ),
    "unknown encoding": (
        "POST", "/v1/chat/completions", API_KEY, {"Content-Encoding": "br"}, b"{}",
        415, "unsupported_content_encoding",
    ),
    "corrupt gzip": (
        "POST", "/v1/chat/completions", API_KEY, {"Content-Encoding": "gzip"}, b"{}", 400, "invalid_request"
    ),
    "unknown expectation": ("POST", "/v1/completions", API_KEY, {"Expect": "nothing"}, b"{}", 417, "http_417"),
}  # fmt: skip


def _check_answer(response: requests.Response, method: str, path: str, status: int, code: str) -> None:
    """``response`` is the documented answer ``status`` with error ``code``, headers included."""
    assert (response.status_code, response.json()["error"]["code"]) == (status, code), response.text
    documented = _resolve(SPEC["paths"][path][method.lower()]["responses"][str(status)])
    for name, header in documented.get("headers", {}).items():
        header = _resolve(header)
        if name in response.headers:
            _validator_of(header["schema"]).validate(response.headers[name])
        else:
            assert not header.get("required"), f"{status} without its {name} header"
    schema[path][method].validate_response(response)  # the body and its content type, by schemathesis


@pytest.mark.parametrize("answer", ANSWERS)
def test_what_drawn_cases_do_not_reach_is_answered_as_documented(live: Live, answer: str) -> None:
    method, path, key, headers, body, status, code = ANSWERS[answer]
    headers = {**headers, "Authorization": f"Bearer {key}", "Content-Type": "application/json"}
    if status == 429:  # the key's one request of the minute, then the one too many
        assert requests.request(method, live.url + path, headers=headers, timeout=10).status_code == 200
    response = requests.request(method, live.url + path, headers=headers, data=body, timeout=10)
    _check_answer(response, method, path, status, code)


def test_an_invalid_routing_yaml_is_a_documented_422_and_changes_nothing(live: Live) -> None:
    valid = live.config.read_text()
    admin = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    generation = requests.get(f"{live.url}/admin/config", headers=admin, timeout=10).json()["config_generation"]
    try:
        live.config.write_text(valid.replace("accepts: [text]", "accepts: [txt]"))
        response = requests.post(f"{live.url}/admin/reload", headers=admin, timeout=10)
    finally:
        live.config.write_text(valid)
    _check_answer(response, "POST", "/admin/reload", 422, "invalid_config")
    assert "unknown modality 'txt'" in response.json()["error"]["message"]
    assert requests.get(f"{live.url}/admin/config", headers=admin, timeout=10).json()["config_generation"] == generation


def test_every_route_the_gateway_can_say_is_documented() -> None:
    """X-Gateway-Route's values: "direct", or any of the actions, in their order."""
    import itertools

    from gateway.admission.route import ROUTE_ACTIONS

    pattern = re.compile(SPEC["components"]["headers"]["XGatewayRoute"]["schema"]["pattern"])
    readme = (SPEC_PATH.parent / "reference.md").read_text()  # the contract's table of headers
    said = ["direct"] + [
        ", ".join(chosen)
        for n in range(1, len(ROUTE_ACTIONS) + 1)
        for chosen in itertools.combinations(ROUTE_ACTIONS, n)
    ]
    assert all(pattern.fullmatch(route) for route in said)
    assert not pattern.fullmatch("strip, redirect") and not pattern.fullmatch("encode")
    assert all(f"`{action}`" in readme for action in ROUTE_ACTIONS)

"""docs/routing.schema.json must describe what gateway.config parses: same keys, enums and defaults."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from jsonschema import Draft202012Validator

from gateway.config import (
    EncoderConfig,
    MediaConfig,
    PriorityCap,
    QueueConfig,
    ServerConfig,
    TracingConfig,
    parse_config,
)
from gateway.config.keys import (
    API_KEY_KEYS,
    AUTH_KEYS,
    BREAKER_KEYS,
    ENCODER_KEYS,
    HEALTH_CHECK_KEYS,
    HISTORY_ACTIONS,
    MEDIA_KEYS,
    MODEL_KEYS,
    POLICY_ACTIONS,
    PRIORITY_KEYS,
    QUEUE_KEYS,
    RATE_LIMIT_KEYS,
    RETRY_KEYS,
    SERVER_KEYS,
    TIMEOUT_KEYS,
    TOP_KEYS,
    TRACING_KEYS,
    UPSTREAM_KEYS,
)
from gateway.errors import ConfigError
from gateway.modalities import MODALITY_NAMES

ROOT = Path(__file__).resolve().parents[2]
SCHEMA: dict[str, Any] = json.loads((ROOT / "docs" / "routing.schema.json").read_text(encoding="utf-8"))
DEFS: dict[str, Any] = SCHEMA["$defs"]
VALIDATOR = Draft202012Validator(SCHEMA)


def schema_errors(text: str) -> list[str]:
    return [error.message for error in VALIDATOR.iter_errors(yaml.safe_load(text))]


def subschemas(node: Any, where: str = "") -> Iterator[tuple[str, dict[str, Any]]]:
    if isinstance(node, dict):
        yield where, node
        for key, value in node.items():
            yield from subschemas(value, f"{where}/{key}")
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from subschemas(value, f"{where}/{i}")


def test_schema_is_a_valid_draft_2020_12_schema() -> None:
    assert SCHEMA["$schema"] == "https://json-schema.org/draft/2020-12/schema"
    Draft202012Validator.check_schema(SCHEMA)


# --- keys -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("properties", "keys"),
    [
        pytest.param(SCHEMA["properties"], TOP_KEYS, id="top"),
        pytest.param(DEFS["server"]["properties"], SERVER_KEYS, id="server"),
        pytest.param(DEFS["media"]["properties"], MEDIA_KEYS, id="media"),
        pytest.param(DEFS["localEncoder"]["properties"], ENCODER_KEYS["local"], id="encoder-local"),
        pytest.param(DEFS["httpEncoder"]["properties"], ENCODER_KEYS["http"], id="encoder-http"),
        pytest.param(DEFS["model"]["properties"], MODEL_KEYS, id="model"),
        pytest.param(DEFS["weightedUpstream"]["properties"], UPSTREAM_KEYS, id="upstream"),
        pytest.param(DEFS["retries"]["properties"], RETRY_KEYS, id="retries"),
        pytest.param(DEFS["breaker"]["properties"], BREAKER_KEYS, id="breaker"),
        pytest.param(DEFS["timeouts"]["properties"], TIMEOUT_KEYS, id="timeouts"),
        pytest.param(DEFS["queue"]["properties"], QUEUE_KEYS, id="queue"),
        pytest.param(DEFS["healthCheck"]["properties"], HEALTH_CHECK_KEYS, id="health-check"),
        pytest.param(DEFS["auth"]["properties"], AUTH_KEYS, id="auth"),
        pytest.param(DEFS["apiKey"]["properties"], API_KEY_KEYS, id="api-key"),
        pytest.param(DEFS["rateLimit"]["properties"], RATE_LIMIT_KEYS, id="rate-limit"),
        pytest.param(DEFS["priority"]["properties"], PRIORITY_KEYS, id="priority"),
        pytest.param(DEFS["server"]["properties"]["tracing"]["properties"], TRACING_KEYS, id="tracing"),
    ],
)
def test_schema_keys_match_the_parser(properties: dict[str, Any], keys: tuple[str, ...]) -> None:
    assert tuple(properties) == keys


@pytest.mark.parametrize(
    "schema",
    [
        pytest.param(SCHEMA, id="top"),
        pytest.param(DEFS["server"], id="server"),
        pytest.param(DEFS["media"], id="media"),
        pytest.param(DEFS["localEncoder"], id="encoder-local"),
        pytest.param(DEFS["httpEncoder"], id="encoder-http"),
        pytest.param(DEFS["model"], id="model"),
        pytest.param(DEFS["model"]["properties"]["encode"], id="encode"),
        pytest.param(DEFS["policy"]["oneOf"][1], id="redirect"),
    ],
)
def test_unknown_keys_are_refused(schema: dict[str, Any]) -> None:
    assert schema["additionalProperties"] is False


def test_required_keys_match_the_parser() -> None:
    assert SCHEMA["required"] == ["version", "models"]
    assert DEFS["model"]["required"] == ["name", "upstreams", "accepts"]
    assert DEFS["encoder"]["required"] == ["kind"]
    assert DEFS["httpEncoder"]["required"] == ["urls"]
    assert DEFS["policy"]["oneOf"][1]["required"] == ["history"]
    assert DEFS["policy"]["oneOf"][1]["properties"]["history"]["enum"] == list(HISTORY_ACTIONS)
    assert DEFS["policy"]["oneOf"][2]["required"] == ["redirect"]


def test_every_key_has_a_description() -> None:
    undocumented = [
        f"{where}/{key}"
        for where, node in subschemas(SCHEMA)
        if isinstance(node.get("properties"), dict)
        for key, prop in node["properties"].items()
        if not prop.get("description") and not where.endswith("/if")
    ]
    assert undocumented == []


# --- enums ------------------------------------------------------------------------------------


def test_modality_enum_matches_the_parser() -> None:
    assert tuple(DEFS["modality"]["enum"]) == MODALITY_NAMES


def test_encoder_kind_enum_matches_the_parser() -> None:
    assert tuple(DEFS["encoder"]["properties"]["kind"]["enum"]) == tuple(ENCODER_KEYS)
    assert DEFS["localEncoder"]["properties"]["kind"]["const"] == "local"
    assert DEFS["httpEncoder"]["properties"]["kind"]["const"] == "http"


def test_policy_enum_matches_the_parser() -> None:
    assert tuple(DEFS["policy"]["oneOf"][0]["enum"]) == POLICY_ACTIONS


def test_encode_allows_only_encodable_modalities() -> None:
    from gateway.config.keys import ENCODABLE

    # the encodable modalities, and min_images
    assert tuple(DEFS["model"]["properties"]["encode"]["properties"]) == (*(m.value for m in ENCODABLE), "min_images")


# --- defaults ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("properties", "instance", "skip"),
    [
        pytest.param(DEFS["server"]["properties"], ServerConfig(), (), id="server"),
        pytest.param(DEFS["media"]["properties"], MediaConfig(), (), id="media"),
        pytest.param(DEFS["localEncoder"]["properties"], EncoderConfig("v", "local"), ("kind",), id="encoder-local"),
        pytest.param(
            DEFS["httpEncoder"]["properties"], EncoderConfig("v", "http"), ("kind", "urls"), id="encoder-http"
        ),
        pytest.param(DEFS["queue"]["properties"], QueueConfig(), (), id="queue"),
        pytest.param(DEFS["priority"]["properties"], PriorityCap(), (), id="priority"),
        pytest.param(
            DEFS["server"]["properties"]["tracing"]["properties"], TracingConfig(""), ("otlp_endpoint",), id="tracing"
        ),
    ],
)
def test_defaults_match_the_dataclasses(properties: dict[str, Any], instance: Any, skip: tuple[str, ...]) -> None:
    for key, prop in properties.items():
        if key in skip:
            assert "default" not in prop
            continue
        expected = getattr(instance, key)
        expected = list(expected) if isinstance(expected, tuple) else expected
        assert prop["default"] == expected, key
        assert type(prop["default"]) is type(expected), key


def test_every_dataclass_field_is_in_the_schema() -> None:
    server = {f.name for f in dataclasses.fields(ServerConfig) if f.init}  # not those made from the others
    assert server == set(DEFS["server"]["properties"])
    assert {f.name for f in dataclasses.fields(MediaConfig)} == set(DEFS["media"]["properties"])
    encoder_fields = {f.name for f in dataclasses.fields(EncoderConfig)} - {"name"}
    assert encoder_fields == set(DEFS["localEncoder"]["properties"]) | set(DEFS["httpEncoder"]["properties"])


# --- valid and invalid documents --------------------------------------------------------------


def doc_examples() -> list[Any]:
    """Every complete routing.yaml in the docs (a ```yaml block that starts with ``version:``)."""
    found = []
    for page in sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md")]):
        blocks = page.read_text(encoding="utf-8").split("```yaml\n")[1:]
        for i, block in enumerate(blocks):
            text = block.split("```", 1)[0]
            if text.startswith("version:"):
                found.append(pytest.param(text, id=f"{page.name}-{i}"))
    return found


VALID = [
    pytest.param((ROOT / "routing.yaml").read_text(encoding="utf-8"), id="shipped-routing-yaml"),
    *doc_examples(),
    pytest.param("version: 1\nmodels: [{name: a, upstreams: ['http://h:1'], accepts: [text]}]\n", id="minimal"),
    pytest.param(
        """\
version: 1
server: {host: 0.0.0.0, port: 9000, max_body_bytes: 2048, admin_token_env: TOKEN, reload_interval_s: 0,
         upstream_connect_timeout_s: 1.5, upstream_read_timeout_s: 60, upstream_cooldown_s: 0}
media: {allow_domains: [example.com], allow_private_networks: true, fetch_timeout_s: 2, max_image_bytes: 1}
encoders:
  vision:
    kind: local
    model: builtin:vit-small
    device: cuda:1
    max_batch_size: 8
    max_batch_delay_ms: 2
    timeout_s: 10
  vision-pool:
    kind: http
    urls: [http://127.0.0.1:9001, https://encoders.internal/v1/]
    timeout_s: 5
models:
  - name: kimi-k3
    upstreams: [http://127.0.0.1:30000, http://127.0.0.1:30001]
    upstream_model: moonshotai/Kimi-K3
    accepts: [text, image]
    limits: {image: 8, text: 0}
    encode: {image: vision-pool}
    on_unsupported:
      video: {redirect: qwen-omni}
      audio: reject
  - name: qwen-omni
    upstreams: ['http://[::1]:8000']
    accepts: [audio, video, image, text]
    max_concurrency: 8
    queue: {size: 64, timeout_s: 10, reserved: 2}
auth:
  keys:
    - name: team-a
      key_env: TEAM_A_KEY
      rate_limit: {requests_per_minute: 600, burst: 20, tokens_per_minute: 200000, tokens_per_day: 20000000}
      priority: {default: default, max: interactive}
""",
        id="every-key",
    ),
    pytest.param(
        """\
version: 1
encoders: {v: {kind: local}}
models:
  - name: a
    upstreams: [https://h]
    accepts: [text, image]
    encode: {image: v}
    on_unsupported: {audio: strip, video: reject}
""",
        id="local-encoder-defaults",
    ),
]


@pytest.mark.parametrize("text", VALID)
def test_valid_documents_pass_schema_and_parser(text: str) -> None:
    assert schema_errors(text) == []
    parse_config(text)


INVALID = [
    pytest.param(
        "version: 1\nmodel: a\nmodels: [{name: a, upstreams: ['http://h:1'], accepts: [text]}]\n", id="unknown-top-key"
    ),
    pytest.param(
        "version: 1\nserver: {hots: x}\nmodels: [{name: a, upstreams: ['http://h:1'], accepts: [text]}]\n",
        id="unknown-server-key",
    ),
    pytest.param("version: 1\nmodels: [{name: a, upstreams: ['http://h:1'], accepts: [text, vidoe]}]\n", id="modality"),
    pytest.param(
        "version: 1\nmodels: [{name: a, upstreams: ['http://h:1'], accepts: [text], on_unsupported: {image: drop}}]\n",
        id="policy",
    ),
    pytest.param(
        "version: 1\nmodels: [{name: a, upstreams: ['http://h:1'], accepts: [text], "
        "on_unsupported: {image: {to: b}}}]\n",
        id="redirect-key",
    ),
    pytest.param(
        "version: 1\nencoders: {v: {kind: local, urls: ['http://e:1']}}\n"
        "models: [{name: a, upstreams: ['http://h:1'], accepts: [text]}]\n",
        id="local-encoder-with-urls",
    ),
    pytest.param(
        "version: 1\nencoders: {v: {kind: http, urls: ['http://e:1'], device: cpu}}\n"
        "models: [{name: a, upstreams: ['http://h:1'], accepts: [text]}]\n",
        id="http-encoder-with-device",
    ),
    pytest.param(
        "version: 1\nencoders: {v: {kind: http}}\nmodels: [{name: a, upstreams: ['http://h:1'], accepts: [text]}]\n",
        id="http-encoder-without-urls",
    ),
    pytest.param(
        "version: 1\nencoders: {v: {kind: grpc}}\nmodels: [{name: a, upstreams: ['http://h:1'], accepts: [text]}]\n",
        id="encoder-kind",
    ),
    pytest.param(
        "version: 1\nencoders: {v: {model: x}}\nmodels: [{name: a, upstreams: ['http://h:1'], accepts: [text]}]\n",
        id="encoder-without-kind",
    ),
    pytest.param(
        "version: 1\nencoders: {v: {kind: local, device: gpu}}\n"
        "models: [{name: a, upstreams: ['http://h:1'], accepts: [text]}]\n",
        id="device",
    ),
    pytest.param("version: 2\nmodels: [{name: a, upstreams: ['http://h:1'], accepts: [text]}]\n", id="version"),
    pytest.param("models: [{name: a, upstreams: ['http://h:1'], accepts: [text]}]\n", id="version-missing"),
    pytest.param("version: 1\nmodels: []\n", id="models-empty"),
    pytest.param("version: 1\nmodels: [{name: a, upstreams: ['http://h:1'], accepts: [image]}]\n", id="no-text"),
    pytest.param("version: 1\nmodels: [{name: a, upstreams: ['http://h:1'], accepts: [text, text]}]\n", id="twice"),
    pytest.param("version: 1\nmodels: [{name: a, upstreams: ['ftp://h:1'], accepts: [text]}]\n", id="url-scheme"),
    pytest.param("version: 1\nmodels: [{name: a, upstreams: ['http://u:p@h:1'], accepts: [text]}]\n", id="url-creds"),
    pytest.param("version: 1\nmodels: [{name: a, upstreams: ['http://h:1/?a=1'], accepts: [text]}]\n", id="url-query"),
    pytest.param("version: 1\nmodels: [{name: a, upstreams: ['http://:80'], accepts: [text]}]\n", id="url-no-host"),
    pytest.param(
        "version: 1\nmodels: [{name: a, upstreams: ['http://h:1', 'http://h:1'], accepts: [text]}]\n",
        id="duplicate-upstream",
    ),
    pytest.param(
        "version: 1\nencoders: {v: {kind: http, urls: ['http://e:1', 'http://e:1']}}\n"
        "models: [{name: a, upstreams: ['http://h:1'], accepts: [text]}]\n",
        id="duplicate-encoder-url",
    ),
    pytest.param(
        "version: 1\nmodels: [{name: a, upstreams: ['http://h:1'], accepts: [text], limits: {text: -1}}]\n",
        id="negative-limit",
    ),
    pytest.param(
        "version: 1\nmodels: [{name: a, upstreams: ['http://h:1'], accepts: [text], encode: {audio: v}}]\n",
        id="encode-audio",
    ),
    pytest.param(
        "version: 1\nserver: {port: 70000}\nmodels: [{name: a, upstreams: ['http://h:1'], accepts: [text]}]\n",
        id="port",
    ),
    pytest.param(
        "version: 1\nmedia: {fetch_timeout_s: 0}\nmodels: [{name: a, upstreams: ['http://h:1'], accepts: [text]}]\n",
        id="timeout-zero",
    ),
    pytest.param(
        "version: 1\nserver: {port: '8080'}\nmodels: [{name: a, upstreams: ['http://h:1'], accepts: [text]}]\n",
        id="port-string",
    ),
    pytest.param(
        "version: 1\nserver: {host: ' '}\nmodels: [{name: a, upstreams: ['http://h:1'], accepts: [text]}]\n",
        id="blank-host",
    ),
]


@pytest.mark.parametrize("text", INVALID)
def test_invalid_documents_fail_schema_and_parser(text: str) -> None:
    assert schema_errors(text) != []
    with pytest.raises(ConfigError):
        parse_config(text)


def test_schema_error_names_the_unknown_key() -> None:
    text = "version: 1\nmodels: [{name: a, upstreams: ['http://h:1'], accepts: [text], accept: [text]}]\n"
    assert schema_errors(text) == ["Additional properties are not allowed ('accept' was unexpected)"]

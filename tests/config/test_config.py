from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from gateway.config import (
    REJECT,
    EncoderConfig,
    GatewayConfig,
    MediaConfig,
    Policy,
    ServerConfig,
    load_config,
    parse_config,
)
from gateway.errors import ConfigError, ConfigProblem
from gateway.modalities import Modality

ROOT = Path(__file__).resolve().parents[2]
MODALITIES = "(expected one of: text, image, video, audio, file)"
SERVER_KEYS = (
    "(expected one of: host, port, max_body_bytes, admin_token_env, reload_interval_s, "
    "upstream_connect_timeout_s, upstream_read_timeout_s, upstream_cooldown_s, upstream_stream_idle_timeout_s, "
    "client_body_timeout_s, client_write_timeout_s, client_idle_timeout_s, max_json_values, max_json_depth, "
    "max_messages, max_content_parts, max_text_chars, max_upstream_body_bytes, drain_grace_s, drain_timeout_s, "
    "admin_listen, access_log, forward_client_credentials, upstream_client, limits_store, tracing)"
)
MODEL_KEYS = (
    "(expected one of: name, upstreams, upstream_model, engine, accepts, apis, limits, encode, on_encoder_error, "
    "on_unsupported, api_key_env, balance, retries, breaker, timeouts, max_concurrency, queue, health_check, video, "
    "visual_tokens, on_oversize, produces, on_unsupported_output, output_limits, image_urls, realtime)"
)
# A valid models section on two lines, for documents that test the sections above it.
MODELS = ("models:", "  - {name: a, upstreams: ['http://h:1'], accepts: [text]}")


def doc(*lines: str) -> str:
    """One YAML line per argument, so the line numbers in the expectations are the argument positions."""
    return "\n".join(lines) + "\n"


def model_doc(*lines: str) -> str:
    """A document with one model (lines 3-5), plus the given lines (from line 6) inside that model."""
    return doc(
        "version: 1",
        "models:",
        "  - name: a",
        "    upstreams: [http://h:1]",
        "    accepts: [text]",
        *lines,
    )


def problems(text: str) -> list[str]:
    with pytest.raises(ConfigError) as info:
        parse_config(text, filename="r.yaml")
    return [str(p) for p in info.value.problems]


def two_models(a: list[str], b: list[str], c: list[str] | None = None) -> str:
    """Models a, b (and c), each given its accepts/on_unsupported lines."""
    lines = ["version: 1", "models:"]
    for i, extra in enumerate([a, b] if c is None else [a, b, c]):
        lines += [f"  - name: {'abc'[i]}", f"    upstreams: [http://h:{i + 1}]", *extra]
    return doc(*lines)


# --- unknown keys -----------------------------------------------------------------------------

UNKNOWN_KEYS = [
    pytest.param(
        doc("version: 1", *MODELS, "model: b"),
        [
            "r.yaml:4:1: model: unknown key 'model' "
            "(expected one of: version, server, media, encoders, auth, models); did you mean 'models'?"
        ],
        id="top",
    ),
    pytest.param(
        doc("version: 1", *MODELS, "colour: blue"),
        ["r.yaml:4:1: colour: unknown key 'colour' (expected one of: version, server, media, encoders, auth, models)"],
        id="top-no-suggestion",
    ),
    pytest.param(
        doc("version: 1", "server:", "  hots: 0.0.0.0", *MODELS),
        [f"r.yaml:3:3: server.hots: unknown key 'hots' {SERVER_KEYS}; did you mean 'host'?"],
        id="server",
    ),
    pytest.param(
        doc("version: 1", "media:", "  allow_domain: [example.com]", *MODELS),
        [
            "r.yaml:3:3: media.allow_domain: unknown key 'allow_domain' (expected one of: allow_domains, "
            "allow_private_networks, fetch_timeout_s, max_image_bytes, max_video_bytes, max_audio_bytes, "
            "max_file_bytes, cache_bytes); did you mean 'allow_domains'?"
        ],
        id="media",
    ),
    pytest.param(
        doc("version: 1", "encoders:", "  v:", "    kind: local", "    max_batch: 4", *MODELS),
        [
            "r.yaml:5:5: encoders.v.max_batch: unknown key 'max_batch' (expected one of: kind, model, device, "
            "max_batch_size, max_batch_delay_ms, timeout_s, port); did you mean 'max_batch_size'?"
        ],
        id="encoder-local",
    ),
    pytest.param(
        doc("version: 1", "encoders:", "  v:", "    kind: http", "    urls: [http://e:1]", "    timout_s: 3", *MODELS),
        [
            "r.yaml:6:5: encoders.v.timout_s: unknown key 'timout_s' "
            "(expected one of: kind, urls, timeout_s); did you mean 'timeout_s'?"
        ],
        id="encoder-http",
    ),
    pytest.param(
        doc("version: 1", "encoders:", "  v: {kind: http, urls: [http://e:1], model: builtin:vit-small}", *MODELS),
        ["r.yaml:3:39: encoders.v.model: unknown key 'model' (expected one of: kind, urls, timeout_s)"],
        id="encoder-http-with-local-key",
    ),
    pytest.param(
        doc("version: 1", "encoders:", "  v: {kind: local, urls: [http://e:1]}", *MODELS),
        [
            "r.yaml:3:20: encoders.v.urls: unknown key 'urls' (expected one of: kind, model, device, "
            "max_batch_size, max_batch_delay_ms, timeout_s, port)"
        ],
        id="encoder-local-with-http-key",
    ),
    pytest.param(
        model_doc("    upstream: x"),
        [f"r.yaml:6:5: models[0].upstream: unknown key 'upstream' {MODEL_KEYS}; did you mean 'upstreams'?"],
        id="model",
    ),
    pytest.param(
        doc("version: 1", "models:", "  - name: a", "    upstreams: [http://h:1]", "    accept: [text]"),
        [
            "r.yaml:3:5: models[0].accepts: is required: list the modalities the model takes "
            "(text, image, video, audio, file)",
            f"r.yaml:5:5: models[0].accept: unknown key 'accept' {MODEL_KEYS}; did you mean 'accepts'?",
        ],
        id="model-misspelled-required-key",
    ),
    pytest.param(
        model_doc("    on_unsupported:", "      video: {redirekt: b}"),
        [
            "r.yaml:7:15: models[0].on_unsupported.video.redirekt: unknown key 'redirekt' "
            "(expected one of: redirect); did you mean 'redirect'?"
        ],
        id="redirect-mapping",
    ),
    pytest.param(
        model_doc("    on_unsupported:", "      video: {redirect: b, why: no}"),
        ["r.yaml:7:28: models[0].on_unsupported.video.why: unknown key 'why' (expected one of: redirect)"],
        id="redirect-mapping-extra-key",
    ),
    pytest.param(
        doc("version: 1", "encoders:", "  v: {kind: locale}", *MODELS),
        [
            "r.yaml:3:13: encoders.v.kind: unknown encoder kind 'locale' "
            "(expected one of: local, http, vllm); did you mean 'local'?"
        ],
        id="encoder-kind",
    ),
    pytest.param(
        doc("version: 1", "encoders:", "  v: {model: builtin:vit-small}", *MODELS),
        ["r.yaml:3:6: encoders.v: 'kind' is required (local, http or vllm)"],
        id="encoder-kind-missing",
    ),
    pytest.param(
        model_doc("    limits: {imgae: 2}"),
        [f"r.yaml:6:14: models[0].limits.imgae: unknown modality 'imgae' {MODALITIES}; did you mean 'image'?"],
        id="limits-modality",
    ),
    pytest.param(
        model_doc("    on_unsupported: {smell: reject}"),
        [f"r.yaml:6:22: models[0].on_unsupported.smell: unknown modality 'smell' {MODALITIES}"],
        id="on-unsupported-modality",
    ),
    pytest.param(
        doc("version: 1", "1: x", *MODELS),
        ["r.yaml:2:1: mapping keys must be strings"],
        id="non-string-key",
    ),
]


@pytest.mark.parametrize(("text", "expected"), UNKNOWN_KEYS)
def test_unknown_keys(text: str, expected: list[str]) -> None:
    assert problems(text) == expected


# --- types ------------------------------------------------------------------------------------

WRONG_TYPES = [
    pytest.param(doc("- version: 1"), ["r.yaml:1:1: the document must be a mapping, not a list"], id="document-list"),
    pytest.param(doc("hello"), ["r.yaml:1:1: the document must be a mapping, not string 'hello'"], id="document-str"),
    pytest.param(
        doc("version: 1", "server: [host]", *MODELS),
        ["r.yaml:2:9: server: server must be a mapping, not a list"],
        id="server-list",
    ),
    pytest.param(
        doc("version: 1", "media:", *MODELS),
        ["r.yaml:2:7: media: media must be a mapping, not null"],
        id="media-null",
    ),
    pytest.param(
        doc("version: 1", "server: {host: 1}", *MODELS),
        ["r.yaml:2:16: server.host: must be a non-empty string, not int 1"],
        id="host-int",
    ),
    pytest.param(
        doc("version: 1", "server: {host: ' '}", *MODELS),
        ["r.yaml:2:16: server.host: must be a non-empty string, not string ' '"],
        id="host-blank",
    ),
    pytest.param(
        doc("version: 1", "server: {port: '8080'}", *MODELS),
        ["r.yaml:2:16: server.port: must be an integer, not string '8080'"],
        id="port-str",
    ),
    pytest.param(
        doc("version: 1", "server: {port: true}", *MODELS),
        ["r.yaml:2:16: server.port: must be an integer, not boolean true"],
        id="port-bool",
    ),
    pytest.param(
        doc("version: 1", "server: {port: 80.5}", *MODELS),
        ["r.yaml:2:16: server.port: must be an integer, not float 80.5"],
        id="port-float",
    ),
    pytest.param(
        doc("version: 1", "server: {reload_interval_s: soon}", *MODELS),
        ["r.yaml:2:29: server.reload_interval_s: must be a number, not string 'soon'"],
        id="number-str",
    ),
    pytest.param(
        doc("version: 1", "server: {upstream_read_timeout_s: .inf}", *MODELS),
        ["r.yaml:2:35: server.upstream_read_timeout_s: must be a number, not float inf"],
        id="number-inf",
    ),
    pytest.param(
        doc("version: 1", "server: {upstream_cooldown_s: false}", *MODELS),
        ["r.yaml:2:31: server.upstream_cooldown_s: must be a number, not boolean false"],
        id="number-bool",
    ),
    pytest.param(
        doc("version: 1", "media: {allow_private_networks: 1}", *MODELS),
        ["r.yaml:2:33: media.allow_private_networks: must be true or false, not int 1"],
        id="bool-int",
    ),
    pytest.param(
        doc("version: 1", "media: {allow_private_networks: 'true'}", *MODELS),
        ["r.yaml:2:33: media.allow_private_networks: must be true or false, not string 'true'"],
        id="bool-str",
    ),
    pytest.param(
        doc("version: 1", "media: {allow_domains: example.com}", *MODELS),
        ["r.yaml:2:24: media.allow_domains: must be a list, not string 'example.com'"],
        id="list-str",
    ),
    pytest.param(
        doc("version: 1", "media: {allow_domains: [example.com, 7, {a: 1}]}", *MODELS),
        [
            "r.yaml:2:38: media.allow_domains[1]: must be a non-empty string, not int 7",
            "r.yaml:2:41: media.allow_domains[2]: must be a non-empty string, not a mapping",
        ],
        id="list-items",
    ),
    pytest.param(
        doc("version: 1", "encoders: [vision]", *MODELS),
        ["r.yaml:2:11: encoders: encoders must be a mapping of name to encoder, not a list"],
        id="encoders-list",
    ),
    pytest.param(
        doc("version: 1", "encoders:", "  v: local", *MODELS),
        ["r.yaml:3:6: encoders.v: an encoder must be a mapping, not string 'local'"],
        id="encoder-str",
    ),
    pytest.param(
        doc("version: 1", "encoders:", "  v: {kind: local, model: 3, device: gpu}", *MODELS),
        [
            "r.yaml:3:27: encoders.v.model: must be a non-empty string, not int 3",
            "r.yaml:3:38: encoders.v.device: unknown device 'gpu' (expected auto, cpu, cuda or cuda:N)",
        ],
        id="encoder-local-values",
    ),
    pytest.param(
        doc("version: 1", "encoders:", "  v: {kind: local, device: 'cuda:x'}", *MODELS),
        ["r.yaml:3:28: encoders.v.device: unknown device 'cuda:x' (expected auto, cpu, cuda or cuda:N)"],
        id="encoder-device-index",
    ),
    pytest.param(
        doc("version: 1", "encoders:", "  v: {kind: http, urls: http://e:1}", *MODELS),
        ["r.yaml:3:25: encoders.v.urls: must be a list, not string 'http://e:1'"],
        id="encoder-urls-str",
    ),
    pytest.param(
        doc("version: 1", "encoders:", "  v: {kind: http}", *MODELS),
        ["r.yaml:3:6: encoders.v: 'urls' is required for an http encoder"],
        id="encoder-urls-missing",
    ),
    pytest.param(
        doc("version: 1", "encoders:", "  v: {kind: http, urls: []}", *MODELS),
        ["r.yaml:3:25: encoders.v.urls: must list at least one URL"],
        id="encoder-urls-empty",
    ),
    pytest.param(
        doc("version: 1", "models: {a: 1}"),
        ["r.yaml:2:9: models: must be a list of models, not a mapping"],
        id="models-mapping",
    ),
    pytest.param(
        doc("version: 1", "models: [a]"),
        ["r.yaml:2:10: models[0]: a model must be a mapping, not string 'a'"],
        id="model-str",
    ),
    pytest.param(
        doc("version: 1", "models:", "  - name: 1", "    upstreams: [http://h:1]", "    accepts: [text]"),
        ["r.yaml:3:11: models[0].name: must be a non-empty string, not int 1"],
        id="name-int",
    ),
    pytest.param(
        model_doc("    upstream_model: ''"),
        ["r.yaml:6:21: models[0].upstream_model: must be a non-empty string, not string ''"],
        id="upstream-model-empty",
    ),
    pytest.param(
        doc("version: 1", "models:", "  - name: a", "    upstreams: http://h:1", "    accepts: [text]"),
        ["r.yaml:4:16: models[0].upstreams: must be a list, not string 'http://h:1'"],
        id="upstreams-str",
    ),
    pytest.param(
        doc("version: 1", "models:", "  - name: a", "    upstreams: [http://h:1]", "    accepts: text"),
        ["r.yaml:5:14: models[0].accepts: must be a list of modalities, not string 'text'"],
        id="accepts-str",
    ),
    pytest.param(
        model_doc("    limits: [image]"),
        ["r.yaml:6:13: models[0].limits: must be a mapping of modality to value, not a list"],
        id="limits-list",
    ),
    pytest.param(
        model_doc("    limits: {text: '2'}"),
        ["r.yaml:6:20: models[0].limits.text: must be a whole number of items (0 or more), not '2'"],
        id="limit-str",
    ),
    pytest.param(
        model_doc("    encode: image"),
        ["r.yaml:6:13: models[0].encode: must be a mapping of modality to value, not string 'image'"],
        id="encode-str",
    ),
    pytest.param(
        model_doc("    encode: {image: 1}"),
        ["r.yaml:6:21: models[0].encode.image: must be a non-empty string, not int 1"],
        id="encode-int",
    ),
    pytest.param(
        model_doc("    on_unsupported: [video]"),
        ["r.yaml:6:21: models[0].on_unsupported: must be a mapping of modality to value, not a list"],
        id="on-unsupported-list",
    ),
    pytest.param(
        model_doc("    on_unsupported: {video: {redirect: [b]}}"),
        ["r.yaml:6:40: models[0].on_unsupported.video.redirect: must be a non-empty string, not a list"],
        id="redirect-list",
    ),
]


@pytest.mark.parametrize(("text", "expected"), WRONG_TYPES)
def test_wrong_types(text: str, expected: list[str]) -> None:
    assert problems(text) == expected


# --- ranges -----------------------------------------------------------------------------------

OUT_OF_RANGE = [
    pytest.param("server: {port: 65536}", "2:16: server.port: must be between 0 and 65535, not 65536", id="port-high"),
    pytest.param("server: {port: -1}", "2:16: server.port: must be between 0 and 65535, not -1", id="port-low"),
    pytest.param(
        "server: {max_body_bytes: 1023}",
        "2:26: server.max_body_bytes: must be at least 1024, not 1023",
        id="max-body-bytes",
    ),
    pytest.param(
        "server: {reload_interval_s: -1}",
        "2:29: server.reload_interval_s: must be at least 0, not -1",
        id="reload-interval",
    ),
    pytest.param(
        "server: {upstream_connect_timeout_s: 0}",
        "2:38: server.upstream_connect_timeout_s: must be greater than 0, not 0",
        id="connect-timeout",
    ),
    pytest.param(
        "server: {upstream_read_timeout_s: -0.5}",
        "2:35: server.upstream_read_timeout_s: must be greater than 0, not -0.5",
        id="read-timeout",
    ),
    pytest.param(
        "server: {upstream_cooldown_s: -3}",
        "2:31: server.upstream_cooldown_s: must be at least 0, not -3",
        id="cooldown",
    ),
    pytest.param(
        "media: {fetch_timeout_s: 0}", "2:26: media.fetch_timeout_s: must be greater than 0, not 0", id="fetch-timeout"
    ),
    pytest.param(
        "media: {max_image_bytes: 0}", "2:26: media.max_image_bytes: must be at least 1, not 0", id="max-image-bytes"
    ),
    pytest.param(
        "encoders: {v: {kind: local, max_batch_size: 0}}",
        "2:45: encoders.v.max_batch_size: must be at least 1, not 0",
        id="max-batch-size",
    ),
    pytest.param(
        "encoders: {v: {kind: local, max_batch_delay_ms: -1}}",
        "2:49: encoders.v.max_batch_delay_ms: must be at least 0, not -1",
        id="max-batch-delay",
    ),
    pytest.param(
        "encoders: {v: {kind: http, urls: ['http://e:1'], timeout_s: 0}}",
        "2:61: encoders.v.timeout_s: must be greater than 0, not 0",
        id="encoder-timeout",
    ),
]


@pytest.mark.parametrize(("line", "expected"), OUT_OF_RANGE)
def test_out_of_range(line: str, expected: str) -> None:
    assert problems(doc("version: 1", line, *MODELS)) == [f"r.yaml:{expected}"]


def test_zero_is_allowed_where_documented() -> None:
    config = parse_config(
        doc(
            "version: 1",
            "server: {port: 0, reload_interval_s: 0, upstream_cooldown_s: 0}",
            "encoders: {v: {kind: local, max_batch_delay_ms: 0}}",
            "models:",
            "  - {name: a, upstreams: ['http://h:1'], accepts: [text, image], limits: {image: 0}}",
        )
    )
    assert (config.server.port, config.server.reload_interval_s, config.server.upstream_cooldown_s) == (0, 0.0, 0.0)
    assert config.encoders["v"].max_batch_delay_ms == 0.0
    assert config.models[0].limits == {Modality.IMAGE: 0}


# --- version and models -----------------------------------------------------------------------

DOCUMENT = [
    pytest.param(doc(*MODELS), ["r.yaml:1:1: version: is required (the only version is 1)"], id="version-missing"),
    pytest.param(
        doc("version: 2", *MODELS),
        ["r.yaml:1:10: version: unsupported version 2 (the only version is 1)"],
        id="version-2",
    ),
    pytest.param(
        doc("version: '1'", *MODELS),
        ["r.yaml:1:10: version: unsupported version '1' (the only version is 1)"],
        id="version-str",
    ),
    pytest.param(
        doc("version: true", *MODELS),
        ["r.yaml:1:10: version: unsupported version true (the only version is 1)"],
        id="version-bool",
    ),
    pytest.param(doc("version: 1"), ["r.yaml:1:1: models: is required: list at least one model"], id="models-missing"),
    pytest.param(
        doc("version: 1", "models: []"),
        ["r.yaml:2:9: models: must list at least one model"],
        id="models-empty",
    ),
    pytest.param(
        doc("version: 1", "models:"),
        ["r.yaml:2:8: models: must be a list of models, not null"],
        id="models-null",
    ),
    pytest.param(
        doc("version: 1", "models:", "  - name: a"),
        [
            "r.yaml:3:5: models[0].upstreams: is required: list the model's OpenAI-compatible servers",
            "r.yaml:3:5: models[0].accepts: is required: list the modalities the model takes "
            "(text, image, video, audio, file)",
        ],
        id="model-required-keys",
    ),
    pytest.param(
        doc("version: 1", "models:", "  - upstreams: [http://h:1]", "    accepts: [text]"),
        ["r.yaml:3:5: models[0].name: is required"],
        id="model-name-missing",
    ),
]


@pytest.mark.parametrize(("text", "expected"), DOCUMENT)
def test_version_and_models(text: str, expected: list[str]) -> None:
    assert problems(text) == expected


# --- modalities -------------------------------------------------------------------------------


def test_unknown_modality_as_in_the_design() -> None:
    text = doc(
        "version: 1",
        "models:",
        "  - name: a",
        "    upstreams: [http://h:1]",
        "    accepts: [text]",
        "  - name: b",
        "    upstreams: [http://h:2]",
        "    accepts: [text]",
        "  - name: c",
        "    upstreams: [http://h:3]",
        "    upstream_model: c-7b",
        "    accepts:",
        "    - text",
        "    - vidoe",
    )
    with pytest.raises(ConfigError) as info:
        parse_config(text, filename="routing.yaml")
    assert [str(p) for p in info.value.problems] == [
        f"routing.yaml:14:7: models[2].accepts[1]: unknown modality 'vidoe' {MODALITIES}; did you mean 'video'?"
    ]
    assert info.value.problems == (
        ConfigProblem(
            "routing.yaml",
            14,
            7,
            "models[2].accepts[1]",
            f"unknown modality 'vidoe' {MODALITIES}; did you mean 'video'?",
        ),
    )


MODALITY_PROBLEMS = [
    pytest.param(
        "    accepts: [text, 3, null]",
        [
            f"r.yaml:5:21: models[0].accepts[1]: unknown modality 3 {MODALITIES}",
            f"r.yaml:5:24: models[0].accepts[2]: unknown modality null {MODALITIES}",
        ],
        id="not-strings",
    ),
    pytest.param(
        "    accepts: [text, image, image]",
        ["r.yaml:5:28: models[0].accepts[2]: modality 'image' is listed twice"],
        id="listed-twice",
    ),
    pytest.param(
        "    accepts: [image, video]",
        ["r.yaml:5:14: models[0].accepts: must include 'text' (every chat request carries text)"],
        id="without-text",
    ),
    pytest.param(
        "    accepts: []",
        ["r.yaml:5:14: models[0].accepts: must list at least one modality"],
        id="empty",
    ),
]


@pytest.mark.parametrize(("accepts", "expected"), MODALITY_PROBLEMS)
def test_accepts(accepts: str, expected: list[str]) -> None:
    text = doc("version: 1", "models:", "  - name: a", "    upstreams: [http://h:1]", accepts)
    assert problems(text) == expected


# --- duplicates -------------------------------------------------------------------------------

DUPLICATES = [
    pytest.param(
        doc("version: 1", *MODELS, "version: 1"),
        ["r.yaml:4:1: version: duplicate key 'version' (first at line 1)"],
        id="top-key",
    ),
    pytest.param(
        model_doc("    name: b"),
        ["r.yaml:6:5: models[0].name: duplicate key 'name' (first at line 3)"],
        id="model-key",
    ),
    pytest.param(
        model_doc("    limits: {text: 1, text: 2}"),
        ["r.yaml:6:23: models[0].limits.text: duplicate key 'text' (first at line 6)"],
        id="flow-key",
    ),
    pytest.param(
        doc(
            "version: 1",
            "models:",
            "  - name: a",
            "    upstreams: [http://h:1]",
            "    accepts: [text]",
            "  - name: b",
            "    upstreams: [http://h:2]",
            "    accepts: [text]",
            "  - name: a",
            "    upstreams: [http://h:3]",
            "    accepts: [text]",
        ),
        ["r.yaml:9:11: models[2].name: duplicate model name 'a' (first defined at line 3)"],
        id="model-name",
    ),
    pytest.param(
        doc(
            "version: 1", "models:", "  - name: a", "    upstreams: [http://h:1, 'http://h:1/']", "    accepts: [text]"
        ),
        ["r.yaml:4:29: models[0].upstreams[1]: duplicate upstream 'http://h:1/'"],
        id="upstream",
    ),
]


@pytest.mark.parametrize(("text", "expected"), DUPLICATES)
def test_duplicates(text: str, expected: list[str]) -> None:
    assert problems(text) == expected


# --- URLs -------------------------------------------------------------------------------------

BAD_URLS = [
    pytest.param("ftp://h:1", "must be an http:// or https:// URL", id="scheme"),
    pytest.param("127.0.0.1:8000", "must be an http:// or https:// URL", id="no-scheme"),
    pytest.param("http://", "has no host", id="no-host"),
    pytest.param("http://:8000", "has no host", id="port-only"),
    pytest.param("http://h:99999", "has an invalid port", id="port-range"),
    pytest.param("http://h:http", "has an invalid port", id="port-name"),
    pytest.param(
        "http://h:1/v1?key=x", "must not have a query or fragment (the request path is appended to it)", id="query"
    ),
    pytest.param(
        "http://h:1/#top", "must not have a query or fragment (the request path is appended to it)", id="fragment"
    ),
    pytest.param("http://user:pw@h:1", "must not carry credentials", id="credentials"),
    pytest.param("http://user@h:1", "must not carry credentials", id="user"),
]


@pytest.mark.parametrize(("url", "message"), BAD_URLS)
def test_bad_upstream_url(url: str, message: str) -> None:
    text = doc("version: 1", "models:", "  - name: a", f"    upstreams: ['{url}']", "    accepts: [text]")
    assert problems(text) == [f"r.yaml:4:17: models[0].upstreams[0]: bad URL '{url}': {message}"]


@pytest.mark.parametrize(("url", "message"), BAD_URLS)
def test_bad_encoder_url(url: str, message: str) -> None:
    text = doc("version: 1", "encoders:", "  v:", "    kind: http", f"    urls: ['http://e:1', '{url}']", *MODELS)
    assert problems(text) == [f"r.yaml:5:26: encoders.v.urls[1]: bad URL '{url}': {message}"]


def test_empty_and_missing_upstreams() -> None:
    missing = doc("version: 1", "models:", "  - name: a", "    accepts: [text]")
    empty = doc("version: 1", "models:", "  - name: a", "    upstreams: []", "    accepts: [text]")
    assert problems(missing) == [
        "r.yaml:3:5: models[0].upstreams: is required: list the model's OpenAI-compatible servers"
    ]
    assert problems(empty) == ["r.yaml:4:16: models[0].upstreams: must list at least one upstream URL"]


# --- limits, encode, on_unsupported -----------------------------------------------------------

MODEL_CHECKS = [
    pytest.param(
        "    limits: {image: 4}",
        ["r.yaml:6:14: models[0].limits.image: a limit for 'image', which the model does not accept"],
        id="limit-not-accepted",
    ),
    pytest.param(
        "    limits: {text: -1}",
        ["r.yaml:6:20: models[0].limits.text: must be a whole number of items (0 or more), not -1"],
        id="limit-negative",
    ),
    pytest.param(
        "    limits: {text: 1.5}",
        ["r.yaml:6:20: models[0].limits.text: must be a whole number of items (0 or more), not 1.5"],
        id="limit-float",
    ),
    pytest.param(
        "    encode: {image: vision}",
        [
            "r.yaml:6:14: models[0].encode.image: encodes 'image', which the model does not accept",
            "r.yaml:6:21: models[0].encode.image: unknown encoder 'vision' (encoders: none defined)",
        ],
        id="encode-not-accepted-and-missing-encoder",
    ),
    pytest.param(
        "    encode: {audio: v}",
        [
            "r.yaml:6:14: models[0].encode.audio: only image parts can be encoded, not 'audio'",
            "r.yaml:6:21: models[0].encode.audio: unknown encoder 'v' (encoders: none defined)",
        ],
        id="encode-audio",
    ),
    pytest.param(
        "    encode: {text: v}",
        [
            "r.yaml:6:14: models[0].encode.text: only image parts can be encoded, not 'text'",
            "r.yaml:6:20: models[0].encode.text: unknown encoder 'v' (encoders: none defined)",
        ],
        id="encode-text",
    ),
    pytest.param(
        "    on_unsupported: {text: strip}",
        [
            "r.yaml:6:22: models[0].on_unsupported.text: "
            "'text' is accepted by this model, so this policy would never apply"
        ],
        id="policy-for-accepted",
    ),
    pytest.param(
        "    on_unsupported: {image: drop}",
        [
            "r.yaml:6:29: models[0].on_unsupported.image: "
            "unknown policy 'drop' (expected reject, strip, {history: strip}, {redirect: MODEL}, {transcribe: MODEL}, "
            "{describe: MODEL}, {frames: N} or {extract: {max_pages: N}})"
        ],
        id="policy-unknown",
    ),
    pytest.param(
        "    on_unsupported: {image: null}",
        [
            "r.yaml:6:29: models[0].on_unsupported.image: "
            "unknown policy null (expected reject, strip, {history: strip}, {redirect: MODEL}, {transcribe: MODEL}, "
            "{describe: MODEL}, {frames: N} or {extract: {max_pages: N}})"
        ],
        id="policy-null",
    ),
    pytest.param(
        "    on_unsupported: {image: {redirect: a}}",
        ["r.yaml:6:40: models[0].on_unsupported.image.redirect: model 'a' redirects to itself"],
        id="redirect-self",
    ),
    pytest.param(
        "    on_unsupported: {image: {redirect: zz}}",
        ["r.yaml:6:40: models[0].on_unsupported.image.redirect: redirect target 'zz' is not a model here (a)"],
        id="redirect-missing",
    ),
]


@pytest.mark.parametrize(("line", "expected"), MODEL_CHECKS)
def test_model_checks(line: str, expected: list[str]) -> None:
    assert problems(model_doc(line)) == expected


def test_encode_names_a_missing_encoder_among_defined_ones() -> None:
    text = doc(
        "version: 1",
        "encoders:",
        "  v1: {kind: local}",
        "  v2: {kind: http, urls: ['http://e:1']}",
        "models:",
        "  - {name: a, upstreams: ['http://h:1'], accepts: [text, image], encode: {image: v3}}",
    )
    assert problems(text) == ["r.yaml:6:82: models[0].encode.image: unknown encoder 'v3' (encoders: v1, v2)"]


def test_encode_video_that_is_accepted() -> None:
    text = doc(
        "version: 1",
        "encoders: {v: {kind: local}}",
        "models:",
        "  - {name: a, upstreams: ['http://h:1'], accepts: [text, video], encode: {video: v}}",
    )
    assert problems(text) == ["r.yaml:4:75: models[0].encode.video: only image parts can be encoded, not 'video'"]


def test_redirect_to_a_model_that_does_not_accept_the_modality() -> None:
    text = two_models(
        ["    accepts: [text]", "    on_unsupported: {video: {redirect: b}}"],
        ["    accepts: [text, image]"],
    )
    assert problems(text) == [
        "r.yaml:6:40: models[0].on_unsupported.video.redirect: "
        "redirect target 'b' does not accept 'video' (it accepts: text, image)"
    ]


def test_redirect_to_a_missing_model_lists_the_models() -> None:
    text = two_models(["    accepts: [text]", "    on_unsupported: {video: {redirect: omni}}"], ["    accepts: [text]"])
    assert problems(text) == [
        "r.yaml:6:40: models[0].on_unsupported.video.redirect: redirect target 'omni' is not a model here (a, b)"
    ]


# --- redirect loops ---------------------------------------------------------------------------


def test_two_model_redirect_loop() -> None:
    text = two_models(
        ["    accepts: [text, image]", "    on_unsupported: {video: {redirect: b}}"],
        ["    accepts: [text, video]", "    on_unsupported: {image: {redirect: a}}"],
    )
    assert problems(text) == [
        "r.yaml:6:40: models[0].on_unsupported.video.redirect: redirect loop: 'a' -(video)-> 'b' -(image)-> 'a'"
    ]


def test_three_model_redirect_loop_through_three_modalities() -> None:
    text = two_models(
        ["    accepts: [text, image]", "    on_unsupported: {video: {redirect: b}}"],
        ["    accepts: [text, video]", "    on_unsupported: {audio: {redirect: c}}"],
        ["    accepts: [text, audio]", "    on_unsupported: {image: {redirect: a}}"],
    )
    assert problems(text) == [
        "r.yaml:6:40: models[0].on_unsupported.video.redirect: "
        "redirect loop: 'a' -(video)-> 'b' -(audio)-> 'c' -(image)-> 'a'"
    ]


def test_loop_reached_from_a_model_outside_it_is_reported_once() -> None:
    text = two_models(
        ["    accepts: [text, image]", "    on_unsupported: {video: {redirect: b}, audio: {redirect: c}}"],
        ["    accepts: [text, video]", "    on_unsupported: {image: {redirect: c}}"],
        ["    accepts: [text, image, audio]", "    on_unsupported: {video: {redirect: b}}"],
    )
    assert problems(text) == [
        "r.yaml:10:40: models[1].on_unsupported.image.redirect: redirect loop: 'b' -(image)-> 'c' -(video)-> 'b'"
    ]


def test_redirect_chain_without_a_loop_is_valid() -> None:
    text = two_models(
        ["    accepts: [text]", "    on_unsupported: {video: {redirect: b}, image: {redirect: c}}"],
        ["    accepts: [text, video]", "    on_unsupported: {image: {redirect: c}}"],
        ["    accepts: [text, image, video]"],
    )
    config = parse_config(text)
    assert config.models[0].policy(Modality.VIDEO) == Policy("redirect", "b")
    assert config.models[1].policy(Modality.IMAGE) == Policy("redirect", "c")
    assert config.models[2].policy(Modality.AUDIO) == REJECT


# --- YAML and files ---------------------------------------------------------------------------

YAML_ERRORS = [
    pytest.param(
        doc("version: 1", "models: [a, b"),
        ["r.yaml:3:1: invalid YAML: expected ',' or ']', but got '<stream end>'"],
        id="unclosed-flow",
    ),
    pytest.param(
        doc("version: 1", "models:", "  - name: a", "   accepts: [text]"),
        ["r.yaml:4:4: invalid YAML: expected <block end>, but found '<block mapping start>'"],
        id="indentation",
    ),
    pytest.param(
        doc("version: 1", "\tmodels: []"),
        ["r.yaml:2:1: invalid YAML: found character '\\t' that cannot start any token"],
        id="tab",
    ),
    pytest.param(
        doc("version: 1", "---", "version: 1"),
        ["r.yaml:2:1: invalid YAML: but found another document"],
        id="two-documents",
    ),
    pytest.param(
        doc("version: 1", "models: *m"),
        ["r.yaml:2:9: invalid YAML: found undefined alias 'm'"],
        id="undefined-alias",
    ),
]


@pytest.mark.parametrize(("text", "expected"), YAML_ERRORS)
def test_yaml_syntax_errors(text: str, expected: list[str]) -> None:
    assert problems(text) == expected


@pytest.mark.parametrize("text", ["", "\n\n", "# only a comment\n"], ids=["empty", "blank", "comment"])
def test_empty_file(text: str) -> None:
    assert problems(text) == ["r.yaml: the file is empty (expected a mapping with 'version' and 'models')"]


def test_load_config_on_a_missing_path(tmp_path: Path) -> None:
    path = tmp_path / "missing.yaml"
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert [str(p) for p in info.value.problems] == [
        f"{path}: cannot read file: [Errno 2] No such file or directory: '{path}'"
    ]
    assert info.value.problems[0].line == 0


def test_load_config_on_a_file_that_is_not_utf8(tmp_path: Path) -> None:
    path = tmp_path / "latin1.yaml"
    path.write_bytes(b"version: 1\n# caf\xe9\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(info.value) == (
        f"{path}: cannot read file: 'utf-8' codec can't decode byte 0xe9 in position 16: invalid continuation byte"
    )


def test_load_config_names_the_file_in_problems(tmp_path: Path) -> None:
    path = tmp_path / "routing.yaml"
    path.write_text(doc("version: 3", *MODELS))
    with pytest.raises(ConfigError) as info:
        load_config(str(path))
    assert str(info.value) == f"{path}:1:10: version: unsupported version 3 (the only version is 1)"


def test_problems_are_sorted_by_line_then_column() -> None:
    text = doc(
        "version: 2",
        "server: {host: 1, port: x}",
        *MODELS,
        "extra: 1",
    )
    assert problems(text) == [
        "r.yaml:1:10: version: unsupported version 2 (the only version is 1)",
        "r.yaml:2:16: server.host: must be a non-empty string, not int 1",
        "r.yaml:2:25: server.port: must be an integer, not string 'x'",
        "r.yaml:5:1: extra: unknown key 'extra' (expected one of: version, server, media, encoders, auth, models)",
    ]


def test_every_problem_of_every_section_is_reported() -> None:
    text = doc(
        "version: 1",
        "server: {port: 99999}",
        "media: {fetch_timeout_s: 0}",
        "encoders: {v: {kind: ftp}}",
        "models:",
        "  - {name: a, upstreams: ['ftp://h'], accepts: [text, vidoe]}",
    )
    assert problems(text) == [
        "r.yaml:2:16: server.port: must be between 0 and 65535, not 99999",
        "r.yaml:3:26: media.fetch_timeout_s: must be greater than 0, not 0",
        "r.yaml:4:22: encoders.v.kind: unknown encoder kind 'ftp' (expected one of: local, http, vllm)",
        "r.yaml:6:27: models[0].upstreams[0]: bad URL 'ftp://h': must be an http:// or https:// URL",
        f"r.yaml:6:55: models[0].accepts[1]: unknown modality 'vidoe' {MODALITIES}; did you mean 'video'?",
    ]


def test_a_wrong_value_hides_no_problem_across_models() -> None:
    """The checks across models (targets, limits, encoders) run beside a value that did not
    parse, so one check says every problem; not where a model or its name could not be read."""
    text = doc(
        "version: 1",
        "models:",
        "  - {name: a, upstreams: [http://h:1], accepts: [text, imagee], on_unsupported: {audio: {transcribe: zz}}}",
        "  - {name: b, upstreams: [notaurl], accepts: [text], on_unsupported: {audio: {transcribe: a}}}",
    )
    assert problems(text) == [
        f"r.yaml:3:56: models[0].accepts[1]: unknown modality 'imagee' {MODALITIES}; did you mean 'image'?",
        "r.yaml:3:102: models[0].on_unsupported.audio.transcribe: transcription model 'zz' is not a model here (a, b)",
        "r.yaml:4:27: models[1].upstreams[0]: bad URL 'notaurl': must be an http:// or https:// URL",
        "r.yaml:4:91: models[1].on_unsupported.audio.transcribe: transcription model 'a' must accept audio "
        "(it accepts: text)",
    ]
    unnamed = doc(
        "version: 1",
        "models:",
        "  - {upstreams: [http://h:1], accepts: [text]}",
        "  - {name: b, upstreams: [http://h:1], accepts: [text], on_unsupported: {video: {redirect: nope}}}",
    )
    assert problems(unnamed) == ["r.yaml:3:5: models[0].name: is required"]  # what refers to which is unknown


def test_a_local_encoders_port_is_its_own() -> None:
    text = doc(
        "version: 1",
        "server: {port: 8080}",
        "encoders:",
        "  v: {kind: local, port: 9001}",
        "  w: {kind: local, port: 9001}",
        "  x: {kind: local, port: 8080}",
        "models:",
        "  - {name: a, upstreams: [http://h:1], accepts: [text]}",
    )
    assert problems(text) == [
        "r.yaml:5:26: encoders.w.port: port 9001 is encoders.v.port's already",
        "r.yaml:6:26: encoders.x.port: port 8080 is server.port's already",
    ]


def test_config_error_message_joins_the_problems() -> None:
    with pytest.raises(ConfigError) as info:
        parse_config(doc("version: 2", "models: []"), filename="r.yaml")
    assert str(info.value) == (
        "r.yaml:1:10: version: unsupported version 2 (the only version is 1)\n"
        "r.yaml:2:9: models: must list at least one model"
    )


# --- valid configs ----------------------------------------------------------------------------


def test_shipped_routing_yaml_loads() -> None:
    config = load_config(ROOT / "routing.yaml")
    assert config.source == str(ROOT / "routing.yaml")
    assert [m.name for m in config.models] == ["kimi-k3", "qwen-omni", "qwen-vl-epd", "whisper", "kimi-k3-text"]
    kimi = config.model("kimi-k3")
    assert kimi is not None
    assert kimi.upstream_name == "moonshotai/Kimi-K3"
    assert kimi.accepts == (Modality.TEXT, Modality.IMAGE)
    assert kimi.limits == {Modality.IMAGE: 8}
    assert kimi.policy(Modality.VIDEO) == Policy("redirect", "qwen-omni")
    assert kimi.policy(Modality.AUDIO) == REJECT
    text_only = config.model("kimi-k3-text")
    assert text_only is not None
    assert text_only.policy(Modality.IMAGE) == Policy("strip")
    epd = config.model("qwen-vl-epd")
    assert epd is not None and epd.encode == {Modality.IMAGE: "vision"} and epd.on_encoder_error == "passthrough"
    assert epd.policy(Modality.VIDEO) == Policy("frames", frames=8)
    assert epd.policy(Modality.AUDIO).action == "transcribe" and epd.policy(Modality.AUDIO).target == "whisper"
    assert config.encoders["vision"].kind == "local" and config.encoders["vision"].model == "builtin:vit-small"
    whisper = config.model("whisper")  # a speech model serves the audio APIs, not chat (issue 38)
    assert whisper is not None and whisper.apis == ("transcriptions", "translations")


def test_defaults_are_applied() -> None:
    config = parse_config(
        doc("version: 1", "encoders:", "  v: {kind: local}", "  p: {kind: http, urls: ['http://e:1']}", *MODELS)
    )
    assert config.server == ServerConfig()
    assert config.media == MediaConfig()
    assert config.encoders == {"v": EncoderConfig("v", "local"), "p": EncoderConfig("p", "http", urls=("http://e:1",))}
    assert config.version == 1
    model = config.models[0]
    assert (model.upstream_model, model.upstream_name) == (None, "a")
    assert (model.limits, model.encode, model.on_unsupported) == ({}, {}, {})
    assert model.policy(Modality.IMAGE) == REJECT


def test_default_values() -> None:
    server, media, encoder = ServerConfig(), MediaConfig(), EncoderConfig("v", "local")
    assert (server.host, server.port, server.max_body_bytes, server.admin_token_env) == (
        "127.0.0.1",
        8080,
        33554432,
        "GATEWAY_ADMIN_TOKEN",
    )
    assert (media.allow_domains, media.allow_private_networks, media.fetch_timeout_s, media.max_image_bytes) == (
        (),
        False,
        5.0,
        20971520,
    )
    assert (media.max_video_bytes, media.max_audio_bytes, media.cache_bytes) == (104857600, 26214400, 268435456)
    assert (encoder.model, encoder.device, encoder.max_batch_size, encoder.timeout_s, encoder.urls) == (
        "builtin:vit-small",
        "auto",
        32,
        30.0,
        (),
    )


def test_parse_config_default_filename_and_source() -> None:
    config = parse_config(doc("version: 1", *MODELS))
    assert config.source == "routing.yaml"
    with pytest.raises(ConfigError) as info:
        parse_config(doc("version: 9", *MODELS))
    assert info.value.problems[0].file == "routing.yaml"


def test_explicit_values_are_read(tmp_path: Path) -> None:
    config = parse_config(
        doc(
            "version: 1",
            "server: {host: 0.0.0.0, port: 9090, max_body_bytes: 2048, admin_token_env: TOKEN, reload_interval_s: 1,",
            "         upstream_connect_timeout_s: 1.5, upstream_read_timeout_s: 60, upstream_cooldown_s: 2}",
            "media: {allow_domains: [Example.COM], allow_private_networks: true, fetch_timeout_s: 2,",
            "        max_image_bytes: 100, max_video_bytes: 200, max_audio_bytes: 300, max_file_bytes: 400,",
            "        cache_bytes: 0}",
            "encoders:",
            f"  v: {{kind: local, model: {tmp_path}, device: 'cuda:1', max_batch_size: 8, max_batch_delay_ms: 2,",
            "      timeout_s: 10}",
            *MODELS,
        )
    )
    assert config.server == ServerConfig("0.0.0.0", 9090, 2048, "TOKEN", 1.0, 1.5, 60.0, 2.0)
    assert config.media == MediaConfig(("example.com",), True, 2.0, 100, 200, 300, 400, 0)
    assert config.encoders["v"] == EncoderConfig("v", "local", str(tmp_path), "cuda:1", 8, 2.0, 10.0)
    assert isinstance(config.server.reload_interval_s, float)


def test_config_is_frozen() -> None:
    config = parse_config(model_doc("    limits: {text: 2}"))
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.server = ServerConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.models[0].name = "b"
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.server.port = 1
    with pytest.raises(TypeError):
        config.models[0].limits[Modality.TEXT] = 3  # type: ignore[index]
    with pytest.raises(TypeError):
        config.encoders["v"] = EncoderConfig("v", "local")  # type: ignore[index]


def test_trailing_slash_is_removed_from_urls() -> None:
    config = parse_config(
        doc(
            "version: 1",
            "encoders: {p: {kind: http, urls: ['http://e:1/']}}",
            "models:",
            "  - {name: a, upstreams: ['http://h:1/', 'https://h:2/v1/'], accepts: [text]}",
        )
    )
    assert config.models[0].upstreams == ("http://h:1", "https://h:2/v1")
    assert config.encoders["p"].urls == ("http://e:1",)


def test_accepts_are_kept_in_modality_order() -> None:
    config = parse_config(model_doc("  - {name: b, upstreams: ['http://h:2'], accepts: [audio, video, text, image]}"))
    b = config.model("b")
    assert b is not None
    assert b.accepts == (Modality.TEXT, Modality.IMAGE, Modality.VIDEO, Modality.AUDIO)
    assert b.accepts_text() == "text, image, video, audio"


def test_model_lookup_by_name() -> None:
    config = parse_config(model_doc("  - {name: b, upstreams: ['http://h:2'], accepts: [text]}"))
    a, b = config.models
    assert config.model("a") is a
    assert config.model("b") is b
    assert config.model("c") is None
    assert config.model("") is None


def test_gateway_config_built_in_code() -> None:
    model = parse_config(doc("version: 1", *MODELS)).models[0]
    config = GatewayConfig(models=(model,))
    assert config.model("a") is model
    assert config.source == "<memory>"


def test_full_model_is_read() -> None:
    config = parse_config(
        doc(
            "version: 1",
            "encoders: {vision: {kind: local}}",
            "models:",
            "  - name: a",
            "    upstreams: [http://h:1]",
            "    upstream_model: org/a",
            "    accepts: [text, image]",
            "    limits: {image: 2, text: 10}",
            "    encode: {image: vision}",
            "    on_unsupported: {video: {redirect: b}, audio: strip}",
            "  - name: b",
            "    upstreams: [http://h:2]",
            "    accepts: [text, video]",
        )
    )
    a = config.models[0]
    assert a.upstream_name == "org/a"
    assert a.limits == {Modality.IMAGE: 2, Modality.TEXT: 10}
    assert a.encode == {Modality.IMAGE: "vision"}
    assert a.on_unsupported == {Modality.VIDEO: Policy("redirect", "b"), Modality.AUDIO: Policy("strip")}
    assert str(a.policy(Modality.VIDEO)) == "redirect to 'b'"
    assert str(a.policy(Modality.AUDIO)) == "strip"


# --- values that once crashed the parser ------------------------------------------------------

ODD_VALUES = [
    pytest.param(
        doc("version: 1", "encoders: {v: {kind: [local]}}", *MODELS),
        ["r.yaml:2:22: encoders.v.kind: unknown encoder kind a list (expected one of: local, http, vllm)"],
        id="encoder-kind-list",
    ),
    pytest.param(
        doc("version: 1", "encoders: {v: {kind: {local: 1}}}", *MODELS),
        ["r.yaml:2:22: encoders.v.kind: unknown encoder kind a mapping (expected one of: local, http, vllm)"],
        id="encoder-kind-mapping",
    ),
    pytest.param(
        model_doc("    on_unsupported: {video: {}}"),
        [
            "r.yaml:6:29: models[0].on_unsupported.video: "
            "unknown policy {} (expected reject, strip, {history: strip}, {redirect: MODEL}, {transcribe: MODEL}, "
            "{describe: MODEL}, {frames: N} or {extract: {max_pages: N}})"
        ],
        id="empty-policy-mapping",
    ),
    pytest.param(
        doc("version: 1", "models:", "  - {name: a, upstreams: ['http://[::1:8000'], accepts: [text]}"),
        ["r.yaml:3:27: models[0].upstreams[0]: bad URL 'http://[::1:8000': Invalid IPv6 URL"],
        id="malformed-ipv6-host",
    ),
    pytest.param(
        doc("version: !custom 1", *MODELS),
        ["r.yaml:1:10: version: cannot read this value: could not determine a constructor for the tag '!custom'"],
        id="unknown-tag",
    ),
    pytest.param(
        doc("version: 1", "media: {fetch_timeout_s: 1" + "0" * 400 + "}", *MODELS),
        ["r.yaml:2:26: media.fetch_timeout_s: must be a number, not int 1" + "0" * 400],
        id="int-too-large-for-a-float",
    ),
    pytest.param(
        doc("version: 1", "encoders: {p: {kind: http, urls: ['http://e:1', 'http://e:1/']}}", *MODELS),
        ["r.yaml:2:49: encoders.p.urls[1]: duplicate encoder URL 'http://e:1/'"],
        id="duplicate-encoder-url",
    ),
]


@pytest.mark.parametrize(("text", "expected"), ODD_VALUES)
def test_odd_values_are_problems_not_crashes(text: str, expected: list[str]) -> None:
    assert problems(text) == expected


def test_yaml_merge_keys() -> None:
    config = parse_config(
        doc(
            "version: 1",
            "models:",
            "  - &a {name: a, upstreams: ['http://h:1'], accepts: [text, image], limits: {image: 2}}",
            "  - <<: *a",
            "    name: b",
        )
    )
    a, b = config.models
    assert (b.name, b.upstreams, b.accepts, b.limits) == ("b", a.upstreams, a.accepts, a.limits)


def test_yaml_merge_key_of_a_scalar() -> None:
    text = doc(
        "version: 1", "models:", "  - <<: 3", "    name: a", "    upstreams: [http://h:1]", "    accepts: [text]"
    )
    assert problems(text) == ["r.yaml:3:9: models[0]: '<<' merges a mapping or a list of mappings"]


def test_encoder_models_and_allowed_domains_are_checked_where_they_would_fail_later() -> None:
    text = doc(
        "version: 1",
        "media: {allow_domains: [images.example.com, '*.example.com', 'https://x.example.com/']}",
        "encoders:",
        "  a: {kind: local, model: 'builtin:vit-large'}",
        "  b: {kind: local, model: /no/such/model/dir}",
        *MODELS,
    )
    assert problems(text) == [
        "r.yaml:2:45: media.allow_domains[1]: '*.example.com' is not a host name: write the domain alone, like "
        "images.example.com (no scheme, port, path or wildcard; its subdomains are allowed too)",
        "r.yaml:2:62: media.allow_domains[2]: 'https://x.example.com/' is not a host name: write the domain alone, "
        "like images.example.com (no scheme, port, path or wildcard; its subdomains are allowed too)",
        "r.yaml:4:27: encoders.a.model: unknown builtin tower 'builtin:vit-large' (expected one of: "
        "builtin:vit-small); did you mean 'builtin:vit-small'?",
    ]


def test_a_model_directory_is_looked_for_only_on_the_machine_that_runs_it(tmp_path: Path) -> None:
    text = doc("version: 1", "encoders:", "  b: {kind: local, model: /no/such/model/dir}", *MODELS)
    parse_config(text, filename="r.yaml")  # `check FILE`: the same answer on any machine
    with pytest.raises(ConfigError) as info:
        parse_config(text, filename="r.yaml", here=True)  # serve, reload, `check --here`
    assert [str(p) for p in info.value.problems] == [
        "r.yaml:3:27: encoders.b.model: '/no/such/model/dir' is not a directory on this machine (expected "
        "builtin:vit-small or a model directory)"
    ]
    here = tmp_path / "tower"
    here.mkdir()
    parse_config(text.replace("/no/such/model/dir", str(here)), filename="r.yaml", here=True)


def test_files_that_expand_without_end_are_refused_not_crashed_on() -> None:
    bomb = ["version: 1", "a: &a [x, x, x, x, x, x, x, x, x, x]"]
    for level in "bcdefg":
        previous = chr(ord(level) - 1)
        bomb.append(f"{level}: &{level} [" + ", ".join([f"*{previous}"] * 10) + "]")
    assert problems(doc(*bomb)) == [
        "r.yaml: cannot read this file: more than 200000 values (aliases that expand without end?)"
    ]
    assert problems(doc("version: 1", "x: &a {<<: *a}")) == [
        "r.yaml: cannot read this file: nesting too deep (a recursive alias?)"
    ]


def test_an_api_key_env_is_a_variable_name_and_must_be_set_where_the_gateway_runs(monkeypatch) -> None:
    model = "  - {name: a, upstreams: ['http://h:1'], accepts: [text], api_key_env: %s}"
    assert problems(doc("version: 1", "models:", model % "'sk-abc def'")) == [
        "r.yaml:3:72: models[0].api_key_env: must be the name of an environment variable (like VLLM_API_KEY), "
        "not 'sk-abc def'"
    ]
    text = doc("version: 1", "models:", model % "MODALITY_GATEWAY_TEST_KEY")
    monkeypatch.delenv("MODALITY_GATEWAY_TEST_KEY", raising=False)
    assert parse_config(text).models[0].api_key_env == "MODALITY_GATEWAY_TEST_KEY"  # `check FILE`
    with pytest.raises(ConfigError) as info:
        parse_config(text, filename="r.yaml", here=True)
    assert [str(p) for p in info.value.problems] == [
        "r.yaml:3:72: models[0].api_key_env: the environment variable MODALITY_GATEWAY_TEST_KEY is not set"
    ]
    monkeypatch.setenv("MODALITY_GATEWAY_TEST_KEY", "sk-x")
    parse_config(text, filename="r.yaml", here=True)
    monkeypatch.setenv("MODALITY_GATEWAY_TEST_KEY", "sk-x\n")  # a secret file's newline: stripped, fine
    parse_config(text, filename="r.yaml", here=True)
    monkeypatch.setenv("MODALITY_GATEWAY_TEST_KEY", "sk-x\nX-Evil: 1")
    with pytest.raises(ConfigError) as info:
        parse_config(text, filename="r.yaml", here=True)
    assert [str(p) for p in info.value.problems] == [
        "r.yaml:3:72: models[0].api_key_env: the value of MODALITY_GATEWAY_TEST_KEY holds a line break or another "
        "control character; it cannot go into an Authorization header"
    ]


@pytest.mark.parametrize(
    ("model", "expected"),
    [
        pytest.param(
            "upstreams: ['http://h:1', {url: 'http://h:2', weight: 0}]",
            "models[0].upstreams[1].weight: must be between 1 and 100, not 0",
            id="weight",
        ),
        pytest.param(
            "upstreams: ['http://h:1', {url: 'http://h:2', wieght: 2}]",
            "models[0].upstreams[1].wieght: unknown key 'wieght' (expected one of: url, weight); "
            "did you mean 'weight'?",
            id="weight-key",
        ),
        pytest.param(
            "upstreams: ['http://h:1', {weight: 2}]", "models[0].upstreams[1].url: is required", id="weight-no-url"
        ),
        pytest.param(
            "upstreams: ['http://h:1'], balance: random",
            "models[0].balance: unknown balance policy 'random' (expected one of: p2c, round_robin, affinity)",
            id="balance",
        ),
        pytest.param(
            "upstreams: ['http://h:1'], retries: {on_status: [404]}",
            "models[0].retries.on_status: must be a list of statuses among 429, 500, 502, 503, 504, not a list",
            id="retry-status",
        ),
        pytest.param(
            "upstreams: ['http://h:1'], retries: {attempts: 11}",
            "models[0].retries.attempts: must be between 0 and 10, not 11",
            id="retry-attempts",
        ),
        pytest.param(
            "upstreams: ['http://h:1'], breaker: {failures: 0}",
            "models[0].breaker.failures: must be at least 1, not 0",
            id="breaker-failures",
        ),
        pytest.param(
            "upstreams: ['http://h:1'], breaker: {opens: 3}",
            "models[0].breaker.opens: unknown key 'opens' (expected one of: failures, open_s, successes); "
            "did you mean 'open_s'?",
            id="breaker-key",
        ),
    ],
)
def test_pool_keys_are_checked(model: str, expected: str) -> None:
    found = problems(doc("version: 1", "models:", f"  - {{name: a, accepts: [text], {model}}}"))
    assert [p.split(": ", 1)[1] for p in found] == [expected]


def test_pool_keys_parse_with_their_defaults() -> None:
    config = parse_config(
        doc(
            "version: 1",
            "server: {upstream_cooldown_s: 7}",
            "models:",
            "  - {name: a, accepts: [text], upstreams: ['http://h:1', {url: 'http://h:2', weight: 3}],",
            "     balance: round_robin, retries: {attempts: 0, on_status: [503, 500]}, breaker: {successes: 1}}",
            "  - {name: b, accepts: [text], upstreams: ['http://h:3', {url: 'http://h:4'}]}",
        )
    )
    a, b = config.models
    assert a.upstreams == ("http://h:1", "http://h:2") and a.weights == (1, 3) and a.balance == "round_robin"
    assert (a.retries.attempts, a.retries.on_status, a.retries.budget) == (0, (500, 503), 0.2)
    assert (a.breaker.failures, a.breaker.open_s, a.breaker.successes) == (5, 7.0, 1)
    assert b.upstreams == ("http://h:3", "http://h:4") and b.weights == () and b.balance == "p2c"


def test_a_password_in_the_limits_stores_url_is_never_shown() -> None:
    from gateway.config import as_dict

    config = parse_config(
        doc(
            "version: 1",
            "server: {limits_store: {url: 'redis://:s3cret@redis:6379/0'}}",
            "models: [{name: a, accepts: [text], upstreams: ['http://h:1']}]",
        )
    )
    assert config.server.limits_store is not None and "s3cret" in config.server.limits_store.url  # used as given
    shown = as_dict(config)["server"]["limits_store"]
    assert shown["url"] == "redis://:***@redis:6379/0" and "s3cret" not in str(as_dict(config))


# --- engines (issue 38) ----------------------------------------------------------------------


def test_a_model_runs_on_vllm_unless_its_engine_says_otherwise() -> None:
    config = parse_config(doc("version: 1", "models:", "  - {name: a, upstreams: ['http://e:1'], accepts: [text]}",
                              "  - {name: b, upstreams: ['http://e:1'], accepts: [text], engine: sglang}"))  # fmt: skip
    assert [m.engine for m in config.models] == ["vllm", "sglang"]
    assert config.models[0].takes_on("responses") == (Modality.TEXT,)


@pytest.mark.parametrize(
    ("model", "message"),
    [
        ("{name: a, upstreams: ['http://e:1'], accepts: [text], engine: tgi}", "unknown engine 'tgi'"),
        (
            "{name: a, upstreams: ['http://e:1'], accepts: [text, image], engine: sglang, encode: {image: v}}",
            "models[0].encode: encoded images reach the engine as image_embeds parts",
        ),
        (
            "{name: a, upstreams: ['http://e:1'], accepts: [text, file]}",
            "models[0].accepts: 'file' is taken on none of this model's APIs (chat, responses, messages): "
            "vLLM's chat API has no file part (engine: vllm) (take files as their text",
        ),
        (
            "{name: a, upstreams: ['http://e:1'], accepts: [text, image], apis: [score], engine: sglang}",
            "'image' is taken on none of this model's APIs (score): SGLang's score API has no image part",
        ),
        (
            "{name: a, upstreams: ['http://e:1'], accepts: [text, image], on_unsupported: {image: strip}}",
            "'image' is accepted by this model, so this policy would never apply",
        ),
    ],
)
def test_check_refuses_what_a_models_engine_cannot_take(model: str, message: str) -> None:
    with pytest.raises(ConfigError) as caught:
        parse_config(
            doc("version: 1", "encoders:", "  v: {kind: http, urls: ['http://enc:1']}", "models:", f"  - {model}")
        )
    assert message in str(caught.value)


def test_a_policy_for_a_modality_the_engine_lacks_on_one_api_is_taken() -> None:
    config = parse_config(
        doc(
            "version: 1",
            "models:",
            "  - {name: a, upstreams: ['http://e:1'], accepts: [text, audio], on_unsupported: {audio: strip}}",
            "  - {name: f, upstreams: ['http://e:1'], accepts: [text, file], engine: openai}",
        )
    )
    a = config.models[0]
    assert a.policy(Modality.AUDIO) == Policy("strip") and a.takes_on("chat") == (Modality.TEXT, Modality.AUDIO)
    assert a.takes_on("responses") == (Modality.TEXT,) and config.models[1].takes_on("chat")[-1] is Modality.FILE

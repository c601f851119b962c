"""routing.yaml -> a frozen, validated :class:`GatewayConfig`.

Loading has three steps: YAML is composed into nodes (so every value keeps its line and column),
the nodes are parsed section by section into frozen dataclasses, and :func:`_validate` checks what
spans sections (redirect targets, loops, encoders). Every problem found is collected, and all of
them are raised together as one :class:`~gateway.errors.ConfigError`, each rendered as
``FILE:LINE:COL: dotted.path: message``. The schema is documented in ``docs/routing.md`` and,
for editors, ``docs/routing.schema.json``.
"""

from __future__ import annotations

import difflib
import math
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any, Literal
from urllib.parse import urlsplit

import yaml

from .errors import ConfigError, ConfigProblem
from .modality import DEFAULT_BOUNDS, MODALITY_NAMES, ContentBounds, Modality

SUPPORTED_VERSION = 1
ENCODABLE = (Modality.IMAGE,)
BUILTIN_TOWERS = ("builtin:vit-small",)  # as backends/vision_encoder/towers knows them
_HOST_NAME = re.compile(
    r"(?=.{1,253}$)([a-z0-9_]([a-z0-9_-]{0,61}[a-z0-9_])?)(\.[a-z0-9_]([a-z0-9_-]{0,61}[a-z0-9_])?)*", re.I
)

# Keys per section: the parser and docs/routing.schema.json must agree (tests/test_schema.py).
TOP_KEYS = ("version", "server", "media", "encoders", "models")
SERVER_KEYS = (
    "host",
    "port",
    "max_body_bytes",
    "admin_token_env",
    "reload_interval_s",
    "upstream_connect_timeout_s",
    "upstream_read_timeout_s",
    "upstream_cooldown_s",
    "upstream_stream_idle_timeout_s",
    "client_body_timeout_s",
    "client_write_timeout_s",
    "client_idle_timeout_s",
    "max_json_values",
    "max_json_depth",
    "max_messages",
    "max_content_parts",
    "max_text_chars",
    "max_upstream_body_bytes",
)
MEDIA_KEYS = ("allow_domains", "allow_private_networks", "fetch_timeout_s", "max_image_bytes")
ENCODER_KEYS = {
    "local": ("kind", "model", "device", "max_batch_size", "max_batch_delay_ms", "timeout_s"),
    "http": ("kind", "urls", "timeout_s"),
}
MODEL_KEYS = (
    "name",
    "upstreams",
    "upstream_model",
    "accepts",
    "limits",
    "encode",
    "on_encoder_error",
    "on_unsupported",
)
ENCODER_ERROR_ACTIONS = ("fail", "passthrough")
MAX_JSON_DEPTH = 254  # the deepest body orjson can write back
# Images per request for a model that encodes them, unless limits.image says otherwise: every
# image becomes an image_embeds payload upstream, often 1000x the size of the part it replaces.
DEFAULT_ENCODE_IMAGE_LIMIT = 32
POLICY_ACTIONS = ("reject", "strip")


@dataclass(frozen=True, slots=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8080
    max_body_bytes: int = 32 * 1024 * 1024
    admin_token_env: str = "GATEWAY_ADMIN_TOKEN"
    reload_interval_s: float = 2.0  # 0 turns off watching routing.yaml
    upstream_connect_timeout_s: float = 5.0
    # Longest silence of a replica. A non-streamed reply comes only when the whole generation is
    # done (and a stream's first chunk after queueing and prefill), so this must exceed the longest
    # generation: the OpenAI SDK's own default. Streams are also bounded by the shorter idle timeout.
    upstream_read_timeout_s: float = 600.0
    upstream_cooldown_s: float = 5.0  # how long a replica that refused a connection is skipped
    # "stream": true: headers (engines send them at once) and the gaps between chunks
    upstream_stream_idle_timeout_s: float = 60.0
    # What one client may cost (docs/security.md says why each default is what it is).
    client_body_timeout_s: float = 60.0  # the whole body must arrive within this
    client_write_timeout_s: float = 60.0  # a client that takes no bytes for this long is dropped
    client_idle_timeout_s: float = 75.0  # idle keep-alive, and headers that trickle in; > the LB's idle timeout
    max_json_values: int = 262_144  # counted before parsing: every ',' '[' '{' byte of the body
    max_json_depth: int = 128  # nested arrays and objects (orjson writes at most 254)
    max_messages: int = DEFAULT_BOUNDS.messages
    max_content_parts: int = DEFAULT_BOUNDS.parts  # over all messages
    max_text_chars: int = DEFAULT_BOUNDS.text_chars  # one text part or string content
    max_upstream_body_bytes: int = 512 * 1024 * 1024  # a body grown by image_embeds, as sent upstream

    @property
    def content_bounds(self) -> ContentBounds:
        return ContentBounds(self.max_messages, self.max_content_parts, self.max_text_chars)


@dataclass(frozen=True, slots=True)
class MediaConfig:
    allow_domains: tuple[str, ...] = ()
    allow_private_networks: bool = False
    fetch_timeout_s: float = 5.0
    max_image_bytes: int = 20 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class EncoderConfig:
    name: str
    kind: Literal["local", "http"]
    model: str = "builtin:vit-small"
    device: str = "auto"
    max_batch_size: int = 32
    max_batch_delay_ms: float = 0.0
    timeout_s: float = 30.0
    urls: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class Policy:
    """What to do with a modality a model does not accept."""

    action: Literal["reject", "strip", "redirect"]
    target: str | None = None  # the model to redirect to

    def __str__(self) -> str:
        return f"redirect to '{self.target}'" if self.action == "redirect" else self.action


REJECT = Policy("reject")


@dataclass(frozen=True, slots=True)
class ModelConfig:
    name: str
    upstreams: tuple[str, ...]
    accepts: tuple[Modality, ...]  # in Modality order
    upstream_model: str | None = None
    limits: Mapping[Modality, int] = field(default_factory=lambda: MappingProxyType({}))
    encode: Mapping[Modality, str] = field(default_factory=lambda: MappingProxyType({}))
    on_unsupported: Mapping[Modality, Policy] = field(default_factory=lambda: MappingProxyType({}))
    # when the encoder fails: 503 encoder_unavailable (fail), or send the original images (passthrough)
    on_encoder_error: Literal["fail", "passthrough"] = "fail"

    @property
    def upstream_name(self) -> str:
        return self.upstream_model or self.name

    def policy(self, modality: Modality) -> Policy:
        return self.on_unsupported.get(modality, REJECT)

    def accepts_text(self) -> str:
        return ", ".join(self.accepts)


@dataclass(frozen=True, slots=True)
class GatewayConfig:
    models: tuple[ModelConfig, ...]
    server: ServerConfig = ServerConfig()
    media: MediaConfig = MediaConfig()
    encoders: Mapping[str, EncoderConfig] = field(default_factory=lambda: MappingProxyType({}))
    version: int = SUPPORTED_VERSION
    source: str = "<memory>"
    _by_name: Mapping[str, ModelConfig] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_by_name", MappingProxyType({m.name: m for m in self.models}))

    def model(self, name: str) -> ModelConfig | None:
        return self._by_name.get(name)


def load_config(path: str | Path) -> GatewayConfig:
    """Read and validate a routing.yaml; raise ConfigError listing every problem."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError([ConfigProblem(str(path), 0, 0, "", f"cannot read file: {exc}")]) from None
    return parse_config(text, filename=str(path))


def parse_config(text: str, *, filename: str = "routing.yaml") -> GatewayConfig:
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        line, col = (mark.line + 1, mark.column + 1) if mark else (0, 0)
        message = f"invalid YAML: {exc.problem or exc.context}"
        raise ConfigError([ConfigProblem(filename, line, col, "", message)]) from None
    except yaml.YAMLError as exc:
        raise ConfigError([ConfigProblem(filename, 0, 0, "", f"invalid YAML: {exc}")]) from None
    parser = _Parser(filename)
    if node is None:
        parser.problem("", "the file is empty (expected a mapping with 'version' and 'models')")
        raise ConfigError(parser.problems)
    try:
        document = parser.to_python(node, "")
    except (_TooLarge, RecursionError) as exc:  # alias bombs, recursive aliases, absurd nesting
        what = str(exc) if isinstance(exc, _TooLarge) else "nesting too deep (a recursive alias?)"
        raise ConfigError([ConfigProblem(filename, 0, 0, "", f"cannot read this file: {what}")]) from None
    config = parser.config(document, source=filename)
    if config is not None and not parser.problems:
        _validate(config, parser)
    if parser.problems:
        # one problem per place: the first found says most (an unreadable value is also a wrong one)
        first = {(p.path, p.line, p.column): p for p in reversed(parser.problems)}
        kept = [p for p in parser.problems if first[(p.path, p.line, p.column)] is p]
        raise ConfigError(sorted(kept, key=lambda p: (p.line, p.column)))
    assert config is not None
    return config


# A routing table is a few thousand values at most; aliases can make a small file expand to billions.
MAX_VALUES = 200_000


class _TooLarge(Exception):
    pass


class _Missing:
    pass


MISSING: Any = _Missing()


class _Parser:
    """Turns YAML nodes into config objects, collecting problems with their locations."""

    def __init__(self, filename: str) -> None:
        self.filename = filename
        self.problems: list[ConfigProblem] = []
        self.value_marks: dict[str, yaml.Mark] = {}
        self.key_marks: dict[str, yaml.Mark] = {}
        self._scalars = yaml.SafeLoader("")
        self.values = 0

    # --- locations -------------------------------------------------------------------------

    def problem(self, path: str, message: str, *, at_key: bool = False, mark: yaml.Mark | None = None) -> None:
        mark = mark or (self.key_marks.get(path) if at_key else None) or self._nearest_mark(path)
        line, col = (mark.line + 1, mark.column + 1) if mark else (0, 0)
        self.problems.append(ConfigProblem(self.filename, line, col, path, message))

    def _nearest_mark(self, path: str) -> yaml.Mark | None:
        while True:
            if path in self.value_marks:
                return self.value_marks[path]
            if not path:
                return None
            cut = max(path.rfind("."), path.rfind("["))
            path = path[: max(cut, 0)]

    def to_python(self, node: yaml.Node, path: str) -> Any:
        self.values += 1
        if self.values > MAX_VALUES:
            raise _TooLarge(f"more than {MAX_VALUES} values (aliases that expand without end?)")
        self.value_marks[path] = node.start_mark
        if isinstance(node, yaml.SequenceNode):
            return [self.to_python(child, f"{path}[{i}]") for i, child in enumerate(node.value)]
        if isinstance(node, yaml.MappingNode):
            explicit, merged = self._pairs(node, path)
            result: dict[str, Any] = {}
            first_seen: dict[str, yaml.Mark] = {}
            for key_node, value_node, is_merged in [(k, v, False) for k, v in explicit] + [
                (k, v, True) for k, v in merged
            ]:
                key = self._construct_scalar(key_node, path) if isinstance(key_node, yaml.ScalarNode) else None
                if not isinstance(key, str):
                    self.problem(path, "mapping keys must be strings", mark=key_node.start_mark)
                    continue
                if key in first_seen:
                    if not is_merged:  # an explicit key overrides a merged one, as YAML says
                        line = first_seen[key].line + 1
                        self.problem(
                            _join(path, key), f"duplicate key '{key}' (first at line {line})", mark=key_node.start_mark
                        )
                    continue
                child = _join(path, key)
                self.key_marks.setdefault(child, key_node.start_mark)
                first_seen[key] = key_node.start_mark
                result[key] = self.to_python(value_node, child)
            return result
        return self._construct_scalar(node, path)

    def _pairs(
        self, node: yaml.MappingNode, path: str
    ) -> tuple[list[tuple[yaml.Node, yaml.Node]], list[tuple[yaml.Node, yaml.Node]]]:
        """A mapping's own key/value pairs, and those it merges in with ``<<`` (YAML merge keys)."""
        explicit: list[tuple[yaml.Node, yaml.Node]] = []
        merged: list[tuple[yaml.Node, yaml.Node]] = []
        for key_node, value_node in node.value:
            if key_node.tag != "tag:yaml.org,2002:merge":
                explicit.append((key_node, value_node))
                continue
            sources = value_node.value if isinstance(value_node, yaml.SequenceNode) else [value_node]
            for source in sources:
                if not isinstance(source, yaml.MappingNode):
                    self.problem(path, "'<<' merges a mapping or a list of mappings", mark=source.start_mark)
                    continue
                own, inherited = self._pairs(source, path)
                merged.extend(own + inherited)
        return explicit, merged

    def _construct_scalar(self, node: yaml.Node, path: str) -> Any:
        try:
            return self._scalars.construct_object(node)
        except yaml.YAMLError as exc:  # an unknown tag, a malformed timestamp, ...
            problem = getattr(exc, "problem", None) or str(exc)
            self.problem(path, f"cannot read this value: {problem}", mark=node.start_mark)
            return None

    # --- typed readers ---------------------------------------------------------------------

    def mapping(self, value: Any, path: str, allowed: tuple[str, ...], *, what: str) -> dict[str, Any] | None:
        if not isinstance(value, dict):
            self.problem(path, f"{what} must be a mapping, not {_kind(value)}")
            return None
        for key in value:
            if key not in allowed:
                self.problem(_join(path, key), _unknown(key, allowed, "key"), at_key=True)
        return value

    def string(self, value: Any, path: str, default: Any = MISSING) -> Any:
        if value is MISSING:
            return self._required(path, default)
        if not isinstance(value, str) or not value.strip():
            self.problem(path, f"must be a non-empty string, not {_kind(value)}")
            return default if default is not MISSING else None
        return value

    def integer(self, value: Any, path: str, default: int, *, minimum: int, maximum: int | None = None) -> int:
        if value is MISSING:
            return default
        if isinstance(value, bool) or not isinstance(value, int):
            self.problem(path, f"must be an integer, not {_kind(value)}")
            return default
        if value < minimum or (maximum is not None and value > maximum):
            bound = f"between {minimum} and {maximum}" if maximum is not None else f"at least {minimum}"
            self.problem(path, f"must be {bound}, not {value}")
            return default
        return value

    def number(self, value: Any, path: str, default: float, *, positive: bool = True) -> float:
        if value is MISSING:
            return default
        if isinstance(value, bool) or not isinstance(value, int | float) or not _finite(value):
            self.problem(path, f"must be a number, not {_kind(value)}")
            return default
        if value < 0 or (positive and value == 0):
            self.problem(path, f"must be {'greater than 0' if positive else 'at least 0'}, not {value}")
            return default
        return float(value)

    def boolean(self, value: Any, path: str, default: bool) -> bool:
        if value is MISSING:
            return default
        if not isinstance(value, bool):
            self.problem(path, f"must be true or false, not {_kind(value)}")
            return default
        return value

    def string_list(self, value: Any, path: str) -> list[tuple[str, str]]:
        """[(item, item_path)] of the string items; problems for the others."""
        if not isinstance(value, list):
            self.problem(path, f"must be a list, not {_kind(value)}")
            return []
        items = []
        for i, item in enumerate(value):
            if isinstance(item, str) and item.strip():
                items.append((item, f"{path}[{i}]"))
            else:
                self.problem(f"{path}[{i}]", f"must be a non-empty string, not {_kind(item)}")
        return items

    def url(self, value: str, path: str) -> str | None:
        try:
            parts = urlsplit(value)
        except ValueError as exc:  # e.g. a malformed IPv6 host
            self.problem(path, f"bad URL '{value}': {exc}")
            return None
        problem = None
        if parts.scheme not in ("http", "https"):
            problem = "must be an http:// or https:// URL"
        elif not parts.hostname:
            problem = "has no host"
        elif parts.query or parts.fragment:
            problem = "must not have a query or fragment (the request path is appended to it)"
        elif parts.username or parts.password:
            problem = "must not carry credentials"
        else:
            try:
                parts.port  # noqa: B018 - raises ValueError for a bad port
            except ValueError:
                problem = "has an invalid port"
        if problem:
            self.problem(path, f"bad URL '{value}': {problem}")
            return None
        return value.rstrip("/")

    def host_name(self, value: str, path: str) -> bool:
        if _HOST_NAME.fullmatch(value.rstrip(".")):
            return True
        self.problem(
            path,
            f"'{value}' is not a host name: write the domain alone, like images.example.com "
            "(no scheme, port, path or wildcard; its subdomains are allowed too)",
        )
        return False

    def tower(self, value: Any, path: str) -> str:
        """An encoder's model: a builtin name, or a directory on this machine."""
        default = "builtin:vit-small"
        model = self.string(value, path, default)
        if not isinstance(model, str):
            return default
        if model.startswith("builtin:"):
            if model not in BUILTIN_TOWERS:
                self.problem(path, _unknown(model, BUILTIN_TOWERS, "builtin tower"))
        elif not Path(model).is_dir():
            self.problem(
                path,
                f"'{model}' is not a directory on this machine (expected {', '.join(BUILTIN_TOWERS)} "
                "or a model directory)",
            )
        return model

    def modality(self, value: Any, path: str, *, at_key: bool = False) -> Modality | None:
        if isinstance(value, str) and value in MODALITY_NAMES:
            return Modality(value)
        self.problem(path, _unknown(value, MODALITY_NAMES, "modality"), at_key=at_key)
        return None

    def _required(self, path: str, default: Any) -> Any:
        if default is MISSING:
            self.problem(path, "is required")
            return None
        return default

    # --- sections --------------------------------------------------------------------------

    def config(self, doc: Any, *, source: str) -> GatewayConfig | None:
        top = self.mapping(doc, "", TOP_KEYS, what="the document")
        if top is None:
            return None
        version = top.get("version", MISSING)
        if version is MISSING:
            self.problem("version", "is required (the only version is 1)")
        elif version != SUPPORTED_VERSION or not isinstance(version, int) or isinstance(version, bool):
            self.problem("version", f"unsupported version {_show(version)} (the only version is 1)")
        server = self.server(top.get("server", {}))
        media = self.media(top.get("media", {}))
        encoders = self.encoders(top.get("encoders", {}))
        models = self.models(top.get("models", MISSING))
        return GatewayConfig(
            models=tuple(models),
            server=server,
            media=media,
            encoders=MappingProxyType(encoders),
            source=source,
        )

    def server(self, value: Any) -> ServerConfig:
        d = ServerConfig()
        raw = self.mapping(value, "server", SERVER_KEYS, what="server")
        if raw is None:
            return d

        def get(key: str) -> tuple[Any, str, Any]:
            return raw.get(key, MISSING), f"server.{key}", getattr(d, key)

        return ServerConfig(
            host=self.string(*get("host")),
            port=self.integer(*get("port"), minimum=0, maximum=65535),
            max_body_bytes=self.integer(*get("max_body_bytes"), minimum=1024),
            admin_token_env=self.string(*get("admin_token_env")),
            reload_interval_s=self.number(*get("reload_interval_s"), positive=False),
            upstream_connect_timeout_s=self.number(*get("upstream_connect_timeout_s")),
            upstream_read_timeout_s=self.number(*get("upstream_read_timeout_s")),
            upstream_cooldown_s=self.number(*get("upstream_cooldown_s"), positive=False),
            upstream_stream_idle_timeout_s=self.number(*get("upstream_stream_idle_timeout_s")),
            client_body_timeout_s=self.number(*get("client_body_timeout_s")),
            client_write_timeout_s=self.number(*get("client_write_timeout_s")),
            client_idle_timeout_s=self.number(*get("client_idle_timeout_s")),
            max_json_values=self.integer(*get("max_json_values"), minimum=16),
            max_json_depth=self.integer(*get("max_json_depth"), minimum=4, maximum=MAX_JSON_DEPTH),
            max_messages=self.integer(*get("max_messages"), minimum=1),
            max_content_parts=self.integer(*get("max_content_parts"), minimum=1),
            max_text_chars=self.integer(*get("max_text_chars"), minimum=1),
            max_upstream_body_bytes=self.integer(*get("max_upstream_body_bytes"), minimum=1024),
        )

    def media(self, value: Any) -> MediaConfig:
        d = MediaConfig()
        raw = self.mapping(value, "media", MEDIA_KEYS, what="media")
        if raw is None:
            return d

        def get(key: str) -> tuple[Any, str, Any]:
            return raw.get(key, MISSING), f"media.{key}", getattr(d, key)

        domains = [
            (d, where)
            for d, where in self.string_list(raw.get("allow_domains", []), "media.allow_domains")
            if self.host_name(d, where)
        ]
        return MediaConfig(
            allow_domains=tuple(d.lower() for d, _ in domains),
            allow_private_networks=self.boolean(*get("allow_private_networks")),
            fetch_timeout_s=self.number(*get("fetch_timeout_s")),
            max_image_bytes=self.integer(*get("max_image_bytes"), minimum=1),
        )

    def encoders(self, value: Any) -> dict[str, EncoderConfig]:
        if not isinstance(value, dict):
            self.problem("encoders", f"encoders must be a mapping of name to encoder, not {_kind(value)}")
            return {}
        result = {}
        for name, raw in value.items():
            encoder = self.encoder(name, raw, f"encoders.{name}")
            if encoder is not None:
                result[name] = encoder
        return result

    def encoder(self, name: str, value: Any, path: str) -> EncoderConfig | None:
        if not isinstance(value, dict):
            self.problem(path, f"an encoder must be a mapping, not {_kind(value)}")
            return None
        kind = value.get("kind", MISSING)
        if kind is MISSING:
            self.problem(path, "'kind' is required (local or http)")
            return None
        if not isinstance(kind, str) or kind not in ENCODER_KEYS:
            self.problem(f"{path}.kind", _unknown(kind, tuple(ENCODER_KEYS), "encoder kind"))
            return None
        raw = self.mapping(value, path, ENCODER_KEYS[kind], what="an encoder")
        assert raw is not None
        d = EncoderConfig(name, "local")
        timeout = self.number(raw.get("timeout_s", MISSING), f"{path}.timeout_s", d.timeout_s)
        if kind == "http":
            urls = self.url_list(
                raw.get("urls", MISSING),
                f"{path}.urls",
                missing=(path, "'urls' is required for an http encoder"),
                empty="must list at least one URL",
                what="encoder URL",
            )
            return EncoderConfig(name, "http", timeout_s=timeout, urls=tuple(urls))

        def get(key: str) -> tuple[Any, str, Any]:
            return raw.get(key, MISSING), f"{path}.{key}", getattr(d, key)

        return EncoderConfig(
            name,
            "local",
            model=self.tower(raw.get("model", MISSING), f"{path}.model") if "model" in raw else d.model,
            device=self.device(raw.get("device", MISSING), f"{path}.device"),
            max_batch_size=self.integer(*get("max_batch_size"), minimum=1),
            max_batch_delay_ms=self.number(*get("max_batch_delay_ms"), positive=False),
            timeout_s=timeout,
        )

    def device(self, value: Any, path: str) -> str:
        if value is MISSING:
            return "auto"
        if isinstance(value, str) and (
            value in ("auto", "cpu", "cuda") or (value.startswith("cuda:") and value[5:].isdigit())
        ):
            return value
        self.problem(path, f"unknown device {_show(value)} (expected auto, cpu, cuda or cuda:N)")
        return "auto"

    def models(self, value: Any) -> list[ModelConfig]:
        if value is MISSING:
            self.problem("models", "is required: list at least one model")
            return []
        if value == []:
            self.problem("models", "must list at least one model")
            return []
        if not isinstance(value, list):
            self.problem("models", f"must be a list of models, not {_kind(value)}")
            return []
        return [m for i, raw in enumerate(value) if (m := self.model(raw, f"models[{i}]")) is not None]

    def model(self, value: Any, path: str) -> ModelConfig | None:
        raw = self.mapping(value, path, MODEL_KEYS, what="a model")
        if raw is None:
            return None
        name = self.string(raw.get("name", MISSING), f"{path}.name")
        upstreams = self.upstreams(raw.get("upstreams", MISSING), f"{path}.upstreams")
        accepts = self.accepts(raw.get("accepts", MISSING), f"{path}.accepts")
        upstream_model = raw.get("upstream_model", MISSING)
        upstream_model = None if upstream_model is MISSING else self.string(upstream_model, f"{path}.upstream_model")
        limits = self.modality_map(raw.get("limits", {}), f"{path}.limits", self.limit)
        encode = self.modality_map(raw.get("encode", {}), f"{path}.encode", self.string)
        policies = self.modality_map(raw.get("on_unsupported", {}), f"{path}.on_unsupported", self.policy)
        if Modality.IMAGE in encode and Modality.IMAGE in (accepts or ()):
            limits.setdefault(Modality.IMAGE, DEFAULT_ENCODE_IMAGE_LIMIT)
        on_encoder_error = raw.get("on_encoder_error", "fail")
        if on_encoder_error not in ENCODER_ERROR_ACTIONS:
            self.problem(f"{path}.on_encoder_error", _unknown(on_encoder_error, ENCODER_ERROR_ACTIONS, "action"))
            on_encoder_error = "fail"
        if name is None or accepts is None:
            return None
        return ModelConfig(
            name=name,
            upstreams=tuple(upstreams),
            accepts=accepts,
            upstream_model=upstream_model,
            limits=MappingProxyType(limits),
            encode=MappingProxyType(encode),
            on_unsupported=MappingProxyType(policies),
            on_encoder_error=on_encoder_error,
        )

    def upstreams(self, value: Any, path: str) -> list[str]:
        return self.url_list(
            value,
            path,
            missing=(path, "is required: list the model's OpenAI-compatible servers"),
            empty="must list at least one upstream URL",
            what="upstream",
        )

    def url_list(self, value: Any, path: str, *, missing: tuple[str, str], empty: str, what: str) -> list[str]:
        if value is MISSING:
            self.problem(*missing)
            return []
        items = self.string_list(value, path)
        if isinstance(value, list) and not value:
            self.problem(path, empty)
        urls: list[str] = []
        for item, item_path in items:
            url = self.url(item, item_path)
            if url is None:
                continue
            if url in urls:
                self.problem(item_path, f"duplicate {what} '{item}'")
            else:
                urls.append(url)
        return urls

    def accepts(self, value: Any, path: str) -> tuple[Modality, ...] | None:
        if value is MISSING:
            self.problem(path, f"is required: list the modalities the model takes ({', '.join(MODALITY_NAMES)})")
            return None
        if value == []:
            self.problem(path, "must list at least one modality")
            return None
        if not isinstance(value, list):
            self.problem(path, f"must be a list of modalities, not {_kind(value)}")
            return None
        seen: list[Modality] = []
        for i, item in enumerate(value):
            m = self.modality(item, f"{path}[{i}]")
            if m is None:
                continue
            if m in seen:
                self.problem(f"{path}[{i}]", f"modality '{m}' is listed twice")
            seen.append(m)
        if seen and Modality.TEXT not in seen:
            self.problem(path, "must include 'text' (every chat request carries text)")
        return tuple(m for m in Modality if m in seen)

    def modality_map(self, value: Any, path: str, read: Any) -> dict[Modality, Any]:
        if not isinstance(value, dict):
            self.problem(path, f"must be a mapping of modality to value, not {_kind(value)}")
            return {}
        result = {}
        for key, item in value.items():
            m = self.modality(key, _join(path, key), at_key=True)
            parsed = read(item, _join(path, key))
            if m is not None and parsed is not None:
                result[m] = parsed
        return result

    def limit(self, value: Any, path: str) -> int | None:
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            self.problem(path, f"must be a whole number of items (0 or more), not {_show(value)}")
            return None
        return value

    def policy(self, value: Any, path: str) -> Policy | None:
        if isinstance(value, str) and value in POLICY_ACTIONS:
            return Policy(value)  # type: ignore[arg-type]
        if isinstance(value, dict) and set(value) == {"redirect"}:
            target = self.string(value["redirect"], f"{path}.redirect")
            return Policy("redirect", target) if target else None
        if isinstance(value, dict) and value:
            for key in value:
                if key != "redirect":
                    self.problem(_join(path, key), _unknown(key, ("redirect",), "key"), at_key=True)
            return None
        self.problem(path, f"unknown policy {_show(value)} (expected reject, strip, or {{redirect: MODEL}})")
        return None


def _validate(config: GatewayConfig, p: _Parser) -> None:
    """Checks that span sections: names, redirects, encoders, limits."""
    first: dict[str, int] = {}
    for i, model in enumerate(config.models):
        path = f"models[{i}]"
        if model.name in first:
            line = p.value_marks[f"models[{first[model.name]}].name"].line + 1
            p.problem(f"{path}.name", f"duplicate model name '{model.name}' (first defined at line {line})")
        else:
            first[model.name] = i
        for m in model.limits:
            if m not in model.accepts:
                p.problem(f"{path}.limits.{m}", f"a limit for '{m}', which the model does not accept", at_key=True)
        for m, encoder in model.encode.items():
            where = f"{path}.encode.{m}"
            if m not in ENCODABLE:
                p.problem(where, f"only {', '.join(ENCODABLE)} parts can be encoded, not '{m}'", at_key=True)
            elif m not in model.accepts:
                p.problem(where, f"encodes '{m}', which the model does not accept", at_key=True)
            if encoder not in config.encoders:
                known = ", ".join(config.encoders) or "none defined"
                p.problem(where, f"unknown encoder '{encoder}' (encoders: {known})")
        if model.on_encoder_error != "fail" and not model.encode:
            p.problem(f"{path}.on_encoder_error", "applies only to a model with 'encode'", at_key=True)
        for m, policy in model.on_unsupported.items():
            where = f"{path}.on_unsupported.{m}"
            if m in model.accepts:
                p.problem(where, f"'{m}' is accepted by this model, so this policy would never apply", at_key=True)
                continue
            if policy.action != "redirect":
                continue
            target = config.model(policy.target or "")
            if policy.target == model.name:
                p.problem(f"{where}.redirect", f"model '{model.name}' redirects to itself")
            elif target is None:
                names = ", ".join(mm.name for mm in config.models)
                p.problem(f"{where}.redirect", f"redirect target '{policy.target}' is not a model here ({names})")
            elif m not in target.accepts:
                p.problem(
                    f"{where}.redirect",
                    f"redirect target '{target.name}' does not accept '{m}' (it accepts: {target.accepts_text()})",
                )
    if not p.problems:
        _check_redirect_loops(config, p)


def _check_redirect_loops(config: GatewayConfig, p: _Parser) -> None:
    """A request carrying several modalities may follow redirects of different modalities, so any
    cycle in the redirect graph can loop."""
    index = {m.name: i for i, m in enumerate(config.models)}
    state: dict[str, int] = {}  # 1 on the stack, 2 done
    reported: set[frozenset[str]] = set()

    def edges(model: ModelConfig) -> Iterator[tuple[Modality, str]]:
        for m, policy in model.on_unsupported.items():
            if policy.action == "redirect" and policy.target:
                yield m, policy.target

    def report(cycle: list[tuple[str, Modality]], target: str) -> None:
        key = frozenset(n for n, _ in cycle)
        if key in reported:
            return
        reported.add(key)
        route = " ".join(f"'{n}' -({mm})->" for n, mm in cycle) + f" '{target}'"
        first_name, first_modality = cycle[0]
        p.problem(f"models[{index[first_name]}].on_unsupported.{first_modality}.redirect", f"redirect loop: {route}")

    # An iterative depth-first search: a chain of thousands of redirects is valid and must not
    # exhaust Python's recursion limit. ``trail`` holds the (model, modality) edges taken so far.
    for root in config.models:
        if root.name in state:
            continue
        state[root.name] = 1
        trail: list[tuple[str, Modality]] = []
        stack: list[tuple[str, Iterator[tuple[Modality, str]]]] = [(root.name, edges(root))]
        while stack:
            name, pending = stack[-1]
            step = next(pending, None)
            if step is None:
                state[name] = 2
                stack.pop()
                if trail:
                    trail.pop()
                continue
            m, target = step
            if state.get(target) == 1:
                path = [*trail, (name, m)]
                start = next(k for k, (n, _) in enumerate(path) if n == target)
                report(path[start:], target)
            elif target not in state:
                state[target] = 1
                trail.append((name, m))
                stack.append((target, edges(config.models[index[target]])))


def _finite(value: float) -> bool:
    try:
        return math.isfinite(value)
    except OverflowError:  # an int too large for a float
        return False


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _kind(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return f"boolean {str(value).lower()}"
    if isinstance(value, dict):
        return "a mapping"
    if isinstance(value, list):
        return "a list"
    if isinstance(value, str):
        return f"string {value!r}"
    return f"{type(value).__name__} {value!r}"


def _show(value: Any) -> str:
    """A value as YAML would write it, for messages."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, dict | list):
        return ("{}" if isinstance(value, dict) else "[]") if not value else _kind(value)
    return repr(value)


def _unknown(value: Any, allowed: tuple[str, ...], what: str) -> str:
    message = f"unknown {what} {_show(value)} (expected one of: {', '.join(allowed)})"
    if isinstance(value, str):
        close = difflib.get_close_matches(value, allowed, n=1)
        if close:
            message += f"; did you mean '{close[0]}'?"
    return message

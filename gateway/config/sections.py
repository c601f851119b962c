"""The sections of routing.yaml, each read by one method into its frozen type."""

from __future__ import annotations

import urllib.parse
from collections.abc import Callable
from types import MappingProxyType
from typing import Any

from ..modalities import MODALITY_NAMES, Modality
from .auth import AuthReaders
from .engines import DEFAULT_ENGINE, ENGINES
from .keys import (
    API_NAMES,
    DEFAULT_APIS,
    DEFAULT_DESCRIBE_PROMPT,
    DEFAULT_ENCODE_IMAGE_LIMIT,
    DESCRIBE_ERRORS,
    DESCRIBE_KEYS,
    ENCODER_ERROR_ACTIONS,
    ENCODER_KEYS,
    EXTRACT_KEYS,
    EXTRACT_OPTIONS,
    FRAMES_KEYS,
    HISTORY_ACTIONS,
    LIMITS_STORE_KEYS,
    LIMITS_STORE_SCHEMES,
    MAX_JSON_DEPTH,
    MEDIA_KEYS,
    MODEL_KEYS,
    POLICY_ACTIONS,
    SERVER_KEYS,
    SUPPORTED_VERSION,
    TOP_KEYS,
    TRACING_KEYS,
    TRANSCRIBE_KEYS,
    UPSTREAM_CLIENTS,
    VISUAL_LIMITS,
)
from .loader import MISSING, join_path
from .outputs import OutputReaders
from .pools import PoolReaders
from .readers import describe, fields, show, unknown_message
from .types import (
    EncoderConfig,
    GatewayConfig,
    LimitsStoreConfig,
    MediaConfig,
    ModelConfig,
    Policy,
    ServerConfig,
    TracingConfig,
)
from .visual import VisualReaders


class Parser(PoolReaders, AuthReaders, VisualReaders, OutputReaders):
    """Turns YAML nodes into config objects, collecting problems with their locations."""

    # --- sections --------------------------------------------------------------------------

    def config(self, doc: Any, *, source: str, sha256: str = "") -> GatewayConfig | None:
        top = self.mapping(doc, "", TOP_KEYS, what="the document")
        if top is None:
            return None
        version = top.get("version", MISSING)
        if version is MISSING:
            self.problem("version", "is required (the only version is 1)")
        elif version != SUPPORTED_VERSION or not isinstance(version, int) or isinstance(version, bool):
            self.problem("version", f"unsupported version {show(version)} (the only version is 1)")
        server = self.server(top.get("server", {}))
        media = self.media(top.get("media", {}))
        encoders = self.encoders(top.get("encoders", {}))
        auth = self.auth(top["auth"]) if "auth" in top else None
        models = self.models(top.get("models", MISSING), server)
        return GatewayConfig(
            models=tuple(models),
            server=server,
            media=media,
            encoders=MappingProxyType(encoders),
            auth=auth,
            source=source,
            sha256=sha256,
        )

    def server(self, value: Any) -> ServerConfig:
        get = self._section(value, "server", SERVER_KEYS, ServerConfig())
        if get is None:
            return ServerConfig()
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
            drain_grace_s=self.number(*get("drain_grace_s"), positive=False),
            drain_timeout_s=self.number(*get("drain_timeout_s"), positive=False),
            admin_listen=self.listen_address(*get("admin_listen")),
            access_log=self.boolean(*get("access_log")),
            forward_client_credentials=self.boolean(*get("forward_client_credentials")),
            upstream_client=self.upstream_client(*get("upstream_client")),
            limits_store=self.limits_store(*get("limits_store")),
            tracing=self.tracing(*get("tracing")),
        )

    def tracing(self, value: Any, path: str, default: None) -> TracingConfig | None:
        raw = self.optional_mapping(value, path, TRACING_KEYS, "tracing")
        if raw is None:
            return None
        endpoint = self.string(raw.get("otlp_endpoint", MISSING), f"{path}.otlp_endpoint")
        if endpoint is not None:  # http(s), a host, a valid port, no query and no credentials (shown in /admin/config)
            endpoint = self.url(endpoint, f"{path}.otlp_endpoint")
        get = fields(raw, path, TracingConfig(""))
        ratio, ratio_path, default_ratio = get("sample_ratio")
        sample_ratio = self.number(ratio, ratio_path, default_ratio, positive=False)
        if not 0.0 <= sample_ratio <= 1.0:
            self.problem(ratio_path, f"must be between 0 and 1, not {sample_ratio:g}")
            sample_ratio = default_ratio
        service = self.string(raw.get("service_name", "modality-gateway"), f"{path}.service_name")
        trust = self.boolean(*get("trust_client_sampling"))
        if endpoint is None:
            return None
        return TracingConfig(endpoint, sample_ratio, service or "modality-gateway", trust)

    def limits_store(self, value: Any, path: str, default: None) -> LimitsStoreConfig | None:
        raw = self.optional_mapping(value, path, LIMITS_STORE_KEYS, "limits_store")
        if raw is None:
            return None
        url = self.string(raw.get("url", MISSING), f"{path}.url")
        try:
            scheme = urllib.parse.urlsplit(url).scheme if url is not None else None
        except ValueError:  # e.g. a malformed IPv6 host
            scheme = ""
        if url is not None and scheme not in LIMITS_STORE_SCHEMES:
            self.problem(f"{path}.url", f"must be a redis://, rediss:// or unix:// URL, not {url!r}")
            url = None
        get = fields(raw, path, LimitsStoreConfig(""))
        timeout = self.number(*get("timeout_ms"))
        on_failure = raw.get("on_failure", "open")
        if on_failure not in ("open", "closed"):
            self.problem(f"{path}.on_failure", f"must be open or closed, not {describe(on_failure)}")
            on_failure = "open"
        return None if url is None else LimitsStoreConfig(url, timeout, on_failure)

    def upstream_client(self, value: Any, path: str, default: str) -> Any:
        if value == "aiohttp":
            self.problem(path, "aiohttp's client is no longer an upstream client: the gateway's own HTTP/1.1 client "
                               "is the one (drop the key, or say http1)")  # fmt: skip
            return default
        return self.choice(value, path, UPSTREAM_CLIENTS, "client", default)

    def media(self, value: Any) -> MediaConfig:
        get = self._section(value, "media", MEDIA_KEYS, MediaConfig())
        if get is None:
            return MediaConfig()
        raw_domains, where_domains, _ = get("allow_domains")
        listed = self.string_list([] if raw_domains is MISSING else raw_domains, where_domains)
        domains = [(d, where) for d, where in listed if self.host_name(d, where)]
        return MediaConfig(
            allow_domains=tuple(d.lower() for d, _ in domains),
            allow_private_networks=self.boolean(*get("allow_private_networks")),
            fetch_timeout_s=self.number(*get("fetch_timeout_s")),
            max_image_bytes=self.integer(*get("max_image_bytes"), minimum=1),
            max_video_bytes=self.integer(*get("max_video_bytes"), minimum=1),
            max_audio_bytes=self.integer(*get("max_audio_bytes"), minimum=1),
            max_file_bytes=self.integer(*get("max_file_bytes"), minimum=1),
            cache_bytes=self.integer(*get("cache_bytes"), minimum=0),
        )

    def _section(
        self, value: Any, name: str, keys: tuple[str, ...], defaults: object
    ) -> Callable[[str], tuple[Any, str, Any]] | None:
        """The field reader of a top-level section, or None when it is not a mapping (said so)."""
        raw = self.mapping(value, name, keys, what=name)
        return None if raw is None else fields(raw, name, defaults)

    def encoders(self, value: Any) -> dict[str, EncoderConfig]:
        if not isinstance(value, dict):
            self.problem("encoders", f"encoders must be a mapping of name to encoder, not {describe(value)}")
            return {}
        result = {}
        for name, raw in value.items():
            encoder = self.encoder(name, raw, f"encoders.{name}")
            if encoder is not None:
                result[name] = encoder
        return result

    def encoder(self, name: str, value: Any, path: str) -> EncoderConfig | None:
        if not isinstance(value, dict):
            self.problem(path, f"an encoder must be a mapping, not {describe(value)}")
            return None
        kind = value.get("kind", MISSING)
        if kind is MISSING:
            self.problem(path, "'kind' is required (local, http or vllm)")
            return None
        if not isinstance(kind, str) or kind not in ENCODER_KEYS:
            self.problem(f"{path}.kind", unknown_message(kind, tuple(ENCODER_KEYS), "encoder kind"))
            return None
        raw = self.mapping(value, path, ENCODER_KEYS[kind], what="an encoder")
        assert raw is not None
        d = EncoderConfig(name, "local")
        timeout = self.number(raw.get("timeout_s", MISSING), f"{path}.timeout_s", d.timeout_s)
        if kind in ("http", "vllm"):
            urls = self.url_list(
                raw.get("urls", MISSING),
                f"{path}.urls",
                missing=(path, f"'urls' is required for {'an http' if kind == 'http' else 'a vllm'} encoder"),
                empty="must list at least one URL",
                what="encoder URL",
            )
            if kind == "http":
                return EncoderConfig(name, "http", timeout_s=timeout, urls=tuple(urls))
            batch = self.integer(raw.get("max_batch_size", MISSING), f"{path}.max_batch_size", 8, minimum=1)
            return EncoderConfig(name, "vllm", timeout_s=timeout, urls=tuple(urls), max_batch_size=batch)

        get = fields(raw, path, d)

        return EncoderConfig(
            name,
            "local",
            model=self.tower(raw.get("model", MISSING), f"{path}.model") if "model" in raw else d.model,
            device=self.device(raw.get("device", MISSING), f"{path}.device"),
            max_batch_size=self.integer(*get("max_batch_size"), minimum=1),
            max_batch_delay_ms=self.number(*get("max_batch_delay_ms"), positive=False),
            timeout_s=timeout,
            port=self.integer(*get("port"), minimum=0, maximum=65535),
        )

    def device(self, value: Any, path: str) -> str:
        if value is MISSING:
            return "auto"
        if isinstance(value, str) and (
            value in ("auto", "cpu", "cuda") or (value.startswith("cuda:") and value[5:].isdigit())
        ):
            return value
        self.problem(path, f"unknown device {show(value)} (expected auto, cpu, cuda or cuda:N)")
        return "auto"

    def models(self, value: Any, server: ServerConfig) -> list[ModelConfig]:
        if value is MISSING:
            self.problem("models", "is required: list at least one model")
            return []
        if value == []:
            self.problem("models", "must list at least one model")
            return []
        if not isinstance(value, list):
            self.problem("models", f"must be a list of models, not {describe(value)}")
            return []
        return [m for i, raw in enumerate(value) if (m := self.model(raw, f"models[{i}]", server)) is not None]

    def model(self, value: Any, path: str, server: ServerConfig) -> ModelConfig | None:
        raw = self.mapping(value, path, MODEL_KEYS, what="a model")
        if raw is None:
            return None
        name = self.string(raw.get("name", MISSING), f"{path}.name")
        upstreams, weights = self.upstreams(raw.get("upstreams", MISSING), f"{path}.upstreams")
        pool = self.pool(raw, path, server)
        accepts = self.accepts(raw.get("accepts", MISSING), f"{path}.accepts")
        apis = self.apis(raw.get("apis", MISSING), f"{path}.apis")
        upstream_model = raw.get("upstream_model", MISSING)
        upstream_model = None if upstream_model is MISSING else self.string(upstream_model, f"{path}.upstream_model")
        visual = self.visual(raw, path)
        limits = raw.get("limits", {})
        if isinstance(limits, dict):
            limits = {k: v for k, v in limits.items() if k not in VISUAL_LIMITS}
        limits = self.modality_map(limits, f"{path}.limits", self.limit)
        raw_encode = raw.get("encode", {})
        min_images = 1
        if isinstance(raw_encode, dict) and "min_images" in raw_encode:
            raw_encode = dict(raw_encode)
            min_images = self.integer(raw_encode.pop("min_images"), f"{path}.encode.min_images", 1, minimum=1)
            if Modality.IMAGE not in raw_encode:
                self.problem(f"{path}.encode.min_images", "min_images needs an image encoder (encode: {image: NAME})")
        encode = self.modality_map(raw_encode, f"{path}.encode", self.string)
        policies = self.modality_map(raw.get("on_unsupported", {}), f"{path}.on_unsupported", self.policy)
        if Modality.IMAGE in encode and Modality.IMAGE in (accepts or ()):
            limits.setdefault(Modality.IMAGE, DEFAULT_ENCODE_IMAGE_LIMIT)
        video_sample = self.video_sample(raw.get("video", MISSING), f"{path}.video")
        if video_sample is not None and Modality.VIDEO not in (accepts or ()):
            self.problem(
                f"{path}.video", "video.sample is for a model that accepts video (see on_unsupported for others)"
            )
        engine = raw.get("engine", DEFAULT_ENGINE)
        if engine not in ENGINES:
            self.problem(f"{path}.engine", unknown_message(engine, ENGINES, "engine"))
            engine = DEFAULT_ENGINE
        on_encoder_error = raw.get("on_encoder_error", "fail")
        if on_encoder_error not in ENCODER_ERROR_ACTIONS:
            self.problem(f"{path}.on_encoder_error", unknown_message(on_encoder_error, ENCODER_ERROR_ACTIONS, "action"))
            on_encoder_error = "fail"
        made = self.outputs(raw, path)
        outputs = self.modality_map(
            raw.get("on_unsupported_output", {}), f"{path}.on_unsupported_output", self.output_policy
        )
        if name is None or accepts is None:
            return None
        return ModelConfig(
            on_unsupported_output=MappingProxyType(outputs),
            name=name,
            upstreams=tuple(upstreams),
            accepts=accepts,
            apis=apis,
            upstream_model=upstream_model,
            engine=engine,
            limits=MappingProxyType(limits),
            encode=MappingProxyType(encode),
            on_unsupported=MappingProxyType(policies),
            on_encoder_error=on_encoder_error,
            encode_min_images=min_images,
            video_sample=video_sample,
            weights=weights if any(w != 1 for w in weights) else (),
            **pool,
            **visual,
            **made,
        )

    def apis(self, value: Any, path: str) -> tuple[str, ...]:
        if value is MISSING:
            return DEFAULT_APIS
        if not isinstance(value, list) or not value:
            self.problem(path, f"must be a non-empty list of APIs ({', '.join(API_NAMES)}), not {describe(value)}")
            return DEFAULT_APIS
        seen: list[str] = []
        for i, item in enumerate(value):
            if item not in API_NAMES:
                self.problem(f"{path}[{i}]", unknown_message(item, API_NAMES, "API"))
            elif item in seen:
                self.problem(f"{path}[{i}]", f"API '{item}' is listed twice")
            else:
                seen.append(item)
        return tuple(a for a in API_NAMES if a in seen)

    def accepts(self, value: Any, path: str) -> tuple[Modality, ...] | None:
        if value is MISSING:
            self.problem(path, f"is required: list the modalities the model takes ({', '.join(MODALITY_NAMES)})")
            return None
        if value == []:
            self.problem(path, "must list at least one modality")
            return None
        if not isinstance(value, list):
            self.problem(path, f"must be a list of modalities, not {describe(value)}")
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
            self.problem(path, f"must be a mapping of modality to value, not {describe(value)}")
            return {}
        result = {}
        for key, item in value.items():
            m = self.modality(key, join_path(path, key), at_key=True)
            parsed = read(item, join_path(path, key))
            if m is not None and parsed is not None:
                result[m] = parsed
        return result

    def limit(self, value: Any, path: str) -> int | None:
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            self.problem(path, f"must be a whole number of items (0 or more), not {show(value)}")
            return None
        return value

    def video_sample(self, value: Any, path: str) -> Policy | None:
        """``video: {sample: {frames: N, fps, max_side}}``."""
        if value is MISSING:
            return None
        if not isinstance(value, dict) or set(value) != {"sample"}:
            self.problem(path, f"must be {{sample: {{frames: N}}}}, not {show(value)}")
            return None
        sample = value["sample"]
        if not isinstance(sample, dict) or "frames" not in sample or not set(sample) <= set(FRAMES_KEYS[:3]):
            self.problem(
                f"{path}.sample", f"must be {{frames: N, fps: F, max_side: PX}} (frames required), not {show(sample)}"
            )
            return None
        policy = self.policy(dict(sample), f"{path}.sample")
        return policy if policy is not None and policy.action == "frames" else None

    def policy(self, value: Any, path: str) -> Policy | None:
        if isinstance(value, str) and value in POLICY_ACTIONS:
            return Policy(value)  # type: ignore[arg-type]
        if isinstance(value, dict) and set(value) == {"history"}:
            # reject in the newest turn; the earlier turns' parts as history says (an agent's session)
            history = self.choice(value["history"], f"{path}.history", HISTORY_ACTIONS, "action", "strip")
            return Policy("reject", history=history)  # type: ignore[arg-type]
        if isinstance(value, dict) and set(value) == {"redirect"}:
            target = self.string(value["redirect"], f"{path}.redirect")
            return Policy("redirect", target) if target else None
        if isinstance(value, dict) and "transcribe" in value and set(value) <= set(TRANSCRIBE_KEYS):
            target = self.string(value["transcribe"], f"{path}.transcribe")
            on_error = value.get("on_error", "fail")
            if on_error not in ("fail", "reject"):
                self.problem(f"{path}.on_error", unknown_message(on_error, ("fail", "reject"), "action"))
                return None
            return Policy("transcribe", target, on_error) if target else None
        if isinstance(value, dict) and "describe" in value and set(value) <= set(DESCRIBE_KEYS):
            target = self.string(value["describe"], f"{path}.describe")
            on_error = self.choice(
                value.get("on_error", MISSING), f"{path}.on_error", DESCRIBE_ERRORS, "action", "fail"
            )
            prompt = self.string(value.get("prompt", DEFAULT_DESCRIBE_PROMPT), f"{path}.prompt")
            most = self.integer(value.get("max_images", MISSING), f"{path}.max_images", 8, minimum=1, maximum=64)
            if target is None or prompt is None:
                return None
            return Policy("describe", target, on_error, prompt=prompt, max_images=most)  # type: ignore[arg-type]
        if isinstance(value, dict) and "extract" in value and set(value) <= set(EXTRACT_KEYS):
            return self._extract(value, path)
        if isinstance(value, dict) and "frames" in value and set(value) <= set(FRAMES_KEYS):
            frames = self.integer(value["frames"], f"{path}.frames", 8, minimum=1, maximum=64)
            fps = value.get("fps")
            if fps is not None:
                fps = self.number(fps, f"{path}.fps", 1.0)
            max_side = self.integer(value.get("max_side", 768), f"{path}.max_side", 768, minimum=16, maximum=4096)
            timestamps = self.boolean(value.get("timestamps", True), f"{path}.timestamps", True)
            return Policy("frames", frames=frames, fps=fps, max_side=max_side, timestamps=timestamps)
        if isinstance(value, dict) and value:
            allowed = (
                TRANSCRIBE_KEYS
                if "transcribe" in value
                else DESCRIBE_KEYS
                if "describe" in value
                else FRAMES_KEYS
                if "frames" in value
                else EXTRACT_KEYS
                if "extract" in value
                else ("redirect",)
            )
            for key in value:
                if key not in allowed:
                    self.problem(join_path(path, key), unknown_message(key, allowed, "key"), at_key=True)
            return None
        self.problem(
            path,
            f"unknown policy {show(value)} (expected reject, strip, {{history: strip}}, {{redirect: MODEL}}, "
            "{transcribe: MODEL}, {describe: MODEL}, {frames: N} or {extract: {max_pages: N}})",
        )
        return None

    def _extract(self, value: dict[str, Any], path: str) -> Policy | None:
        """``{extract: {max_pages, timeout_s, page_images, dpi}, max_files}`` (``extract: {}`` takes
        the defaults)."""
        options = value["extract"] if value["extract"] is not None else {}
        if not isinstance(options, dict):
            self.problem(f"{path}.extract", f"must be a mapping {{max_pages: N, timeout_s: S}}, not {show(options)}")
            return None
        for key in options:
            if key not in EXTRACT_OPTIONS:
                self.problem(
                    join_path(f"{path}.extract", key), unknown_message(key, EXTRACT_OPTIONS, "key"), at_key=True
                )
        pages = self.integer(
            options.get("max_pages", MISSING), f"{path}.extract.max_pages", 20, minimum=1, maximum=1000
        )
        timeout = self.number(options.get("timeout_s", MISSING), f"{path}.extract.timeout_s", 10.0)
        if timeout > 300:
            self.problem(f"{path}.extract.timeout_s", f"must be at most 300 seconds, not {timeout:g}")
        images = self.boolean(options.get("page_images", MISSING), f"{path}.extract.page_images", False)
        dpi = self.integer(options.get("dpi", MISSING), f"{path}.extract.dpi", 100, minimum=36, maximum=300)
        files = self.integer(value.get("max_files", MISSING), f"{path}.max_files", 8, minimum=1, maximum=64)
        return Policy("extract", max_files=files, max_pages=pages, timeout_s=timeout, page_images=images, dpi=dpi)

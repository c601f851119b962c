"""What routing.yaml may say: its version, its sections' keys, the values some keys take, and the
limits the gateway holds every config to (gateway.config.types makes the frozen config of them)."""

from __future__ import annotations

import re

from ..modalities import Modality

SUPPORTED_VERSION = 1
ENCODABLE = (Modality.IMAGE,)
BUILTIN_TOWERS = ("builtin:vit-small",)  # as backends/vision_encoder/towers knows them
ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
HOST_NAME = re.compile(
    r"(?=.{1,253}$)([a-z0-9_]([a-z0-9_-]{0,61}[a-z0-9_])?)(\.[a-z0-9_]([a-z0-9_-]{0,61}[a-z0-9_])?)*", re.I
)

# Keys per section: the parser and docs/routing.schema.json must agree (tests/config/test_schema.py).
TOP_KEYS = ("version", "server", "media", "encoders", "auth", "models")
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
    "drain_grace_s",
    "drain_timeout_s",
    "admin_listen",
    "access_log",
    "forward_client_credentials",
    "upstream_client",
    "limits_store",
    "tracing",
)
TRACING_KEYS = ("otlp_endpoint", "sample_ratio", "service_name", "trust_client_sampling")
LIMITS_STORE_KEYS = ("url", "timeout_ms", "on_failure")
LIMITS_STORE_SCHEMES = ("redis", "rediss", "unix")
# the keys of an on_unsupported policy written as a mapping (video: {sample: ...} takes the first
# three of FRAMES_KEYS)
TRANSCRIBE_KEYS = ("transcribe", "on_error")
DESCRIBE_KEYS = ("describe", "prompt", "on_error", "max_images")
DESCRIBE_ERRORS = ("fail", "reject", "strip")  # describe's on_error
DEFAULT_DESCRIBE_PROMPT = "Describe the image for someone who cannot see it."
FRAMES_KEYS = ("frames", "fps", "max_side", "timestamps")
EXTRACT_KEYS = ("extract", "max_files")  # file: {extract: {...}, max_files: N}
EXTRACT_OPTIONS = ("max_pages", "timeout_s", "page_images", "dpi")  # what extract: {...} holds
MEDIA_KEYS = (
    "allow_domains",
    "allow_private_networks",
    "fetch_timeout_s",
    "max_image_bytes",
    "max_video_bytes",
    "max_audio_bytes",
    "max_file_bytes",
    "cache_bytes",
)
ENCODER_KEYS = {
    "local": ("kind", "model", "device", "max_batch_size", "max_batch_delay_ms", "timeout_s", "port"),
    "http": ("kind", "urls", "timeout_s"),
    "vllm": ("kind", "urls", "timeout_s", "max_batch_size"),
}
MODEL_KEYS = (
    "name",
    "upstreams",
    "upstream_model",
    "engine",
    "accepts",
    "apis",
    "limits",
    "encode",
    "on_encoder_error",
    "on_unsupported",
    "api_key_env",
    "balance",
    "retries",
    "breaker",
    "timeouts",
    "max_concurrency",
    "queue",
    "health_check",
    "video",
    "visual_tokens",
    "on_oversize",
    "produces",
    "on_unsupported_output",
    "output_limits",
    "image_urls",
    "realtime",
)
# realtime: a WebSocket session's bounds (GET /v1/realtime, gateway.server.realtime)
REALTIME_KEYS = ("max_session_s", "idle_s", "max_append_bytes", "audio_speed", "audio_burst_s")
AUDIO_BYTES_PER_S = 32_000  # PCM16 at 16 kHz, mono: the audio of vLLM's realtime sessions
# What a model may be said to produce (routing.yaml `produces:`), and what becomes of an output a
# request asks of a model that does not produce it (`on_unsupported_output:`)
OUTPUT_MODALITIES = ("text", "audio", "image")
OUTPUT_ACTIONS = ("reject",)  # and {redirect: MODEL}
# output_limits: the images a request asks for; the text the speech API speaks in one request
OUTPUT_LIMIT_KEYS = ("image", "image_sizes", "image_pixels", "speech_input_chars")
# image_urls: how the images a model makes come back: inline (b64_json: a URL names a file on the
# replica that made it) or as the URLs it writes (shared: storage every client reaches)
IMAGE_URLS = ("inline", "shared")
# The APIs a model's upstreams may serve (routing.yaml `apis:`), and what a generative model
# served by vLLM or SGLang serves when the key is left out.
API_NAMES = ("chat", "completions", "responses", "messages", "embeddings", "score", "rerank", "transcriptions",
             "translations", "images", "edits", "speech", "realtime")  # fmt: skip
# the APIs whose answer is an output of its own: a model served on one must produce it
PRODUCING_APIS = {"images": "image", "edits": "image", "speech": "audio"}
DEFAULT_APIS = API_NAMES[:4]  # a generative model's; a pooling model lists embeddings, score or rerank
ENCODER_ERROR_ACTIONS = ("fail", "passthrough")
UPSTREAM_CLIENTS = ("http1",)  # the gateway's own HTTP/1.1 client; aiohttp's was removed (issue 41)
UPSTREAM_KEYS = ("url", "weight")
BALANCE_POLICIES = ("p2c", "round_robin", "affinity")
RETRY_KEYS = ("attempts", "on_status", "budget", "min_per_s", "backoff_s", "max_backoff_s")
RETRYABLE_STATUSES = (429, 500, 502, 503, 504)  # what retries.on_status may list
BREAKER_KEYS = ("failures", "open_s", "successes")
TIMEOUT_KEYS = ("connect_s", "first_byte_s", "idle_s", "total_s")
QUEUE_KEYS = ("size", "timeout_s", "reserved")
AUTH_KEYS = ("keys",)
API_KEY_KEYS = ("name", "key_env", "key_sha256", "models", "rate_limit", "max_concurrency", "priority")
PRIORITY_KEYS = ("default", "max")
# The priority classes, highest first: a model's queue serves them in this order (x-priority)
PRIORITIES = ("system", "interactive", "default", "bulk")
RATE_LIMIT_KEYS = ("requests_per_minute", "burst", "visual_tokens_per_minute", "tokens_per_minute", "tokens_per_day")
SHA256_HEX = re.compile(r"[0-9a-f]{64}")
HEALTH_CHECK_KEYS = ("path", "interval_s", "timeout_s", "failures")
MAX_JSON_DEPTH = 254  # the deepest body orjson can write back
# Images per request for a model that encodes them, unless limits.image says otherwise: every
# image becomes an image_embeds payload upstream, often 1000x the size of the part it replaces.
DEFAULT_ENCODE_IMAGE_LIMIT = 32
POLICY_ACTIONS = ("reject", "strip")
HISTORY_ACTIONS = ("strip",)  # {history: strip}: what an earlier turn's part gets, where the newest turn's is refused
VISUAL_LIMITS = ("visual_tokens", "image_pixels")  # limits: beside the modalities, not items
VISUAL_KEYS = ("preset", "patch", "merge", "min_pixels", "max_pixels", "longest_edge", "fixed", "remote", "video")
VIDEO_KEYS = ("frames", "fps", "min_frames", "max_frames", "min_pixels", "max_pixels", "temporal_patch")
OVERSIZE_KEYS = ("max_pixels", "max_tokens")

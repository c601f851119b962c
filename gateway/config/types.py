"""What routing.yaml becomes: the frozen types of a config, and their defaults (its keys: gateway.config.keys)."""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Literal

from ..modalities import Modality
from .engines import DEFAULT_ENGINE, DIALECTS, Dialect
from .keys import (
    DEFAULT_APIS,
    DEFAULT_DESCRIBE_PROMPT,
    PRIORITIES,
    SUPPORTED_VERSION,
)


@dataclass(frozen=True, slots=True)
class ContentBounds:
    """How much content one request may carry (``server.max_messages``, ``max_content_parts``,
    ``max_text_chars``); checked cheaply, before or while parts are classified."""

    messages: int = 4096
    parts: int = 8192  # over all messages; a string content counts as one
    text_chars: int = 8 * 1024 * 1024  # one text: ~2M tokens, past every context window but the largest


DEFAULT_BOUNDS = ContentBounds()


@dataclass(frozen=True, slots=True)
class LimitsStoreConfig:
    """``server.limits_store``: the Redis that key limits are shared through
    (gateway.admission.shared); each call waits ``timeout_ms`` at most, then ``on_failure``."""

    url: str
    timeout_ms: float = 50.0
    on_failure: Literal["open", "closed"] = "open"


@dataclass(frozen=True, slots=True)
class TracingConfig:
    """``server.tracing``: spans sent to an OTLP/HTTP collector (gateway.tracing)."""

    otlp_endpoint: str  # http://collector:4318; spans go to its /v1/traces
    sample_ratio: float = 1.0  # of the traces that begin here; a client's traceparent decides its own
    service_name: str = "modality-gateway"  # the resource's service.name
    # a client's traceparent is continued either way; whether its "sampled" flag decides (true), or
    # sample_ratio does (false: a client cannot make every request recorded, 2.5x the CPU)
    trust_client_sampling: bool = False


@dataclass(frozen=True, slots=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8080
    max_body_bytes: int = 32 * 1024 * 1024
    admin_token_env: str = "GATEWAY_ADMIN_TOKEN"
    reload_interval_s: float = 0.5  # 0 turns off watching routing.yaml
    upstream_connect_timeout_s: float = 5.0
    # Longest silence of a replica. A non-streamed reply comes only when the whole generation is
    # done (and a stream's first chunk after queueing and prefill), so this must exceed the longest
    # generation: the OpenAI SDK's own default. Streams are also bounded by the shorter idle timeout.
    upstream_read_timeout_s: float = 600.0
    upstream_cooldown_s: float = 5.0  # the default breaker.open_s of models and encoders
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
    # SIGTERM: /readyz turns 503 and new connections are still taken for drain_grace_s (load
    # balancers need a moment to notice); then the listener closes and requests in flight have
    # drain_timeout_s to finish. Together within Kubernetes' terminationGracePeriodSeconds (30).
    drain_grace_s: float = 5.0
    drain_timeout_s: float = 20.0
    # "HOST:PORT": /admin/* and /metrics are served there only, and the main port serves /v1/* and
    # health alone; None: everything on the main port
    admin_listen: str | None = None
    access_log: bool = True  # a line per request (id, model, route), written in batches (gateway/server/access_log.py)
    # without auth:, whether a client's Authorization and x-api-key go on to the engines (a developer's
    # real vendor key, sent by an SDK or agent pointed here, would). With auth: never
    forward_client_credentials: bool = True
    # how requests reach upstreams: the gateway's own HTTP/1.1 client (gateway/upstream/http1/), or aiohttp's
    upstream_client: Literal["http1"] = "http1"  # the one upstream client (a config may still name it)
    # key limits shared by every gateway process pointing at it; None: per process. Read at start
    limits_store: LimitsStoreConfig | None = None
    tracing: TracingConfig | None = None  # None: no traces. Read at start
    # max_messages, max_content_parts and max_text_chars together: made once, read by every request
    content_bounds: ContentBounds = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        bounds = ContentBounds(self.max_messages, self.max_content_parts, self.max_text_chars)
        object.__setattr__(self, "content_bounds", bounds)

    @property
    def admin_address(self) -> tuple[str, int] | None:
        """``admin_listen`` as (host, port); IPv6 brackets removed."""
        if self.admin_listen is None:
            return None
        host, _, port = self.admin_listen.rpartition(":")
        return host.strip("[]"), int(port)


@dataclass(frozen=True, slots=True)
class MediaConfig:
    allow_domains: tuple[str, ...] = ()
    allow_private_networks: bool = False
    fetch_timeout_s: float = 5.0
    max_image_bytes: int = 20 * 1024 * 1024
    # a video decoded to frames (on_unsupported: {video: {frames: N}}, video: {sample: ...}): held
    # whole in memory until its frames are sampled
    max_video_bytes: int = 100 * 1024 * 1024
    # an audio clip sent for transcription: OpenAI's and vLLM's own limit for one file
    max_audio_bytes: int = 25 * 1024 * 1024
    # a document read for its text (on_unsupported: {file: {extract: ...}}): OpenAI's own limit
    max_file_bytes: int = 32 * 1024 * 1024
    # what the gateway made of media it converted (transcripts, video frames), kept for the next
    # turn of the conversation, which sends them again (gateway.media.conversions); 0: not kept
    cache_bytes: int = 256 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class EncoderConfig:
    name: str
    kind: Literal["local", "http", "vllm"]  # vllm: encoder-only vLLM instances (EC connector producers)
    model: str = "builtin:vit-small"
    device: str = "auto"
    max_batch_size: int = 32  # local: a batch's images; vllm: images primed in one request (default 8)
    max_batch_delay_ms: float = 0.0
    timeout_s: float = 30.0
    urls: tuple[str, ...] = ()
    port: int = 0  # local: the loopback port it listens on; 0, a free one at each start


@dataclass(frozen=True, slots=True)
class RetryConfig:
    """When a model's request is tried again on another replica (docs/reliability.md)."""

    attempts: int = 2  # tries after the first, each on a replica not tried yet
    # statuses retried, besides connect errors and resets (500 is not: it may be the request's fault)
    on_status: tuple[int, ...] = (429, 502, 503, 504)
    budget: float = 0.2  # retries over the last 10 s: at most this fraction of the model's requests...
    min_per_s: float = 10.0  # ...plus this many per second
    backoff_s: float = 0.025  # before retry n: between half and all of backoff_s * 2**(n-1)...
    max_backoff_s: float = 0.25  # ...capped here


@dataclass(frozen=True, slots=True)
class BreakerConfig:
    """When a replica is ejected and let back (gateway.upstream.replicas)."""

    failures: int = 5  # consecutive failures that open the breaker
    open_s: float = 5.0  # skipped this long, then one probe at a time (default: server.upstream_cooldown_s)
    successes: int = 2  # consecutive successful probes that close it again


@dataclass(frozen=True, slots=True)
class TimeoutConfig:
    """A model's upstream deadlines; each defaults to its server.upstream_* key."""

    connect_s: float = 5.0  # reaching a replica
    first_byte_s: float = 600.0  # the reply's start: a non-streamed reply comes whole, after generation
    idle_s: float = 60.0  # "stream": true: the headers, and the gaps between chunks
    total_s: float | None = None  # the whole exchange, retries and relay included; None: no limit


@dataclass(frozen=True, slots=True)
class QueueConfig:
    """Where a model's requests wait when max_concurrency are in flight."""

    size: int = 128  # waiting requests at most; one more: 429 queue_full
    timeout_s: float = 30.0  # the longest wait; then 503 queue_timeout
    reserved: int = 0  # slots of max_concurrency only requests of the top class (system) may take


@dataclass(frozen=True, slots=True)
class HealthCheckConfig:
    """Active health checks of a model's replicas (gateway.upstream.health)."""

    path: str = "/health"  # vLLM and SGLang answer 200 here when ready
    interval_s: float = 5.0
    timeout_s: float = 2.0
    failures: int = 2  # consecutive failed probes that take a replica out; one success brings it back


@dataclass(frozen=True, slots=True)
class RateLimit:
    """A token bucket: ``requests_per_minute`` refill, room for ``burst`` at once; one of
    visual tokens: ``visual_tokens_per_minute`` refill, room for a minute's worth; and the token
    budgets, spent by what the engines' replies say they cost (``usage``): ``tokens_per_minute``
    and ``tokens_per_day``, each a bucket of its span's worth. None: no limit of that kind."""

    requests_per_minute: float | None
    burst: int
    visual_tokens_per_minute: float | None = None
    tokens_per_minute: float | None = None
    tokens_per_day: float | None = None

    @property
    def budgets_tokens(self) -> bool:
        """Whether replies' usage is spent of it (a token budget): every stream must say its usage."""
        return self.tokens_per_minute is not None or self.tokens_per_day is not None


@dataclass(frozen=True, slots=True)
class PriorityCap:
    """The priority classes a key's requests get (``x-priority``): ``default`` without the
    header, and never above ``max`` (a key may lower its class, not raise it)."""

    default: str = "default"  # one of PRIORITIES
    max: str = "default"
    # ``default``'s rank in PRIORITIES (0 the highest): a request without the header's, known once
    rank: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "rank", PRIORITIES.index(self.default) if self.default in PRIORITIES else -1)


@dataclass(frozen=True, slots=True)
class ApiKey:
    """One client key of ``auth.keys``. The key itself is never held: an env var names it, or
    its sha256 is given."""

    name: str  # the label in metrics and logs
    key_env: str | None = None
    key_sha256: str | None = None  # lowercase hex
    models: tuple[str, ...] = ()  # names or globs (fnmatch); empty: every model
    rate_limit: RateLimit | None = None
    max_concurrency: int | None = None
    priority: PriorityCap = PriorityCap()

    def allows(self, model: str) -> bool:
        return not self.models or any(fnmatch.fnmatchcase(model, pattern) for pattern in self.models)


@dataclass(frozen=True, slots=True)
class AuthConfig:
    keys: tuple[ApiKey, ...]


@dataclass(frozen=True, slots=True)
class Policy:
    """What to do with a modality a model does not accept."""

    action: Literal["reject", "strip", "redirect", "transcribe", "frames", "describe", "extract", "speak"]
    # the model to redirect to, whose upstreams transcribe (audio) or describe (image), or (speak,
    # an output) speak the model's text answer
    target: str | None = None
    # transcribe, describe: when it fails, 502/504, 400 as if rejected, or (describe) the image dropped
    on_error: Literal["fail", "reject", "strip"] = "fail"
    prompt: str = DEFAULT_DESCRIBE_PROMPT  # describe: what the describing model is asked, with the image
    max_images: int = 8  # describe: a request's images at most (each a generation of the describing model)
    # extract (file): a request's files at most, a PDF's pages at most, and one PDF's reading time;
    # page_images: each PDF page as an image too (rendered at dpi), for a model that accepts images
    max_files: int = 8
    max_pages: int = 20
    timeout_s: float = 10.0
    page_images: bool = False
    dpi: int = 100
    # frames (video): this many frames sampled evenly (or fps a second, capped by frames), each
    # scaled to fit max_side, each after a text part with its time when timestamps is on
    frames: int = 8
    fps: float | None = None
    max_side: int = 768
    timestamps: bool = True
    # reject: what happens to the modality's parts in the conversation's earlier turns (those before
    # the model's last turn), which a coding agent resends every turn: refused too, or stripped with a note
    history: Literal["reject", "strip"] = "reject"

    def __str__(self) -> str:
        if self.action == "redirect":
            return f"redirect to '{self.target}'"
        if self.action == "transcribe":
            return f"transcribe with '{self.target}'"
        if self.action == "describe":
            return f"describe with '{self.target}'"
        if self.action == "frames":
            return f"{self.frames} frames"
        if self.action == "extract":
            return f"extract its text and page images at {self.dpi} dpi" if self.page_images else "extract its text"
        if self.history == "strip":
            return "reject what the user sent in the newest turn, strip tool results and earlier turns"
        return self.action


REJECT = Policy("reject")


@dataclass(frozen=True, slots=True)
class VisualTokens:
    """How a model's image processor turns an image into tokens (routing.yaml ``visual_tokens:``;
    the formulas: gateway.admission.visual). ``remote``: the (width, height) assumed for an image
    the gateway does not have the bytes of (a URL it does not fetch); ``fetch``: the gateway fetches
    it to read its header; None: counted at the most an image costs the model."""

    kind: Literal["grid", "longest_edge", "fixed", "tiles", "anyres"]
    patch: int = 14
    merge: int = 2
    min_pixels: int = 0
    max_pixels: int = 1 << 62
    longest_edge: int = 0
    fixed: int = 0  # fixed: every image; tiles: each tile
    tiles: tuple[int, int] = (1, 1)  # tiles: the fewest and most tiles of `patch` pixels (plus a thumbnail)
    side: int = 0  # anyres: the base image's side (its vision tower's input)
    pinpoints: tuple[tuple[int, int], ...] = ()  # anyres: the (height, width) grids an image may take
    preset: str | None = None
    remote: tuple[int, int] | Literal["fetch"] | None = None
    video: VideoTokens | None = None  # videos counted too (``video:``); None: their tokens are the engine's


@dataclass(frozen=True, slots=True)
class VideoTokens:
    """How a model's video processor turns a video into tokens (``visual_tokens: {video: ...}``;
    the formulas: gateway.admission.visual). The frames it takes: ``frames`` spread evenly over the
    video (vLLM's loader: 32 by default, all of a shorter one), or ``fps`` a second (the processor's
    own sampling, within ``min_frames``/``max_frames``); each frame resized within the pixel bounds
    (``per: frame``, Qwen2-VL's; ``per: video``, Qwen3-VL's, bounds over all the frames), and a
    token a ``merge x merge`` block of ``patch``-pixel patches of ``temporal_patch`` frames."""

    per: Literal["frame", "video"]
    patch: int
    merge: int
    temporal_patch: int
    min_pixels: int
    max_pixels: int
    frames: int | None = 32
    fps: float | None = None
    min_frames: int = 4
    max_frames: int = 768


# Each family's video processor in transformers (Qwen2VLVideoProcessor, Qwen3VLVideoProcessor) as
# the released checkpoints configure it: Qwen3-VL's video_preprocessor_config.json (fps 2, 4 to 768
# frames, 4096 to 25165824 pixels over all the frames); Qwen2-VL and Qwen2.5-VL ship none, and the
# processor takes preprocessor_config.json's min_pixels and max_pixels for each frame (32 frames:
# vLLM's loader's). tests/admission/test_visual.py holds the formulas to the processors' counts.
VIDEO_PRESETS: Mapping[str, VideoTokens] = MappingProxyType(
    {
        "qwen2-vl": VideoTokens("frame", 14, 2, 2, 3136, 12845056, frames=32),
        "qwen2.5-vl": VideoTokens("frame", 14, 2, 2, 3136, 12845056, frames=32),
        "qwen3-vl": VideoTokens("video", 16, 2, 2, 4096, 25165824, frames=None, fps=2.0),
    }
)


# Each the released checkpoints' preprocessor_config.json (tests/admission/test_visual.py holds
# them to the Hugging Face processors' counts).
VISUAL_PRESETS: Mapping[str, VisualTokens] = MappingProxyType(
    {
        "qwen2-vl": VisualTokens("grid", patch=14, merge=2, min_pixels=3136, max_pixels=12845056),
        "qwen2.5-vl": VisualTokens("grid", patch=14, merge=2, min_pixels=3136, max_pixels=12845056),
        "qwen3-vl": VisualTokens("grid", patch=16, merge=2, min_pixels=65536, max_pixels=16777216),
        "pixtral": VisualTokens("longest_edge", patch=16, longest_edge=1024),  # Pixtral-12B
        "mistral-small-3.1": VisualTokens("longest_edge", patch=28, longest_edge=1540),  # patch 14, merge 2
        "llava-1.5": VisualTokens("fixed", fixed=576),  # CLIP ViT-L/14 at 336 px
        "gemma-3": VisualTokens("fixed", fixed=256),  # pan-and-scan off, vLLM's default
        # 448-pixel tiles, 1 to 12 and a thumbnail, 256 tokens each, and <img> </img>
        "internvl3": VisualTokens("tiles", patch=448, fixed=256, tiles=(1, 12)),
        # LLaVA-NeXT (v1.6): a 336-pixel base image and the grid of its best resolution, unpadded
        "llava-next": VisualTokens(
            "anyres", patch=14, side=336, pinpoints=((336, 672), (672, 336), (672, 672), (1008, 336), (336, 1008))
        ),
    }
)


@dataclass(frozen=True, slots=True)
class Oversize:
    """``on_oversize``: what becomes of an image over ``limits.image_pixels`` or of a request over
    ``limits.visual_tokens``: refused (400), or each image downscaled to fit (``max_pixels`` an
    image, ``max_tokens`` a request; each within its limit, the limit alone when not given)."""

    action: Literal["reject", "downscale"] = "reject"
    max_pixels: int | None = None
    max_tokens: int | None = None


@dataclass(frozen=True, slots=True)
class RealtimeConfig:
    """``realtime:``: the bounds of one WebSocket session (``GET /v1/realtime``) of a model."""

    max_session_s: float = 3600.0  # a session's whole length; then closed (1008, "session too long")
    idle_s: float = 300.0  # no event either way this long: closed (1000, "idle")
    max_append_bytes: int = 1 << 20  # an input_audio_buffer.append's audio, decoded (vLLM's PCM16 16 kHz mono)
    # the audio a session may send: audio_burst_s seconds at once, then audio_speed seconds a second
    audio_speed: float = 10.0
    audio_burst_s: float = 60.0


@dataclass(frozen=True, slots=True)
class OutputLimits:
    """``output_limits:``: the images a request may ask a model for (the images API's ``n``), the
    sizes it may ask them in (none listed: any), and the most pixels of one; the characters of
    text the speech API speaks in one request (its ``input``: what bounds the audio's length)."""

    images: int | None = None
    sizes: tuple[tuple[int, int], ...] = ()
    pixels: int | None = None
    speech_chars: int | None = None

    @property
    def of_sizes(self) -> bool:
        """Whether it holds the size of an image asked for (``image_sizes``, ``image_pixels``)."""
        return bool(self.sizes) or self.pixels is not None

    @property
    def of_images(self) -> bool:
        return self.images is not None or self.of_sizes


@dataclass(frozen=True, slots=True)
class ModelConfig:
    name: str
    upstreams: tuple[str, ...]
    accepts: tuple[Modality, ...]  # in Modality order
    upstream_model: str | None = None
    engine: str = DEFAULT_ENGINE  # its upstreams' dialect (gateway/config/engines.py): vllm, sglang or openai
    apis: tuple[str, ...] = DEFAULT_APIS  # the APIs its upstreams serve, in API_NAMES order
    limits: Mapping[Modality, int] = field(default_factory=lambda: MappingProxyType({}))
    encode: Mapping[Modality, str] = field(default_factory=lambda: MappingProxyType({}))
    # video.sample: for a model that takes video, each video_url sent as vLLM's pre-sampled form
    # (data:video/jpeg;base64,<frame>,<frame>,...): this many frames (a Policy of action "frames")
    video_sample: Policy | None = None
    # encode.min_images: a request with fewer images goes to the upstreams with its raw images
    # (Encode/Prefill/Decode costs image-light requests more than it saves them)
    encode_min_images: int = 1
    on_unsupported: Mapping[Modality, Policy] = field(default_factory=lambda: MappingProxyType({}))
    # when the encoder fails: 503 encoder_unavailable (fail), or send the original images (passthrough)
    on_encoder_error: Literal["fail", "passthrough"] = "fail"
    api_key_env: str | None = None  # the env var whose value goes upstream as "Authorization: Bearer"
    weights: tuple[int, ...] = ()  # per upstream, in order; empty: all 1
    balance: Literal["p2c", "round_robin", "affinity"] = "p2c"
    retries: RetryConfig = RetryConfig()
    breaker: BreakerConfig = BreakerConfig()
    timeouts: TimeoutConfig = TimeoutConfig()
    max_concurrency: int | None = None  # requests in flight upstream at most; None: no limit
    queue: QueueConfig = QueueConfig()
    health_check: HealthCheckConfig | None = None  # None: passive health (the breaker) only
    visual_tokens: VisualTokens | None = None  # None: images are counted as items only
    max_visual_tokens: int | None = None  # limits.visual_tokens: a request's images, in all
    max_image_pixels: int | None = None  # limits.image_pixels: each image
    on_oversize: Oversize = Oversize()
    # what it answers with (text; audio: chat's modalities/audio; image: Responses' image_generation),
    # and what becomes of an output asked of it that it does not produce: reject (400), or a redirect
    produces: tuple[Modality, ...] = (Modality.TEXT,)
    on_unsupported_output: Mapping[Modality, Policy] = field(default_factory=lambda: MappingProxyType({}))
    output_limits: OutputLimits | None = None
    image_urls: Literal["inline", "shared"] = "inline"  # generated images: b64_json, or the engine's URLs
    realtime: RealtimeConfig = RealtimeConfig()

    @property
    def counts_images(self) -> bool:
        """Whether admission reads each image's size: for its tokens, or a pixel limit."""
        return self.visual_tokens is not None or self.max_image_pixels is not None

    @property
    def upstream_name(self) -> str:
        return self.upstream_model or self.name

    @property
    def dialect(self) -> Dialect:
        return DIALECTS[self.engine]

    def takes_on(self, api: str) -> tuple[Modality, ...]:
        """The modalities it takes on ``api``: those it accepts that its engine has a part for there."""
        lacking = self.dialect.lacking(api)
        return self.accepts if not lacking else tuple(m for m in self.accepts if m not in lacking)

    def policy(self, modality: Modality) -> Policy:
        return self.on_unsupported.get(modality, REJECT)

    def output_policy(self, modality: Modality) -> Policy:
        return self.on_unsupported_output.get(modality, REJECT)

    def accepts_text(self) -> str:
        return ", ".join(self.accepts)


@dataclass(frozen=True, slots=True)
class GatewayConfig:
    models: tuple[ModelConfig, ...]
    server: ServerConfig = ServerConfig()
    media: MediaConfig = MediaConfig()
    encoders: Mapping[str, EncoderConfig] = field(default_factory=lambda: MappingProxyType({}))
    auth: AuthConfig | None = None  # None: the gateway is open to anyone who reaches it
    version: int = SUPPORTED_VERSION
    source: str = "<memory>"
    sha256: str = ""  # of the file's text: which config is live (gateway_config_info)
    _by_name: Mapping[str, ModelConfig] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_by_name", MappingProxyType({m.name: m for m in self.models}))

    def model(self, name: str) -> ModelConfig | None:
        return self._by_name.get(name)

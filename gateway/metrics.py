"""Every metric the gateway exports, declared once on an injected CollectorRegistry.

Label values are bounded: model and upstream names come from routing.yaml, modalities from
:class:`~gateway.modalities.Modality` (plus ``unknown`` for a part of no known type), codes are
HTTP status codes. Never a URL from a request or a request id. The series a config can produce are
made at 0 by the config store when it takes the config (gateway.server.store); the replica
pools' gauges are read at scrape time by gateway.upstream.collector.

The series every request writes are of the loop-cheap types of gateway.meters. Under
``serve --workers N`` every worker keeps its metrics in prometheus_client's multiprocess files,
and any worker answering a scrape sums them all (gateway.meters.WorkersCollector). Each gauge says
how its workers' values combine (``multiprocess_mode``, ignored in a single process); the pools'
collector reads the answering worker's own pools.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from .meters import LoopCounter, LoopGauge, LoopHistogram

REJECTION_REASONS = ("unsupported", "too_many_items", "invalid_content", "media_refused", "too_many_visual_tokens",
                     "image_too_large")  # fmt: skip
# A request's visual tokens: one thumbnail (~100) to a camera roll (100k+)
VISUAL_TOKEN_BUCKETS = (64, 256, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)
SHED_REASONS = ("queue_full", "queue_timeout", "preempted")  # gateway_shed_total{reason}
TOKEN_KINDS = ("prompt", "completion", "cached")  # gateway_tokens_total's kind
UNKNOWN_MODEL = "_unknown"  # the model label of requests that name no configured model
NO_KEY = "-"  # the key label of requests without auth

# LLM requests run from milliseconds (rejections) to minutes (long generations).
DURATION_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)


Metered = Counter | Gauge | Histogram | LoopCounter | LoopHistogram


class GatewayMetrics:
    def __init__(self, registry: CollectorRegistry, *, multiprocess: bool = False) -> None:
        self.registry = registry
        self._multiprocess = multiprocess  # values live in prometheus_client's multiprocess files
        self._live_sha256: str | None = None
        self._children: dict[tuple[object, tuple[str, ...]], Any] = {}
        self.requests = self._counter(
            "gateway_requests",
            "Requests answered, by the model the client asked for, the HTTP status sent, the API key's name "
            "(- without auth), and the API (chat, responses, messages, ...).",
            ["model", "code", "key", "api"],
        )
        self.auth_failures = Counter(
            "gateway_auth_failures",
            "Requests refused for their API key: missing or invalid.",
            ["reason"],
            registry=registry,
        )
        self.rate_limited = Counter(
            "gateway_rate_limited",
            "Requests refused by their key's limits: rate, concurrency, tokens (its token budgets) or visual_tokens.",
            ["key", "reason"],
            registry=registry,
        )
        self.tokens = self._counter(
            "gateway_tokens",
            "Tokens the engines' replies say they cost (usage), by serving model, API key (- without auth) and "
            "kind: prompt (cached included), completion, cached (of the prompt).",
            ["model", "key", "kind"],
        )
        self.limits_store_errors = Counter(
            "gateway_limits_store_errors",
            "Calls to server.limits_store that failed or timed out, and those not made while it was paused after "
            "one (answered by its on_failure), by op: admit, visual, finish, members (the heartbeat that counts the "
            "live processes).",
            ["op"],
            registry=registry,
        )
        self.request_duration = self._histogram(
            "gateway_request_duration_seconds",
            "Time from the request's arrival to the last byte of the response.",
            ["model"],
            DURATION_BUCKETS,
        )
        self.in_flight: Gauge | LoopGauge = (
            Gauge("gateway_requests_in_flight", "Requests being handled now.", registry=registry,
                  multiprocess_mode="livesum")
            if multiprocess
            else LoopGauge("gateway_requests_in_flight", "Requests being handled now.", registry)
        )  # fmt: skip
        self.rejections = Counter(
            "gateway_modality_rejections",
            "Requests refused at admission for their content, by the API they came in on.",
            ["model", "modality", "reason", "api"],
            registry=registry,
        )
        self.redirects = Counter(
            "gateway_modality_redirects",
            "Requests sent to another model because of a modality the requested model does not accept.",
            ["model", "modality", "target"],
            registry=registry,
        )
        self.visual_tokens = self._counter(
            "gateway_visual_tokens",
            "Visual tokens admitted (the model's visual_tokens: formula, after any downscale), by serving model.",
            ["model"],
        )
        self.request_visual_tokens = self._histogram(
            "gateway_request_visual_tokens",
            "Visual tokens of each admitted request that carries images, to a model with a visual_tokens: formula.",
            ["model"],
            VISUAL_TOKEN_BUCKETS,
        )
        self.images_downscaled = Counter(
            "gateway_images_downscaled",
            "Images the gateway resized before sending them (on_oversize: downscale).",
            ["model"],
            registry=registry,
        )
        self.stripped_parts = Counter(
            "gateway_modality_stripped_parts",
            "Content parts removed from requests under an on_unsupported: strip policy.",
            ["model", "modality"],
            registry=registry,
        )
        self.upstream_requests = self._counter(
            "gateway_upstream_requests",
            "Requests sent to upstream replicas, by outcome: ok, http_4xx, http_5xx, connect_error, reset, timeout, "
            "aborted.",
            ["model", "upstream", "outcome"],
        )
        self.upstream_duration = self._histogram(
            "gateway_upstream_response_seconds",
            "Time from sending a request upstream to the response headers.",
            ["model", "upstream"],
            DURATION_BUCKETS,
        )
        self.encoder_requests = Counter(
            "gateway_encoder_requests",
            "Images sent to encoder backends, by outcome: ok, cached, invalid, connect_error, timeout, overloaded, "
            "error, unavailable.",
            ["encoder", "outcome"],
            registry=registry,
        )
        self.encoder_seconds = Histogram(
            "gateway_encoder_seconds",
            "Time to encode one distinct image of a request, backend retries included.",
            ["encoder"],
            buckets=DURATION_BUCKETS,
            registry=registry,
        )
        self.encoder_backend_requests = Counter(
            "gateway_encoder_backend_requests",
            "Requests to each encoder backend or vLLM encoder instance (an image, or a priming request's images), "
            "by outcome: ok, invalid, connect_error, timeout, overloaded, error.",
            ["encoder", "backend", "outcome"],
            registry=registry,
        )
        self.encoder_backend_seconds = Histogram(
            "gateway_encoder_backend_seconds",
            "Time of one request to an encoder backend or vLLM encoder instance, to its whole answer.",
            ["encoder", "backend"],
            buckets=DURATION_BUCKETS,
            registry=registry,
        )
        self.audio_transcribed_seconds = Counter(
            "gateway_audio_transcribed_seconds",
            "Seconds of audio replaced by its transcript (on_unsupported: {audio: {transcribe: M}}), by the "
            "request's model; from the transcription's duration, a WAV's header, or the length its container "
            "states (0 when none says).",
            ["model"],
            registry=registry,
        )
        self.video_frames = Counter(
            "gateway_video_frames",
            "Frames of videos served: as images (on_unsupported: {video: {frames: N}}) or in vLLM's pre-sampled "
            "form (video: {sample: ...}), sampled or kept from an earlier turn, by the request's model.",
            ["model"],
            registry=registry,
        )
        self.video_decode_seconds = Histogram(
            "gateway_video_decode_seconds",
            "Time to sample one video's frames (decoding, scaling, JPEG; a video kept from an earlier turn is not "
            "decoded), by the request's model.",
            ["model"],
            buckets=DURATION_BUCKETS,
            registry=registry,
        )
        self.video_decode_shed = Counter(
            "gateway_video_decode_shed",
            "Media (videos, images to downscale, documents) refused with 503 decoders_busy because every decoding "
            "thread was busy: the queue for them was "
            "full (queue_full) or the wait too long (queue_timeout), by the request's model.",
            ["model", "reason"],
            registry=registry,
        )
        self.media_cache_requests = Counter(
            "gateway_media_cache_requests",
            "Lookups of media the gateway converted before (media.cache_bytes), by kind (transcript, frames, "
            "presample, downscale) and result (hit; shared: waited for the same conversion under way; miss).",
            ["kind", "result"],
            registry=registry,
        )
        self.media_cache_bytes = Gauge(
            "gateway_media_cache_bytes",
            "Bytes held by the cache of converted media (transcripts, video frames).",
            registry=registry,
            multiprocess_mode="livesum",  # each worker has a cache of its own
        )
        self.encode_decisions = Counter(
            "gateway_encode_decisions",
            "Requests with images to a model that encodes them, by decision: encoded, or direct (fewer images than "
            "its encode.min_images: sent upstream raw).",
            ["model", "decision"],
            registry=registry,
        )
        self.encoder_passthrough = Counter(
            "gateway_encoder_passthrough",
            "Requests whose images went upstream unencoded because the encoder failed (on_encoder_error: passthrough).",
            ["model", "encoder"],
            registry=registry,
        )
        self.retries = Counter(
            "gateway_retries",
            "Upstream attempts tried again on another replica, by what failed: connect_error, reset, http_<status>.",
            ["model", "reason"],
            registry=registry,
        )
        self.retries_refused = Counter(
            "gateway_retries_refused",
            "Retries not made because the model's retry budget was spent (the failure went to the client).",
            ["model"],
            registry=registry,
        )
        self.stored_responses = Counter(
            "gateway_stored_response_routes",
            "Responses API requests that continue a stored response (previous_response_id), by where they went: "
            "holder (the replica that served it), elsewhere (it admitted no request), unknown (not relayed here).",
            ["model", "result"],
            registry=registry,
        )
        self.upstream_ejections = Counter(
            "gateway_upstream_ejections",
            "Times a replica's circuit breaker opened (it is skipped until a probe succeeds).",
            ["model", "upstream"],
            registry=registry,
        )
        self.config_reloads = Counter(
            "gateway_config_reloads",
            "routing.yaml reloads, by result: success or failure.",
            ["result"],
            registry=registry,
        )
        self.config_generation = Gauge(
            "gateway_config_generation",
            "How many times a new routing.yaml took effect since start (1 for the first).",
            registry=registry,
            multiprocess_mode="livemax",  # a restarted worker counts from 1 again
        )
        self.health_checks = Counter(
            "gateway_health_checks",
            "Active health checks of upstream replicas, by result: pass or fail.",
            ["model", "upstream", "result"],
            registry=registry,
        )
        self.shed = Counter(
            "gateway_shed",
            "Requests refused because their model was at max_concurrency: queue_full (429), queue_timeout (503), or "
            "preempted (503: shed from the full queue for a request of a higher class), by the shed one's priority.",
            ["model", "reason", "priority"],
            registry=registry,
        )
        self.images_described = Counter(
            "gateway_images_described",
            "Images described by a vision model for a model that takes none (on_unsupported: {image: {describe: M}}), "
            "by the requested model; a description served from media.cache_bytes is not counted again.",
            ["model"],
            registry=registry,
        )
        self.image_describe_seconds = Histogram(
            "gateway_image_describe_seconds",
            "Time to describe one image: the describing model's answer, retries included.",
            ["model"],
            buckets=DURATION_BUCKETS,
            registry=registry,
        )
        self.files_extracted = Counter(
            "gateway_files_extracted",
            "Files served as their text to a model that takes none (on_unsupported: {file: {extract: ...}}), by the "
            "requested model and the file's kind (pdf, text); a PDF read before comes from media.cache_bytes.",
            ["model", "kind"],
            registry=registry,
        )
        self.file_pages = Counter(
            "gateway_file_pages",
            "Pages of PDFs read for their text (a PDF read before, from media.cache_bytes, not counted again).",
            ["model"],
            registry=registry,
        )
        self.file_page_images = Counter(
            "gateway_file_page_images",
            "Page images rendered of PDFs for a model that takes images (extract: {page_images: true}); a PDF "
            "read before, from media.cache_bytes, not counted again.",
            ["model"],
            registry=registry,
        )
        self.file_extract_seconds = Histogram(
            "gateway_file_extract_seconds",
            "Time to read one PDF's text in a reader process, its wait for a decoding thread included.",
            ["model"],
            buckets=DURATION_BUCKETS,
            registry=registry,
        )
        self.queue_wait = Histogram(
            "gateway_queue_wait_seconds",
            "Time a request of a model with max_concurrency waited for its slot (0 when one was free), by its "
            "priority class; only requests that got one.",
            ["model", "priority"],
            buckets=DURATION_BUCKETS,
            registry=registry,
        )
        self.realtime_open = Gauge(
            "gateway_realtime_sessions_open",
            "Realtime sessions (GET /v1/realtime, WebSocket) relayed now, by model.",
            ["model"],
            registry=registry,
            multiprocess_mode="livesum",
        )
        self.realtime_opened = Counter(
            "gateway_realtime_sessions_opened",
            "Realtime sessions opened (upgraded, their engine's side open), by model.",
            ["model"],
            registry=registry,
        )
        self.realtime_closed = Counter(
            "gateway_realtime_sessions",
            "Realtime sessions relayed, counted as they end, by model and the reason they ended: client (the "
            "client closed), engine (the engine closed), engine_lost (its connection failed), idle, too_long "
            "(realtime.max_session_s), draining (the gateway stopped), error.",
            ["model", "reason"],
            registry=registry,
        )
        self.realtime_events = Counter(
            "gateway_realtime_events",
            "Realtime events relayed, by model and where they came from (client, engine).",
            ["model", "source"],
            registry=registry,
        )
        self.realtime_bytes = Counter(
            "gateway_realtime_bytes",
            "Bytes of realtime events relayed, by model and where they came from (client, engine).",
            ["model", "source"],
            registry=registry,
        )
        self.realtime_refused = Counter(
            "gateway_realtime_events_refused",
            "Client events of realtime sessions answered with an error event and not passed on, by model and "
            "reason: model (session.update naming another model), output (an output the model does not produce), "
            "too_large (realtime.max_append_bytes), too_fast (audio_speed), invalid (a binary frame).",
            ["model", "reason"],
            registry=registry,
        )
        self.spoken = Counter(
            "gateway_outputs_spoken",
            "Chat answers (each choice) of a model that answers in text, spoken by the model its "
            "on_unsupported_output: {audio: {speak: M}} names, by model and speaker.",
            ["model", "speaker"],
            registry=registry,
        )
        self.audio_seconds = Counter(
            "gateway_audio_seconds",
            "Seconds of audio the clients sent, by serving model and API (realtime: each append's PCM16 at 16 kHz).",
            ["model", "api"],
            registry=registry,
        )
        self.config_info = Gauge(
            "gateway_config_info",
            "The live routing.yaml, by the sha256 of its text (1 for the live one; join on it in dashboards).",
            ["sha256"],
            registry=registry,
            multiprocess_mode="livemax",  # every version some worker runs (WorkersCollector drops the 0s)
        )
        for reason in ("missing", "invalid"):
            self.auth_failures.labels(reason)
        self.config_reloads.labels("success")
        self.config_reloads.labels("failure")

    def _counter(self, name: str, documentation: str, labels: Sequence[str]) -> Counter | LoopCounter:
        """A metric every request writes: prometheus_client's under ``--workers`` (its values in the
        multiprocess files every worker sums), lock-free in one process (the module's docstring)."""
        if self._multiprocess:
            return Counter(name, documentation, labels, registry=self.registry)
        return LoopCounter(name, documentation, labels, self.registry)

    def _histogram(
        self, name: str, documentation: str, labels: Sequence[str], buckets: Sequence[float]
    ) -> Histogram | LoopHistogram:
        if self._multiprocess:
            return Histogram(name, documentation, labels, buckets=buckets, registry=self.registry)
        return LoopHistogram(name, documentation, labels, self.registry, buckets=buckets)

    def child(self, metric: Metered, *labels: str) -> Any:
        """``metric.labels(*labels)``, looked up once: prometheus_client's lookup checks and locks
        on every call (~1.5 us, several a request), a dict lookup costs a tenth of that. Label
        values are bounded (module docstring), and series are never removed from these metrics,
        so the cache is bounded and never stale."""
        key = (metric, labels)
        found = self._children.get(key)
        if found is None:
            found = self._children[key] = metric.labels(*labels)
        return found

    def live_config(self, sha256: str) -> None:
        """``gateway_config_info{sha256}`` is 1 for the config in effect, and only for it."""
        if self._live_sha256 is not None and self._live_sha256 != sha256:
            if self._multiprocess:  # a series cannot leave a multiprocess file: 0, which scrapes drop
                self.config_info.labels(self._live_sha256).set(0)
            else:
                self.config_info.remove(self._live_sha256)
        self.config_info.labels(sha256).set(1)
        self._live_sha256 = sha256

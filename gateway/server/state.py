"""What handlers and middlewares share, injected through the application (no globals)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from aiohttp import web

from ..admission.auth import KeyLimits
from ..admission.priority import ANONYMOUS, DEFAULT_RANK, HEADER, priority_of
from ..admission.route import Visible
from ..admission.shared import SharedLimits
from ..config import ApiKey
from ..encode.client import EncoderClient
from ..encode.supervisor import Supervisor
from ..media.conversions import ConversionCache
from ..media.converters import Tools
from ..media.decoders import DecoderPool
from ..media.describe import Describer
from ..media.documents import Documents
from ..media.speak import Speaker
from ..media.transcribe import Transcriber
from ..metrics import GatewayMetrics
from ..tracing import Tracing
from ..upstream.client import UpstreamClient
from ..upstream.concurrency import Gates
from ..upstream.realtime import Hub
from .store import ConfigStore


@dataclass(slots=True)
class Lifecycle:
    """Where the process stands: ``draining`` from SIGTERM on (``/readyz`` answers 503)."""

    draining: bool = False
    admin_port: int | None = None  # where server.admin_listen listens, once it does
    worker: int | None = None  # this process's index under `serve --workers N` (None: the only process)
    reload_others: Callable[[], None] | None = None  # a worker's: have the master reload the other workers


@dataclass(frozen=True, slots=True)
class Services:
    store: ConfigStore
    metrics: GatewayMetrics
    upstream: UpstreamClient
    encoder: EncoderClient
    supervisor: Supervisor
    max_body_bytes: int  # fixed at start: aiohttp reads it once
    gates: Gates = field(default_factory=Gates)
    key_limits: KeyLimits = field(default_factory=KeyLimits)
    shared_limits: SharedLimits | None = None  # server.limits_store: the key limits every process shares
    lifecycle: Lifecycle = field(default_factory=Lifecycle)
    transcriber: Transcriber | None = None  # audio to text (on_unsupported: {audio: {transcribe: M}})
    describer: Describer | None = None  # images to text (on_unsupported: {image: {describe: M}})
    speaker: Speaker | None = None  # a text answer spoken (on_unsupported_output: {audio: {speak: M}})
    documents: Documents | None = None  # files to text (on_unsupported: {file: {extract: ...}})
    # transcripts and video frames made before, for the next turn (media.cache_bytes)
    conversions: ConversionCache = field(default_factory=lambda: ConversionCache(0))
    # videos sampled into frames (gateway.media.video): threads of their own, a bounded queue for them,
    # apart from the default executor (DNS lookups, large data URLs); closed with the app
    decoders: DecoderPool = field(default_factory=DecoderPool)
    tracing: Tracing | None = None  # server.tracing: spans for each stage of a request (gateway.tracing)
    realtime: Hub = field(default_factory=Hub)  # the realtime sessions relayed now (gateway.upstream.realtime)

    @property
    def tools(self) -> Tools:
        """What the conversions of a request work with (gateway.media.converters)."""
        return Tools(self.encoder.fetcher, self.decoders, self.conversions, self.metrics, self.transcriber,
                     self.describer, self.documents)  # fmt: skip

    # where the key limits are held: the shared store, or this process (an attribute: every keyed request asks)
    limits: KeyLimits | SharedLimits = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "limits", self.shared_limits if self.shared_limits is not None else self.key_limits)


SERVICES_KEY = web.AppKey("services", Services)
REQUEST_ID_KEY = web.RequestKey("request_id", str)
# The model label of gateway_requests_total; set by handlers that serve a model.
MODEL_LABEL_KEY = web.RequestKey("model_label", str)
# The client's API key (auth on), set by the front door (middlewares.front) for /v1/* requests; its name labels
# gateway_requests_total ("-" when auth is off).
API_KEY_KEY: web.RequestKey[ApiKey | None] = web.RequestKey("api_key")  # None: no key asked (auth off, or not an API)


@dataclass(slots=True)
class Tab:
    """A keyed request's account with its key, kept by the front door: the x-ratelimit-* headers
    its answer carries, and the tokens its reply and conversions cost (gateway.server.spending),
    spent of the key's budgets at its end. (One object in one slot of the request: each slot is
    a call to set and two to read.)"""

    headers: Mapping[str, str]  # (shared by the key's requests while its levels are the same: never changed)
    spent: int = 0


TAB_KEY = web.RequestKey("tab", Tab)  # a keyed request's only (set with API_KEY_KEY)


def visible(request: web.Request) -> Visible:
    """The model names the request's API key may use (None: every one, auth off)."""
    key = request.get(API_KEY_KEY)
    return key.allows if key is not None else None


def left_by_the_door(request: web.Request, key: ApiKey | None) -> tuple[Visible, Tab | None]:
    """What the front door left a request of ``key`` (:func:`admitted_as`'s): the model names the
    key may use (None: every one, auth off or a key of every model, none asked), and the key's
    account (None: no key)."""
    if key is None:
        return None, None
    return (key.allows if key.models else None), request[TAB_KEY]


def admitted_as(request: web.Request) -> tuple[ApiKey | None, int]:
    """The request's key (the one the front middleware found: a reload since, auth taken off,
    does not unkey a request it let in), and its class: ``x-priority`` within the key's cap (400
    for an unknown class)."""
    key = request.get(API_KEY_KEY)
    header = request.headers.get(HEADER)
    if key is None:
        return None, DEFAULT_RANK if header is None else priority_of(header, ANONYMOUS)
    if header is None and key.priority.rank >= 0:  # its key's default class (priority_of's, known at once)
        return key, key.priority.rank
    return key, priority_of(header, key.priority)

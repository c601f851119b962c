"""What the upstream hop needs of one request, and all it sees of it (the handler's exchange stays
with the server): its deadlines, and the :class:`Dispatch` the client and the relay take."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping

from ..admission.apis import CHAT, Api
from ..config import ModelConfig
from ..values import record
from .replicas import Pool
from .usage import Usage


@record
class Timeouts:
    """One request's upstream deadlines (a model's ``timeouts``, and the client's write deadline)."""

    connect: float  # reaching a replica
    read: float  # the longest silence of the replica (before a non-streamed reply, before a stream's first chunk)
    client_write: float  # the longest a client may take no bytes before it is dropped
    # "stream": true: the longest wait for the response headers, and between two chunks once the
    # first came (the engine sends its headers at once, then queues and prefills); None otherwise
    stream_idle: float | None = None
    total: float | None = None  # the whole exchange with upstreams, retries and relay included


@record
class Dispatch:
    """What the upstream hop needs of one request, and all it sees of it: the model and its pool
    of this generation, the bytes to send, the deadlines, the headers that go both ways, the
    model's key (sent in place of the client's ``Authorization``, which is not sent either when
    ``forward_client_auth`` is off), the balancing key, and ``reprime``: for a request whose
    images were primed on vLLM encoder instances, how to make its body again, the images primed
    anew, when the EC consumer missed one (:mod:`gateway.upstream.consumer`); that second try
    is relayed whatever it answers. ``on_usage`` is told what a relayed successful reply cost
    (:mod:`gateway.upstream.usage`; None: it did not say), once, after its last byte."""

    model: ModelConfig
    pool: Pool
    body: bytes
    timeouts: Timeouts
    gateway_headers: Mapping[str, str]
    auth: str | None = None
    forward_client_auth: bool = True
    affinity_key: bytes | None = None
    reprime: Callable[[], Awaitable[bytes]] | None = None
    api: Api = CHAT  # the API it came in on: how a broken stream ends, whether the engine stores its response
    continues: str | None = None  # the stored response it continues (previous_response_id): its holder first
    owner: str | None = None  # the request's API key's name (None: auth off): a stored response is its key's
    # a chat or completions stream whose usage the gateway asked for (a key's token budgets), not
    # the client: the usage chunk is read, and not relayed
    hide_usage: bool = False
    content_type: str = "application/json"  # of the body (an audio upload: its multipart type, boundary included)
    on_usage: Callable[[Usage | None], None] | None = None
    # for the client only, over any of the name the upstream's answer has: a key's x-ratelimit-*
    # (a stream's, whose head goes before the front door sees it)
    answer_headers: Mapping[str, str] | None = None

"""Every error the gateway can answer with, and its one JSON rendering.

The tree (status, OpenAI ``type``, stable ``code``)::

    GatewayError                          500 server_error          internal_error
    ├── InvalidRequestError               400 invalid_request_error invalid_request
    │   ├── UnsupportedModalityError      400                       unsupported_modality
    │   ├── UnsupportedOutputModalityError 400                      unsupported_output_modality
    │   ├── UnsupportedApiError           400                       unsupported_api
    │   ├── InvalidPriorityError          400                       invalid_priority
    │   ├── TooManyItemsError             400                       too_many_items
    │   ├── TooManyVisualTokensError      400                       too_many_visual_tokens
    │   ├── ImageTooLargeError            400                       image_too_large
    │   ├── UnreadableBodyError           400                       invalid_request
    │   ├── InvalidContentPartError       400                       invalid_content_part
    │   ├── InvalidImageError             400                       invalid_image
    │   │   └── ImagesRefusedError        400                       invalid_image
    │   ├── InvalidVideoError             400                       invalid_video
    │   ├── InvalidAudioError             400                       invalid_audio
    │   ├── InvalidFileError              400                       invalid_file
    │   └── MediaRefusedError             400                       media_refused
    ├── AuthenticationError               401 authentication_error  invalid_admin_token
    │   └── InvalidApiKeyError            401                       invalid_api_key
    ├── PermissionDeniedError             403 permission_error      admin_disabled
    ├── NotFoundError                     404 invalid_request_error not_found
    │   └── ModelNotFoundError            404                       model_not_found
    ├── MethodNotAllowedError             405 invalid_request_error method_not_allowed
    ├── RequestTimeoutError               408 invalid_request_error request_timeout
    ├── PayloadTooLargeError              413 invalid_request_error payload_too_large
    ├── UnsupportedEncodingError          415 invalid_request_error unsupported_content_encoding
    ├── InvalidConfigError                422 invalid_request_error invalid_config
    ├── RateLimitedError                  429 rate_limit_error      rate_limit_exceeded
    │   ├── ConcurrencyLimitError         429                       concurrency_limit_exceeded
    │   ├── VisualTokensRateLimitedError  429                       visual_tokens_rate_limit_exceeded
    │   └── TokensRateLimitedError        429                       tokens_rate_limit_exceeded
    ├── QueueFullError                    429 rate_limit_error      queue_full
    ├── QueueTimeoutError                 503 server_error          queue_timeout
    ├── PreemptedError                    503 server_error          preempted
    ├── DecodersBusyError                 503 server_error          decoders_busy
    ├── LimitsStoreUnavailableError       503 server_error          limits_store_unavailable
    ├── UpstreamError                     502 server_error          upstream_error
    │   ├── UpstreamConnectError          502                       upstream_unreachable
    │   ├── UpstreamTimeoutError          504                       upstream_timeout
    │   ├── NoHealthyUpstreamError        503                       no_healthy_upstream
    │   └── EmbeddingsNotDeliveredError   502                       upstream_error
    └── EncoderError                      503 server_error          encoder_unavailable

``HTTPStatusError`` carries any other status aiohttp raises itself (``http_417``, ...) in the same
shape. On the Anthropic Messages API the same errors take Anthropic's shape
(:meth:`GatewayError.to_anthropic`: ``{"type": "error", "error": {"type", "message"}}``, the
``type`` from the status as Anthropic's API and SDK name them); a stream that breaks after its
first byte ends with each API's own error event (its ``stream_error``: :func:`openai_stream_error`,
:func:`responses_stream_error`, :func:`anthropic_stream_error`). The encoder backend's
errors (backends/vision_encoder/errors.py) are GatewayErrors too.

Errors are raised anywhere and rendered only by :func:`render` (called by ``middlewares.front``,
the front door of every route, and by the encoder backend's middleware). An error that rejects
part of a request's content carries a :class:`Rejection`, which the front door counts in
``gateway_modality_rejections_total``.

``ConfigError`` stands apart: it describes a bad routing.yaml and never reaches HTTP.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import orjson
from aiohttp import web


@dataclass(frozen=True, slots=True)
class Rejection:
    """What a rejection counts as: ``reason`` is one of unsupported, too_many_items,
    invalid_content, media_refused, too_many_visual_tokens, image_too_large, unsupported_output
    (an output the model does not produce: ``modality`` is the output's), output_limit (images
    asked past the model's ``output_limits``)."""

    model: str
    modality: str
    reason: str


class GatewayError(Exception):
    status: ClassVar[int] = 500
    type: ClassVar[str] = "server_error"
    code: ClassVar[str] = "internal_error"
    # True when the connection cannot be reused after the answer (the rest of the body is unread)
    closes_connection: ClassVar[bool] = False
    # True when the rest of the body is not even waited for: closed right after the answer, where
    # aiohttp would otherwise linger up to 10 s for it (a body that trickles in)
    stops_reading: ClassVar[bool] = False

    def __init_subclass__(
        cls,
        *,
        status: int | None = None,
        type: str | None = None,  # the OpenAI field's name
        code: str | None = None,
        closes_connection: bool | None = None,
        stops_reading: bool | None = None,
        **kwargs: Any,
    ) -> None:
        """A subclass states what differs from its parent in its class line:
        ``class TooManyItemsError(InvalidRequestError, code="too_many_items")``."""
        super().__init_subclass__(**kwargs)
        given = {
            "status": status,
            "type": type,
            "code": code,
            "closes_connection": closes_connection,
            "stops_reading": stops_reading,
        }
        for name, value in given.items():
            if value is not None:
                setattr(cls, name, value)

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        headers: Mapping[str, str] | None = None,
        rejection: Rejection | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.headers: Mapping[str, str] = headers or {}
        self.rejection = rejection

    def to_dict(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def to_anthropic(self) -> dict[str, Any]:
        """Anthropic's shape (the Messages API), the message naming the part as in OpenAI's."""
        kind = ANTHROPIC_TYPES.get(self.status) or ("invalid_request_error" if self.status < 500 else "api_error")
        return {"type": "error", "error": {"type": kind, "message": self.message}}

    def located_at(self, location: str, *, what: str = "", rejection: Rejection | None = None) -> GatewayError:
        """The same error, said of the part at ``location``: one request's error about a medium,
        given to another request that carries the same medium elsewhere, or an encoder's about an
        image, said at its part (``what``: what of the part it is about, "a frame of the video";
        ``rejection``: how it counts, else as it did). Itself when it is said of that part already."""
        if location == self.param and not what and rejection is None:
            return self
        message = self.message
        if self.param and message.startswith(f"{self.param}: "):
            message = message[len(self.param) + 2 :]
        return type(self)(
            f"{location}: {what + ': ' if what else ''}{message}",
            param=location,
            headers=self.headers,
            rejection=rejection if rejection is not None else self.rejection,
        )


class InvalidRequestError(GatewayError, status=400, type="invalid_request_error", code="invalid_request"): ...


class UnreadableBodyError(InvalidRequestError, closes_connection=True):
    """A body that cannot be decoded (corrupt gzip); the connection cannot be reused after it."""


class UnsupportedModalityError(InvalidRequestError, code="unsupported_modality"): ...


class UnsupportedOutputModalityError(InvalidRequestError, code="unsupported_output_modality"):
    """An output (audio, image) the request asks of a model that does not produce it (``produces:``)."""


class InvalidPriorityError(InvalidRequestError, code="invalid_priority"):
    """An ``x-priority`` header that names no priority class."""


class UnsupportedApiError(InvalidRequestError, code="unsupported_api"):
    """A model whose upstreams do not serve the API the request came in on (routing.yaml ``apis:``)."""


class TooManyItemsError(InvalidRequestError, code="too_many_items"): ...


class InvalidContentPartError(InvalidRequestError, code="invalid_content_part"): ...


class InvalidImageError(InvalidRequestError, code="invalid_image"): ...


class TooManyVisualTokensError(InvalidRequestError, code="too_many_visual_tokens"):
    """A request's images cost the model more tokens than ``limits.visual_tokens``."""


class ImageTooLargeError(InvalidRequestError, code="image_too_large"):
    """An image over ``limits.image_pixels``, or one the model's processor refuses for its shape."""


class ImagesRefusedError(InvalidImageError):
    """A vLLM encoder instance refused a group of images (400, 422): the client's fault, said at
    the request's first part that carries one of ``uuids``."""

    def __init__(self, message: str, *, uuids: tuple[str, ...] = (), **kwargs: Any) -> None:
        super().__init__(message, **kwargs)
        self.uuids = uuids


class InvalidVideoError(InvalidRequestError, code="invalid_video"):
    """A video the gateway samples into frames cannot be, or costs more than a request may spend."""


class InvalidAudioError(InvalidRequestError, code="invalid_audio"):
    """Audio the gateway transcribes is not base64, or the transcription model refused it."""


class InvalidFileError(InvalidRequestError, code="invalid_file"):
    """A document the gateway extracts cannot be read, is of a type it does not read, or breaks a bound."""


class MediaRefusedError(InvalidRequestError, code="media_refused"): ...


class AuthenticationError(GatewayError, status=401, type="authentication_error", code="invalid_admin_token"): ...


class InvalidApiKeyError(AuthenticationError, code="invalid_api_key"):
    """No key, or not one of auth.keys (the same answer for both)."""


class PermissionDeniedError(GatewayError, status=403, type="permission_error", code="admin_disabled"): ...


class NotFoundError(GatewayError, status=404, type="invalid_request_error", code="not_found"): ...


class ModelNotFoundError(NotFoundError, code="model_not_found"): ...


class MethodNotAllowedError(GatewayError, status=405, type="invalid_request_error", code="method_not_allowed"): ...


class RequestTimeoutError(
    GatewayError,
    status=408,
    type="invalid_request_error",
    code="request_timeout",
    closes_connection=True,
    stops_reading=True,
):
    """The client took too long to send its request; the connection is closed after the answer."""


class PayloadTooLargeError(
    GatewayError, status=413, type="invalid_request_error", code="payload_too_large", closes_connection=True
):
    """The body is over a limit; the rest of it is not read."""


class UnsupportedEncodingError(
    GatewayError,
    status=415,
    type="invalid_request_error",
    code="unsupported_content_encoding",
    closes_connection=True,
):
    """A Content-Encoding the gateway does not decode; the body is not read."""


class InvalidConfigError(GatewayError, status=422, type="invalid_request_error", code="invalid_config"):
    """POST /admin/reload found routing.yaml invalid; the running config stays."""


class RateLimitedError(GatewayError, status=429, type="rate_limit_error", code="rate_limit_exceeded"):
    """The key's rate_limit is spent (with Retry-After and the x-ratelimit-* headers)."""

    limit: ClassVar[str] = "rate"  # the reason label of gateway_rate_limited_total


class VisualTokensRateLimitedError(RateLimitedError, code="visual_tokens_rate_limit_exceeded"):
    """The key's visual_tokens_per_minute is spent (with its x-ratelimit-*-visual-tokens headers)."""

    limit = "visual_tokens"


class TokensRateLimitedError(RateLimitedError, code="tokens_rate_limit_exceeded"):
    """The key's tokens_per_minute or tokens_per_day is spent (with its x-ratelimit-*-tokens headers)."""

    limit = "tokens"


class ConcurrencyLimitError(RateLimitedError, code="concurrency_limit_exceeded"):
    """The key has max_concurrency requests in flight already."""

    limit = "concurrency"


class QueueFullError(GatewayError, status=429, type="rate_limit_error", code="queue_full"):
    """The model's max_concurrency are in flight and its queue is full (with Retry-After)."""


class UpstreamError(GatewayError, status=502, code="upstream_error"): ...


class UpstreamConnectError(UpstreamError, code="upstream_unreachable"): ...


class UpstreamTimeoutError(UpstreamError, status=504, code="upstream_timeout"): ...


class NoHealthyUpstreamError(UpstreamError, status=503, code="no_healthy_upstream"): ...


class EmbeddingsNotDeliveredError(UpstreamError):
    """A vLLM EC consumer failed for want of the primed embeddings, before any byte reached the
    client: the handler primes again and sends the request once more (never rendered to a client
    unless that is impossible; then it is a 502 like any upstream failure)."""


class QueueTimeoutError(GatewayError, status=503, code="queue_timeout"):
    """The request waited queue.timeout_s for a slot of its model (with Retry-After)."""


class PreemptedError(GatewayError, status=503, code="preempted"):
    """The request waited in its model's full queue and was shed for one of a higher priority
    class, before any byte of it went upstream (with Retry-After)."""


class LimitsStoreUnavailableError(GatewayError, status=503, code="limits_store_unavailable"):
    """server.limits_store failed or was slow, under on_failure: closed (with Retry-After)."""


class DecodersBusyError(GatewayError, status=503, code="decoders_busy"):
    """Every media decoding thread is busy and the queue for them full, or waited in too long
    (with Retry-After); ``reason`` says which: ``queue_full`` or ``queue_timeout``."""

    def __init__(self, message: str, *, reason: str = "queue_full", **kwargs: Any) -> None:
        kwargs.setdefault("headers", {"Retry-After": "1"})
        super().__init__(message, **kwargs)
        self.reason = reason


class EncoderError(GatewayError, status=503, code="encoder_unavailable"): ...


# Anthropic's error types by status (docs.claude.com/en/api/errors; the SDK's ErrorType)
ANTHROPIC_TYPES: Mapping[int, str] = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    408: "timeout_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
    504: "timeout_error",
    529: "overloaded_error",
}
Shape = Literal["openai", "anthropic"]


# The statuses a client's retry would get again: the openai and anthropic SDKs (and Claude Code,
# which retries a 401 ten times otherwise) honour ``x-should-retry: false``. A 408, 409 or 429 may
# pass, and a 5xx is the engine's or the gateway's, not the request's.
FINAL_STATUSES = frozenset(range(400, 500)) - {408, 409, 429}


def render(error: GatewayError, shape: Shape = "openai") -> web.Response:
    """The only place a GatewayError becomes a response, in the shape of the API it answers."""
    headers = {"Content-Type": "application/json", **error.headers}  # as a header: content_type= parses it
    if error.status in FINAL_STATUSES:
        headers.setdefault("x-should-retry", "false")
    body = error.to_anthropic() if shape == "anthropic" else error.to_dict()
    response = web.Response(status=error.status, body=orjson.dumps(body), headers=headers)
    if error.closes_connection:
        response.force_close()
    return response


# The events that end a stream broken after its first byte, as each API's clients read them (an
# API's ``stream_error``, gateway.admission.apis): (the error, the stream's response id and model)
StreamError = Callable[[GatewayError, str | None, str | None], bytes]


def openai_stream_error(error: GatewayError, response_id: str | None = None, model: str | None = None) -> bytes:
    """Chat's and completions' ``data: {"error": ...}`` (the openai SDK raises it)."""
    return b"data: " + orjson.dumps(error.to_dict()) + b"\n\n"


def responses_stream_error(error: GatewayError, response_id: str | None = None, model: str | None = None) -> bytes:
    """The Responses API's: an ``error`` event (the openai SDK's) and then ``response.failed``
    with the error in ``response.error`` (``response_id``: the stream's response, from its
    ``response.created``), the event Codex reads (it ignores ``error``, reports a stream closed
    before ``response.completed`` and reconnects)."""
    event = {"type": "error", "code": error.code, "message": error.message, "param": error.param}
    failed = {
        "type": "response.failed",
        "response": {
            "id": response_id,
            "object": "response",
            "status": "failed",
            "model": model,
            "output": [],
            "error": {"code": error.code, "message": error.message},
        },
    }
    return (
        b"event: error\ndata: "
        + orjson.dumps(event)
        + b"\n\nevent: response.failed\ndata: "
        + orjson.dumps(failed)
        + b"\n\n"
    )


def anthropic_stream_error(error: GatewayError, response_id: str | None = None, model: str | None = None) -> bytes:
    """Anthropic's ``event: error`` (the anthropic SDK and Claude Code raise it)."""
    return b"event: error\ndata: " + orjson.dumps(error.to_anthropic()) + b"\n\n"


def did_you_mean(value: str, choices: Iterable[str]) -> str:
    """``; did you mean 'X'?`` for the choice closest to ``value`` (a typo's fix), or nothing. The
    value may be client text on an error's path, which anyone can reach: its first 64 characters
    are matched against at most 64 choices (past that, none is suggested), so its cost is
    bounded whatever it is (~0.1 ms)."""
    listed = list(choices)
    if len(listed) > 64:
        return ""
    close = difflib.get_close_matches(value[:64], listed, n=1)
    return f"; did you mean '{close[0]}'?" if close else ""


def clip(text: str, limit: int = 64) -> str:
    """Client text as error messages echo it: never more than ``limit`` characters of it."""
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


class HTTPStatusError(GatewayError):
    """A status that aiohttp raised itself, in the OpenAI shape (``code`` is ``http_<status>``)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status  # type: ignore[misc]
        self.type = "invalid_request_error" if status < 500 else "server_error"  # type: ignore[misc]
        self.code = f"http_{status}"  # type: ignore[misc]


@dataclass(frozen=True, slots=True)
class ConfigProblem:
    """One problem in a routing.yaml, located as precisely as the YAML allows."""

    file: str
    line: int  # 1-based; 0 when unknown
    column: int  # 1-based; 0 when unknown
    path: str  # dotted path, e.g. models[2].accepts[1]; "" for the document itself
    message: str

    def __str__(self) -> str:
        where = f"{self.file}:{self.line}:{self.column}" if self.line else self.file
        return f"{where}: {self.path}: {self.message}" if self.path else f"{where}: {self.message}"


class ConfigError(Exception):
    """A routing.yaml that cannot be used; ``problems`` lists every problem found, in file order."""

    def __init__(self, problems: Sequence[ConfigProblem]) -> None:
        self.problems = tuple(problems)
        super().__init__("\n".join(str(p) for p in self.problems))


def error_detail(payload: bytes) -> str:
    """``": <message>"`` of an OpenAI-shape error body another server answered (an encoder, a
    transcription model), to quote in the gateway's own message; "" when it is not one."""
    try:
        message = orjson.loads(payload)["error"]["message"]
    except (orjson.JSONDecodeError, KeyError, TypeError):
        return ""
    return f": {message}" if isinstance(message, str) else ""

"""Every error the encoder backend answers with, rendered in one place (the app's middleware). They
are the gateway's errors (``gateway.errors.GatewayError``: the same shape,
``{"error": {"message", "type", "param", "code"}}``, and aiohttp's own statuses as
``HTTPStatusError``)::

    BackendError            500 server_error          internal_error
    ├── InvalidImageError   400 invalid_request_error invalid_image
    ├── ImageTooLargeError  413 invalid_request_error payload_too_large
    ├── OverloadedError     503 server_error          encoder_overloaded (with Retry-After)
    ├── UnhealthyError      503 server_error          encoder_unhealthy
    └── EncodeTimeoutError  504 server_error          encoder_timeout

The gateway reads the status (400/413: the client's image; 5xx: try another backend).
"""

from __future__ import annotations

from gateway.errors import GatewayError, HTTPStatusError

__all__ = [
    "BackendError",
    "EncodeTimeoutError",
    "HTTPStatusError",
    "ImageTooLargeError",
    "InvalidImageError",
    "OverloadedError",
    "UnhealthyError",
]


class BackendError(GatewayError):
    """The backend's own failures (500 internal_error); its 4xx and 5xx below."""


class InvalidImageError(BackendError, status=400, type="invalid_request_error", code="invalid_image"): ...


class ImageTooLargeError(BackendError, status=413, type="invalid_request_error", code="payload_too_large"): ...


class OverloadedError(BackendError, status=503, code="encoder_overloaded"): ...


class UnhealthyError(BackendError, status=503, code="encoder_unhealthy"): ...


class EncodeTimeoutError(BackendError, status=504, code="encoder_timeout"): ...

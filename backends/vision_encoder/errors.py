"""Every error the encoder backend answers with, rendered in one place (the app's middleware), in
the gateway's shape ``{"error": {"message", "type", "param", "code"}}``::

    BackendError            500 server_error          internal_error
    ├── InvalidImageError   400 invalid_request_error invalid_image
    ├── ImageTooLargeError  413 invalid_request_error payload_too_large
    ├── OverloadedError     503 server_error          encoder_overloaded (with Retry-After)
    ├── UnhealthyError      503 server_error          encoder_unhealthy
    └── EncodeTimeoutError  504 server_error          encoder_timeout

The gateway reads the status (400/413: the client's image; 5xx: try another backend).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar


class BackendError(Exception):
    status: ClassVar[int] = 500
    type: ClassVar[str] = "server_error"
    code: ClassVar[str] = "internal_error"

    def __init__(self, message: str, *, headers: Mapping[str, str] | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.headers: Mapping[str, str] = headers or {}

    def to_dict(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": None, "code": self.code}}


class InvalidImageError(BackendError):
    status = 400
    type = "invalid_request_error"
    code = "invalid_image"


class ImageTooLargeError(BackendError):
    status = 413
    type = "invalid_request_error"
    code = "payload_too_large"


class OverloadedError(BackendError):
    status = 503
    code = "encoder_overloaded"


class UnhealthyError(BackendError):
    status = 503
    code = "encoder_unhealthy"


class EncodeTimeoutError(BackendError):
    status = 504
    code = "encoder_timeout"


class HTTPStatusError(BackendError):
    """A status aiohttp raised itself (404, 405, ...), in the same shape."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status  # type: ignore[misc]
        self.type = "invalid_request_error" if status < 500 else "server_error"  # type: ignore[misc]
        self.code = f"http_{status}"  # type: ignore[misc]

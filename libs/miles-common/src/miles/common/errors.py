"""The error base of every miles service.

Each class carries its HTTP status and gRPC status code, so the HTTP app factory and the gRPC interceptor map
any `MilesError` in one place. Services subclass these (e.g. `class SessionNotFound(NotFoundError)`) and raise;
they never build status responses by hand. Unexpected exceptions are not caught here: they propagate and
become 500 / INTERNAL, loudly.
"""

from __future__ import annotations

from typing import Any, ClassVar

import grpc


class MilesError(Exception):
    """Base of every error a miles service raises on purpose.

    `field` names the offending input field (e.g. "group.samples[0].loss_mask") when there is one;
    `retry_after_s` tells the caller when a retry may succeed (sent as `Retry-After`).
    """

    http_status: ClassVar[int] = 500
    grpc_status: ClassVar[grpc.StatusCode] = grpc.StatusCode.INTERNAL
    code: ClassVar[str] = "internal"
    retryable: ClassVar[bool] = False

    def __init__(
        self,
        message: str,
        *,
        field: str | None = None,
        retry_after_s: float | None = None,
        details: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.field = field
        self.retry_after_s = retry_after_s
        self.details = details or {}

    def to_dict(self) -> dict[str, Any]:
        """The JSON error body: {"type", "code", "message", "field"?, "retry_after_s"?, "details"?}."""
        body: dict[str, Any] = {"type": type(self).__name__, "code": self.code, "message": self.message}
        if self.field is not None:
            body["field"] = self.field
        if self.retry_after_s is not None:
            body["retry_after_s"] = self.retry_after_s
        if self.details:
            body["details"] = self.details
        return body


class InvalidArgumentError(MilesError):
    """The request is malformed or violates a documented constraint; fix the input and do not retry."""

    http_status = 400
    grpc_status = grpc.StatusCode.INVALID_ARGUMENT
    code = "invalid_argument"


class UnauthenticatedError(MilesError):
    """No credentials, or credentials that are not valid."""

    http_status = 401
    grpc_status = grpc.StatusCode.UNAUTHENTICATED
    code = "unauthenticated"


class PermissionDeniedError(MilesError):
    """Valid credentials that do not allow this operation on this resource."""

    http_status = 403
    grpc_status = grpc.StatusCode.PERMISSION_DENIED
    code = "permission_denied"


class NotFoundError(MilesError):
    """The named resource does not exist (or no longer exists)."""

    http_status = 404
    grpc_status = grpc.StatusCode.NOT_FOUND
    code = "not_found"


class ConflictError(MilesError):
    """The resource is in a state that conflicts with the request (e.g. a concurrent update or version gate).

    Retryable: the same request may succeed once the state has moved on.
    """

    http_status = 409
    grpc_status = grpc.StatusCode.ABORTED
    code = "conflict"
    retryable = True


class FailedPreconditionError(MilesError):
    """The system is not in a state where the request can run (e.g. deleting a running job); not retryable as is."""

    http_status = 409
    grpc_status = grpc.StatusCode.FAILED_PRECONDITION
    code = "failed_precondition"


class UnprocessableError(MilesError):
    """Well-formed input whose content cannot be processed (e.g. records that do not reconstruct a session)."""

    http_status = 422
    grpc_status = grpc.StatusCode.INVALID_ARGUMENT
    code = "unprocessable"


class ResourceExhaustedError(MilesError):
    """A quota or capacity is full; back off and retry (see retry_after_s)."""

    http_status = 429
    grpc_status = grpc.StatusCode.RESOURCE_EXHAUSTED
    code = "resource_exhausted"
    retryable = True


class UpstreamError(MilesError):
    """A service this one depends on answered with something malformed."""

    http_status = 502
    grpc_status = grpc.StatusCode.INTERNAL
    code = "bad_upstream"


class UnavailableError(MilesError):
    """This service or one it depends on cannot be reached right now; retry with backoff."""

    http_status = 503
    grpc_status = grpc.StatusCode.UNAVAILABLE
    code = "unavailable"
    retryable = True


class DeadlineExceededError(MilesError):
    """The operation did not finish within its deadline."""

    http_status = 504
    grpc_status = grpc.StatusCode.DEADLINE_EXCEEDED
    code = "deadline_exceeded"
    retryable = True


class ConfigError(MilesError):
    """Settings are invalid or ask for something that cannot work here; raised at start-up, never per request."""

    code = "config"


_STANDARD_ERRORS: tuple[type[MilesError], ...] = (
    InvalidArgumentError,
    UnauthenticatedError,
    PermissionDeniedError,
    NotFoundError,
    ConflictError,
    FailedPreconditionError,
    ResourceExhaustedError,
    UnavailableError,
    DeadlineExceededError,
)
_CLASS_BY_GRPC_STATUS: dict[grpc.StatusCode, type[MilesError]] = {cls.grpc_status: cls for cls in _STANDARD_ERRORS}
_CLASS_BY_HTTP_STATUS: dict[int, type[MilesError]] = {
    **{cls.http_status: cls for cls in reversed(_STANDARD_ERRORS)},
    422: UnprocessableError,
    502: UpstreamError,
}


def error_class_for_grpc_status(status: grpc.StatusCode) -> type[MilesError]:
    """The standard error class a gRPC status code maps back to (MilesError for codes with no class)."""
    return _CLASS_BY_GRPC_STATUS.get(status, MilesError)


def error_class_for_http_status(status: int) -> type[MilesError]:
    """The standard error class an HTTP status maps back to (UnavailableError for other 5xx, else MilesError)."""
    if status in _CLASS_BY_HTTP_STATUS:
        return _CLASS_BY_HTTP_STATUS[status]
    return UnavailableError if status >= 500 else MilesError

"""Errors of the sandbox-gateway, each a subclass of the common hierarchy (mapped to HTTP/gRPC in one place)."""

from __future__ import annotations

from miles.common.errors import (
    ConfigError,
    FailedPreconditionError,
    InvalidArgumentError,
    NotFoundError,
    ResourceExhaustedError,
    UnavailableError,
)


class SandboxNotFoundError(NotFoundError):
    """No live sandbox has this id (never created, destroyed or reaped), or none the caller may see."""

    @classmethod
    def of(cls, sandbox_id: str) -> SandboxNotFoundError:
        """The one answer for an id the caller cannot use, whether it never existed or is another job's."""
        return cls(f"no sandbox {sandbox_id!r} (never created, destroyed or reaped)", field="sandbox_id")


class InvalidSandboxRequestError(InvalidArgumentError):
    """A request field is out of range or malformed; `field` names it (e.g. "limits.memory_bytes")."""


class FileTooLargeError(InvalidArgumentError):
    """A file write or stdin larger than the gateway's cap (HTTP 413, gRPC INVALID_ARGUMENT)."""

    http_status = 413


class UnsafePathError(InvalidArgumentError):
    """A path that leaves the work dir, crosses a symlink, or names something that is not a regular file."""


class QuotaExceededError(ResourceExhaustedError):
    """The job (or the whole gateway) already has its maximum number of live sandboxes."""


class SandboxStartFailedError(UnavailableError):
    """The backend could not start a sandbox (bwrap failed, the pod did not become ready, the provider refused)."""


class SandboxGoneError(FailedPreconditionError):
    """The sandbox exists but can no longer run anything (its processes died or it is being destroyed)."""


class BackendUnusableError(ConfigError):
    """The configured backend cannot work on this machine (e.g. bubblewrap is missing); raised at start-up."""

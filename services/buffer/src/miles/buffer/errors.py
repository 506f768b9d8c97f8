"""Errors the buffer raises on purpose; each maps to its gRPC status in miles.common (one place)."""

from __future__ import annotations

from miles.common.errors import InvalidArgumentError, ResourceExhaustedError, UnavailableError


class InvalidRequestError(InvalidArgumentError):
    """A request field violates the contract (the field is named); nothing was stored."""


class UnknownJobError(InvalidArgumentError):
    """The job was never configured (or was deleted); field "job_id"."""

    def __init__(self, job_id: str) -> None:
        super().__init__(f"job {job_id!r} is not configured in the buffer (ConfigureJob first)", field="job_id")


class BufferFullError(ResourceExhaustedError):
    """The job holds capacity_groups groups and none left within the push's deadline."""


class StoreUnavailableError(UnavailableError):
    """Redis cannot be reached or is loading. The call may or may not have taken effect; every buffer call is
    safe to retry (pushes, acks, nacks and extensions are idempotent; a lost pull's leases simply expire)."""

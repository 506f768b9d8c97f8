"""Errors weight-sync raises on purpose; each maps to its HTTP/gRPC status in miles.common (one place)."""

from __future__ import annotations

import grpc

from miles.common.errors import (
    ConflictError,
    FailedPreconditionError,
    InvalidArgumentError,
    MilesError,
    NotFoundError,
    UnavailableError,
    UpstreamError,
)


class InvalidPublishError(InvalidArgumentError):
    """A publish violates the contract (bad header, mismatched shapes/dtypes, bad chunk, truncated stream, bad
    checksum); the field is named. Nothing was stored and no engine was touched."""


class WrongParentError(FailedPreconditionError):
    """A publish names a parent version that is not the store's latest (or a version that is not parent + 1)."""


class VersionTakenError(FailedPreconditionError):
    """A publish names a version number the store already holds with other weights (numbers are never reused), or
    one retention already removed."""


class UnknownJobError(NotFoundError):
    """The request names another job than the one this daemon serves; field "job_id"."""

    def __init__(self, job_id: str, served_job_id: str) -> None:
        super().__init__(f"this daemon serves job {served_job_id!r}, not {job_id!r}", field="job_id")


class VersionNotFoundError(NotFoundError):
    """The version was never stored, or retention removed it."""


class StoreCorruptError(MilesError):
    """Stored bytes do not match their content address or manifest (disk corruption, tampering, truncation)."""

    grpc_status = grpc.StatusCode.DATA_LOSS
    code = "data_loss"


class DeltaVerificationError(StoreCorruptError):
    """A reconstructed tensor's sha256 differs from its manifest: the delta or the local copy is wrong. The
    delta transport falls back to a full load; nothing reached the engine."""


class EngineUpdateError(UpstreamError):
    """An engine (or the router) refused or failed a step of an update; the engine is left drained."""

    http_status_of_engine: int = 0
    """The engine's or router's HTTP status when it answered (0: it did not)."""


class EngineUnreachableError(UnavailableError):
    """An engine, the router or a peer daemon could not be reached."""


class RolloutInProgressError(ConflictError):
    """Another rollout holds the engine; retry once it has finished."""


class UnsupportedTransportError(InvalidArgumentError):
    """The transport cannot run here (e.g. NCCL requested from a daemon, disk without a model config)."""


class DataChannelError(UnavailableError):
    """A raw TCP data channel broke during the transfer (closed early = truncated, reset, stalled, extra bytes);
    what arrived is discarded and no engine is touched."""


class DataChannelSetupError(DataChannelError):
    """A data channel could not be set up (no answer, connection refused, token refused); callers fall back to
    the gRPC stream (FetchWeights)."""


class PublishChannelUnavailableError(FailedPreconditionError):
    """This daemon takes no publish over a data channel (the data channel is off, or its listener cannot start);
    the trainer publishes with PublishWeights instead. Its class name (miles-error-type) tells it apart from a
    refused publish (WrongParentError, VersionTakenError), after which the trainer must not send anything."""

"""Errors of the controller: subclasses of `miles.common.errors`, mapped to HTTP by the common app factory."""

from __future__ import annotations

from miles.common.errors import (
    FailedPreconditionError,
    NotFoundError,
    ResourceExhaustedError,
    UnauthenticatedError,
    UnprocessableError,
)


class JobNotFoundError(NotFoundError):
    """No job with this id (never submitted, or deleted)."""


class JobStateConflictError(FailedPreconditionError):
    """The job's state does not allow the request (e.g. DELETE of a running job, PATCH of an ended one)."""

    code = "job_state_conflict"


class EvalExistsError(FailedPreconditionError):
    """A weight version of the job already has a score (one per version, the first scorer's; a `missed` entry is
    no score and gets replaced)."""

    code = "eval_exists"


class IllegalTransitionError(FailedPreconditionError):
    """A state change the job state machine does not allow (e.g. SUCCEEDED -> RUNNING)."""

    code = "illegal_transition"


class IdempotencyKeyReusedError(UnprocessableError):
    """An `Idempotency-Key` already used with a different request body."""

    code = "idempotency_key_reused"


class RoutingReplayNeedsMoEError(UnprocessableError):
    """`train.routing_replay: true` with a model whose config.json has no MoE layers (nothing to replay)."""

    code = "routing_replay_needs_moe"


class TooManyActiveJobsError(ResourceExhaustedError):
    """`max_active_jobs` jobs are already PENDING, QUEUED or RUNNING."""


class MissingTokenError(UnauthenticatedError):
    """No `Authorization: Bearer <token>` header."""


class WrongTokenError(UnauthenticatedError):
    """A bearer token that is not one of the controller's api tokens."""

"""Errors of the trainer, mapped to gRPC/HTTP statuses by miles.common in one place."""

from __future__ import annotations

from miles.common.errors import FailedPreconditionError, UnavailableError


class OnPolicyViolationError(FailedPreconditionError):
    """strict_on_policy: recomputed logprobs of current-version data differ from the rollout logprobs."""

    code = "on_policy_violation"


class TrainerNotRunningError(FailedPreconditionError):
    """The request needs a running training loop (a job is configured and the trainer has not stopped)."""

    code = "trainer_not_running"


class TrainerBusyError(UnavailableError):
    """The trainer cannot take the request right now (e.g. it is starting up); retry."""

    code = "trainer_busy"

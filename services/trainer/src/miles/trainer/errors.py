"""Errors of the trainer, mapped to gRPC/HTTP statuses by miles.common in one place."""

from __future__ import annotations

from miles.common.errors import FailedPreconditionError, MilesError, UnavailableError


class OnPolicyViolationError(FailedPreconditionError):
    """strict_on_policy: recomputed logprobs of current-version data differ from the rollout logprobs."""

    code = "on_policy_violation"


class TrainerNotRunningError(FailedPreconditionError):
    """The request needs a running training loop (a job is configured and the trainer has not stopped)."""

    code = "trainer_not_running"


class TrainerBusyError(UnavailableError):
    """The trainer cannot take the request right now (e.g. it is starting up); retry."""

    code = "trainer_busy"


class PublishDigestMismatchError(MilesError):
    """The receiver of a published version reports another weights digest than the trainer computed: bytes changed
    on the way. Not retryable (the trainer fails; its restart resumes publishing from its checkpoint)."""

    code = "publish_digest_mismatch"


class PublishStateError(FailedPreconditionError):
    """What the receiving side holds cannot be reconciled with the trainer's weights (e.g. the weight-sync store is
    behind the trainer's checkpoint); the message says what was found."""

    code = "publish_state"


class CheckpointDirNotSharedError(FailedPreconditionError):
    """A rank does not see the directory rank 0 created: checkpoint_format `sharded` needs one checkpoint_dir that
    every rank mounts."""

    code = "checkpoint_dir_not_shared"

"""The session-server's one error hierarchy: every error a request can meet, each carrying its HTTP status.

All classes derive from `miles.common.errors`, so the common HTTP app maps them in one handler (JSON body
`{"error": {type, code, message, field?, retry_after_s?, details?}}` plus `Retry-After` when set). The TITO
package's errors (non-append history, unsupported role, bad tool-call JSON: 400; template not append-only: 422)
derive from the same classes and are re-exported here. Anything else that escapes is a bug and becomes a 500.
"""

from __future__ import annotations

from typing import ClassVar

from miles.common.errors import (
    ConflictError,
    InvalidArgumentError,
    MilesError,
    NotFoundError,
    PermissionDeniedError,
    UnauthenticatedError,
    UnavailableError,
    UnprocessableError,
    UpstreamError,
)
from miles.session.tito.errors import (
    ChatTemplateKwargConflictError,
    InvalidMessageError,
    InvalidToolCallArgumentsError,
    NonAppendHistoryError,
    TemplateNotPrefixError,
    TemplateRenderError,
    UnsupportedRoleError,
)


class SessionNotFoundError(NotFoundError):
    """No live session has this id (never created, deleted, or expired after its ttl_s)."""

    code = "session_not_found"


class ExportUnavailableError(UnavailableError):
    """The export process answering a long session's GET or samples failed or exited (exports.py); retry."""

    code = "export_unavailable"


class JobNotFoundError(NotFoundError):
    """No model config is registered for the job and the server has no default model."""

    code = "job_not_found"


class MissingTokenError(UnauthenticatedError):
    """The request carries no `Authorization: Bearer <token>` header."""

    code = "missing_token"


class WrongTokenError(PermissionDeniedError):
    """The bearer token is neither this session's capability token nor the operator token."""

    code = "wrong_token"


class InvalidRequestError(InvalidArgumentError):
    """The request body is not valid JSON or not a valid request (the message names the field)."""

    code = "invalid_request"


class InvalidSessionRequestError(UnprocessableError):
    """A POST /v1/sessions body or header breaks the published schema (no body, ttl_s out of range, ...)."""

    code = "invalid_session_request"


class IdempotencyKeyReusedError(UnprocessableError):
    """An Idempotency-Key came again with another body: a key stays bound to its first body while its session lives."""

    code = "idempotency_key_reused"


class RequestTooLargeError(InvalidArgumentError):
    """The request body is larger than max_body_bytes."""

    http_status: ClassVar[int] = 413
    code = "request_too_large"


class PromptTooLongError(InvalidArgumentError):
    """The prompt leaves no room to generate within the model's context."""

    code = "prompt_too_long"


class ToolsChangedError(InvalidArgumentError):
    """A later turn sent a different tool list than the session's first turn (the prompt was rendered with it)."""

    code = "tools_changed"


class TreeFullError(ConflictError):
    """A tree session holds max_tree_nodes nodes or max_tree_tokens stored ids: start a new session."""

    code = "session_tree_full"


class AdapterNotFoundError(NotFoundError):
    """A LoRA job has no live adapter yet (the trainer has not published a version)."""

    code = "adapter_not_found"


class AdapterNotEnabledError(ConflictError):
    """An adapter was set for a job whose config does not have lora_adapter on."""

    code = "adapter_not_enabled"


class AdapterVersionRegressedError(ConflictError):
    """An adapter was set with a lower weight_version than the job's live one."""

    code = "adapter_version_regressed"


class AdapterNotPublishedError(UnavailableError):
    """A LoRA job's turn found no live adapter within adapter_wait_s; retry once the trainer published one."""

    code = "adapter_not_published"


class InvalidJobConfigError(InvalidArgumentError):
    """A job model config names a model directory, family or kwargs that cannot be served."""

    code = "invalid_job_config"


class SampleAssemblyError(UnprocessableError):
    """The session's records do not reconstruct its token buffer (e.g. an output that is not in it)."""

    code = "sample_assembly_failed"


class SampleContractError(MilesError):
    """A sample this server built breaks the Sample contract (miles.common.contracts.samples): a bug, so 500."""

    code = "sample_contract_broken"


class SessionBusyError(UnavailableError):
    """The per-session lock stayed taken for lock_wait_s (another request is in its critical section)."""

    code = "session_busy"


class StoreUnavailableError(UnavailableError):
    """The session store (Redis) cannot be reached."""

    code = "store_unavailable"


class ModelUnavailableError(UnavailableError):
    """The session's tokenizer or chat template cannot be loaded on this replica."""

    code = "model_unavailable"


class UpstreamUnavailableError(UnavailableError):
    """The rollout router / engine cannot be reached, timed out, is overloaded or aborted the generation."""

    code = "upstream_unavailable"


class UpstreamRejectedError(InvalidArgumentError):
    """The engine refused the request as invalid (its message is passed on)."""

    code = "upstream_rejected"


class UpstreamConflictError(ConflictError):
    """The engine answered 409 (e.g. behind a required weight version); retry."""

    code = "upstream_conflict"


class UpstreamMalformedError(UpstreamError):
    """The engine answered something that is not a valid SGLang /generate response."""

    code = "upstream_malformed"


class UpstreamRoutingMismatchError(UpstreamMalformedError):
    """A session that records routing (R3) got no routed experts, or another number of rows than it asked for."""

    code = "upstream_routing_mismatch"


__all__ = [
    "AdapterNotEnabledError",
    "AdapterNotFoundError",
    "AdapterNotPublishedError",
    "AdapterVersionRegressedError",
    "ChatTemplateKwargConflictError",
    "IdempotencyKeyReusedError",
    "InvalidJobConfigError",
    "InvalidMessageError",
    "InvalidRequestError",
    "InvalidSessionRequestError",
    "InvalidToolCallArgumentsError",
    "JobNotFoundError",
    "MissingTokenError",
    "ModelUnavailableError",
    "NonAppendHistoryError",
    "PromptTooLongError",
    "RequestTooLargeError",
    "SampleAssemblyError",
    "SampleContractError",
    "SessionBusyError",
    "SessionNotFoundError",
    "StoreUnavailableError",
    "TemplateNotPrefixError",
    "TemplateRenderError",
    "ToolsChangedError",
    "UnsupportedRoleError",
    "UpstreamConflictError",
    "UpstreamMalformedError",
    "UpstreamRejectedError",
    "UpstreamRoutingMismatchError",
    "UpstreamUnavailableError",
    "WrongTokenError",
]

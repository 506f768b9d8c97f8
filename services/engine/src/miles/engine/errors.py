"""Errors of the engine, mapped to HTTP by miles.common (one place).

`BadRequestError` is what SGLang answers with HTTP 400 `{"error": {"message": ...}}` for a bad /generate
request (empty input, out-of-vocabulary ids, negative max_new_tokens, prompt over the context ...): our body
carries the same `error.message` (plus miles' `type` and `code`). Request-schema errors (wrong JSON types) are
answered by the HTTP layer with SGLang's OpenAI-style 400 body instead.
"""

from __future__ import annotations

from miles.common.errors import ConflictError, InvalidArgumentError, UnavailableError


class BadRequestError(InvalidArgumentError):
    """The request cannot be served as sent (SGLang's 400)."""

    code = "bad_request"


class EngineNotReadyError(UnavailableError):
    """The engine is starting or stopping."""

    code = "engine_not_ready"


class EngineBusyError(InvalidArgumentError):
    """The operation needs an idle engine (no running or waiting request), e.g. releasing the KV cache."""

    code = "engine_busy"


class WeightUpdateError(InvalidArgumentError):
    """New weights were refused (unreadable, unknown names, wrong shapes, a failed or unknown weight-update group);
    the old weights stay in place."""

    code = "weight_update_failed"


class WeightsCheckError(InvalidArgumentError):
    """/weights_checker cannot answer: an unknown action or dtype, or a model that holds no weights."""

    code = "weights_check_failed"


class WeightVersionBehindError(ConflictError):
    """The request demands a newer weight version than this engine serves (409, retry once it is updated)."""

    code = "weight_version_behind"

"""Errors of the TITO package: each names what is wrong and what to change.

They subclass the `miles.common.errors` classes, so the session-server maps them to HTTP statuses in its one
error handler (400 for bad requests, 422 for content that cannot be tokenized, 500-class config errors at
start-up). `details` carries machine-readable context (family, role, message index).
"""

from __future__ import annotations

from miles.common.errors import (
    ConfigError,
    InvalidArgumentError,
    NotFoundError,
    UnprocessableError,
)


class UnknownFamilyError(NotFoundError):
    """No TITO family is registered under the requested name."""

    code = "tito_unknown_family"


class NonAppendHistoryError(InvalidArgumentError):
    """The request's messages do not extend the stored history (an earlier message was changed or removed)."""

    code = "tito_non_append_history"


class UnsupportedRoleError(InvalidArgumentError):
    """A message role is unknown, or is not an append role the family's template renders append-only."""

    code = "tito_unsupported_role"


class InvalidMessageError(InvalidArgumentError):
    """A message is malformed (missing role, non-string content, tool call without a function name, ...)."""

    code = "tito_invalid_message"


class InvalidToolCallArgumentsError(InvalidArgumentError):
    """A tool call's `function.arguments` is not a JSON object (as a JSON string or an object)."""

    code = "tito_invalid_tool_call_arguments"


class ChatTemplateKwargConflictError(InvalidArgumentError):
    """A request chat_template_kwargs value contradicts a value the family fixes (e.g. clear_thinking)."""

    code = "tito_chat_template_kwarg_conflict"


class TemplateNotPrefixError(UnprocessableError):
    """Rendering with the appended messages does not start with the rendering without them.

    The template re-renders earlier turns depending on what follows (a `loop.last` or last-user-index rule),
    so an incremental suffix cannot be taken. Use a family with a fixed template or avoid the role.
    """

    code = "tito_template_not_prefix"


class TemplateRenderError(UnprocessableError):
    """The chat template raised (jinja `raise_exception` or a template error) for these messages."""

    code = "tito_template_render_failed"


class TokenizerUnavailableError(ConfigError):
    """A tokenizer or chat template the family needs is not available on this machine."""

    code = "tito_tokenizer_unavailable"


__all__ = [
    "ChatTemplateKwargConflictError",
    "InvalidMessageError",
    "InvalidToolCallArgumentsError",
    "NonAppendHistoryError",
    "TemplateNotPrefixError",
    "TemplateRenderError",
    "TokenizerUnavailableError",
    "UnknownFamilyError",
    "UnsupportedRoleError",
]

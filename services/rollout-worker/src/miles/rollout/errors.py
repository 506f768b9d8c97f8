"""Errors of the rollout worker (subclasses of `miles.common.errors`).

Start-up problems (an agent that cannot be imported, an unreadable dataset, a cursor made for another dataset)
are `ConfigError`s: the process stops with one readable message. Per-episode failures never raise out of the
episode: they end as a sample status (see `episode.py`); the classes below only travel inside the worker.
"""

from __future__ import annotations

from miles.common.errors import ConfigError, UnavailableError, UnprocessableError


class UserCodeLoadError(ConfigError):
    """An agent or reward function named by a dotted path cannot be imported or is not a coroutine function."""

    code = "user_code_load"


class DatasetError(ConfigError):
    """The dataset cannot be read, is empty, or a row has no usable prompt."""

    code = "dataset"


class CursorMismatchError(ConfigError):
    """The job's cursor in Redis was made for a dataset of another size or seed (its prompt order would change)."""

    code = "cursor_mismatch"


class EnvironmentStartError(ConfigError):
    """The environment server could not start: no interpreter, bad connector args, or setup failed or ran past
    its startup timeout (the message carries the server's last output)."""

    code = "environment_start"


class EpisodeAbortedError(Exception):
    """An agent or environment gives up on an episode for a named reason (the episode ends ABORTED with it):
    `environment_error` (the environment raised or its server was unreachable), `bad_reward` (a malformed
    result)."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message


class BadRewardError(ValueError):
    """A reward function's per-role rewards do not fit the job's roles (a role missing, unknown, or declared by no
    job): the episode ends ABORTED with reason `bad_reward`."""


class SessionServerUnavailableError(UnavailableError):
    """The session server stayed unreachable (or answered 5xx/429) for the whole retry budget."""

    code = "session_server_unavailable"


class SampleAssemblyFailedError(UnprocessableError):
    """The session server could not turn the session into samples (422): the trajectory cannot be trusted."""

    code = "sample_assembly_failed"

"""What a connector implements: an `Environment` the server (`server.py`) exposes over the protocol.

A connector module `miles.envserver.connectors.<name>` has `create(args: dict) -> Environment`; `args` is the
job spec's `rollout.environment.args`, passed through unchanged (the connector validates it and raises
`ConnectorArgsError` naming the field). `setup` runs once before the server reports healthy (load the
environment, build its dataset); `rows` is then fixed for the server's life (the worker's dataset order
depends on it); `run_episode` may run many episodes concurrently on one event loop.
"""

from __future__ import annotations

import abc

from miles.envserver.protocol import EpisodeRequest, EpisodeResult, Row


class ConnectorArgsError(ValueError):
    """The spec's environment args are wrong (the server exits 2 with this message before it listens)."""


class Environment(abc.ABC):
    connector: str = ""
    """The connector's name (`reasoning_gym`, `verifiers`, `openenv`, `harbor`)."""

    @property
    @abc.abstractmethod
    def name(self) -> str:
        """The environment's own name (a dataset, an environment id, a task set)."""

    async def setup(self) -> None:  # noqa: B027 - optional hook
        """Load the environment (may be slow: it runs before /healthz answers 200)."""

    async def close(self) -> None:  # noqa: B027 - optional hook
        """Release what `setup` took (containers, sandboxes, subprocesses)."""

    @abc.abstractmethod
    def rows(self) -> list[Row]:
        """The prompts, in a fixed order; the worker shuffles and repeats them per its dataset settings."""

    @abc.abstractmethod
    async def run_episode(self, request: EpisodeRequest) -> EpisodeResult:
        """Run one episode against request.base_url (the session's OpenAI endpoint) and score it."""

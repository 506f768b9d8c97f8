"""The job's inference pools, for reward functions: a judge (or a reward model) reached through the OpenAI API.

A job's `inference_pools` are engines of their own model (miles.common.jobspec.pools); the controller registers a
session-server job config for each (`<job_id>--<name>`). A reward function opens a session on one and talks to it
like any OpenAI client:

    from miles.rollout.pools import pool_session

    async def reward(prompt, samples, agent_result):
        async with pool_session("judge") as session:
            client = openai.AsyncOpenAI(base_url=session.base_url, api_key=session.token)
            answer = await client.chat.completions.create(model="judge", messages=[...], temperature=0)
        ...

The session is deleted when the block ends: its turns never become samples (nothing of the judge is trained), and
the judge's engines see only the judge's requests. The worker configures the pools at start (`configure`); each
pool's name maps to its session-server job config.

Limits: one session per `pool_session` block (a judge call with several turns reuses it; concurrent judge calls
open several); the judge's model is served as it is, with no weight updates.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field

from miles.common.errors import ConfigError
from miles.rollout.sessions import SessionClient, SessionHandle

DEFAULT_POOL_SESSION_TTL_S = 600.0


@dataclass
class InferencePools:
    """The worker's session client and the job's pools: name -> session-server job config."""

    sessions: SessionClient
    job_configs: Mapping[str, str] = field(default_factory=dict)

    @contextlib.asynccontextmanager
    async def session(self, name: str, *, ttl_s: float = DEFAULT_POOL_SESSION_TTL_S) -> AsyncIterator[SessionHandle]:
        config = self.job_configs.get(name)
        if config is None:
            raise ConfigError(
                f"the job declares no inference pool {name!r} (inference_pools: {sorted(self.job_configs)})"
            )
        handle = await self.sessions.create(job_id=config, episode_id=f"pool-{uuid.uuid4().hex}", ttl_s=ttl_s)
        try:
            yield handle
        finally:
            await self.sessions.delete(handle, as_operator=True)


_configured: InferencePools | None = None


def configure(pools: InferencePools | None) -> None:
    """Set (or clear, with None) the pools `pool_session` opens sessions on; the worker calls it at start."""
    global _configured
    _configured = pools


def pool_session(
    name: str, *, ttl_s: float = DEFAULT_POOL_SESSION_TTL_S
) -> contextlib.AbstractAsyncContextManager[SessionHandle]:
    """A session on the job's inference pool `name`: its `base_url` and `token` are an OpenAI endpoint and key."""
    if _configured is None:
        raise ConfigError("no inference pools are configured in this process (pool_session runs in a rollout worker)")
    return _configured.session(name, ttl_s=ttl_s)

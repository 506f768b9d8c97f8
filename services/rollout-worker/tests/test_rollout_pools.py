"""`pool_session` for reward functions: a session on the named inference pool's job config, deleted afterwards;
clear errors for a pool the job does not declare and outside a worker."""

from __future__ import annotations

from typing import Any

import pytest

from miles.common.errors import ConfigError
from miles.rollout import pools
from miles.rollout.sessions import SessionHandle


class RecordingSessions:
    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []

    async def create(self, *, job_id: str, episode_id: str, ttl_s: float) -> SessionHandle:
        self.calls.append(("create", job_id))
        return SessionHandle("s-1", "http://session/v1/sessions/s-1/v1", "token-1")

    async def delete(self, handle: SessionHandle, *, as_operator: bool = False) -> None:
        self.calls.append(("delete", handle.session_id))


async def test_a_pool_session_opens_on_the_pools_job_config_and_is_deleted_even_on_error() -> None:
    sessions = RecordingSessions()
    pools.configure(pools.InferencePools(sessions, {"judge": "job-1--judge"}))  # type: ignore[arg-type]
    try:
        async with pools.pool_session("judge") as session:
            assert (session.base_url, session.token) == ("http://session/v1/sessions/s-1/v1", "token-1")
        with pytest.raises(RuntimeError):
            async with pools.pool_session("judge"):
                raise RuntimeError("the judge's answer did not parse")
        assert sessions.calls == [("create", "job-1--judge"), ("delete", "s-1")] * 2
        with pytest.raises(ConfigError, match="no inference pool 'teacher'"):
            async with pools.pool_session("teacher"):
                pass
    finally:
        pools.configure(None)
    with pytest.raises(ConfigError, match="rollout worker"):
        pools.pool_session("judge")

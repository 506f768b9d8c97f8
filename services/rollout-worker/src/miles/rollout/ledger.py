"""Which sessions the in-flight episodes of a prompt seq hold, in Redis — so none outlives a killed worker.

An episode records its session here right after creating it and forgets it once deleted (a multi-agent
episode: each of its sessions, one per role). A worker that
reclaims a seq (its previous holder died, e.g. kill -9) takes the sessions that holder left behind and deletes
them at once instead of waiting for their TTL. Keys: `<prefix>:{<job>}:sessions:<seq>` (hash session id ->
session token, expiring with the sessions). The token is stored because a session server without an operator
token (loopback development) accepts only it; it is a capability for that one session and expires with it.

Best effort by design: a Redis error here is logged and never fails an episode (the session TTL stays the
last resort).
"""

from __future__ import annotations

import logging

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from miles.rollout.sessions import SessionHandle

log = logging.getLogger(__name__)


class SessionLedger:
    def __init__(self, client: aioredis.Redis, *, key_prefix: str, job_id: str) -> None:
        self._client = client
        self._base = f"{key_prefix}:{{{job_id}}}:sessions"

    def _key(self, seq: int) -> str:
        return f"{self._base}:{seq}"

    async def record(self, seq: int, handle: SessionHandle, ttl_s: float) -> None:
        try:
            pipeline = self._client.pipeline(transaction=True)
            pipeline.hset(self._key(seq), handle.session_id, handle.token)
            pipeline.expire(self._key(seq), int(ttl_s) + 60)
            await pipeline.execute()
        except RedisError:
            log.warning("could not record a session in the ledger", exc_info=True)

    async def forget(self, seq: int, session_id: str) -> None:
        try:
            await self._client.hdel(self._key(seq), session_id)
        except RedisError:
            log.warning("could not remove a session from the ledger", exc_info=True)

    async def known_session_ids(self) -> set[str]:
        """Every session any worker of the job recorded and has not deleted yet."""
        known: set[str] = set()
        async for key in self._client.scan_iter(match=f"{self._base}:*", count=500):
            known.update(_text(session_id) for session_id in await self._client.hkeys(key))
        return known

    async def take_orphans(self, seq: int) -> list[SessionHandle]:
        """The sessions recorded for seq (by a worker that died), removed from the ledger."""
        try:
            pipeline = self._client.pipeline(transaction=True)
            pipeline.hgetall(self._key(seq))
            pipeline.delete(self._key(seq))
            recorded, _ = await pipeline.execute()
        except RedisError:
            log.warning("could not read the session ledger", exc_info=True)
            return []
        return [SessionHandle(_text(session_id), "", _text(token)) for session_id, token in dict(recorded).items()]


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value

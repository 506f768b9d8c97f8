"""The job's dataset cursor in Redis: which prompt seqs are handed out, leased, done — shared by every worker.

A worker *claims* one seq at a time (one Lua script, atomic, so several workers never get the same seq while
its lease is live), in this order: a seq whose lease expired (its worker died: regenerate it), a seq the buffer
handed back for regeneration (stale under the REQUEUE policy), else the next new seq. A claim is a *lease*
(`lease_s`, renewed by the worker's heartbeat); a seq is *completed* once its group was decided (pushed,
duplicate, filtered), or *retried* (back to the redo set, undecided) when the platform could not run its
episodes at all (session server unreachable). So a worker killed at any instant loses nothing: its seqs come
back when their leases expire — at once when it restarts under the same `worker_id` (`release_worker`). A
group pushed but not yet completed when the worker died is generated and pushed again; its group id is
deterministic (`groups.py`), so the buffer answers DUPLICATE and trains it once. Lease times use the Redis
server's clock.

Keys, per job (one hash tag): `cursor` (hash: next_seq, num_done, fingerprint), `leases` (zset seq -> expiry
ms), `holders` (hash seq -> worker id), `redo` (zset of seqs to regenerate, oldest first).

Limits: one Redis (not Cluster-aware beyond the per-job hash tag); seqs are never reordered, so a stuck lease
delays nothing but its own prompt.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, cast

import redis.asyncio as aioredis

from miles.rollout.errors import CursorMismatchError

ClaimSource = Literal["new", "reclaimed", "requeued"]

_NOW_MS = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
"""

_CLAIM = (
    _NOW_MS
    + """
local expiry = now + tonumber(ARGV[2])
local function lease(seq)
  redis.call('ZADD', KEYS[2], expiry, seq)
  redis.call('HSET', KEYS[3], seq, ARGV[1])
end
local expired = redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', now, 'LIMIT', 0, 1)
if #expired > 0 then
  lease(expired[1])
  return {expired[1], 'reclaimed'}
end
local redo = redis.call('ZRANGE', KEYS[4], 0, 0)
if #redo > 0 then
  redis.call('ZREM', KEYS[4], redo[1])
  lease(redo[1])
  return {redo[1], 'requeued'}
end
local nxt = tonumber(redis.call('HGET', KEYS[1], 'next_seq') or '0')
local limit = tonumber(ARGV[3])
if limit >= 0 and nxt >= limit then
  return {'-1', 'exhausted'}
end
redis.call('HSET', KEYS[1], 'next_seq', nxt + 1)
lease(tostring(nxt))
return {tostring(nxt), 'new'}
"""
)

_COMPLETE = """
local removed = redis.call('ZREM', KEYS[2], ARGV[1])
redis.call('HDEL', KEYS[3], ARGV[1])
redis.call('ZREM', KEYS[4], ARGV[1])
if removed == 1 then
  redis.call('HINCRBY', KEYS[1], 'num_done', 1)
end
return removed
"""

_EXTEND = (
    _NOW_MS
    + """
local expiry = now + tonumber(ARGV[2])
local lost = {}
for i = 3, #ARGV do
  if redis.call('HGET', KEYS[3], ARGV[i]) == ARGV[1] and redis.call('ZSCORE', KEYS[2], ARGV[i]) then
    redis.call('ZADD', KEYS[2], 'XX', expiry, ARGV[i])
  else
    table.insert(lost, ARGV[i])
  end
end
return lost
"""
)

_RELEASE = """
local held = redis.call('HGETALL', KEYS[3])
local released = 0
for i = 1, #held, 2 do
  if held[i + 1] == ARGV[1] and redis.call('ZSCORE', KEYS[2], held[i]) then
    redis.call('ZADD', KEYS[2], 'XX', 0, held[i])
    released = released + 1
  end
end
return released
"""

_RETRY = """
redis.call('ZREM', KEYS[2], ARGV[1])
redis.call('HDEL', KEYS[3], ARGV[1])
return redis.call('ZADD', KEYS[4], ARGV[1], ARGV[1])
"""

_REQUEUE = """
if redis.call('ZSCORE', KEYS[2], ARGV[1]) then
  return 0
end
return redis.call('ZADD', KEYS[4], ARGV[1], ARGV[1])
"""


@dataclass(frozen=True)
class Claim:
    seq: int
    source: ClaimSource


@dataclass(frozen=True)
class CursorStatus:
    """The job's progress: seqs handed out (`next_seq`), decided (`num_done`), leased now, waiting to redo."""

    next_seq: int
    num_done: int
    num_leased: int
    num_redo: int
    lowest_open_seq: int
    """Every seq below this one is decided: the resume point if nothing were leased."""


class DatasetCursor:
    """The cursor of one job; every method is one atomic Redis script or read."""

    def __init__(self, client: aioredis.Redis, *, key_prefix: str, job_id: str, num_seqs: int | None) -> None:
        base = f"{key_prefix}:{{{job_id}}}"
        self._keys = [f"{base}:cursor", f"{base}:leases", f"{base}:holders", f"{base}:redo"]
        self._client = client
        self._num_seqs = -1 if num_seqs is None else num_seqs
        self._claim = client.register_script(_CLAIM)
        self._complete = client.register_script(_COMPLETE)
        self._extend = client.register_script(_EXTEND)
        self._release = client.register_script(_RELEASE)
        self._requeue = client.register_script(_REQUEUE)
        self._retry = client.register_script(_RETRY)

    async def check_fingerprint(self, fingerprint: str) -> None:
        """Binds the cursor to a dataset order; raises CursorMismatchError if it was made for another."""
        await self._client.hsetnx(self._keys[0], "fingerprint", fingerprint)
        stored = await self._client.hget(self._keys[0], "fingerprint")
        stored_text = stored.decode() if isinstance(stored, bytes) else str(stored)
        if stored_text != fingerprint:
            raise CursorMismatchError(
                f"the job's cursor was made for a dataset with {stored_text}, this one has {fingerprint}: resuming "
                "would visit other prompts; use a new job id (or delete the cursor keys) to start over",
                field="rollout.dataset",
            )

    async def claim(self, worker_id: str, lease_s: float) -> Claim | None:
        """The next seq for this worker (leased for lease_s), or None when every epoch is handed out."""
        seq, source = await self._claim(keys=self._keys, args=[worker_id, int(lease_s * 1000), self._num_seqs])
        source_text = source.decode() if isinstance(source, bytes) else str(source)
        if source_text == "exhausted":
            return None
        return Claim(int(seq), cast(ClaimSource, source_text))

    async def complete(self, seq: int) -> bool:
        """Marks seq decided; False if it already was (another worker completed it first)."""
        return bool(await self._complete(keys=self._keys, args=[seq]))

    async def extend(self, worker_id: str, seqs: list[int], lease_s: float) -> list[int]:
        """Renews this worker's leases; returns the seqs it no longer holds (expired and reclaimed elsewhere)."""
        if not seqs:
            return []
        lost: list[Any] = await self._extend(keys=self._keys, args=[worker_id, int(lease_s * 1000), *seqs])
        return [int(seq) for seq in lost]

    async def release_worker(self, worker_id: str) -> int:
        """Expires every lease held by worker_id now (a restart under the same id; a clean shutdown)."""
        return int(await self._release(keys=self._keys, args=[worker_id]))

    async def retry(self, seq: int) -> None:
        """Gives a leased seq back undecided, to be claimed again first (its group could not be generated)."""
        await self._retry(keys=self._keys, args=[seq])

    async def requeue(self, seq: int) -> bool:
        """Asks for seq to be generated again (unless it is leased right now)."""
        return bool(await self._requeue(keys=self._keys, args=[seq]))

    async def status(self) -> CursorStatus:
        pipeline = self._client.pipeline(transaction=False)
        pipeline.hgetall(self._keys[0])
        pipeline.zrange(self._keys[1], 0, -1)
        pipeline.zrange(self._keys[3], 0, -1)
        cursor, leased, redo = await pipeline.execute()
        fields = {key.decode() if isinstance(key, bytes) else str(key): value for key, value in cursor.items()}
        next_seq = int(fields.get("next_seq", 0))
        open_seqs = [int(seq) for seq in [*leased, *redo]]
        return CursorStatus(
            next_seq=next_seq,
            num_done=int(fields.get("num_done", 0)),
            num_leased=len(leased),
            num_redo=len(redo),
            lowest_open_seq=min(open_seqs, default=next_seq),
        )

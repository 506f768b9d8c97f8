"""Job records, per-job event streams, idempotency keys and the supervisor lease, in Redis.

Keys (prefix `key_prefix`): `<p>:job:<id>` (hash: the JobRecord's fields), `<p>:job:<id>:events` (stream: the
job's events, trimmed to `max_events`), `<p>:jobs` (sorted set of every job id by creation time), `<p>:jobs:active`
(set of PENDING/QUEUED/RUNNING job ids), `<p>:idem:<sha256(key)>` (JSON {job_id, body_sha256}, expiring), `<p>:leader`
(the supervising replica's id, expiring).

Every multi-key change (create, state transition, delete) is one Lua script, so a crash or a concurrent replica can
never leave a job half-created, in an illegal state, or deleted while running. Stream ids are the SSE event ids:
a client that reconnects with `Last-Event-ID` resumes right after the last event it saw.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

import redis.asyncio as aioredis
from redis.exceptions import RedisError, ResponseError

from miles.common.errors import UnavailableError
from miles.controller.errors import (
    IdempotencyKeyReusedError,
    IllegalTransitionError,
    JobNotFoundError,
    JobStateConflictError,
    TooManyActiveJobsError,
)
from miles.controller.jobs import TERMINAL_STATES, JobRecord, JobState, sources_of

_CREATE = """
-- KEYS: job hash, jobs zset, active set, events stream, idem key ("" when none)
-- ARGV: prefix, job_id, score, max_active, idem value, idem ttl ms, body hash, maxlen, event json, fields...
local idem = KEYS[5]
if idem ~= '' then
  local existing = redis.call('GET', idem)
  if existing then
    local parsed = cjson.decode(existing)
    if redis.call('EXISTS', ARGV[1] .. ':job:' .. parsed['job_id']) == 1 then
      if parsed['body_sha256'] ~= ARGV[7] then return {'reused', parsed['job_id']} end
      return {'existing', parsed['job_id']}
    end
  end
end
if redis.call('SCARD', KEYS[3]) >= tonumber(ARGV[4]) then return {'full', ''} end
for i = 10, #ARGV, 2 do redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1]) end
redis.call('ZADD', KEYS[2], ARGV[3], ARGV[2])
redis.call('SADD', KEYS[3], ARGV[2])
if idem ~= '' then redis.call('SET', idem, ARGV[5], 'PX', ARGV[6]) end
redis.call('XADD', KEYS[4], 'MAXLEN', '~', ARGV[8], '*', 'event', ARGV[9])
return {'created', ARGV[2]}
"""

_TRANSITION = """
-- KEYS: job hash, active set, events stream; ARGV: new state, allowed sources csv, terminal (1/0), maxlen,
-- event json, job id, fields...
local current = redis.call('HGET', KEYS[1], 'state')
if not current then return {'missing', ''} end
if not string.find(',' .. ARGV[2] .. ',', ',' .. current .. ',', 1, true) then return {'illegal', current} end
redis.call('HSET', KEYS[1], 'state', ARGV[1])
for i = 7, #ARGV, 2 do redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1]) end
if ARGV[3] == '1' then redis.call('SREM', KEYS[2], ARGV[6]) end
local event_id = redis.call('XADD', KEYS[3], 'MAXLEN', '~', ARGV[4], '*', 'event', ARGV[5])
return {'ok', current}
"""

_UPDATE = """
-- KEYS: job hash, events stream; ARGV: maxlen, event json ("" = none), fields...
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
for i = 3, #ARGV, 2 do redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1]) end
if ARGV[2] ~= '' then redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[1], '*', 'event', ARGV[2]) end
return 1
"""

_CLEAR_RESIZE = """
-- KEYS: job hash, events stream; ARGV: spec json the resize applied, maxlen, event json
if redis.call('HGET', KEYS[1], 'spec') ~= ARGV[1] then return 0 end
redis.call('HSET', KEYS[1], 'resize_pending', '')
redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[2], '*', 'event', ARGV[3])
return 1
"""

_DELETE = """
-- KEYS: job hash, events stream, jobs zset, active set; ARGV: job id, terminal states csv
local current = redis.call('HGET', KEYS[1], 'state')
if not current then return 'missing' end
if not string.find(',' .. ARGV[2] .. ',', ',' .. current .. ',', 1, true) then return current end
redis.call('DEL', KEYS[1], KEYS[2])
redis.call('ZREM', KEYS[3], ARGV[1])
redis.call('SREM', KEYS[4], ARGV[1])
return 'deleted'
"""

_LEASE = """
-- KEYS: leader key; ARGV: holder, lease ms
local holder = redis.call('GET', KEYS[1])
if holder == ARGV[1] then redis.call('PEXPIRE', KEYS[1], ARGV[2]) return 1 end
if not holder then redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2]) return 1 end
return 0
"""

_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


@dataclass(frozen=True)
class JobEvent:
    """One entry of a job's event stream. `event_id` is the Redis stream id (the SSE id)."""

    event_id: str
    type: str
    data: dict[str, Any]


def body_sha256(body: bytes) -> str:
    return hashlib.sha256(body).hexdigest()


def _flat(fields: Mapping[str, str]) -> list[str]:
    return [item for pair in fields.items() for item in pair]


class JobStore:
    """The controller's Redis state. Every method raises UnavailableError when Redis cannot be reached."""

    def __init__(self, redis_url: str, *, key_prefix: str, max_events: int, socket_timeout_s: float = 10.0) -> None:
        self.redis: aioredis.Redis = aioredis.Redis.from_url(
            redis_url, decode_responses=True, socket_timeout=socket_timeout_s, socket_connect_timeout=5.0
        )
        self.prefix = key_prefix
        self.max_events = max_events
        self._create = self.redis.register_script(_CREATE)
        self._transition = self.redis.register_script(_TRANSITION)
        self._update = self.redis.register_script(_UPDATE)
        self._delete = self.redis.register_script(_DELETE)
        self._clear_resize = self.redis.register_script(_CLEAR_RESIZE)
        self._lease = self.redis.register_script(_LEASE)
        self._release = self.redis.register_script(_RELEASE)

    def _job_key(self, job_id: str) -> str:
        return f"{self.prefix}:job:{job_id}"

    def _events_key(self, job_id: str) -> str:
        return f"{self.prefix}:job:{job_id}:events"

    @property
    def _jobs_key(self) -> str:
        return f"{self.prefix}:jobs"

    @property
    def _active_key(self) -> str:
        return f"{self.prefix}:jobs:active"

    async def close(self) -> None:
        await self.redis.aclose()

    async def ping(self) -> None:
        await self.redis.ping()

    async def create(
        self,
        record: JobRecord,
        event: Mapping[str, Any],
        *,
        max_active: int,
        idempotency_key: str | None = None,
        body_hash: str = "",
        idempotency_ttl_s: float = 86400.0,
    ) -> tuple[str, bool]:
        """Store a new job (and its first event) unless the idempotency key names an existing one.

        Returns (job id, created). Raises IdempotencyKeyReusedError (same key, other body) or `full_error` when
        `max_active` jobs are active.
        """
        idem_key = ""
        if idempotency_key is not None:
            idem_key = f"{self.prefix}:idem:{hashlib.sha256(idempotency_key.encode()).hexdigest()}"
        idem_value = json.dumps({"job_id": record.job_id, "body_sha256": body_hash})
        keys = [
            self._job_key(record.job_id),
            self._jobs_key,
            self._active_key,
            self._events_key(record.job_id),
            idem_key,
        ]
        args: list[str | int | float] = [
            self.prefix,
            record.job_id,
            record.created_at_s,
            max_active,
            idem_value,
            int(idempotency_ttl_s * 1000),
            body_hash,
            self.max_events,
            json.dumps(dict(event)),
            *_flat(record.to_redis()),
        ]
        outcome, job_id = await self._run(self._create, keys, args)
        if outcome == "reused":
            raise IdempotencyKeyReusedError(
                f"Idempotency-Key already used for job {job_id} with a different request body; "
                "use a new key for a different job",
                field="Idempotency-Key",
                details={"job_id": job_id},
            )
        if outcome == "full":
            raise TooManyActiveJobsError(
                f"{max_active} jobs are already PENDING, QUEUED or RUNNING (max_active_jobs); wait for one to end",
                retry_after_s=30.0,
            )
        return job_id, outcome == "created"

    async def get(self, job_id: str) -> JobRecord:
        data = await self._call(self.redis.hgetall(self._job_key(job_id)))
        if not data:
            raise JobNotFoundError(f"job {job_id!r} does not exist", field="job_id")
        return JobRecord.from_redis(data)

    async def list_jobs(self, *, limit: int, offset: int = 0) -> list[JobRecord]:
        """Jobs, newest first."""
        job_ids = await self._call(self.redis.zrevrange(self._jobs_key, offset, offset + limit - 1))
        if not job_ids:
            return []
        async with self.redis.pipeline(transaction=False) as pipe:
            for job_id in job_ids:
                pipe.hgetall(self._job_key(job_id))
            rows = await self._call(pipe.execute())
        return [JobRecord.from_redis(row) for row in rows if row]

    async def active_job_ids(self) -> list[str]:
        return sorted(await self._call(self.redis.smembers(self._active_key)))

    async def transition(
        self, job_id: str, new_state: JobState, event: Mapping[str, Any], fields: Mapping[str, str] | None = None
    ) -> JobState:
        """Move the job to `new_state` if the state machine allows it from its current state (atomic);
        returns the previous state. Raises JobNotFoundError or IllegalTransitionError."""
        sources = ",".join(state.value for state in sources_of(new_state))
        keys = [self._job_key(job_id), self._active_key, self._events_key(job_id)]
        terminal = "1" if new_state in TERMINAL_STATES else "0"
        all_fields = {"updated_at_s": repr(time.time()), **(fields or {})}
        args = [new_state.value, sources, terminal, self.max_events, json.dumps(dict(event)), job_id]
        outcome, current = await self._run(self._transition, keys, [*args, *_flat(all_fields)])
        if outcome == "missing":
            raise JobNotFoundError(f"job {job_id!r} does not exist", field="job_id")
        if outcome == "illegal":
            raise IllegalTransitionError(f"job {job_id} is {current}; it cannot become {new_state.value}")
        return JobState(current)

    async def update(self, job_id: str, fields: Mapping[str, str], event: Mapping[str, Any] | None = None) -> bool:
        """Set fields (and append an event) of an existing job; False when the job no longer exists."""
        all_fields = {"updated_at_s": repr(time.time()), **fields}
        args: list[str | int] = [self.max_events, json.dumps(dict(event)) if event else "", *_flat(all_fields)]
        result = await self._call(self._update(keys=[self._job_key(job_id), self._events_key(job_id)], args=args))
        return bool(result)

    async def resize_applied(self, job_id: str, spec_json: str, event: Mapping[str, Any]) -> bool:
        """Clear `resize_pending` if the job's spec is still the one the resize applied (a newer PATCH keeps it
        pending, so the supervisor applies that one too); True when cleared."""
        keys = [self._job_key(job_id), self._events_key(job_id)]
        args: list[str | int] = [spec_json, self.max_events, json.dumps(dict(event))]
        return bool(await self._call(self._clear_resize(keys=keys, args=args)))

    async def delete(self, job_id: str) -> None:
        """Delete an ended job and its events. Raises JobNotFoundError, or JobStateConflictError while it is active."""
        terminal = ",".join(state.value for state in TERMINAL_STATES)
        keys = [self._job_key(job_id), self._events_key(job_id), self._jobs_key, self._active_key]
        outcome = await self._call(self._delete(keys=keys, args=[job_id, terminal]))
        if outcome == "missing":
            raise JobNotFoundError(f"job {job_id!r} does not exist", field="job_id")
        if outcome != "deleted":
            raise JobStateConflictError(
                f"job {job_id} is {outcome}: only an ended job (SUCCEEDED, FAILED, CANCELLED) can be deleted; "
                f"cancel it first (POST /v1/jobs/{job_id}/cancel)"
            )

    async def events(
        self, job_id: str, *, after_id: str, count: int = 100, block_ms: int | None = None
    ) -> list[JobEvent]:
        """Events after `after_id` ("0" = from the start), waiting up to `block_ms` for one when there are none."""
        if block_ms is None:
            replies = await self._call(self.redis.xread({self._events_key(job_id): after_id}, count=count))
        else:
            replies = await self._call(
                self.redis.xread({self._events_key(job_id): after_id}, count=count, block=block_ms)
            )
        events: list[JobEvent] = []
        for _stream, entries in replies or []:
            for event_id, fields in entries:
                payload = json.loads(fields.get("event", "{}"))
                events.append(JobEvent(event_id, str(payload.pop("type", "message")), payload))
        return events

    async def acquire_lease(self, holder: str, lease_s: float) -> bool:
        """Take or renew the supervisor lease; True while `holder` holds it."""
        return bool(await self._call(self._lease(keys=[f"{self.prefix}:leader"], args=[holder, int(lease_s * 1000)])))

    async def release_lease(self, holder: str) -> None:
        await self._call(self._release(keys=[f"{self.prefix}:leader"], args=[holder]))

    async def _run(self, script: Any, keys: Sequence[str], args: Sequence[str | int | float]) -> tuple[str, str]:
        result = await self._call(script(keys=list(keys), args=list(args)))
        outcome, value = cast(list[str], result)
        return outcome, value

    async def _call(self, awaitable: Any) -> Any:
        try:
            return await awaitable
        except ResponseError:
            raise
        except (RedisError, OSError) as exc:
            raise UnavailableError(f"Redis is unavailable: {type(exc).__name__}: {exc}", retry_after_s=1.0) from exc

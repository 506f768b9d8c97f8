"""RedisStore: sessions in Redis, shared by every replica (a replica keeps no session state of its own).

Keys (`P` = key_prefix; `{id}` is a hash tag keeping one session's keys together):
- `P:s:{id}` hash: meta (JSON), job, version, messages (JSON), ids (int32 little-endian), tools, ends,
  not_recorded, and optionally token (the token hash after a rotation; it overrides meta's) and idem (the name
  of its idempotency key). Expires ttl_s after creation or the last commit.
- `P:s:{id}:records` list of TurnRecords, each a JSON header and its arrays as raw bytes (record_codec.py;
  appended per commit; trimmed by a rollback).
- `P:s:{id}:routing` list of packed routing chunks (R3), one per record, binary, appended and trimmed with the
  records; absent for sessions that do not record routing. Read only to build samples.
- `P:s:{id}:nodes`, `:node_ids`, `:node_routing`: a tree session's nodes (store_redis_tree.py).
- `P:s:{id}:lock` the per-session lock: a lease (SET NX PX) released by compare-and-delete.
- `P:live` sorted set of session ids scored by expiry time (ms): live-session count, listing, expiry counting.
- `P:job:<job_id>:config`, `P:job:<job_id>:adapter`: a job's ModelConfig and its live adapter (store_redis_jobs.py).
- `P:idem:<sha256 of an Idempotency-Key>` "<session_id> <body sha256>": created with its session by one script,
  given the same expiry by every commit, deleted with it.
An appending turn costs two round trips: one HMGET of the meta (auth) and the state (phase 1, no lock: the commit
is fenced), and the fenced commit script (phase 3; it also refreshes the TTLs and the index). A rollback turn also
takes the lock and reads the state and the records under it (the lock is released in the background, during the
engine call). Each critical section is one Lua script (store_redis_scripts.py).
Scripts touch the shared `P:live` key and idempotency keys too, so the store expects a single Redis (with AOF),
not a cluster.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from miles.session.errors import SessionBusyError, StoreUnavailableError
from miles.session.json_stream import loads_array_in_pieces
from miles.session.record_codec import decode_record, encode_record
from miles.session.records import (
    CommitOutcome,
    IdempotencyRecord,
    SessionMeta,
    SessionState,
    TurnCommit,
    TurnRecord,
    dumps,
    pack_ids,
    unpack_ids,
)
from miles.session.settings import SessionSettings
from miles.session.store import ReapResult
from miles.session.store_redis_jobs import RedisJobs
from miles.session.store_redis_scripts import COMMIT, CREATE, DELETE, LOCK_AND_LOAD, RELEASE, ROTATE
from miles.session.store_redis_tree import TREE_SUFFIXES, RedisTree, store_errors

_BUSY = -3
_STATE_FIELDS = ("version", "messages", "ids", "tools", "ends", "not_recorded")
_REAP_BATCH = 1000


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _now_ms() -> int:
    return int(time.time() * 1000)


def _meta(raw: Any, token: Any) -> SessionMeta | None:
    """The meta of a session hash's `meta` and `token` fields (None when there is no session)."""
    if raw is None:
        return None
    meta = SessionMeta.from_json(json.loads(raw))
    return meta if token is None else dataclasses.replace(meta, token_sha256=_text(token))


_PARSE_INLINE_BYTES = 256 * 1024
"""Stored records up to this size are parsed on the event loop (a thread hop costs more than the parse)."""


def _records(raw: list[Any]) -> list[TurnRecord]:
    return [decode_record(item) for item in raw]


def _state(values: list[Any]) -> SessionState:
    version, messages, ids, tools, ends, not_recorded = values
    return SessionState(
        version=int(version),
        messages=loads_array_in_pieces(messages),
        token_ids=unpack_ids(ids),
        tools=json.loads(tools),
        message_ends=json.loads(ends),
        num_not_recorded=int(not_recorded or 0),
    )


async def _parse_state(values: list[Any]) -> SessionState:
    if sum(len(value or b"") for value in values) < _PARSE_INLINE_BYTES:
        return _state(values)
    return await asyncio.to_thread(_state, values)  # a long session's history: not on the event loop


class RedisStore(RedisTree, RedisJobs):
    hands_out_copies = True
    shared_across_processes = True

    def __init__(self, client: aioredis.Redis, *, key_prefix: str, lock_ttl_s: float, lock_wait_s: float) -> None:
        self._redis = client
        self._prefix = key_prefix
        self._lock_ttl_ms = max(1, int(lock_ttl_s * 1000))
        self._lock_wait_s = lock_wait_s
        self._lock_and_load = client.register_script(LOCK_AND_LOAD)
        self._release = client.register_script(RELEASE)
        self._commit = client.register_script(COMMIT)
        self._delete = client.register_script(DELETE)
        self._create = client.register_script(CREATE)
        self._rotate = client.register_script(ROTATE)
        self._register_tree_scripts()
        self._register_job_scripts()
        self._releases: set[asyncio.Task[None]] = set()

    @classmethod
    def from_settings(cls, settings: SessionSettings) -> RedisStore:
        client = aioredis.Redis.from_url(
            settings.redis_url,
            max_connections=settings.redis_max_connections,
            socket_timeout=settings.redis_socket_timeout_s,
            socket_connect_timeout=settings.redis_socket_timeout_s,
        )
        return cls(
            client, key_prefix=settings.key_prefix, lock_ttl_s=settings.lock_ttl_s, lock_wait_s=settings.lock_wait_s
        )

    def _key(self, session_id: str, suffix: str = "") -> str:
        return f"{self._prefix}:s:{{{session_id}}}{suffix}"

    def _session_keys(self, session_id: str) -> list[str]:
        """hash, records, lock, live index, routing, then the tree's keys: the KEYS of the commit and delete
        scripts."""
        key = self._key(session_id)
        tree_keys = [f"{key}{suffix}" for suffix in TREE_SUFFIXES]
        return [key, f"{key}:records", f"{key}:lock", f"{self._prefix}:live", f"{key}:routing", *tree_keys]

    async def _until_free(self, session_id: str, attempt: Callable[[], Coroutine[Any, Any, Any]]) -> Any:
        """Run `attempt` until it does not answer busy (-3 or {-3}), backing off, at most lock_wait_s."""
        deadline_s = time.monotonic() + self._lock_wait_s
        delay_s = 0.001
        while True:
            result = await attempt()
            busy = result == _BUSY or (isinstance(result, list) and result and result[0] == _BUSY)
            if not busy:
                return result
            if time.monotonic() > deadline_s:
                raise SessionBusyError(
                    f"session {session_id} is busy (its lock stayed taken for {self._lock_wait_s:g} s); retry",
                    retry_after_s=1.0,
                )
            await asyncio.sleep(delay_s)
            delay_s = min(delay_s * 2, 0.05)

    async def ping(self) -> None:
        await self._redis.ping()

    async def close(self) -> None:
        await asyncio.gather(*self._releases)
        await self._redis.aclose()

    def _idem_key(self, key_sha256: str) -> str:
        return f"{self._prefix}:idem:{key_sha256}"

    @store_errors
    async def create(self, meta: SessionMeta, idempotency: IdempotencyRecord | None = None) -> IdempotencyRecord | None:
        ttl_ms = max(1, int(meta.ttl_s * 1000))
        keys = [self._key(meta.session_id), f"{self._prefix}:live"]
        if idempotency is not None:
            keys.append(self._idem_key(idempotency.key_sha256))
        args: list[str | int] = [
            dumps(meta.to_json()),
            meta.job_id,
            ttl_ms,
            meta.session_id,
            _now_ms() + ttl_ms,
            idempotency.to_text() if idempotency is not None else "",
            f"{self._prefix}:s:{{",
        ]
        held = await self._create(keys=keys, args=args)
        if held is None or idempotency is None:
            return None
        return IdempotencyRecord.from_text(idempotency.key_sha256, _text(held))

    @store_errors
    async def get_idempotency(self, key_sha256: str) -> IdempotencyRecord | None:
        raw = await self._redis.get(self._idem_key(key_sha256))
        if raw is None:
            return None
        record = IdempotencyRecord.from_text(key_sha256, _text(raw))
        return record if await self._redis.exists(self._key(record.session_id)) else None

    @store_errors
    async def rotate_token(self, session_id: str, token_sha256: str) -> SessionMeta | None:
        raw = await self._rotate(keys=[self._key(session_id)], args=[token_sha256])
        if raw is None:
            return None
        return dataclasses.replace(SessionMeta.from_json(json.loads(raw)), token_sha256=token_sha256)

    @store_errors
    async def get_meta(self, session_id: str) -> SessionMeta | None:
        raw, token = await self._redis.hmget(self._key(session_id), ["meta", "token"])
        return _meta(raw, token)

    @store_errors
    async def load_turn_start(
        self, session_id: str, authorize: Callable[[SessionMeta], None]
    ) -> tuple[SessionMeta, SessionState] | None:
        values: list[Any] = await self._redis.hmget(self._key(session_id), ["meta", "token", *_STATE_FIELDS])
        meta = _meta(values[0], values[1])
        if meta is None or values[2] is None:
            return None
        authorize(meta)
        return meta, await _parse_state(values[2:])

    @store_errors
    async def num_token_ids(self, session_id: str) -> int:
        return int(await self._redis.hstrlen(self._key(session_id), "ids")) // 4  # int32 ids: O(1), nothing read

    async def load_state(self, session_id: str) -> SessionState | None:
        values: list[Any] = await self._redis.hmget(self._key(session_id), list(_STATE_FIELDS))
        return None if values[0] is None else await _parse_state(values)

    @contextlib.asynccontextmanager
    async def locked_state(self, session_id: str) -> AsyncIterator[SessionState | None]:
        key, owner = self._key(session_id), uuid.uuid4().hex
        keys = [key, f"{key}:lock"]
        try:
            result = await self._until_free(
                session_id, lambda: self._lock_and_load(keys=keys, args=[owner, self._lock_ttl_ms])
            )
        except (RedisError, OSError) as exc:
            raise StoreUnavailableError(f"session store unavailable: {exc}", retry_after_s=1.0) from exc
        try:
            yield await _parse_state(result[1:]) if result[0] == 1 else None
        finally:
            # Released in the background: the round trip overlaps the engine call instead of preceding it. A
            # commit that comes first just waits for it; a release that never lands expires with its lease.
            task = asyncio.create_task(self._release_lock(f"{key}:lock", owner))
            self._releases.add(task)
            task.add_done_callback(self._releases.discard)

    async def _release_lock(self, lock_key: str, owner: str) -> None:
        with contextlib.suppress(RedisError, OSError):
            await self._release(keys=[lock_key], args=[owner])

    @store_errors
    async def load_records(self, session_id: str) -> list[TurnRecord]:
        raw = await self._redis.lrange(self._key(session_id, ":records"), 0, -1)
        if sum(len(item) for item in raw) < _PARSE_INLINE_BYTES:
            return _records(raw)
        return await asyncio.to_thread(_records, raw)  # a long session's records: not on the event loop

    @store_errors
    async def load_routing(self, session_id: str) -> list[bytes]:
        raw = await self._redis.lrange(self._key(session_id, ":routing"), 0, -1)
        return [item if isinstance(item, bytes) else item.encode() for item in raw]  # the client never decodes

    @store_errors
    async def commit(self, session_id: str, commit: TurnCommit) -> CommitOutcome:
        ttl_ms = int(commit.ttl_s * 1000)
        args: list[str | bytes | int] = [
            commit.expected_version,
            commit.num_kept_records,
            dumps(commit.messages),
            pack_ids(commit.token_ids),
            dumps(commit.tools),
            dumps(commit.message_ends),
            encode_record(commit.record),
            ttl_ms,
            session_id,
            _now_ms() + ttl_ms,
            commit.routing or b"",
            "0" if commit.routing is None else "1",
        ]
        keys = self._session_keys(session_id)
        result = int(await self._until_free(session_id, lambda: self._commit(keys=keys, args=args)))
        if result == -1:
            return CommitOutcome.SESSION_GONE
        if result == -2:
            return CommitOutcome.CONCURRENT_TURN
        return CommitOutcome.COMMITTED

    @store_errors
    async def delete(self, session_id: str) -> bool:
        keys = self._session_keys(session_id)
        return bool(await self._until_free(session_id, lambda: self._delete(keys=keys, args=[session_id])))

    @store_errors
    async def list_sessions(self, job_id: str | None, limit: int) -> list[str]:
        found: list[str] = []
        offset = 0
        while len(found) < limit:
            items = await self._redis.zrangebyscore(f"{self._prefix}:live", _now_ms(), "+inf", start=offset, num=500)
            batch = [_text(item) for item in items]
            if not batch:
                break
            offset += len(batch)
            if job_id is not None:
                async with self._redis.pipeline(transaction=False) as pipe:
                    for sid in batch:
                        pipe.hget(self._key(sid), "job")
                    jobs = [None if job is None else _text(job) for job in await pipe.execute()]
                batch = [sid for sid, job in zip(batch, jobs, strict=True) if job == job_id]
            found.extend(batch)
        return found[:limit]

    @store_errors
    async def reap(self) -> ReapResult:
        now_ms, live_key = _now_ms(), f"{self._prefix}:live"
        stale = [_text(item) for item in await self._redis.zrangebyscore(live_key, "-inf", now_ms, 0, _REAP_BATCH)]
        num_expired = 0
        if stale:
            async with self._redis.pipeline(transaction=False) as pipe:
                for sid in stale:
                    pipe.pttl(self._key(sid))
                ttls = await pipe.execute()
            async with self._redis.pipeline(transaction=False) as pipe:
                for sid, ttl_ms in zip(stale, ttls, strict=True):
                    if ttl_ms < 0:  # gone: ZREM answers 1 on exactly one replica
                        pipe.zrem(live_key, sid)
                    else:  # alive with a stale score: fix it
                        pipe.zadd(live_key, {sid: now_ms + ttl_ms})
                results = await pipe.execute()
            num_expired = sum(int(r) for r, ttl_ms in zip(results, ttls, strict=True) if ttl_ms < 0)
        num_live = int(await self._redis.zcount(live_key, now_ms, "+inf"))
        return ReapResult(num_live=num_live, num_expired=num_expired)

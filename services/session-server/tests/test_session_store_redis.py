"""RedisStore on a real Redis: fenced commits, rollback trimming, lock lease, expiry counted once across replicas;
and the memory store's lock."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
import redis.asyncio as aioredis

from miles.session.errors import SessionBusyError
from miles.session.record_codec import MAGIC
from miles.session.records import (
    CommitOutcome,
    FinishType,
    IdempotencyRecord,
    ModelConfig,
    SessionMeta,
    TurnCommit,
    TurnRecord,
    dumps,
)
from miles.session.store_memory import MemoryStore
from miles.session.store_redis import RedisStore


def make_store(redis_url: str, **kw: float) -> RedisStore:
    options = {"lock_ttl_s": 5.0, "lock_wait_s": 0.2, **kw}
    return RedisStore(aioredis.Redis.from_url(redis_url), key_prefix="t", **options)


def meta(session_id: str, ttl_s: float = 60.0) -> SessionMeta:
    return SessionMeta(session_id, "hash", "job-1", session_id, ModelConfig("/m", "qwen3", "p"), {}, ttl_s, 0)


def commit(version: int, num_kept: int, ids: list[int], end: int) -> TurnCommit:
    record = TurnRecord(
        num_kept, len(ids) - 1, 0, ids[-1:], [-0.1], "1", 0, len(ids) - 1, FinishType.STOP, None, end, 0, 0.0
    )
    ends = [2 * (i + 1) for i in range(num_kept)] + [end]
    return TurnCommit(version, num_kept, [{"role": "user", "content": str(end)}] * end, ids, None, record, ends, 60.0)


@pytest.mark.integration
async def test_commits_are_fenced_by_version_and_a_rollback_trims_records(redis_url: str) -> None:
    store = make_store(redis_url)
    await store.create(meta("s1"))
    assert await store.commit("s1", commit(0, 0, [1, 2, 3], 2)) is CommitOutcome.COMMITTED
    assert await store.commit("s1", commit(0, 0, [1, 2, 9], 2)) is CommitOutcome.CONCURRENT_TURN
    assert await store.commit("s1", commit(1, 1, [1, 2, 3, 4, 5], 4)) is CommitOutcome.COMMITTED
    assert await store.commit("s1", commit(2, 1, [1, 2, 3, 4, 6], 4)) is CommitOutcome.COMMITTED  # rollback of one
    state = await store.load_state("s1")
    records = await store.load_records("s1")
    assert state is not None and state.version == 3 and state.token_ids == [1, 2, 3, 4, 6]
    assert [r.completion_ids for r in records] == [[3], [6]] and state.message_ends == [2, 4]
    assert state.num_not_recorded == 1  # the fenced-out commit
    assert await store.delete("s1") and not await store.delete("s1")
    assert await store.commit("s1", commit(3, 2, [1], 6)) is CommitOutcome.SESSION_GONE
    await store.close()


@pytest.mark.integration
async def test_the_lock_excludes_phase_1_commits_and_deletes_and_a_dead_holder_frees_it(redis_url: str) -> None:
    store = make_store(redis_url, lock_ttl_s=5.0)
    other = make_store(redis_url, lock_wait_s=0.3)
    await store.create(meta("s2"))
    async with store.locked_state("s2") as state:
        assert state is not None and state.version == 0
        with pytest.raises(SessionBusyError):
            async with other.locked_state("s2"):
                pass
        with pytest.raises(SessionBusyError):
            await other.commit("s2", commit(0, 0, [1, 2], 2))
        with pytest.raises(SessionBusyError):
            await other.delete("s2")
    assert await other.commit("s2", commit(0, 0, [1, 2], 2)) is CommitOutcome.COMMITTED  # released by the holder
    await store._redis.set("t:s:{s2}:lock", "a crashed holder", px=100)
    async with other.locked_state("s2") as state:  # the dead holder's lease ran out within the wait
        assert state is not None and state.version == 1
    async with other.locked_state("gone") as missing:
        assert missing is None
    await store.close()
    await other.close()


@pytest.mark.integration
async def test_expiry_is_counted_once_across_replicas(redis_url: str) -> None:
    replicas = [make_store(redis_url) for _ in range(2)]
    await replicas[0].create(meta("short", ttl_s=0.2))
    await replicas[0].create(meta("long", ttl_s=60.0))
    assert (await replicas[1].reap()).num_live == 2
    await asyncio.sleep(0.4)
    results = await asyncio.gather(*(r.reap() for r in replicas))
    assert sum(r.num_expired for r in results) == 1 and all(r.num_live == 1 for r in results)
    assert await replicas[1].get_meta("short") is None
    assert await replicas[1].list_sessions("job-1", 10) == ["long"]
    config = dataclasses.replace(meta("x").model, engine_pool="pool-9")
    await replicas[0].put_job_config("job-1", config)
    assert await replicas[1].get_job_config("job-1") == config
    for replica in replicas:
        await replica.close()


async def test_the_memory_store_lock_times_out_busy_and_is_free_after_a_cancelled_waiter() -> None:
    """The single-replica store's per-session lock: a second holder is told busy; a waiter cancelled while waiting
    neither takes the lock nor leaves it taken."""
    store = MemoryStore(lock_wait_s=0.2)
    await store.create(meta("m1"))
    async with store.locked_state("m1") as state:
        assert state is not None
        with pytest.raises(SessionBusyError):
            async with store.locked_state("m1"):
                pass
        waiter = asyncio.create_task(store.commit("m1", commit(0, 0, [1, 2], 2)))
        await asyncio.sleep(0.05)
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
    assert await store.commit("m1", commit(0, 0, [1, 2], 2)) is CommitOutcome.COMMITTED


@pytest.mark.integration
@pytest.mark.parametrize("backend", ["redis", "memory"])
async def test_an_idempotency_key_is_claimed_once_lives_with_its_session_and_rotation_replaces_the_token(
    redis_url: str, backend: str
) -> None:
    store = make_store(redis_url) if backend == "redis" else MemoryStore(lock_wait_s=0.2)
    claim = IdempotencyRecord("k" * 64, "s1", "b" * 64)
    assert await store.create(meta("s1", ttl_s=0.6), claim) is None
    assert await store.get_idempotency(claim.key_sha256) == claim
    # A second create with the same key (a concurrent replay) creates nothing and gets the holder's record.
    assert await store.create(meta("s2"), dataclasses.replace(claim, session_id="s2")) == claim
    assert await store.get_meta("s2") is None
    rotated = await store.rotate_token("s1", "new-hash")
    assert rotated is not None and rotated.token_sha256 == "new-hash" and rotated.ttl_s == 0.6
    assert (await store.get_meta("s1")) == rotated
    assert await store.rotate_token("nope", "x") is None
    # A commit restarts the key's expiry with the session's; then both expire together.
    await asyncio.sleep(0.4)
    assert (
        await store.commit("s1", dataclasses.replace(commit(0, 0, [1, 2, 3], 2), ttl_s=0.6)) is CommitOutcome.COMMITTED
    )
    await asyncio.sleep(0.4)
    assert await store.get_idempotency(claim.key_sha256) == claim
    await asyncio.sleep(0.4)
    assert await store.get_meta("s1") is None and await store.get_idempotency(claim.key_sha256) is None
    # Deleting a session deletes its key: the key is free for a new session.
    assert await store.create(meta("s3"), dataclasses.replace(claim, session_id="s3")) is None
    assert await store.delete("s3")
    assert await store.get_idempotency(claim.key_sha256) is None
    if backend == "redis":
        client = aioredis.Redis.from_url(redis_url)
        assert await client.keys("t:idem:*") == []
        await client.aclose()
    await store.close()


@pytest.mark.integration
async def test_the_redis_store_keeps_records_in_the_binary_layout(redis_url: str) -> None:
    store = make_store(redis_url)
    await store.create(meta("rc1"))
    await store.commit("rc1", commit(0, 0, [1, 2, 3], 2))
    raw = await store._redis.lrange("t:s:{rc1}:records", 0, -1)
    assert len(raw) == 1 and raw[0].startswith(MAGIC)
    old = commit(1, 1, [1, 2, 3, 4, 5], 4).record
    await store._redis.rpush("t:s:{rc1}:records", dumps(old.to_json()))  # a record a previous release stored
    records = await store.load_records("rc1")
    assert [r.completion_ids for r in records] == [[3], [5]] and records[1] == old
    await store.close()

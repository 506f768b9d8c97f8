"""The dataset cursor over a real Redis: claims never overlap while leased, expired or released leases come
back, requeued seqs are served first, completion is idempotent, and a cursor refuses another dataset order."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis

from miles.rollout.cursor import DatasetCursor
from miles.rollout.errors import CursorMismatchError

pytestmark = pytest.mark.integration


@pytest.fixture
async def client(redis_url: str) -> AsyncIterator[aioredis.Redis]:
    connection = aioredis.Redis.from_url(redis_url)
    yield connection
    await connection.aclose()


def cursor(client: aioredis.Redis, num_seqs: int | None = 6, job_id: str = "job") -> DatasetCursor:
    return DatasetCursor(client, key_prefix="test:rollout", job_id=job_id, num_seqs=num_seqs)


async def test_new_seqs_are_handed_out_in_order_until_exhausted(client: aioredis.Redis) -> None:
    job = cursor(client, num_seqs=3)
    claims = [await job.claim("w1", lease_s=60) for _ in range(4)]
    assert [(c.seq, c.source) for c in claims[:3] if c] == [(0, "new"), (1, "new"), (2, "new")]
    assert claims[3] is None
    status = await job.status()
    assert (status.next_seq, status.num_leased, status.num_done, status.lowest_open_seq) == (3, 3, 0, 0)


async def test_concurrent_workers_never_get_the_same_seq(client: aioredis.Redis) -> None:
    job = cursor(client, num_seqs=200)

    async def drain(worker: str) -> list[int]:
        seqs = []
        while (claim := await job.claim(worker, lease_s=60)) is not None:
            seqs.append(claim.seq)
            await job.complete(claim.seq)
        return seqs

    per_worker = await asyncio.gather(*(drain(f"w{i}") for i in range(4)))
    everything = [seq for seqs in per_worker for seq in seqs]
    assert sorted(everything) == list(range(200)) and all(per_worker)
    assert (await job.status()).num_done == 200


async def test_an_expired_lease_is_reclaimed_by_another_worker(client: aioredis.Redis) -> None:
    job = cursor(client)
    first = await job.claim("dead", lease_s=0.05)
    await asyncio.sleep(0.1)
    reclaimed = await job.claim("alive", lease_s=60)
    assert first is not None and reclaimed is not None
    assert (reclaimed.seq, reclaimed.source) == (first.seq, "reclaimed")
    assert await job.extend("dead", [first.seq], lease_s=60) == [first.seq], "the dead worker lost its lease"
    assert await job.extend("alive", [first.seq], lease_s=60) == []


async def test_a_restarted_worker_takes_its_leases_back_at_once(client: aioredis.Redis) -> None:
    job = cursor(client)
    held = [await job.claim("w1", lease_s=600) for _ in range(2)]
    other = await job.claim("w2", lease_s=600)
    assert await job.release_worker("w1") == 2
    again = [await job.claim("w1", lease_s=600) for _ in range(2)]
    assert sorted(c.seq for c in again if c) == sorted(c.seq for c in held if c)
    assert {c.source for c in again if c} == {"reclaimed"}
    nxt = await job.claim("w1", lease_s=600)
    assert other is not None and nxt is not None and nxt.source == "new" and nxt.seq == 3


async def test_completion_is_idempotent_and_requeued_seqs_come_first(client: aioredis.Redis) -> None:
    job = cursor(client)
    claim = await job.claim("w1", lease_s=60)
    assert claim is not None
    assert await job.complete(claim.seq) is True and await job.complete(claim.seq) is False
    assert await job.requeue(claim.seq) is True
    redo = await job.claim("w1", lease_s=60)
    assert redo is not None and (redo.seq, redo.source) == (claim.seq, "requeued")
    assert await job.requeue(redo.seq) is False, "a leased seq is not requeued twice"
    status = await job.status()
    assert status.num_done == 1 and status.lowest_open_seq == claim.seq


async def test_a_cursor_made_for_another_dataset_order_is_refused(client: aioredis.Redis) -> None:
    job = cursor(client)
    await job.check_fingerprint("rows=10;shuffle=True;seed=0")
    await job.check_fingerprint("rows=10;shuffle=True;seed=0")
    with pytest.raises(CursorMismatchError, match="rows=10"):
        await job.check_fingerprint("rows=11;shuffle=True;seed=0")
    await cursor(client, job_id="another-job").check_fingerprint("rows=11;shuffle=True;seed=0")


async def test_a_forever_job_never_runs_out(client: aioredis.Redis) -> None:
    job = cursor(client, num_seqs=None)
    seqs = [(await job.claim("w", lease_s=60)).seq for _ in range(50)]  # type: ignore[union-attr]
    assert seqs == list(range(50))


async def test_a_retried_seq_comes_back_undecided(client: aioredis.Redis) -> None:
    job = cursor(client, num_seqs=2)
    first = await job.claim("w1", lease_s=60)
    assert first is not None
    await job.retry(first.seq)
    again = await job.claim("w2", lease_s=60)
    assert again is not None and (again.seq, again.source) == (first.seq, "requeued")
    status = await job.status()
    assert status.num_done == 0 and status.num_leased == 1 and status.num_redo == 0

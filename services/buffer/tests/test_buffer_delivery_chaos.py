"""Exactly-once in the end: concurrent producers and two consumers against a real miles-buffer over real Redis,
while (a) the buffer is kill -9'ed mid-stream and restarted, (b) a consumer dies holding leases, (c) pushes are
retried after timeouts, (d) Redis (AOF, appendfsync always) is kill -9'ed and restarted.

Each scenario counts: every pushed group acked exactly once (pushed = acked), no group delivered after it was
acked, the buffer's own counters agree, and re-pushing every group afterwards changes nothing.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import grpc
import pytest
import redis

from miles.buffer.client import ACCEPTED_OUTCOMES, RetryPolicy
from miles.common.errors import DeadlineExceededError, UnavailableError
from miles.common.testing import RedisServer, free_port
from miles.proto.buffer.v1 import buffer_pb2, buffer_pb2_grpc
from miles.proto.common.v1 import common_pb2

if TYPE_CHECKING:
    from conftest import BufferProcess

NUM_PRODUCERS = 3
GROUPS_PER_PRODUCER = 25
TOTAL_GROUPS = NUM_PRODUCERS * GROUPS_PER_PRODUCER
LEASE_S = 2.0
SETTLE_LIMIT_S = 120.0  # only a guard against hanging forever; no speed is asserted
GroupFactory = Callable[..., common_pb2.Group]


@dataclass
class Ledger:
    """What the test saw: pushes, deliveries and acks per group id."""

    pushed: set[str] = field(default_factory=set)
    deliveries: Counter[str] = field(default_factory=Counter)
    acked: Counter[str] = field(default_factory=Counter)
    delivered_after_ack: int = 0
    push_timeouts: int = 0
    duplicate_outcomes: int = 0
    lost_replies: int = 0
    abandoned: list[str] = field(default_factory=list)
    redelivered_to_survivors: set[str] = field(default_factory=set)

    def describe(self) -> str:
        missing = sorted(self.pushed - set(self.acked))
        return (
            f"pushed {len(self.pushed)}, acked {len(self.acked)}, missing {missing[:10]} "
            f"(deliveries of missing: {[self.deliveries[gid] for gid in missing[:10]]})"
        )


def _pushed_in_redis(redis_url: str, job_id: str, group_id: str) -> bool:
    client = redis.Redis.from_url(redis_url)
    try:
        return bool(client.hexists(f"miles:buffer:{{{job_id}}}:data", group_id))
    finally:
        client.close()


async def _push_with_lost_reply(target: str, job_id: str, group: common_pb2.Group) -> None:
    """A push whose reply the producer never sees (as if its deadline passed just after the buffer stored the
    group): the reply is read by this side channel and discarded."""
    async with grpc.aio.insecure_channel(target) as channel:
        stub = buffer_pb2_grpc.BufferServiceStub(channel)
        await stub.PushGroup(buffer_pb2.PushGroupRequest(job_id=job_id, group=group, wait_s=5), timeout=30)


async def produce(
    buffer: BufferProcess, job_id: str, index: int, ledger: Ledger, make_group: GroupFactory, retry_pushes: bool
) -> None:
    tight_retry = RetryPolicy(max_attempts=1)
    async with buffer.client() as client, buffer.client(call_timeout_s=0.003, retry=tight_retry) as tight:
        for number in range(GROUPS_PER_PRODUCER):
            group = make_group(f"p{index}-{number}", num_response_tokens=16)
            if retry_pushes and number % 5 == 0:
                await _push_with_lost_reply(buffer.target, job_id, group)
                assert _pushed_in_redis(buffer.redis_url, job_id, group.group_id)
                ledger.lost_replies += 1
            elif retry_pushes:
                try:
                    await tight.push_group(job_id, group, wait_s=0)
                except (DeadlineExceededError, UnavailableError):
                    ledger.push_timeouts += 1
            response = await client.push_group(job_id, group)
            assert response.outcome in ACCEPTED_OUTCOMES
            ledger.duplicate_outcomes += response.outcome == buffer_pb2.PUSH_OUTCOME_DUPLICATE
            ledger.pushed.add(group.group_id)
            await asyncio.sleep(0.01)


async def consume(buffer: BufferProcess, job_id: str, name: str, ledger: Ledger, stop: asyncio.Event) -> None:
    async with buffer.client() as client:
        while not stop.is_set():
            batch = await client.pull_batch(
                job_id, num_groups=4, trainer_version=0, max_staleness=0, lease_s=LEASE_S, wait_s=0.3, consumer_id=name
            )
            for leased in batch.groups:
                group_id = leased.group.group_id
                ledger.deliveries[group_id] += 1
                ledger.delivered_after_ack += ledger.acked[group_id] > 0
                if leased.redelivery_count > 0:
                    ledger.redelivered_to_survivors.add(group_id)
            if not batch.groups:
                continue
            await asyncio.sleep(0.02)  # "training"
            response = await client.ack(job_id, [leased.lease_id for leased in batch.groups])
            expired = set(response.expired_lease_ids)
            for leased in batch.groups:
                if leased.lease_id not in expired:
                    ledger.acked[leased.group.group_id] += 1


async def die_holding_leases(buffer: BufferProcess, job_id: str, ledger: Ledger) -> None:
    """A consumer that leases a batch and dies before acking it (its channel closes, nothing else happens)."""
    async with buffer.client() as client:
        batch = await client.pull_batch(
            job_id, num_groups=5, trainer_version=0, max_staleness=0, lease_s=1.0, wait_s=10, consumer_id="doomed"
        )
    ledger.abandoned = [leased.group.group_id for leased in batch.groups]
    for group_id in ledger.abandoned:
        ledger.deliveries[group_id] += 1


async def _wait_until(
    condition: Callable[[], bool], what: str, tasks: list[asyncio.Task[None]], describe: Callable[[], str]
) -> None:
    """Waits for condition, failing at once with the error of any task that died."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + SETTLE_LIMIT_S
    while not condition():
        for task in tasks:
            if task.done() and task.exception() is not None:
                raise AssertionError(f"a client task failed while waiting for {what}") from task.exception()
        assert loop.time() < deadline, f"gave up waiting for {what}: {describe()}"
        await asyncio.sleep(0.05)


async def run_stream(
    buffer: BufferProcess,
    job_id: str,
    make_group: GroupFactory,
    *,
    disrupt: Callable[[], Awaitable[None]] | None = None,
    consumer_dies: bool = False,
    retry_pushes: bool = False,
) -> Ledger:
    ledger = Ledger()
    stop = asyncio.Event()
    async with buffer.client() as admin:
        await admin.configure_job(job_id, capacity_groups=32)
    doomed = asyncio.create_task(die_holding_leases(buffer, job_id, ledger)) if consumer_dies else None
    producers = [
        asyncio.create_task(produce(buffer, job_id, index, ledger, make_group, retry_pushes))
        for index in range(NUM_PRODUCERS)
    ]
    if doomed is not None:
        await doomed
    consumers = [
        asyncio.create_task(consume(buffer, job_id, name, ledger, stop)) for name in ("trainer-a", "trainer-b")
    ]
    tasks = producers + consumers
    if disrupt is not None:
        await _wait_until(
            lambda: len(ledger.pushed) >= TOTAL_GROUPS // 3, "a third of the pushes", tasks, ledger.describe
        )
        await disrupt()
    await asyncio.gather(*producers)
    await _wait_until(
        lambda: len(ledger.acked) >= len(ledger.pushed), "every pushed group to be acked", tasks, ledger.describe
    )
    stop.set()
    await asyncio.gather(*consumers)
    return ledger


async def check_exactly_once(buffer: BufferProcess, job_id: str, ledger: Ledger, make_group: GroupFactory) -> None:
    assert len(ledger.pushed) == TOTAL_GROUPS
    assert set(ledger.acked) == ledger.pushed, "pushed = acked"
    assert [gid for gid, count in ledger.acked.items() if count != 1] == [], "each group acked exactly once"
    assert ledger.delivered_after_ack == 0
    async with buffer.client() as client:
        stats = await client.stats(job_id)
        assert (stats.pushed_total, stats.acked_total) == (TOTAL_GROUPS, TOTAL_GROUPS)
        assert (stats.queued_groups, stats.leased_groups) == (0, 0)
        for group_id in sorted(ledger.pushed):
            again = await client.push_group(job_id, make_group(group_id, num_response_tokens=16))
            assert again.outcome == buffer_pb2.PUSH_OUTCOME_DUPLICATE
        leftover = await client.pull_batch(job_id, num_groups=100, trainer_version=0, max_staleness=0, lease_s=5)
        assert list(leftover.groups) == []


@pytest.mark.integration
async def test_buffer_killed_mid_stream_loses_and_duplicates_nothing(
    buffer_process: BufferProcess, make_group: GroupFactory, job_id: str
) -> None:
    async def kill_and_restart() -> None:
        buffer_process.kill9()
        await asyncio.sleep(0.3)
        await asyncio.to_thread(buffer_process.start)

    ledger = await run_stream(buffer_process, job_id, make_group, disrupt=kill_and_restart)
    await check_exactly_once(buffer_process, job_id, ledger, make_group)


@pytest.mark.integration
async def test_consumer_dying_with_leases_gets_them_redelivered(
    buffer_process: BufferProcess, make_group: GroupFactory, job_id: str
) -> None:
    ledger = await run_stream(buffer_process, job_id, make_group, consumer_dies=True)
    await check_exactly_once(buffer_process, job_id, ledger, make_group)
    assert ledger.abandoned, "the doomed consumer leased something before dying"
    assert set(ledger.abandoned) <= ledger.redelivered_to_survivors
    async with buffer_process.client() as client:
        assert (await client.stats(job_id)).expired_leases_total >= len(ledger.abandoned)


@pytest.mark.integration
async def test_pushes_retried_after_timeouts_are_not_duplicated(
    buffer_process: BufferProcess, make_group: GroupFactory, job_id: str
) -> None:
    ledger = await run_stream(buffer_process, job_id, make_group, retry_pushes=True)
    await check_exactly_once(buffer_process, job_id, ledger, make_group)
    assert ledger.lost_replies == NUM_PRODUCERS * 5
    assert ledger.duplicate_outcomes >= ledger.lost_replies, "every retry after a lost reply was a duplicate"
    async with buffer_process.client() as client:
        assert (await client.stats(job_id)).duplicate_pushes_total >= ledger.lost_replies


@pytest.mark.integration
async def test_redis_restart_with_aof_loses_nothing(
    make_group: GroupFactory, job_id: str, tmp_path: Path, start_buffer: Callable[..., BufferProcess]
) -> None:
    """Uses a Redis of its own (not the session's): appendonly yes, appendfsync always, killed with SIGKILL."""
    redis_server = RedisServer(tmp_path / "redis", free_port(), appendfsync="always")
    redis_server.start()
    try:
        buffer = start_buffer(redis_server.url)

        async def kill_redis_and_restart() -> None:
            await asyncio.to_thread(redis_server.restart, kill=True)

        ledger = await run_stream(buffer, job_id, make_group, disrupt=kill_redis_and_restart)
        await check_exactly_once(buffer, job_id, ledger, make_group)
        buffer.stop()
    finally:
        redis_server.stop()

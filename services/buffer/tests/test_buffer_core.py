"""Semantics of the buffer core over a real Redis: idempotent pushes, capacity, filters, leases, acks, stats."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

import pytest

from miles.buffer.core import Buffer
from miles.buffer.errors import BufferFullError, UnknownJobError
from miles.buffer.records import JobConfig
from miles.buffer.store import check_redis_persistence, connect_redis
from miles.common.errors import ConfigError
from miles.common.testing import RedisServer, free_port
from miles.proto.common.v1 import common_pb2

GroupFactory = Callable[..., common_pb2.Group]
ABORTED = common_pb2.SAMPLE_STATUS_ABORTED
FAILED = common_pb2.SAMPLE_STATUS_FAILED
LONG_LEASE_S = 60.0


def _group_id(group_bytes: bytes) -> str:
    group = common_pb2.Group()
    group.ParseFromString(group_bytes)
    return group.group_id


async def _pull_ids(buffer: Buffer, job: str, *, num_groups: int = 10, lease_s: float = LONG_LEASE_S) -> list[str]:
    result = await buffer.pull_batch(job, num_groups=num_groups, trainer_version=0, max_staleness=0, lease_s=lease_s)
    return [_group_id(record.group_bytes) for record in result.groups]


async def test_retried_push_never_duplicates_even_after_ack(buffer_core: Buffer, make_group: GroupFactory) -> None:
    await buffer_core.configure_job("j", JobConfig(capacity_groups=10))
    first = await buffer_core.push_group("j", make_group("g1"), wait_s=0)
    again = await buffer_core.push_group("j", make_group("g1"), wait_s=0)
    assert (first.outcome, again.outcome) == ("queued", "duplicate")
    pulled = await buffer_core.pull_batch("j", num_groups=5, trainer_version=0, max_staleness=0, lease_s=LONG_LEASE_S)
    assert len(pulled.groups) == 1
    while_leased = await buffer_core.push_group("j", make_group("g1"), wait_s=0)
    await buffer_core.ack("j", [pulled.groups[0].lease_id])
    after_ack = await buffer_core.push_group("j", make_group("g1"), wait_s=0)
    assert (while_leased.outcome, after_ack.outcome) == ("duplicate", "duplicate")
    assert await _pull_ids(buffer_core, "j") == []
    stats = await buffer_core.stats("j")
    assert (stats.counter("pushed"), stats.counter("duplicate"), stats.counter("acked")) == (1, 3, 1)


async def test_full_job_waits_then_resource_exhausted(buffer_core: Buffer, make_group: GroupFactory) -> None:
    await buffer_core.configure_job("j", JobConfig(capacity_groups=2))
    for index in range(2):
        await buffer_core.push_group("j", make_group(f"g{index}"), wait_s=0)
    with pytest.raises(BufferFullError):
        await buffer_core.push_group("j", make_group("g2"), wait_s=0.1)
    assert (await buffer_core.stats("j")).queued_groups == 2


async def test_full_job_push_proceeds_once_an_ack_frees_room(buffer_core: Buffer, make_group: GroupFactory) -> None:
    await buffer_core.configure_job("j", JobConfig(capacity_groups=1))
    await buffer_core.push_group("j", make_group("g0"), wait_s=0)
    waiting = asyncio.create_task(buffer_core.push_group("j", make_group("g1"), wait_s=5.0))
    pulled = await buffer_core.pull_batch("j", num_groups=1, trainer_version=0, max_staleness=0, lease_s=LONG_LEASE_S)
    await asyncio.sleep(0.05)
    assert not waiting.done(), "a leased group still counts against capacity"
    await buffer_core.ack("j", [pulled.groups[0].lease_id])
    assert (await waiting).outcome == "queued"


async def test_aborted_groups_rejected_and_filters_count_drops(buffer_core: Buffer, make_group: GroupFactory) -> None:
    await buffer_core.configure_job(
        "j", JobConfig(capacity_groups=10, group_filter="drop_equal_rewards", min_valid_samples=2)
    )
    aborted = make_group("aborted", statuses=(ABORTED, FAILED))
    equal = make_group("equal", rewards=(1.0, 1.0))
    one_valid = make_group("one-valid", statuses=(ABORTED, 1))
    kept = make_group("kept", rewards=(0.0, 1.0))
    outcomes = [(await buffer_core.push_group("j", g, wait_s=0)) for g in (aborted, equal, one_valid, kept)]
    assert [o.outcome for o in outcomes] == ["rejected_all_aborted", "filtered", "filtered", "queued"]
    assert [o.filter_reason for o in outcomes[1:3]] == ["equal_rewards", "too_few_valid"]
    assert (await buffer_core.push_group("j", make_group("equal", rewards=(1.0, 1.0)), wait_s=0)).outcome == "duplicate"
    stats = await buffer_core.stats("j")
    assert stats.filtered_total == 2
    assert stats.counter("rejected_aborted") == 1
    assert await _pull_ids(buffer_core, "j") == ["kept"]


async def test_expired_lease_returns_group_for_redelivery(buffer_core: Buffer, make_group: GroupFactory) -> None:
    await buffer_core.configure_job("j", JobConfig(capacity_groups=10))
    await buffer_core.push_group("j", make_group("g"), wait_s=0)
    first = await buffer_core.pull_batch("j", num_groups=1, trainer_version=0, max_staleness=0, lease_s=0.2)
    assert await _pull_ids(buffer_core, "j") == []
    await asyncio.sleep(0.3)
    second = await buffer_core.pull_batch("j", num_groups=1, trainer_version=0, max_staleness=0, lease_s=LONG_LEASE_S)
    assert [_group_id(r.group_bytes) for r in second.groups] == ["g"]
    assert second.groups[0].redelivery_count == 1
    assert second.num_expired_leases == 1
    late_ack = await buffer_core.ack("j", [first.groups[0].lease_id])
    assert (late_ack.num_acked, late_ack.expired_lease_ids) == (0, [first.groups[0].lease_id])
    good_ack = await buffer_core.ack("j", [second.groups[0].lease_id])
    repeat_ack = await buffer_core.ack("j", [second.groups[0].lease_id])
    assert (good_ack.num_acked, repeat_ack.num_acked, repeat_ack.num_already_acked) == (1, 0, 1)
    stats = await buffer_core.stats("j")
    assert (stats.counter("expired"), stats.counter("acked"), stats.leased_groups, stats.queued_groups) == (1, 1, 0, 0)


async def test_extend_lease_keeps_group_leased(buffer_core: Buffer, make_group: GroupFactory) -> None:
    await buffer_core.configure_job("j", JobConfig(capacity_groups=10))
    await buffer_core.push_group("j", make_group("g"), wait_s=0)
    pulled = await buffer_core.pull_batch("j", num_groups=1, trainer_version=0, max_staleness=0, lease_s=0.3)
    lease_id = pulled.groups[0].lease_id
    extended = await buffer_core.extend_lease("j", [lease_id, "unknown"], LONG_LEASE_S)
    assert (extended.num_extended, extended.expired_lease_ids) == (1, ["unknown"])
    assert extended.lease_expires_unix_ms > pulled.lease_expires_unix_ms
    await asyncio.sleep(0.4)
    assert await buffer_core.reap_expired_leases() == 0
    assert (await buffer_core.ack("j", [lease_id])).num_acked == 1


async def test_nack_requeues_in_place_and_discard_deletes(buffer_core: Buffer, make_group: GroupFactory) -> None:
    await buffer_core.configure_job("j", JobConfig(capacity_groups=10))
    for name in ("a", "b", "c"):
        await buffer_core.push_group("j", make_group(name), wait_s=0)
    pulled = await buffer_core.pull_batch("j", num_groups=2, trainer_version=0, max_staleness=0, lease_s=LONG_LEASE_S)
    lease_a, lease_b = (record.lease_id for record in pulled.groups)
    assert await buffer_core.nack("j", [lease_a], reason="test") == 1
    assert await buffer_core.nack("j", [lease_a]) == 0, "nack is idempotent"
    assert await buffer_core.nack("j", [lease_b], discard=True) == 1
    assert await _pull_ids(buffer_core, "j") == ["a", "c"], "a nacked group keeps its place, oldest first"
    assert (await buffer_core.push_group("j", make_group("b"), wait_s=0)).outcome == "duplicate"
    stats = await buffer_core.stats("j")
    assert (stats.counter("nacked"), stats.counter("discarded")) == (1, 1)


async def test_release_consumer_returns_only_its_leases(buffer_core: Buffer, make_group: GroupFactory) -> None:
    await buffer_core.configure_job("j", JobConfig(capacity_groups=10))
    for name in ("a", "b", "c"):
        await buffer_core.push_group("j", make_group(name), wait_s=0)
    await buffer_core.pull_batch(
        "j", num_groups=2, trainer_version=0, max_staleness=0, lease_s=LONG_LEASE_S, consumer_id="trainer-0"
    )
    await buffer_core.pull_batch(
        "j", num_groups=1, trainer_version=0, max_staleness=0, lease_s=LONG_LEASE_S, consumer_id="trainer-1"
    )
    assert await buffer_core.nack("j", [], consumer_id="trainer-0", reason="restarted") == 2
    assert await _pull_ids(buffer_core, "j") == ["a", "b"]


async def test_long_poll_returns_when_min_groups_arrive(buffer_core: Buffer, make_group: GroupFactory) -> None:
    await buffer_core.configure_job("j", JobConfig(capacity_groups=10))
    await buffer_core.push_group("j", make_group("g0"), wait_s=0)
    pull = asyncio.create_task(
        buffer_core.pull_batch(
            "j", num_groups=4, min_groups=2, trainer_version=0, max_staleness=0, lease_s=LONG_LEASE_S, wait_s=30.0
        )
    )
    await asyncio.sleep(0.1)
    assert not pull.done(), "one group is fewer than min_groups"
    await buffer_core.push_group("j", make_group("g1"), wait_s=0)
    result = await pull
    assert [_group_id(r.group_bytes) for r in result.groups] == ["g0", "g1"]


async def test_long_poll_ends_with_what_is_there(buffer_core: Buffer, make_group: GroupFactory) -> None:
    await buffer_core.configure_job("j", JobConfig(capacity_groups=10))
    await buffer_core.push_group("j", make_group("g0"), wait_s=0)
    result = await buffer_core.pull_batch(
        "j", num_groups=4, min_groups=3, trainer_version=0, max_staleness=0, lease_s=LONG_LEASE_S, wait_s=0.2
    )
    assert len(result.groups) == 1


async def test_staleness_uses_oldest_span_of_any_sample(buffer_core: Buffer, make_group: GroupFactory) -> None:
    await buffer_core.configure_job("j", JobConfig(capacity_groups=10))
    await buffer_core.push_group("j", make_group("mixed", versions=(3, 5)), wait_s=0)
    await buffer_core.push_group("j", make_group("fresh", versions=(5,)), wait_s=0)
    strict = await buffer_core.pull_batch("j", num_groups=5, trainer_version=5, max_staleness=1, lease_s=LONG_LEASE_S)
    assert [_group_id(r.group_bytes) for r in strict.groups] == ["fresh"]
    assert strict.num_dropped_stale == 1


async def test_stats_and_gauges_track_queue_sizes(buffer_core: Buffer, make_group: GroupFactory) -> None:
    await buffer_core.configure_job("j", JobConfig(capacity_groups=10))
    await buffer_core.push_group("j", make_group("a", num_samples=3), wait_s=0)
    await buffer_core.push_group("j", make_group("b", num_samples=2), wait_s=0)
    await asyncio.sleep(0.01)
    stats = await buffer_core.stats("j")
    assert (stats.queued_groups, stats.queued_samples, stats.queued_tokens) == (2, 5, 40)
    assert stats.oldest_group_age_s > 0
    await buffer_core.pull_batch("j", num_groups=1, trainer_version=2, max_staleness=5, lease_s=LONG_LEASE_S)
    stats = await buffer_core.stats("j")
    assert (stats.queued_groups, stats.queued_samples, stats.leased_groups) == (1, 2, 1)
    assert (stats.avg_staleness, stats.counter("staleness_max")) == (2.0, 2)
    exposition = buffer_core.metrics.staleness.labels("j").collect()[0].samples
    assert any(s.name.endswith("_count") and s.value == 1 for s in exposition)
    assert buffer_core.metrics.queued_samples.labels("j")._value.get() == 2


async def test_unknown_job_stores_nothing(buffer_core: Buffer, make_group: GroupFactory) -> None:
    with pytest.raises(UnknownJobError) as caught:
        await buffer_core.push_group("nobody", make_group("g"), wait_s=0)
    assert caught.value.field == "job_id"
    assert await buffer_core.store.client.keys("test:buffer:{nobody}*") == []


async def test_delete_job_removes_everything(buffer_core: Buffer, make_group: GroupFactory) -> None:
    await buffer_core.configure_job("j", JobConfig(capacity_groups=10))
    for name in ("a", "b"):
        await buffer_core.push_group("j", make_group(name), wait_s=0)
    await buffer_core.pull_batch("j", num_groups=1, trainer_version=0, max_staleness=0, lease_s=LONG_LEASE_S)
    assert await buffer_core.delete_job("j") == 2
    assert await buffer_core.store.client.keys("test:buffer:{j}*") == []
    assert await buffer_core.store.list_jobs() == []
    with pytest.raises(UnknownJobError):
        await buffer_core.pull_batch("j", num_groups=1, trainer_version=0, max_staleness=0, lease_s=1)


async def test_reexecuted_pull_script_never_orphans_groups(buffer_core: Buffer, make_group: GroupFactory) -> None:
    """redis-py resends a script whose reply was lost (e.g. Redis restarted): the same arguments run twice.
    The second run must make new leases, not overwrite the first run's (which would orphan their groups)."""
    await buffer_core.configure_job("j", JobConfig(capacity_groups=10))
    for name in ("a", "b"):
        await buffer_core.push_group("j", make_group(name), wait_s=0)
    arguments = {
        "num_groups": 1,
        "min_groups": 1,
        "trainer_version": 0,
        "max_staleness": 0,
        "lease_ms": 200,
        "lease_id_prefix": "same-prefix",
        "consumer_id": "c",
        "max_bytes": 1 << 20,
    }
    _, first = await buffer_core.store.pull("j", **arguments)  # type: ignore[arg-type]
    _, second = await buffer_core.store.pull("j", **arguments)  # type: ignore[arg-type]
    assert first.groups[0].lease_id != second.groups[0].lease_id
    assert (await buffer_core.stats("j")).leased_groups == 2
    await asyncio.sleep(0.3)
    assert sorted(await _pull_ids(buffer_core, "j")) == ["a", "b"], "both groups come back after their leases expire"


async def test_pull_stops_at_the_byte_budget_but_returns_one_group(
    buffer_core: Buffer, make_group: GroupFactory
) -> None:
    await buffer_core.configure_job("j", JobConfig(capacity_groups=10))
    for name in ("a", "b", "c"):
        await buffer_core.push_group("j", make_group(name), wait_s=0)
    group_size = len(make_group("a", prompt_index=0).SerializeToString())
    arguments = {"min_groups": 1, "trainer_version": 0, "max_staleness": 0, "lease_ms": 60_000, "consumer_id": ""}
    _, two = await buffer_core.store.pull(
        "j",
        num_groups=3,
        lease_id_prefix="p1",
        max_bytes=2 * group_size + 100,
        **arguments,  # type: ignore[arg-type]
    )
    _, one = await buffer_core.store.pull(
        "j",
        num_groups=3,
        lease_id_prefix="p2",
        max_bytes=1,
        **arguments,  # type: ignore[arg-type]
    )
    assert (len(two.groups), len(one.groups)) == (2, 1)


async def test_persistence_check_refuses_redis_without_aof(tmp_path: Path, redis_url: str) -> None:
    no_aof = RedisServer(tmp_path / "no-aof", free_port(), appendonly=False)
    no_aof.start()
    try:
        client = connect_redis(no_aof.url, max_connections=2, socket_timeout_s=5.0)
        with pytest.raises(ConfigError):
            await check_redis_persistence(client, "require")
        await check_redis_persistence(client, "warn")  # logs, starts anyway
        await client.aclose()
    finally:
        no_aof.stop()
    with_aof = connect_redis(redis_url, max_connections=2, socket_timeout_s=5.0)
    await check_redis_persistence(with_aof, "require")
    await with_aof.aclose()

"""The barrier of `train.mode: sync` over a real Redis and a real buffer subprocess, with scripted episodes and a
live weight version the test moves: two workers together start exactly one batch per version and nothing more
until the version moves; a group the filters drop (or that the trainer's dynamic sampling would discard) gives its
place to another; a prompt reclaimed from a dead worker keeps its place. Async's staleness window: max_staleness
batches past the live one are admitted, no more, each group into the first version with a place."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
import redis.asyncio as aioredis
import redis.exceptions as redis_exceptions

from miles.buffer.client import BufferClient
from miles.common.jobspec.rollout import RolloutSpec
from miles.common.telemetry import Metrics
from miles.proto.common.v1 import common_pb2
from miles.rollout.barrier import SyncBarrier
from miles.rollout.core import groups_discarded
from miles.rollout.cursor import DatasetCursor
from miles.rollout.dataset import load_dataset
from miles.rollout.episode import EpisodeOutcome, EpisodeTask
from miles.rollout.metrics import RolloutMetrics
from miles.rollout.pusher import GroupPusher
from miles.rollout.scheduler import RolloutScheduler, cancel_and_wait

pytestmark = pytest.mark.integration


class Versions:
    """The engines' live version, as the router would answer it; episodes record the version they ran at."""

    def __init__(self) -> None:
        self.live: int | None = 0

    async def __call__(self) -> int | None:
        return self.live


@pytest.fixture
async def redis_client(redis_url: str) -> AsyncIterator[aioredis.Redis]:
    client = aioredis.Redis.from_url(redis_url)
    yield client
    await client.aclose()


@pytest.fixture
async def buffer(services: Any) -> AsyncIterator[BufferClient]:
    client = BufferClient(services.buffer_address)
    yield client
    await client.close()


@pytest.fixture
def job_id(request: pytest.FixtureRequest) -> str:
    return "barrier-" + "".join(ch if ch.isalnum() else "-" for ch in request.node.name)[:80]


def barrier(redis_client: aioredis.Redis, job_id: str, versions: Versions, **kw: Any) -> SyncBarrier:
    metrics = RolloutMetrics(Metrics("rollout"))
    return SyncBarrier(
        redis_client, key_prefix="test:rollout", job_id=job_id, live_version=versions, metrics=metrics, **kw
    )


class Scheduled:
    def __init__(self, redis_client: aioredis.Redis, buffer: BufferClient, job_id: str, versions: Versions) -> None:
        self.redis, self.buffer, self.job_id, self.versions = redis_client, buffer, job_id, versions
        self.started_at: list[tuple[int, int, int]] = []
        """(prompt index, sample index, live version when the episode started)."""
        self.tasks: list[asyncio.Task[None]] = []

    def episodes(self, make_sample: Callable[..., common_pb2.Sample], equal_rewards: set[int]) -> Any:
        async def run(task: EpisodeTask) -> EpisodeOutcome:
            self.started_at.append((task.prompt_index, task.sample_index, self.versions.live))
            await asyncio.sleep(0.05)
            reward = 0.0 if task.prompt_index in equal_rewards else float(task.sample_index)
            sample = make_sample(reward=reward)
            sample.group_id, sample.episode_id = task.group_id, task.episode_id
            return EpisodeOutcome([sample], sample.status, "ok")

        return run

    def start(self, spec: RolloutSpec, worker_id: str, run: Any, sync_barrier: SyncBarrier) -> RolloutScheduler:
        dataset = load_dataset(spec.dataset)
        metrics = RolloutMetrics(Metrics("rollout"))
        scheduler = RolloutScheduler(
            spec=spec,
            job_id=self.job_id,
            worker_id=worker_id,
            dataset=dataset,
            cursor=DatasetCursor(self.redis, key_prefix="test:rollout", job_id=self.job_id, num_seqs=dataset.num_seqs),
            run_episode=run,
            pusher=GroupPusher(self.buffer, job_id=self.job_id, metrics=metrics, push_wait_s=1.0),
            metrics=metrics,
            lease_s=30,
            idle_poll_s=0.05,
            barrier=sync_barrier,
        )
        self.tasks.append(asyncio.create_task(scheduler.run()))
        return scheduler

    async def stop(self) -> None:
        await cancel_and_wait(self.tasks, "schedulers", wait_s=30)

    async def pushed(self, expected: int) -> None:
        """Waits until `expected` groups were pushed, then checks that no more come while the version stays."""
        while (await self.buffer.stats(self.job_id)).pushed_total < expected:  # noqa: ASYNC110
            await asyncio.sleep(0.02)
        await asyncio.sleep(0.5)  # ten barrier polls: a worker that ignored the barrier would have started more
        assert (await self.buffer.stats(self.job_id)).pushed_total == expected


@pytest.mark.parametrize(
    ("versions_ahead", "batch_size_groups", "max_live_episodes"),
    [(0, 3, 4), (1, 2, 8)],
    ids=["sync barrier", "async window"],
)
async def test_two_workers_start_exactly_the_batches_of_the_window_per_version(
    make_spec: Callable[..., RolloutSpec],
    make_sample: Any,
    redis_client: aioredis.Redis,
    buffer: BufferClient,
    job_id: str,
    versions_ahead: int,
    batch_size_groups: int,
    max_live_episodes: int,
) -> None:
    """Sync: one batch per version. The async window: the live version's batch and versions_ahead more, then one
    new batch per version (the others are already generated)."""
    await buffer.configure_job(job_id)
    versions = Versions()
    spec = make_spec(num_prompts=12, n_samples_per_prompt=2, concurrency={"max_live_episodes": max_live_episodes})
    run = Scheduled(redis_client, buffer, job_id, versions)
    episodes = run.episodes(make_sample, equal_rewards=set())
    first = batch_size_groups * (versions_ahead + 1)
    try:
        for worker_id in ("w1", "w2"):
            window = barrier(
                redis_client, job_id, versions, batch_size_groups=batch_size_groups, versions_ahead=versions_ahead
            )
            run.start(spec, worker_id, episodes, window)
        await run.pushed(first)
        assert len(run.started_at) == 2 * first and {version for *_, version in run.started_at} == {0}
        versions.live = 1
        await run.pushed(first + batch_size_groups)
        assert [version for *_, version in run.started_at[2 * first :]] == [1] * (2 * batch_size_groups)
    finally:
        await run.stop()


async def test_window_admission_fills_the_oldest_version_first_and_keeps_a_reclaimed_place(
    redis_client: aioredis.Redis, job_id: str
) -> None:
    versions = Versions()
    one = barrier(redis_client, job_id, versions, batch_size_groups=2, versions_ahead=2, poll_interval_s=0.01)
    assert [await one.admit(seq) for seq in range(6)] == [0, 0, 1, 1, 2, 2]
    other = barrier(redis_client, job_id, versions, batch_size_groups=2, versions_ahead=2, poll_interval_s=0.01)
    assert await other.admit(3) == 1  # reclaimed from a dead worker: the same place, not a second one
    waiting = asyncio.create_task(other.admit(6))
    await asyncio.sleep(0.2)
    assert not waiting.done()  # the window (live version 0, two ahead) is full
    await one.give_back(2)  # filtered: its place in batch 1 is free again
    assert await asyncio.wait_for(waiting, 5) == 1
    versions.live = 1
    assert [await one.admit(seq) for seq in (7, 8)] == [3, 3]  # batches 1 and 2 are full: the new one, 3
    with pytest.raises(ValueError):
        barrier(redis_client, job_id, versions, batch_size_groups=2, versions_ahead=-1)


async def test_filtered_groups_give_their_place_to_others(
    make_spec: Callable[..., RolloutSpec],
    make_sample: Any,
    redis_client: aioredis.Redis,
    buffer: BufferClient,
    job_id: str,
) -> None:
    await buffer.configure_job(job_id)
    versions = Versions()
    spec = make_spec(num_prompts=8, n_samples_per_prompt=2, concurrency={"max_live_episodes": 2})
    first_two = set(load_dataset(spec.dataset).order(0)[:2])
    run = Scheduled(redis_client, buffer, job_id, versions)
    sync_barrier = barrier(redis_client, job_id, versions, batch_size_groups=2, drop_equal_rewards=True)
    scheduler = run.start(spec, "w1", run.episodes(make_sample, equal_rewards=first_two), sync_barrier)
    try:
        await run.pushed(2)  # the first two prompts had no signal: two others took their places at version 0
        assert {prompt for prompt, *_ in run.started_at} >= first_two and len(run.started_at) == 8
        assert {version for *_, version in run.started_at} == {0}
        exported = scheduler.metrics.registry.exposition().decode()
        assert 'miles_rollout_groups_total{outcome="filtered_equal_rewards"} 2.0' in exported
    finally:
        await run.stop()


async def test_a_reclaimed_prompt_keeps_its_place_and_others_wait(redis_client: aioredis.Redis, job_id: str) -> None:
    versions = Versions()
    one = barrier(redis_client, job_id, versions, batch_size_groups=2)
    assert [await one.admit(seq) for seq in (0, 1)] == [0, 0]
    another_worker = barrier(redis_client, job_id, versions, batch_size_groups=2, poll_interval_s=0.01)
    assert await another_worker.admit(1) == 0  # seq 1's worker died; the prompt is reclaimed in the same batch
    waiting = asyncio.create_task(another_worker.admit(2))
    await asyncio.sleep(0.2)
    assert not waiting.done()
    await one.give_back(0)  # filtered: the place is free at the same version
    assert await asyncio.wait_for(waiting, 5) == 0
    third = asyncio.create_task(another_worker.admit(3))
    await asyncio.sleep(0.2)
    assert not third.done()
    versions.live = 1
    assert await asyncio.wait_for(third, 5) == 1


async def test_each_group_the_trainer_discards_opens_one_place_once_for_all_workers(
    redis_client: aioredis.Redis, job_id: str
) -> None:
    versions = Versions()
    discarded = [0]

    async def discarded_groups() -> int | None:
        return discarded[0]

    def make() -> SyncBarrier:
        return barrier(
            redis_client,
            job_id,
            versions,
            batch_size_groups=1,
            poll_interval_s=0.01,
            discarded=discarded_groups,
            refill_check_s=0.05,
        )

    full, one, two = make(), make(), make()
    await full.start()
    assert await full.admit(0) == 0
    waiting = [asyncio.create_task(one.admit(1)), asyncio.create_task(two.admit(2))]
    await asyncio.sleep(0.5)  # ten refill checks each: nothing was discarded, the batch is whole
    assert not any(task.done() for task in waiting)
    discarded[0] = 1  # the trainer discarded the batch's group (malformed) and waits for one it will never get
    done, pending = await asyncio.wait(waiting, timeout=5, return_when=asyncio.FIRST_COMPLETED)
    assert [task.result() for task in done] == [0]
    await asyncio.sleep(0.5)
    assert len(pending) == 1 and not pending.pop().done(), "one discard opens one place, not one per worker"
    refills = sum(
        float(line.split()[-1])
        for b in (one, two)
        for line in b._metrics.registry.exposition().decode().splitlines()
        if line.startswith("miles_rollout_sync_barrier_refills_total ")
    )
    assert refills == 1.0
    for task in waiting:
        task.cancel()
    await asyncio.gather(*waiting, return_exceptions=True)


async def test_a_waiting_admit_ends_when_cancelled_even_if_redis_swallows_the_cancellation(
    redis_client: aioredis.Redis, job_id: str
) -> None:
    """redis-py can turn a cancellation that lands mid-command into a connection error, which the barrier's retry
    loop catches: the task is left `cancelling` and, before, waited for a place forever (a hung test teardown)."""
    full, waiter = barrier(redis_client, job_id, Versions(), batch_size_groups=1, poll_interval_s=0.01), None
    assert await full.admit(0) == 0
    waiter = barrier(redis_client, job_id, Versions(), batch_size_groups=1, poll_interval_s=0.01)
    in_command = asyncio.Event()

    async def command_that_swallows_cancellation(**_: Any) -> int:
        in_command.set()
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            raise redis_exceptions.ConnectionError("Connection closed by server.") from None
        return 0

    waiter._admit = command_that_swallows_cancellation  # type: ignore[assignment]
    task = asyncio.create_task(waiter.admit(1))
    await asyncio.wait_for(in_command.wait(), timeout=30)
    task.cancel()
    done, _ = await asyncio.wait([task], timeout=30)
    assert done and task.cancelled()


async def test_a_prompt_stuck_at_admission_says_why_in_the_log(
    redis_client: aioredis.Redis, job_id: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A job stopped at admission must be diagnosable from its worker's log: a prompt waiting for a live version
    the router does not know, then for a place in a full window, logs a WARNING with what it waits for."""
    monkeypatch.setattr("miles.rollout.barrier.STUCK_LOG_S", 0.05)
    versions = Versions()
    full = barrier(redis_client, job_id, versions, batch_size_groups=1, versions_ahead=1, poll_interval_s=0.01)
    assert [await full.admit(seq) for seq in range(2)] == [0, 1]
    versions.live = None  # no available engine: the router answers null
    waiting = asyncio.create_task(full.admit(2))
    await asyncio.sleep(0.3)
    assert any("knows no live weight version" in r.getMessage() for r in caplog.records)
    versions.live = 0
    await asyncio.sleep(0.3)
    stuck = [r for r in caplog.records if "waits for a place" in r.getMessage()]
    assert stuck and stuck[-1].admitted_per_version == [1, 1] and stuck[-1].live_version == 0
    assert not waiting.done()
    versions.live = 1
    assert await asyncio.wait_for(waiting, 5) == 2


@pytest.mark.parametrize("policy", ["drop", "requeue"])
async def test_groups_the_buffer_finds_stale_reopen_places_of_an_async_window_only(
    redis_client: aioredis.Redis,
    buffer: BufferClient,
    make_sample: Callable[..., common_pb2.Sample],
    job_id: str,
    policy: str,
) -> None:
    """A long-tail group of an async job that ends up over the staleness bound never reaches the trainer: its
    place in the window must open again, or each one shrinks the window for good (bench-async: ~4 episodes in
    flight of the window's 24 before). A sync barrier's stale group is a surplus one: nothing to replace."""
    await buffer.configure_job(job_id, capacity_groups=16, stale_policy=policy)  # type: ignore[arg-type]
    for index in range(2):
        sample = make_sample(versions=(0,))
        sample.group_id = f"straggler-{index}"
        group = common_pb2.Group(group_id=sample.group_id, job_id=job_id, samples=[sample], prompt_index=index)
        await buffer.push_group(job_id, group)
    pulled = await buffer.pull_batch(job_id, num_groups=2, trainer_version=5, max_staleness=2, lease_s=60)
    assert pulled.groups == [] and pulled.num_dropped_stale + pulled.num_requeued == 2
    assert await groups_discarded(buffer, job_id) == 0  # the sync barrier's count: trainer discards only
    assert await groups_discarded(buffer, job_id, include_stale=True) == 2

    versions, counts = Versions(), {"now": 0}

    async def discarded() -> int | None:
        return await groups_discarded(buffer, job_id, include_stale=True) if counts["now"] else 0

    window = barrier(
        redis_client,
        job_id,
        versions,
        batch_size_groups=1,
        versions_ahead=1,
        poll_interval_s=0.01,
        discarded=discarded,
        refill_check_s=0.05,
    )
    await window.start()  # the count it starts from: 0
    assert [await window.admit(seq) for seq in range(2)] == [0, 1]
    waiting = [asyncio.create_task(window.admit(seq)) for seq in (2, 3, 4)]
    await asyncio.sleep(0.3)
    assert not any(task.done() for task in waiting)
    counts["now"] = 1  # the two stragglers are found stale: two places open at the live version, not three
    done, pending = await asyncio.wait(waiting, timeout=5)
    assert len(done) == 2 and sorted(task.result() for task in done) == [0, 0]
    await asyncio.sleep(0.3)
    assert len(pending) == 1 and not next(iter(pending)).done()
    for task in waiting:
        task.cancel()
    await asyncio.gather(*waiting, return_exceptions=True)

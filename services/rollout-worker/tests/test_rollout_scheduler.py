"""The scheduler over a real Redis cursor and a real buffer subprocess, with scripted episodes (the episode
flow itself is tested in test_rollout_episode_flow.py): no batch barrier, the live-episode cap, backpressure
from a full buffer, several workers on one job, and prompts the buffer hands back for regeneration."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
import redis.asyncio as aioredis

from miles.buffer.client import BufferClient
from miles.common.jobspec.rollout import RolloutSpec
from miles.common.telemetry import Metrics
from miles.proto.common.v1 import common_pb2
from miles.rollout.cursor import DatasetCursor
from miles.rollout.dataset import load_dataset
from miles.rollout.episode import EpisodeOutcome, EpisodeTask
from miles.rollout.metrics import RolloutMetrics
from miles.rollout.pusher import GroupPusher
from miles.rollout.scheduler import RolloutScheduler, cancel_and_wait

pytestmark = pytest.mark.integration


@dataclass
class ScriptedEpisodes:
    """An episode function whose duration the test controls; records concurrency and every task it ran."""

    make_sample: Callable[..., common_pb2.Sample]
    delay_s: float = 0.2
    hold: Callable[[EpisodeTask], bool] = lambda task: False
    unavailable: int = 0
    """The first this-many episodes end `session_unavailable` (the platform could not run them)."""
    released: asyncio.Event = field(default_factory=asyncio.Event)
    live: int = 0
    max_live: int = 0
    tasks: list[EpisodeTask] = field(default_factory=list)

    async def __call__(self, task: EpisodeTask) -> EpisodeOutcome:
        self.tasks.append(task)
        self.live += 1
        self.max_live = max(self.max_live, self.live)
        try:
            if self.hold(task):
                await self.released.wait()
            await asyncio.sleep(self.delay_s)
        finally:
            self.live -= 1
        if len(self.tasks) <= self.unavailable:
            aborted = self.make_sample(status=common_pb2.SAMPLE_STATUS_ABORTED)
            aborted.group_id = task.group_id
            return EpisodeOutcome([aborted], aborted.status, "session_unavailable")
        sample = self.make_sample(reward=float(task.sample_index))
        sample.group_id, sample.episode_id = task.group_id, task.episode_id
        return EpisodeOutcome([sample], sample.status, "ok")


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
    return "sched-" + "".join(ch if ch.isalnum() else "-" for ch in request.node.name)[:80]


Start = Callable[..., Awaitable[tuple[RolloutScheduler, "asyncio.Task[None]"]]]


@pytest.fixture
async def start_scheduler(redis_client: aioredis.Redis, buffer: BufferClient, job_id: str) -> AsyncIterator[Start]:
    running: list[asyncio.Task[None]] = []

    async def start(
        spec: RolloutSpec, episodes: ScriptedEpisodes, *, worker_id: str = "w1", push_wait_s: float = 1.0, **kw: Any
    ) -> tuple[RolloutScheduler, asyncio.Task[None]]:
        dataset = load_dataset(spec.dataset)
        metrics = RolloutMetrics(Metrics("rollout"))
        scheduler = RolloutScheduler(
            spec=spec,
            job_id=job_id,
            worker_id=worker_id,
            dataset=dataset,
            cursor=DatasetCursor(redis_client, key_prefix="test:rollout", job_id=job_id, num_seqs=dataset.num_seqs),
            run_episode=episodes,
            pusher=GroupPusher(buffer, job_id=job_id, metrics=metrics, push_wait_s=push_wait_s),
            metrics=metrics,
            lease_s=30,
            idle_poll_s=0.05,
            **kw,
        )
        task = asyncio.create_task(scheduler.run())
        running.append(task)
        return scheduler, task

    yield start
    await cancel_and_wait(running, "schedulers", wait_s=30)  # as the worker's stop does


async def wait_for(condition: Callable[[], Awaitable[bool]]) -> None:
    """Polls a condition of the system under test (it offers no event to wait on)."""
    while not await condition():  # noqa: ASYNC110
        await asyncio.sleep(0.02)


async def test_free_slots_refill_at_once_without_a_batch_barrier(
    make_spec: Callable[..., RolloutSpec], make_sample: Any, start_scheduler: Start, buffer: BufferClient, job_id: str
) -> None:
    await buffer.configure_job(job_id)
    spec = make_spec(num_prompts=6, n_samples_per_prompt=2, concurrency={"max_live_episodes": 4})
    first_prompt = load_dataset(spec.dataset).order(0)[0]
    episodes = ScriptedEpisodes(make_sample, hold=lambda t: t.prompt_index == first_prompt and t.sample_index == 0)
    scheduler, _ = await start_scheduler(spec, episodes)

    async def others_pushed() -> bool:
        return (await buffer.stats(job_id)).pushed_total == 5

    await wait_for(others_pushed)  # five groups finished while the long-tail episode still runs
    assert scheduler.num_live_episodes == 1 and episodes.max_live == 4
    episodes.released.set()
    await wait_for(lambda: _true_when(scheduler.exhausted))
    assert (await buffer.stats(job_id)).pushed_total == 6 and len(episodes.tasks) == 12


async def _true_when(value: bool) -> bool:
    return value


async def test_groups_larger_than_the_live_cap_still_complete(
    make_spec: Callable[..., RolloutSpec], make_sample: Any, start_scheduler: Start, buffer: BufferClient, job_id: str
) -> None:
    await buffer.configure_job(job_id)
    spec = make_spec(num_prompts=3, n_samples_per_prompt=5, concurrency={"max_live_episodes": 2})
    episodes = ScriptedEpisodes(make_sample)
    scheduler, _ = await start_scheduler(spec, episodes)
    await wait_for(lambda: _true_when(scheduler.exhausted))
    assert episodes.max_live == 2 and (await buffer.stats(job_id)).pushed_total == 3


async def test_a_full_buffer_pauses_new_episodes_until_there_is_room(
    make_spec: Callable[..., RolloutSpec], make_sample: Any, start_scheduler: Start, buffer: BufferClient, job_id: str
) -> None:
    await buffer.configure_job(job_id, capacity_groups=2)
    spec = make_spec(num_prompts=6, n_samples_per_prompt=2, concurrency={"max_live_episodes": 2})
    episodes = ScriptedEpisodes(make_sample)
    scheduler, _ = await start_scheduler(spec, episodes, push_wait_s=0.1)

    await wait_for(lambda: _true_when(scheduler.pusher.paused))
    started = len(episodes.tasks)
    await asyncio.sleep(1.0)
    assert scheduler.pusher.paused and len(episodes.tasks) == started, "no episode starts while paused"
    assert scheduler.num_live_episodes == 0 and (await buffer.stats(job_id)).queued_groups == 2
    taken: list[str] = []
    while len(taken) < 6:  # a trainer making room: every group arrives, none is dropped
        batch = await buffer.pull_batch(job_id, num_groups=2, trainer_version=0, max_staleness=10, lease_s=60, wait_s=5)
        taken += [leased.group.group_id for leased in batch.groups]
        await buffer.ack(job_id, [leased.lease_id for leased in batch.groups])
    assert sorted(taken) == sorted({f"{job_id}/e0/p{i}" for i in range(6)})
    await wait_for(lambda: _true_when(scheduler.exhausted and not scheduler.pusher.paused))
    exported = scheduler.metrics.registry.exposition().decode()
    assert 'miles_rollout_push_retries_total{cause="resource_exhausted"}' in exported


async def test_two_workers_share_a_job_without_overlap(
    make_spec: Callable[..., RolloutSpec], make_sample: Any, start_scheduler: Start, buffer: BufferClient, job_id: str
) -> None:
    await buffer.configure_job(job_id)
    spec = make_spec(num_prompts=20, n_samples_per_prompt=1, concurrency={"max_live_episodes": 3})
    first, second = ScriptedEpisodes(make_sample), ScriptedEpisodes(make_sample)
    one, _ = await start_scheduler(spec, first, worker_id="w1")
    two, _ = await start_scheduler(spec, second, worker_id="w2")
    await wait_for(lambda: _true_when(one.exhausted and two.exhausted))
    ran = [task.prompt_index for task in first.tasks + second.tasks]
    assert sorted(ran) == list(range(20)) and first.tasks and second.tasks
    stats = await buffer.stats(job_id)
    assert stats.pushed_total == 20 and stats.duplicate_pushes_total == 0


async def test_prompts_the_buffer_requeues_are_generated_again_under_the_same_group_id(
    make_spec: Callable[..., RolloutSpec], make_sample: Any, start_scheduler: Start, buffer: BufferClient, job_id: str
) -> None:
    await buffer.configure_job(job_id, stale_policy="requeue")
    spec = make_spec(num_prompts=3, n_samples_per_prompt=2)

    async def requeued() -> list[tuple[int, int]]:
        return [(int(p.epoch), int(p.prompt_index)) for p in await buffer.pull_requeued(job_id)]

    episodes = ScriptedEpisodes(make_sample)
    scheduler, _ = await start_scheduler(spec, episodes, requeued=requeued, requeue_poll_interval_s=0.05)
    await wait_for(lambda: _true_when(scheduler.exhausted))
    stale = await buffer.pull_batch(job_id, num_groups=10, trainer_version=5, max_staleness=0, lease_s=60)
    assert stale.num_requeued == 3 and not stale.groups

    async def regenerated() -> bool:
        return (await buffer.stats(job_id)).queued_groups == 3

    await wait_for(regenerated)
    fresh = await buffer.pull_batch(job_id, num_groups=10, trainer_version=0, max_staleness=10, lease_s=60)
    assert sorted(leased.group.group_id for leased in fresh.groups) == [f"{job_id}/e0/p{i}" for i in range(3)]
    assert len(episodes.tasks) == 12
    exported = scheduler.metrics.registry.exposition().decode()
    assert 'miles_rollout_prompts_claimed_total{source="requeued"} 3.0' in exported


async def test_groups_the_platform_could_not_run_are_retried_not_lost(
    make_spec: Callable[..., RolloutSpec], make_sample: Any, start_scheduler: Start, buffer: BufferClient, job_id: str
) -> None:
    await buffer.configure_job(job_id)
    spec = make_spec(num_prompts=3, n_samples_per_prompt=2, concurrency={"max_live_episodes": 2})
    episodes = ScriptedEpisodes(make_sample, unavailable=2)  # the first group: both episodes found no session server
    scheduler, _ = await start_scheduler(spec, episodes, outage_backoff_s=(0.3, 1.0))
    await wait_for(lambda: _true_when(scheduler.exhausted))
    stats = await buffer.stats(job_id)
    assert stats.pushed_total == 3 and len(episodes.tasks) == 8, "every prompt trained once, the first retried"
    exported = scheduler.metrics.registry.exposition().decode()
    assert 'miles_rollout_groups_total{outcome="retried_unavailable"} 1.0' in exported
    assert 'miles_rollout_prompts_claimed_total{source="requeued"} 1.0' in exported


async def test_a_stop_ends_even_when_a_helper_loop_swallows_its_cancellation(
    make_spec: Callable[..., RolloutSpec], make_sample: Any, start_scheduler: Start, buffer: BufferClient, job_id: str
) -> None:
    await buffer.configure_job(job_id)
    polls_cancelled: list[bool] = []

    async def requeued_turning_cancellation_into_an_error() -> list[tuple[int, int]]:
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:  # what a client library can do to a cancelled call
            polls_cancelled.append(True)
            raise RuntimeError("CANCELLED") from None
        return []

    spec = make_spec(num_prompts=2, n_samples_per_prompt=2)
    scheduler, task = await start_scheduler(
        spec, ScriptedEpisodes(make_sample), requeued=requeued_turning_cancellation_into_an_error
    )
    await wait_for(lambda: _true_when(scheduler.exhausted))
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    assert task.done() and polls_cancelled == [True]

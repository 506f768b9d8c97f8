"""The worker of one job: everything built from settings, started, observed and stopped in one place.

`RolloutWorker.build` fails at start-up (ConfigError) when the dataset cannot be read, the agent or reward
function cannot be imported, the environment server cannot start, or the cursor in Redis belongs to another
dataset order. `start` runs the
scheduler as a task; if it ever dies unexpectedly, `failed` is set and the process stops (loudly, non-zero).
"""

from __future__ import annotations

import asyncio
import functools
import logging
from typing import Any

import redis.asyncio as aioredis

from miles.buffer.client import BufferClient
from miles.common.jobspec.rollout import RolloutSpec
from miles.rollout import pools
from miles.rollout.barrier import SyncBarrier
from miles.rollout.cursor import DatasetCursor
from miles.rollout.dataset import Dataset
from miles.rollout.episode import EpisodeRunner
from miles.rollout.episode_source import EpisodeSource, open_episode_source
from miles.rollout.eval_loop import EvalLoop, build_eval_loop
from miles.rollout.ledger import SessionLedger
from miles.rollout.metrics import RolloutMetrics
from miles.rollout.pusher import GroupPusher
from miles.rollout.rewards import Scorer
from miles.rollout.sandbox import SandboxClient, sandbox_metadata
from miles.rollout.scheduler import RolloutScheduler, cancel_and_wait
from miles.rollout.sessions import SessionClient
from miles.rollout.settings import RolloutSettings
from miles.rollout.sweeper import OrphanSweeper
from miles.rollout.teacher import TeacherScorer

log = logging.getLogger(__name__)
STOP_TIMEOUT_S = 30.0
"""How long a stop waits for the scheduler's own cleanup before cancelling it again."""


async def groups_discarded(buffer: BufferClient, job_id: str, *, include_stale: bool = False) -> int | None:
    """How many of the job's groups the trainer discarded after pulling them, and with `include_stale` also those
    the buffer dropped or requeued as over the staleness bound (each one's place in the async window is lost
    otherwise); None when the buffer cannot say."""
    try:
        stats = await buffer.stats(job_id)
        stale = int(stats.dropped_stale_total + stats.requeued_total) if include_stale else 0
        return int(stats.discarded_total) + stale
    except Exception:  # the buffer restarting: the barrier asks again later
        log.warning("could not read the job's buffer counters", exc_info=True)
        return None


class RolloutWorker:
    def __init__(
        self,
        settings: RolloutSettings,
        spec: RolloutSpec,
        *,
        dataset: Dataset,
        redis_client: aioredis.Redis,
        cursor: DatasetCursor,
        sessions: SessionClient,
        buffer: BufferClient,
        sandbox: SandboxClient | None,
        runner: EpisodeRunner,
        scheduler: RolloutScheduler,
        sweeper: OrphanSweeper,
        source: EpisodeSource,
        evaluation: EvalLoop | None = None,
    ) -> None:
        self.settings = settings
        self.evaluation = evaluation
        self.source = source
        self.spec = spec
        self.dataset = dataset
        self.redis = redis_client
        self.cursor = cursor
        self.sessions = sessions
        self.buffer = buffer
        self.sandbox = sandbox
        self.runner = runner
        self.scheduler = scheduler
        self.sweeper = sweeper
        self.failed = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._sweeper_task: asyncio.Task[None] | None = None
        self._environment_task: asyncio.Task[None] | None = None
        self._eval_task: asyncio.Task[None] | None = None

    @classmethod
    async def build(cls, settings: RolloutSettings, metrics: RolloutMetrics) -> RolloutWorker:
        spec = settings.rollout
        assert spec is not None, "validated by RolloutSettings: a job has a rollout section"
        source = await open_episode_source(spec, settings, metrics)
        try:
            return cls._wire(settings, metrics, spec, source)
        except BaseException:
            await source.close()
            raise

    @classmethod
    def _wire(
        cls, settings: RolloutSettings, metrics: RolloutMetrics, spec: RolloutSpec, source: EpisodeSource
    ) -> RolloutWorker:
        job_id = settings.job_id
        dataset, agent = source.dataset, source.agent
        sandbox_token = settings.sandbox_token.get_secret_value()
        sandbox = SandboxClient(settings.sandbox_address, token=sandbox_token) if settings.sandbox_address else None
        scorer = Scorer(spec.reward, job_id=job_id, sandbox=sandbox)
        redis_client = aioredis.Redis.from_url(settings.redis_url, socket_timeout=10.0, socket_connect_timeout=5.0)
        cursor = DatasetCursor(redis_client, key_prefix=settings.key_prefix, job_id=job_id, num_seqs=dataset.num_seqs)
        sessions = SessionClient(
            settings.session_server_url,
            operator_token=settings.session_operator_token.get_secret_value(),
            request_timeout_s=settings.session_request_timeout_s,
            retry_budget_s=settings.retry_budget_s,
            on_retry=lambda operation: metrics.session_call_retries.labels(operation=operation).inc(),
        )
        pools.configure(pools.InferencePools(sessions, settings.inference_pools))  # for reward functions (a judge)
        ledger = SessionLedger(redis_client, key_prefix=settings.key_prefix, job_id=job_id)
        sweeper = OrphanSweeper(sessions, ledger, job_id=job_id, min_age_s=settings.orphan_min_age_s, metrics=metrics)
        sessions.on_uncertain_create = sweeper.request
        runner = EpisodeRunner(
            spec,
            sessions=sessions,
            agent=agent,
            scorer=scorer,
            metrics=metrics,
            worker_id=settings.worker_id,
            agent_extra_metadata=sandbox_metadata(
                settings.sandbox_http_url, settings.sandbox_address, settings.sandbox_token.get_secret_value()
            ),
            ledger=ledger,
            teacher=TeacherScorer(
                settings.router_url,
                settings.teacher_pool,
                request_timeout_s=settings.session_request_timeout_s,
                retry_budget_s=settings.retry_budget_s,
            )
            if settings.teacher_pool
            else None,
        )
        buffer = BufferClient(settings.buffer_address)
        pusher = GroupPusher(buffer, job_id=job_id, metrics=metrics, push_wait_s=settings.push_wait_s)

        async def reap_orphans(seq: int) -> int:
            # The dead worker may also have been killed inside a create, before it could record the session.
            sweeper.request()
            return await runner.reap_orphans(seq)

        async def requeued() -> list[tuple[int, int]]:
            return [(int(p.epoch), int(p.prompt_index)) for p in await buffer.pull_requeued(job_id)]

        evaluation = None
        if settings.evaluation is not None and settings.evaluation_enabled:
            evaluation = build_eval_loop(settings, settings.evaluation, spec, source, redis_client, metrics)
        barrier = None
        if settings.sync_batch_groups:
            barrier = SyncBarrier.through_router(
                redis_client,
                key_prefix=settings.key_prefix,
                job_id=job_id,
                batch_size_groups=settings.sync_batch_groups,
                router_url=settings.router_url,
                pool=settings.sync_pool or job_id,
                metrics=metrics,
                drop_equal_rewards=settings.sync_drop_equal_rewards,
                discarded=functools.partial(
                    groups_discarded, buffer, job_id, include_stale=settings.admission_versions_ahead > 0
                ),
                versions_ahead=settings.admission_versions_ahead,
            )
        scheduler = RolloutScheduler(
            spec=spec,
            job_id=job_id,
            worker_id=settings.worker_id,
            dataset=dataset,
            cursor=cursor,
            run_episode=runner.run if evaluation is None else evaluation.watch.wrap(runner.run),
            pusher=pusher,
            metrics=metrics,
            lease_s=settings.lease_s,
            requeued=requeued,
            requeue_poll_interval_s=settings.requeue_poll_interval_s,
            reap_orphans=reap_orphans,
            barrier=barrier,
        )
        return cls(
            settings,
            spec,
            dataset=dataset,
            redis_client=redis_client,
            cursor=cursor,
            sessions=sessions,
            buffer=buffer,
            sandbox=sandbox,
            runner=runner,
            scheduler=scheduler,
            sweeper=sweeper,
            source=source,
            evaluation=evaluation,
        )

    async def start(self) -> None:
        """Binds the cursor to the dataset (ConfigError on a mismatch) and starts the scheduler."""
        await self.cursor.check_fingerprint(self.dataset.fingerprint)
        if self.scheduler.barrier is not None:
            await self.scheduler.barrier.start()
        self._task = asyncio.create_task(self.scheduler.run())
        self._task.add_done_callback(self._on_scheduler_done)
        self._sweeper_task = asyncio.create_task(self.sweeper.run())
        if self.evaluation is not None:
            self._eval_task = asyncio.create_task(self.evaluation.run())
        if self.source.environment is not None:
            self._environment_task = asyncio.create_task(self._fail_with(self.source.environment.failed))
        log.info(
            "rollout started",
            extra={
                "job_id": self.settings.job_id,
                "worker_id": self.settings.worker_id,
                "num_prompts": len(self.dataset),
                "max_live_episodes": self.scheduler.max_live_episodes,
            },
        )

    async def _fail_with(self, failed: asyncio.Event) -> None:
        await failed.wait()
        self.failed.set()

    def _on_scheduler_done(self, task: asyncio.Task[None]) -> None:
        if not task.cancelled() and task.exception() is not None:
            log.error("the scheduler stopped unexpectedly", exc_info=task.exception())
            self.failed.set()

    async def stop(self) -> None:
        """Cancels the scheduler (in-flight episodes delete their sessions, leases are handed back), closes."""
        running = (self._task, self._sweeper_task, self._environment_task, self._eval_task)
        # The scheduler's own cleanup is bounded (STOP_WAIT_S twice, then RELEASE_TIMEOUT_S); beyond that a lost
        # cancellation is retried once rather than hanging the stop.
        await cancel_and_wait([task for task in running if task is not None], "worker tasks", STOP_TIMEOUT_S)
        await self.runner.drain()
        if self.evaluation is not None:
            await self.evaluation.close()
        if self.runner.teacher is not None:
            await self.runner.teacher.close()
        await self.source.close()
        if self.scheduler.barrier is not None:
            await self.scheduler.barrier.close()
        await self.sessions.close()
        await self.buffer.close()
        if self.sandbox is not None:
            await self.sandbox.close()
        await self.redis.aclose()

    async def check_ready(self) -> None:
        await self.redis.ping()
        if self._task is None or self._task.done():
            raise RuntimeError("the scheduler is not running")

    async def status(self) -> dict[str, Any]:
        cursor = await self.cursor.status()
        num_rows = len(self.dataset)
        return {
            "job_id": self.settings.job_id,
            "worker_id": self.settings.worker_id,
            "num_prompts": num_rows,
            "num_epochs": self.spec.dataset.num_epochs,
            "epoch": cursor.next_seq // num_rows,
            "cursor": {
                "next_seq": cursor.next_seq,
                "num_done": cursor.num_done,
                "num_leased": cursor.num_leased,
                "num_redo": cursor.num_redo,
                "lowest_open_seq": cursor.lowest_open_seq,
                "num_seqs": self.dataset.num_seqs,
            },
            "live_episodes": self.scheduler.num_live_episodes,
            "max_live_episodes": self.scheduler.max_live_episodes,
            "open_groups": len(self.scheduler.open_seqs),
            "groups_finished": self.scheduler.num_groups_finished,
            "paused": self.scheduler.pusher.paused,
            "exhausted": self.scheduler.exhausted,
            "orphan_sweep_pending": self.sweeper.pending,
        }

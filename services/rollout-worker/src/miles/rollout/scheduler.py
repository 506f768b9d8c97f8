"""The async scheduler: keeps `max_live_episodes` episodes in flight, with no batch barrier.

A free episode slot is filled at once: with the next episode of the group being started, else with the first
episode of a newly claimed prompt (so a prompt is claimed only when a slot can start it). A group is finished
when its n episodes are, and is then filtered and pushed in the background while its slots already run other
episodes — long-tail episodes never hold the others back. While a push waits for a full buffer, no new episode
starts (backpressure). A heartbeat renews the leases of every open group; a poller moves prompts the buffer
hands back (stale groups under REQUEUE) into the cursor's redo set.

A group whose every episode failed because the session server was unreachable is not a result: its prompt goes
back to the cursor undecided and new episodes wait (5 s, doubling up to 60 s while it lasts), so an outage
pauses the rollout instead of using up prompts.

With a `SyncBarrier`, a claimed prompt starts only once it has a place in a batch: the live weight version's
(`train.mode: sync`), or one of the max_staleness versions after it (async's staleness window;
miles.rollout.barrier); a group that is filtered or retried gives its place back.

When the cursor has nothing left (every epoch handed out) the scheduler keeps polling it, because leases of a
dead worker and requeued prompts can still come back; `exhausted` is true while it finds nothing and has
nothing in flight.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from redis.exceptions import RedisError

from miles.common.aio import cancel_requested, raise_if_cancel_requested
from miles.common.jobspec.rollout import RolloutSpec
from miles.rollout import groups
from miles.rollout import samples as sample_ops
from miles.rollout.barrier import SyncBarrier
from miles.rollout.cursor import Claim, DatasetCursor
from miles.rollout.dataset import Dataset, PromptRef
from miles.rollout.episode import EpisodeOutcome, EpisodeTask
from miles.rollout.metrics import RolloutMetrics
from miles.rollout.pusher import GroupPusher

log = logging.getLogger(__name__)

EpisodeFn = Callable[[EpisodeTask], Awaitable[EpisodeOutcome]]
RequeuedFn = Callable[[], Awaitable[list[tuple[int, int]]]]
"""Returns (epoch, prompt_index) of prompts to regenerate."""
INFRASTRUCTURE_REASONS = frozenset({"session_unavailable", "samples_unavailable"})
"""Episode endings that say nothing about the task: the platform could not run the episode."""
OUTAGE_BACKOFF_S = (5.0, 60.0)
"""First and largest pause of new episodes after a group failed for infrastructure reasons."""
RELEASE_TIMEOUT_S = 5.0
"""How long shutdown tries to hand this worker's leases back before leaving them to expire."""
STOP_WAIT_S = 10.0
"""How long a stop waits for its cancelled episodes, pushes and helpers to end. A task still running then ignored
its cancellation (a client library can turn it into an error a retry loop swallows) and is left behind, logged,
because a supervisor waits for the stop."""
ReapFn = Callable[[int], Awaitable[int]]
"""Deletes the sessions a dead worker left behind for a reclaimed seq."""


@dataclass
class _OpenGroup:
    claim: Claim
    ref: PromptRef
    group_id: str
    prompt: dict[str, Any]
    label: Any
    num_started: int = 0
    outcomes: dict[int, EpisodeOutcome] = field(default_factory=dict)


class RolloutScheduler:
    def __init__(
        self,
        *,
        spec: RolloutSpec,
        job_id: str,
        worker_id: str,
        dataset: Dataset,
        cursor: DatasetCursor,
        run_episode: EpisodeFn,
        pusher: GroupPusher,
        metrics: RolloutMetrics,
        lease_s: float,
        requeued: RequeuedFn | None = None,
        requeue_poll_interval_s: float = 5.0,
        idle_poll_s: float = 1.0,
        reap_orphans: ReapFn | None = None,
        outage_backoff_s: tuple[float, float] = OUTAGE_BACKOFF_S,
        barrier: SyncBarrier | None = None,
    ) -> None:
        self.spec = spec
        self.job_id = job_id
        self.worker_id = worker_id
        self.dataset = dataset
        self.cursor = cursor
        self.run_episode = run_episode
        self.pusher = pusher
        self.metrics = metrics
        self.lease_s = lease_s
        self.requeued = requeued
        self.requeue_poll_interval_s = requeue_poll_interval_s
        self.idle_poll_s = idle_poll_s
        self.reap_orphans = reap_orphans
        self.outage_backoff_s = outage_backoff_s
        self.barrier = barrier
        self.max_live_episodes = spec.concurrency.resolved_max_live_episodes
        self._slots = asyncio.Semaphore(self.max_live_episodes)
        self._starting: _OpenGroup | None = None
        self._open: dict[int, _OpenGroup] = {}
        self._episodes: set[asyncio.Task[None]] = set()
        self._finishing: set[asyncio.Task[None]] = set()
        self.exhausted = False
        self.num_groups_finished = 0
        self._outage_backoff_s = 0.0
        self._resume_at = 0.0
        metrics.max_live_episodes.set(self.max_live_episodes)

    @property
    def num_live_episodes(self) -> int:
        return len(self._episodes)

    @property
    def open_seqs(self) -> list[int]:
        return sorted(self._open)

    async def run(self) -> None:
        """Until cancelled: fill slots, finish groups. Cancellation stops everything (see `shutdown`)."""
        released = await self.cursor.release_worker(self.worker_id)
        if released:
            log.info("took back leases of a previous run", extra={"num_leases": released})
        helpers = [asyncio.create_task(self._heartbeat())]
        if self.requeued is not None:
            helpers.append(asyncio.create_task(self._poll_requeued()))
        try:
            await self._fill_slots()
        finally:
            await _cancel_and_wait(helpers, "helpers")
            await self.shutdown()

    async def shutdown(self) -> None:
        """Cancels in-flight episodes and pushes, then hands this worker's leases back for others to redo."""
        await _cancel_and_wait([*self._episodes, *self._finishing], "episodes and pushes")
        # Redis may be gone or hanging at shutdown: the leases then expire by themselves, and a stop must stay bounded
        # (a supervisor waits for it).
        with contextlib.suppress(Exception):
            async with asyncio.timeout(RELEASE_TIMEOUT_S):
                await self.cursor.release_worker(self.worker_id)

    async def _fill_slots(self) -> None:
        while True:
            await self._slots.acquire()
            try:
                await self.pusher.wait_until_clear()
                await self._wait_out_outage()
                group = await self._group_to_start()
            except BaseException:
                self._slots.release()
                raise
            self._start_episode(group)

    async def _group_to_start(self) -> _OpenGroup:
        if self._starting is not None and self._starting.num_started < self.spec.n_samples_per_prompt:
            return self._starting
        while True:
            raise_if_cancel_requested()
            try:
                claim = await self.cursor.claim(self.worker_id, self.lease_s)
            except RedisError:
                log.warning("could not claim a prompt (Redis); retrying", exc_info=True)
                await asyncio.sleep(self.idle_poll_s)
                continue
            if claim is not None:
                if claim.source == "reclaimed" and self.reap_orphans is not None:
                    await self.reap_orphans(claim.seq)
                self.exhausted = False
                self.metrics.dataset_exhausted.set(0)
                group = self._open_group(claim)  # open first: the heartbeat renews its lease while it waits
                if self.barrier is not None:
                    await self.barrier.admit(claim.seq)
                self._starting = group
                return group
            self.exhausted = not self._open
            self.metrics.dataset_exhausted.set(1 if self.exhausted else 0)
            await asyncio.sleep(self.idle_poll_s)

    def _open_group(self, claim: Claim) -> _OpenGroup:
        ref = self.dataset.locate(claim.seq)
        group = _OpenGroup(
            claim=claim,
            ref=ref,
            group_id=groups.group_id_for(self.job_id, ref.epoch, ref.prompt_index),
            prompt=self.dataset.prompt(ref.prompt_index),
            label=self.dataset.label(ref.prompt_index),
        )
        self._open[claim.seq] = group
        self.metrics.prompts_claimed.labels(source=claim.source).inc()
        self.metrics.dataset_epoch.set(ref.epoch)
        return group

    def _start_episode(self, group: _OpenGroup) -> None:
        task = EpisodeTask(
            job_id=self.job_id,
            group_id=group.group_id,
            seq=group.claim.seq,
            sample_index=group.num_started,
            prompt_index=group.ref.prompt_index,
            epoch=group.ref.epoch,
            prompt=group.prompt,
            label=group.label,
        )
        group.num_started += 1
        episode = asyncio.create_task(self._run_one(group, task))
        self._episodes.add(episode)
        self.metrics.live_episodes.set(len(self._episodes))

        def done(finished: asyncio.Task[None]) -> None:
            self._episodes.discard(finished)
            self._slots.release()
            self.metrics.live_episodes.set(len(self._episodes))

        episode.add_done_callback(done)

    async def _run_one(self, group: _OpenGroup, task: EpisodeTask) -> None:
        try:
            outcome = await self.run_episode(task)
        except Exception as exc:  # a bug in the episode flow must not leave its group unfinished forever
            log.exception("episode failed unexpectedly", extra={"group_id": task.group_id})
            sample = sample_ops.placeholder(task.episode_id, task.group_id)
            sample_ops.mark([sample], sample_ops.FAILED, "internal_error", f"{type(exc).__name__}: {exc}")
            self.metrics.episodes.labels(status="FAILED", reason="internal_error").inc()
            outcome = EpisodeOutcome([sample], sample_ops.FAILED, "internal_error")
        group.outcomes[task.sample_index] = outcome
        if len(group.outcomes) == self.spec.n_samples_per_prompt:
            finishing = asyncio.create_task(self._finish(group))
            self._finishing.add(finishing)
            finishing.add_done_callback(self._finishing.discard)

    async def _finish(self, group: _OpenGroup) -> None:
        try:
            await self._decide(group)
        except Exception:  # a bug while pushing: forget the group; its lease expires and it is generated again
            log.exception("could not finish a group", extra={"group_id": group.group_id})
            self.metrics.groups.labels(outcome="push_error").inc()
            self._forget(group)

    def _forget(self, group: _OpenGroup) -> None:
        """The group is no longer this worker's to renew (decided, given back, or left to expire)."""
        self._open.pop(group.claim.seq, None)
        if self._starting is group:
            self._starting = None

    async def _wait_out_outage(self) -> None:
        delay_s = self._resume_at - time.monotonic()
        if delay_s > 0:
            await asyncio.sleep(delay_s)

    def _note_outage(self, outcomes: list[EpisodeOutcome]) -> None:
        first_s, max_s = self.outage_backoff_s
        self._outage_backoff_s = min(max(first_s, self._outage_backoff_s * 2), max_s)
        self._resume_at = time.monotonic() + self._outage_backoff_s
        errors = {str(s.metadata["error"]) for o in outcomes for s in o.samples if "error" in s.metadata}
        log.warning(
            "the session server could not run a group's episodes; its prompt is retried",
            extra={"pause_s": self._outage_backoff_s, "errors": sorted(errors)[:3]},
        )

    async def _decide(self, group: _OpenGroup) -> None:
        outcomes = [group.outcomes[index] for index in sorted(group.outcomes)]
        samples = [sample for outcome in outcomes for sample in outcome.samples]
        filters = self.spec.group_filters
        if self.barrier is not None and self.barrier.drop_equal_rewards:
            filters = filters.model_copy(update={"drop_equal_rewards": True})
        reason = groups.filter_reason(samples, filters)
        if reason == "all_aborted" and all(o.reason in INFRASTRUCTURE_REASONS for o in outcomes):
            self.metrics.groups.labels(outcome="retried_unavailable").inc()
            self._note_outage(outcomes)
            await self.cursor.retry(group.claim.seq)
            await self._give_back(group.claim.seq)
            self._forget(group)
            return
        if reason is None:
            self._outage_backoff_s = 0.0
            built = groups.build_group(
                job_id=self.job_id,
                group_id=group.group_id,
                epoch=group.ref.epoch,
                prompt_index=group.ref.prompt_index,
                outcomes=outcomes,
                prompt=group.prompt,
            )
            outcome = await self.pusher.push(built)
            if self.barrier is not None and outcome == "queued":
                self.barrier.forget(group.claim.seq)
            else:  # a duplicate (pushed before a crash) or refused group adds nothing to the batch
                await self._give_back(group.claim.seq)
        else:
            self.metrics.groups.labels(outcome=f"filtered_{reason}").inc()
            await self._give_back(group.claim.seq)
        await self._complete(group.claim.seq)
        self._forget(group)
        self.num_groups_finished += 1
        self.metrics.prompts_completed.inc()

    async def _give_back(self, seq: int) -> None:
        if self.barrier is not None:
            await self.barrier.give_back(seq)

    async def _complete(self, seq: int) -> None:
        """Marks seq decided, retrying while Redis is unreachable (its lease keeps it ours meanwhile)."""
        delay_s = 0.1
        while True:
            try:
                await self.cursor.complete(seq)
                return
            except RedisError:
                log.warning("could not complete a prompt (Redis); retrying", exc_info=True)
                await asyncio.sleep(delay_s)
                delay_s = min(delay_s * 2, 5.0)

    async def _heartbeat(self) -> None:
        while not cancel_requested():
            await asyncio.sleep(self.lease_s / 3)
            try:
                lost = await self.cursor.extend(self.worker_id, self.open_seqs, self.lease_s)
            except Exception:  # Redis briefly unreachable: the next beat retries (leases last lease_s)
                log.warning("lease heartbeat failed", exc_info=True)
                continue
            if lost:
                log.warning("leases lost to another worker (their groups may be pushed twice)", extra={"seqs": lost})

    async def _poll_requeued(self) -> None:
        assert self.requeued is not None
        while not cancel_requested():
            try:
                for epoch, prompt_index in await self.requeued():
                    if 0 <= prompt_index < len(self.dataset):
                        await self.cursor.requeue(self.dataset.seq_of(epoch, prompt_index))
            except Exception:  # the buffer may be restarting; the next poll retries
                log.warning("could not take requeued prompts from the buffer", exc_info=True)
            await asyncio.sleep(self.requeue_poll_interval_s)


async def _cancel_and_wait(tasks: list[asyncio.Task[Any]], what: str) -> None:
    await cancel_and_wait(tasks, what, STOP_WAIT_S)


async def cancel_and_wait(tasks: list[asyncio.Task[Any]], what: str, wait_s: float, attempts: int = 2) -> None:
    """Cancels `tasks` and waits up to `wait_s` for them; what still runs then is cancelled again (up to `attempts`
    times in all): a cancellation can be lost on its way (a library turning it into an error a retry loop swallows,
    a timeout expiring at the same moment), and one lost cancellation must not hang a stop. Re-cancelling only
    after a whole `wait_s` leaves a task's own bounded cleanup alone. A task still running at the end is left
    behind, logged."""
    pending = set(tasks)
    for _ in range(attempts):
        if not pending:
            break
        for task in pending:
            task.cancel()
        done, pending = await asyncio.wait(pending, timeout=wait_s)
        for task in done:
            if not task.cancelled():
                task.exception()  # retrieved: a task that failed while stopping is no news
    if pending:
        log.error("tasks ignored their cancellation and are left behind", extra={"what": what, "num": len(pending)})

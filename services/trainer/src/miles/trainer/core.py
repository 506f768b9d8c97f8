"""The training loop of rank 0 (`Trainer.run`): pull, train, publish, checkpoint, commit — and its state.

    restore the last checkpoint; release the leases a crashed predecessor held
    until the step budget is spent or Stop:
        pull batch_size_groups valid groups within the staleness bound (admission.py: bad ones nacked with a
            reason; with dynamic sampling, groups without reward variance discarded and replaced)
        advantages -> minibatches -> per epoch and minibatch: forward/backward, optimizer step (step.py)
        publish the new weight version -- unless no optimizer step had signal: then the groups count as
            consumed (acked with the next checkpoint), the version stays, nothing is published
        every checkpoint_interval_steps: durable checkpoint, then ack the groups it contains

Heavy work (forward/backward, gathering state) runs on one dedicated thread so the event loop keeps serving
the control API and extending leases; that thread is also the only one issuing torch.distributed collectives.
Exactly-once bookkeeping lives in `consumption.py`, checkpoint files in `checkpoint.py` (which rank writes and
restores what: `checkpoint_ranks.py`; the control API's requests: `checkpoint_requests.py`), the metrics and events
of publishing a version in `publish_versions.py`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from miles.common.errors import MilesError
from miles.common.faults import crash_point
from miles.proto.trainer.v1 import trainer_pb2
from miles.trainer.admission import Admission, CollectionCounts, PulledGroup
from miles.trainer.assemble import assemble
from miles.trainer.backends.base import ModelShape
from miles.trainer.checkpoint import CheckpointStore, TrainerState
from miles.trainer.checkpoint_ranks import check_checkpoint_format, restore_checkpoint, write_checkpoint
from miles.trainer.checkpoint_requests import CheckpointOutcome, CheckpointRequests
from miles.trainer.consumption import Consumer
from miles.trainer.distributed import RankRunner
from miles.trainer.errors import OnPolicyViolationError, TrainerNotRunningError
from miles.trainer.events import Event, EventLog
from miles.trainer.metrics import TrainerMetrics
from miles.trainer.publish import WeightPublisher
from miles.trainer.publish_versions import VersionPublishing
from miles.trainer.settings import TrainerSettings

log = logging.getLogger(__name__)
State = trainer_pb2.TrainerState
ResultT = TypeVar("ResultT")
_DONE_STATES = (trainer_pb2.TRAINER_STATE_STOPPED, trainer_pb2.TRAINER_STATE_FINISHED, trainer_pb2.TRAINER_STATE_FAILED)


class Trainer:
    """Rank 0's loop and the state the control API reports."""

    def __init__(
        self,
        settings: TrainerSettings,
        *,
        runner: RankRunner,
        consumer: Consumer,
        publisher: WeightPublisher,
        store: CheckpointStore,
        metrics: TrainerMetrics,
        events: EventLog,
        shape: ModelShape,
    ) -> None:
        self.settings = settings
        self.train = settings.train
        self.runner, self.consumer, self.publisher, self.store = runner, consumer, publisher, store
        self.metrics, self.events, self.shape = metrics, events, shape
        check_checkpoint_format(settings.checkpoint_format, runner.backend)
        self.state: int = trainer_pb2.TRAINER_STATE_STARTING
        self.step = 0
        self.weight_version = settings.initial_weight_version
        self.checkpoint_step = -1
        self.checkpoint_path = ""
        self.last_metrics: dict[str, float] = {}
        self.error = ""
        self.groups_trained = 0
        self.admission = Admission(consumer, self.train, metrics, events, shape)
        self.dataset_cursor: dict[str, int] | None = None
        self.done = asyncio.Event()
        self._stop_requested = False
        self._stop_checkpoint = False
        self._checkpoint_requests = CheckpointRequests()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="trainer-compute")
        self.publishing = VersionPublishing(publisher, runner, self._compute, metrics, events)
        self._wait_data_s = 0.0
        self._step_finished_unix_ms = 0

    # ---- the loop ----------------------------------------------------------------------------------------

    async def run(self) -> None:
        """Train until the step budget is spent or Stop; a failure sets FAILED and propagates."""
        lease_keeper = None
        try:
            await self.start()
            lease_keeper = asyncio.create_task(self.consumer.keep_leases(self.metrics.leases_lost.inc))
            while not self._stop_requested and not self._budget_spent():
                groups = await self.collect_batch()
                if groups is None:
                    break
                if await self.train_on(groups):
                    await self.publish()
                    if self.step % self.train.checkpoint_interval_steps == 0 or self._budget_spent():
                        await self.checkpoint()
                await self._serve_checkpoint_requests()
            await self.finish()
        except Exception as exc:
            self._fail(exc)
            raise
        finally:
            if lease_keeper is not None:
                lease_keeper.cancel()
            self.done.set()

    async def start(self) -> None:
        """Restore the newest checkpoint (if any) and hand back the leases of a crashed predecessor."""
        import torch

        torch.manual_seed(self.train.seed)
        removed = await asyncio.to_thread(self.store.remove_temporaries)
        latest = self.store.latest_step()
        state: TrainerState | None = None
        if latest is not None:
            loaded = await restore_checkpoint(self.store, self.runner, self._compute, latest)
            state = loaded.state
            self.step, self.weight_version = state.step, state.weight_version
            self.checkpoint_step, self.checkpoint_path = state.step, str(loaded.path)
            self.dataset_cursor = state.dataset_cursor
        await asyncio.to_thread(self.store.reconcile_ledger, state)
        for entry in self.store.read_ledger()[-2:]:
            self.admission.recent_commits.append(set(entry["group_ids"]))
        released = await self.consumer.release_predecessor(should_stop=lambda: self._stop_requested)
        log.info(
            "trainer started",
            extra={
                "step": self.step,
                "weight_version": self.weight_version,
                "released_leases": released,
                "removed_temporaries": removed,
                "restored": latest is not None,
            },
        )
        await self.resume_publishing()
        self._update_gauges()

    async def collect_batch(self) -> list[PulledGroup] | None:
        """batch_size_groups admitted (valid, not yet trained, informative with dynamic sampling) groups, or None
        when Stop was asked for meanwhile."""
        self._set_state(trainer_pb2.TRAINER_STATE_WAITING_FOR_DATA)
        started = time.perf_counter()
        self.admission.counts = CollectionCounts()
        batch: list[PulledGroup] = []
        while len(batch) < self.train.batch_size_groups:
            if self._stop_requested:
                return None
            await self._serve_checkpoint_requests()
            try:
                response = await self.consumer.pull(
                    self.train.batch_size_groups - len(batch),
                    trainer_version=self.weight_version,
                    max_staleness=self.train.effective_max_staleness,
                    wait_s=self.train.pull_wait_s,
                )
            except MilesError as exc:
                if not exc.retryable:
                    raise
                # The buffer (or its Redis) is restarting: keep the model and the held leases, try again.
                log.warning("pull failed, retrying", extra={"error": str(exc)})
                await asyncio.sleep(1.0)
                continue
            for leased in response.groups:
                pulled = await self.admission.admit(
                    leased, group_index=len(batch), trainer_version=self.weight_version, step=self.step
                )
                if pulled is not None:
                    batch.append(pulled)
        self._wait_data_s = time.perf_counter() - started
        return batch

    async def train_on(self, groups: list[PulledGroup]) -> bool:
        """One trainer step on the groups. True: the weights moved and the version moved on by one (publish it).
        False: no optimizer step had signal, nothing was touched; the groups still count as consumed."""
        self._set_state(trainer_pb2.TRAINER_STATE_TRAINING)
        staleness = [g.staleness for g in groups]
        assembled = assemble(
            [g.samples for g in groups],
            staleness,
            self.train,
            trainer_version=self.weight_version,
            world_size=self.runner.data.size,  # data-parallel ranks (Megatron TP/PP peers train the same share)
        )
        result = await self._compute(self.runner.train_step, assembled.plan)
        if result.violation is not None:
            raise OnPolicyViolationError(result.violation)
        self.consumer.holdings.mark_trained([g.group_id for g in groups])
        self._advance_cursor(groups)
        values = {
            **assembled.stats,
            **result.stats,
            "zero_signal_fraction": self.admission.counts.zero_signal_fraction,
            "rollout_reward_mean": self.admission.counts.rollout_reward_mean,
            "wait_data_s": self._wait_data_s,
        }
        if self.shape.routing is not None:  # MoE: whether the logprob diff above is with or without R3
            values["routing_replay"] = float(self.admission.routing_replay)
        if result.num_optimizer_steps == 0:
            self._record_skip(values, groups)
            return False
        values |= {
            "grad_norm": result.grad_norm,
            "learning_rate": result.learning_rate,
            "tokens_per_second": assembled.num_tokens / max(result.forward_backward_s, 1e-9),
            "forward_backward_s": result.forward_backward_s,
            "optimizer_s": result.optimizer_s,
        }
        self._step_finished_unix_ms = int(time.time() * 1000)
        self.step += 1
        self.weight_version += 1
        self._record_step(values, groups, assembled.num_samples, assembled.num_tokens)
        return True

    @property
    def step_finished_unix_ms(self) -> int:
        """When the optimizer step that produced `weight_version` finished (0 before this process's first step)."""
        return self._step_finished_unix_ms

    async def resume_publishing(self) -> None:
        """Publish the weights the trainer starts from (version 0 of a new job is its initial weights); after a
        crash, a version above the checkpoint published by the dead process makes this a rewind to a new number
        (miles.trainer.publish), and groups of the superseded versions are refused from then on."""
        self.weight_version = await self.publishing.resume(self.weight_version, step=self.step)
        self.admission.superseded = self.publisher.superseded

    async def publish(self) -> None:
        self.last_metrics["publish_s"] = await self.publishing.publish(
            self.weight_version, step=self.step, step_finished_unix_ms=self._step_finished_unix_ms
        )

    async def checkpoint(self) -> CheckpointOutcome:
        """A durable checkpoint of the current step (unless one exists), then ack what it covers."""
        previous_state = self.state
        self._set_state(trainer_pb2.TRAINER_STATE_CHECKPOINTING)
        started = time.perf_counter()
        holdings = self.consumer.holdings
        committed = list(holdings.trained_group_ids)
        if self.step != self.checkpoint_step and self.step > 0:
            state = TrainerState(
                job_id=self.settings.job_id,
                step=self.step,
                weight_version=self.weight_version,
                committed_group_ids=committed,
                dataset_cursor=self.dataset_cursor,
                backend=self.settings.backend,
                world_size=self.settings.world_size,
            )
            checkpoint_format = self.settings.checkpoint_format
            path = await write_checkpoint(self.store, self.runner, self._compute, state, checkpoint_format)
            await asyncio.to_thread(self.store.append_ledger, self.step, committed)
            self.checkpoint_step, self.checkpoint_path = self.step, str(path)
            self.metrics.checkpoints.inc()
            crash_point("trainer.checkpoint.before_ack", self.step)
        if committed:
            self.admission.recent_commits.append(set(committed))
        outcome = await self.consumer.ack_committed()
        self.metrics.groups_acked.inc(outcome.num_acked)
        self.metrics.leases_lost.inc(len(outcome.expired_lease_ids))
        checkpoint_s = time.perf_counter() - started
        self.metrics.phase_seconds.labels("checkpoint").observe(checkpoint_s)
        self._update_gauges()
        self.events.publish(
            Event(
                "checkpoint",
                self.step,
                metrics={"checkpoint_s": checkpoint_s, "num_groups_acked": outcome.num_acked},
                message=self.checkpoint_path,
            )
        )
        self._set_state(previous_state)
        return CheckpointOutcome(self.step, self.checkpoint_path, outcome.num_acked)

    async def finish(self) -> None:
        if self._budget_spent() and not self._stop_requested:
            # Groups a checkpoint already holds but whose acks a crash prevented sit at the head of the queue.
            await self.consumer.drain_redundant(
                self.admission.recently_committed,
                self.train.batch_size_groups,
                self.metrics.groups_already_trained.inc,
            )
            if self.step != self.checkpoint_step or self.consumer.holdings.leases_to_ack():
                await self.checkpoint()
            final_state = trainer_pb2.TRAINER_STATE_FINISHED
        else:
            if self._stop_checkpoint:
                await self.checkpoint()
            final_state = trainer_pb2.TRAINER_STATE_STOPPED
        released = await self.consumer.release_all("trainer stopped")
        await self._serve_checkpoint_requests()
        log.info("trainer loop ended", extra={"step": self.step, "released_leases": released})
        self._set_state(final_state)

    # ---- control API ---------------------------------------------------------------------------------------

    async def request_checkpoint(self) -> CheckpointOutcome:
        if self.state == trainer_pb2.TRAINER_STATE_FAILED:
            raise TrainerNotRunningError(f"the trainer failed: {self.error}")
        if self.done.is_set():
            return CheckpointOutcome(self.checkpoint_step, self.checkpoint_path, 0)
        return await self._checkpoint_requests.wait()

    async def request_stop(self, *, checkpoint: bool) -> int:
        self._stop_checkpoint = self._stop_checkpoint or checkpoint
        self._stop_requested = True
        await self.done.wait()
        return self.step

    # ---- helpers -------------------------------------------------------------------------------------------

    async def _compute(self, fn: Callable[..., ResultT], *args: Any) -> ResultT:
        """On the compute thread, through the runner (a collective failing because a peer is gone ends the process
        with the watchdog's line)."""
        return await asyncio.get_running_loop().run_in_executor(self._executor, self.runner.call, fn, *args)

    def _budget_spent(self) -> bool:
        return self.train.num_steps > 0 and self.step >= self.train.num_steps

    async def _serve_checkpoint_requests(self) -> None:
        await self._checkpoint_requests.serve(self.checkpoint)

    def _advance_cursor(self, groups: list[PulledGroup]) -> None:
        for group in groups:
            cursor = self.dataset_cursor
            if cursor is None or (group.epoch, group.prompt_index) > (cursor["epoch"], cursor["prompt_index"]):
                self.dataset_cursor = {"epoch": group.epoch, "prompt_index": group.prompt_index}

    def _record_step(
        self, values: dict[str, float], groups: list[PulledGroup], num_samples: int, num_tokens: int
    ) -> None:
        self.last_metrics = values
        self.groups_trained += len(groups)
        self.metrics.observe_step(values, [g.staleness for g in groups], num_samples=num_samples, num_tokens=num_tokens)
        self._update_gauges()
        self.events.publish(Event("step", self.step, state=self.state, metrics=values))
        log.info("step", extra={"step": self.step, "weight_version": self.weight_version, "loss": values.get("loss")})

    def _record_skip(self, values: dict[str, float], groups: list[PulledGroup]) -> None:
        """A trainer step without signal: counted and announced; the step, version and last metrics stay."""
        self.metrics.observe_skipped_step(values)
        self.events.publish(
            Event(
                "skipped",
                self.step,
                state=self.state,
                metrics=values,
                message=f"no optimizer step had signal in {len(groups)} groups: consumed without a step",
            )
        )
        log.info("step skipped: no signal", extra={"step": self.step, "num_groups": len(groups)})

    def _update_gauges(self) -> None:
        self.metrics.step.set(self.step)
        self.metrics.weight_version.set(self.weight_version)
        self.metrics.checkpoint_step.set(self.checkpoint_step)

    def _set_state(self, state: int) -> None:
        if state != self.state:
            self.state = state
            self.events.publish(Event("state", self.step, state=state, message=State.Name(state)))

    def _fail(self, exc: BaseException) -> None:
        self.error = f"{type(exc).__name__}: {exc}"
        log.error("trainer failed", exc_info=exc)
        self.events.publish(Event("error", self.step, message=self.error))
        self._set_state(trainer_pb2.TRAINER_STATE_FAILED)
        self._checkpoint_requests.fail(self.error)

    @property
    def groups_rejected(self) -> int:
        return self.admission.num_rejected

    @property
    def is_done(self) -> bool:
        return self.state in _DONE_STATES

    async def stop_workers(self) -> None:
        """Tell ranks > 0 to exit (a no-op without workers)."""
        from miles.trainer.distributed import CoordinatorRunner

        if isinstance(self.runner, CoordinatorRunner):
            await self._compute(self.runner.stop_workers)

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)

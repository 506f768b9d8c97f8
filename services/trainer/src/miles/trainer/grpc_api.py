"""gRPC transport of the trainer's control API (protos/miles/trainer/v1/trainer.proto) over `Trainer`.

Without a job (settings.job_id empty) the API still answers: Status reports STOPPED and Checkpoint/Stop fail with
FAILED_PRECONDITION.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from miles.proto.trainer.v1 import trainer_pb2, trainer_pb2_grpc
from miles.trainer.errors import TrainerNotRunningError
from miles.trainer.events import EventLog

if TYPE_CHECKING:
    from miles.trainer.core import Trainer  # imports torch: only where a job runs

SERVICE_NAME = "miles.trainer.v1.TrainerService"


class TrainerServicer(trainer_pb2_grpc.TrainerServiceServicer):
    def __init__(self, trainer: Trainer | None, events: EventLog, job_id: str) -> None:
        self.trainer = trainer
        self.events = events
        self.job_id = job_id

    def _require_trainer(self) -> Trainer:
        if self.trainer is None:
            raise TrainerNotRunningError("no job is configured (MILES_TRAINER_JOB_ID is empty)")
        return self.trainer

    async def Status(self, request: trainer_pb2.StatusRequest, context: Any) -> trainer_pb2.StatusResponse:
        trainer = self.trainer
        if trainer is None:
            return trainer_pb2.StatusResponse(
                job_id=self.job_id, state=trainer_pb2.TRAINER_STATE_STOPPED, checkpoint_step=-1
            )
        return trainer_pb2.StatusResponse(
            job_id=self.job_id,
            state=trainer.state,  # type: ignore[arg-type]
            step=trainer.step,
            weight_version=trainer.weight_version,
            checkpoint_step=trainer.checkpoint_step,
            last_step_metrics=trainer.last_metrics,
            error=trainer.error,
            checkpoint_path=trainer.checkpoint_path,
            groups_trained=trainer.groups_trained,
            groups_rejected=trainer.groups_rejected,
            pending_groups=len(trainer.consumer.holdings.trained),
            last_step_finished_unix_ms=trainer.step_finished_unix_ms,
        )

    async def Checkpoint(self, request: trainer_pb2.CheckpointRequest, context: Any) -> trainer_pb2.CheckpointResponse:
        outcome = await self._require_trainer().request_checkpoint()
        return trainer_pb2.CheckpointResponse(
            step=outcome.step, path=outcome.path, num_groups_acked=outcome.num_groups_acked
        )

    async def Stop(self, request: trainer_pb2.StopRequest, context: Any) -> trainer_pb2.StopResponse:
        step = await self._require_trainer().request_stop(checkpoint=request.checkpoint)
        return trainer_pb2.StopResponse(step=step)

    async def WatchEvents(
        self, request: trainer_pb2.WatchEventsRequest, context: Any
    ) -> AsyncIterator[trainer_pb2.TrainerEvent]:
        async for event in self.events.watch(request.from_step):
            yield event.to_proto()

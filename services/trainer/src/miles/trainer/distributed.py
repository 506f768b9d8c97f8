"""Rank coordination: rank 0 runs the loop and broadcasts each collective operation to the other ranks.

`RankRunner` executes the operations of one rank (a step on its micro-batches, gathering or loading state).
With world_size > 1, rank 0 wraps it in `CoordinatorRunner`, which first broadcasts the operation and its
arguments (`torch.distributed.broadcast_object_list`); ranks > 0 sit in `serve_worker`, receiving and executing
operations in the same order, so every FSDP collective lines up. Statistics are gathered to every rank and
merged. The process group gets a long timeout: workers legitimately wait as long as rank 0 waits for data.

Limit: only rank 0 talks to the buffer, the publisher and the checkpoint directory; a worker that dies stalls
rank 0 at the next collective (the process group's timeout then fails it loudly).
"""

from __future__ import annotations

import datetime
import logging
import os
import signal
from typing import Any

import torch
import torch.distributed as dist

from miles.common.jobspec.trainer import TrainConfig
from miles.trainer.backends.base import TrainBackend
from miles.trainer.stats import StepStats, merge_all
from miles.trainer.step import StepPlan, StepResult, run_step

log = logging.getLogger(__name__)
PROCESS_GROUP_TIMEOUT = datetime.timedelta(days=7)
_STOP = "stop"


def init_process_group(*, rank: int, world_size: int, master_addr: str, master_port: int, backend: str) -> None:
    """Join the trainer's process group (gloo on the CPU, nccl on CUDA when backend is auto).

    Rendezvous is `env://` so that under torchrun the agent's store is reused (torchrun already listens on
    MASTER_PORT); without torchrun the settings' rank layout is exported first."""
    if backend == "auto":
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    os.environ.setdefault("MASTER_ADDR", master_addr)
    os.environ.setdefault("MASTER_PORT", str(master_port))
    dist.init_process_group(
        backend, init_method="env://", rank=rank, world_size=world_size, timeout=PROCESS_GROUP_TIMEOUT
    )


class RankRunner:
    """The collective operations of one rank over its backend."""

    def __init__(self, backend: TrainBackend, train: TrainConfig, *, rank: int = 0, world_size: int = 1) -> None:
        self.backend = backend
        self.train = train
        self.rank = rank
        self.world_size = world_size

    def _merge(self, stats: StepStats) -> StepStats:
        if self.world_size == 1:
            return stats
        gathered: list[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, stats.to_dict())
        return merge_all(StepStats.from_dict(part) for part in gathered)

    def train_step(self, plan: StepPlan) -> StepResult:
        return run_step(
            self.backend, plan, self.train, rank=self.rank, world_size=self.world_size, merge_stats=self._merge
        )

    def hf_tensors(self) -> dict[str, torch.Tensor]:
        return self.backend.hf_state_dict()

    def full_state(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        return self.backend.hf_state_dict(), self.backend.optimizer_state()

    def load_state(self, tensors: dict[str, torch.Tensor] | None, optimizer: dict[str, Any] | None) -> None:
        self.backend.load_hf_state_dict(tensors or {})
        if optimizer is not None:
            self.backend.load_optimizer_state(optimizer)


class CoordinatorRunner(RankRunner):
    """Rank 0 with workers: every operation is broadcast before it runs here."""

    def _broadcast(self, operation: str, *args: Any) -> None:
        payload: list[Any] = [(operation, args)]
        dist.broadcast_object_list(payload, src=0)

    def train_step(self, plan: StepPlan) -> StepResult:
        self._broadcast("train_step", plan)
        return super().train_step(plan)

    def hf_tensors(self) -> dict[str, torch.Tensor]:
        self._broadcast("hf_tensors")
        return super().hf_tensors()

    def full_state(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        self._broadcast("full_state")
        return super().full_state()

    def load_state(self, tensors: dict[str, torch.Tensor] | None, optimizer: dict[str, Any] | None) -> None:
        # Workers receive weights and optimizer tensors through the state-dict helpers' own broadcast from rank 0;
        # the message carries only the (small) scheduler state.
        scheduler = (optimizer or {}).get("scheduler", {})
        self._broadcast("load_state", None, {"optimizer": {}, "scheduler": scheduler})
        super().load_state(tensors, optimizer)

    def stop_workers(self) -> None:
        self._broadcast(_STOP)


def make_runner(backend: TrainBackend, train: TrainConfig, *, rank: int, world_size: int) -> RankRunner:
    if world_size > 1 and rank == 0:
        return CoordinatorRunner(backend, train, rank=rank, world_size=world_size)
    return RankRunner(backend, train, rank=rank, world_size=world_size)


def serve_worker(runner: RankRunner) -> None:
    """Ranks > 0: execute rank 0's operations until it says stop (or rank 0 disappears: the collective fails).

    SIGTERM is ignored here: rank 0 gets it too, finishes its shutdown and then tells the workers to stop."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    while True:
        payload: list[Any] = [None]
        dist.broadcast_object_list(payload, src=0)
        operation, args = payload[0]
        if operation == _STOP:
            log.info("worker stopping", extra={"rank": runner.rank})
            return
        getattr(runner, operation)(*args)

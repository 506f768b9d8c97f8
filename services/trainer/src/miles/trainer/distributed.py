"""Rank coordination: rank 0 runs the loop and broadcasts each collective operation to the other ranks.

`RankRunner` executes the operations of one rank (a step on its micro-batches, gathering or loading state).
With world_size > 1, rank 0 wraps it in `CoordinatorRunner`, which first broadcasts the operation and its
arguments (`torch.distributed.broadcast_object_list`); ranks > 0 sit in `serve_worker`, receiving and executing
operations in the same order, so every FSDP collective lines up. Statistics are gathered to every rank and
merged.

Two process groups: the operations travel on a gloo *control group* with a 7-day timeout (workers legitimately wait
as long as rank 0 waits for data); the step's own collectives (FSDP, statistics, state gathering) run on the default
group, bounded by `collective_timeout_s` (NCCL's watchdog then aborts the process). A dead peer is noticed much
sooner by every rank's heartbeat watchdog (`rank_health.py`, started by `join_ranks`), which exits the process with
status 75 so that every rank restarts from the last checkpoint.

Limit: only rank 0 talks to the buffer and the publisher; with the full checkpoint format only rank 0 writes
checkpoints, with the sharded one every rank writes its shards into the same (shared) directory.
"""

from __future__ import annotations

import datetime
import logging
import os
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from miles.common.faults import crash_point
from miles.common.jobspec.trainer import TrainConfig
from miles.trainer.backends.base import TrainBackend
from miles.trainer.checkpoint_ranks import load_shards, save_shards
from miles.trainer.rank_health import RankWatchdog, connect_store, guard_rendezvous, new_incarnation
from miles.trainer.stats import StepStats, merge_all
from miles.trainer.step import StepPlan, StepResult, run_step

log = logging.getLogger(__name__)
PROCESS_GROUP_TIMEOUT = datetime.timedelta(days=7)
_STOP = "stop"
_control_group: Any = None
ResultT = TypeVar("ResultT")


def init_process_group(
    *,
    rank: int,
    world_size: int,
    master_addr: str,
    master_port: int,
    backend: str,
    collective_timeout_s: float = PROCESS_GROUP_TIMEOUT.total_seconds(),
) -> None:
    """Join the trainer's process group (gloo on the CPU, nccl on CUDA when backend is auto), bounded by
    `collective_timeout_s`, and create the control group (gloo, 7 days) the operations travel on.

    Rendezvous is `env://` so that under torchrun the agent's store is reused (torchrun already listens on
    MASTER_PORT); without torchrun the settings' rank layout is exported first."""
    global _control_group
    if backend == "auto":
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":  # a timed-out or failed NCCL collective tears the process down instead of hanging
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
    bind_local_gpu()
    os.environ.setdefault("MASTER_ADDR", master_addr)
    os.environ.setdefault("MASTER_PORT", str(master_port))
    timeout = datetime.timedelta(seconds=collective_timeout_s)
    dist.init_process_group(backend, init_method="env://", rank=rank, world_size=world_size, timeout=timeout)
    _control_group = dist.new_group(backend="gloo", timeout=PROCESS_GROUP_TIMEOUT)


def bind_local_gpu() -> int | None:
    """Make GPU LOCAL_RANK this process's current device (torchrun starts one rank per GPU and sets LOCAL_RANK), so
    that NCCL and the model (device "cuda") use the rank's own GPU; before the process group. Returns the GPU, or
    None (no LOCAL_RANK, or fewer GPUs: the current device stays; NCCL then refuses ranks sharing one)."""
    local_rank = int(os.environ.get("LOCAL_RANK", "-1"))
    if not 0 <= local_rank < torch.cuda.device_count():
        return None
    torch.cuda.set_device(local_rank)
    return local_rank


def control_group() -> Any:
    """The group operations are broadcast on (None, the default group, before `init_process_group`)."""
    return _control_group


def join_ranks(
    *,
    rank: int,
    world_size: int,
    master_addr: str,
    master_port: int,
    backend: str,
    collective_timeout_s: float,
    peer_timeout_s: float,
) -> RankWatchdog:
    """Join the ranks' process group and start this rank's heartbeat watchdog (rank_health.py). Ranks > 0 first
    wait out a store whose group formed before they started (a rank restarted on its own)."""
    incarnation = new_incarnation()
    address = os.environ.setdefault("MASTER_ADDR", master_addr)
    port = int(os.environ.setdefault("MASTER_PORT", str(master_port)))
    if rank > 0:
        guard_rendezvous(
            lambda: connect_store(address, port, collective_timeout_s), rank, incarnation, wait_s=collective_timeout_s
        )
    init_process_group(
        rank=rank,
        world_size=world_size,
        master_addr=address,
        master_port=port,
        backend=backend,
        collective_timeout_s=collective_timeout_s,
    )
    watchdog = RankWatchdog(connect_store(address, port, peer_timeout_s), rank, world_size, incarnation, peer_timeout_s)
    incarnations: list[Any] = [None] * world_size
    dist.all_gather_object(incarnations, incarnation, group=control_group())
    watchdog.formed([str(inc) for inc in incarnations])
    watchdog.start()
    log.info("ranks joined", extra={"rank": rank, "world_size": world_size, "incarnation": incarnation})
    return watchdog


class RankRunner:
    """The collective operations of one rank over its backend."""

    def __init__(self, backend: TrainBackend, train: TrainConfig, *, rank: int = 0, world_size: int = 1) -> None:
        self.backend = backend
        self.train = train
        self.rank = rank
        self.world_size = world_size
        # Which share of each minibatch this rank trains (Megatron: its data-parallel rank; TP/PP peers share one).
        self.data = backend.data_ranks(rank, world_size)
        self._step_key = ""  # "rank<r>-v<trainer version>" of the step running (names its crash point)
        self.watchdog: RankWatchdog | None = None
        """This rank's heartbeat watchdog (world_size > 1): consulted when a collective fails."""

    def call(self, operation: Callable[..., ResultT], *args: Any) -> ResultT:
        """Run one operation of this runner; when a collective of it fails because a peer is gone, the watchdog
        ends the process with its one clear line (exit status 75) instead of a collective's stack trace."""
        try:
            return operation(*args)
        except RuntimeError as exc:
            if self.watchdog is not None and _is_collective_error(exc):
                self.watchdog.await_verdict(exc)
            raise

    def _merge(self, stats: StepStats) -> StepStats:
        if self.world_size == 1:
            return stats
        # Mid-step (gradients computed, the optimizer step not taken; the peers wait in this gather): crash tests.
        crash_point("trainer.rank.mid_step", self._step_key)
        gathered: list[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, stats.to_dict())
        return merge_all(StepStats.from_dict(part) for part in gathered)

    def train_step(self, plan: StepPlan) -> StepResult:
        self._step_key = f"rank{self.rank}-v{plan.trainer_version}"
        return run_step(
            self.backend,
            plan,
            self.train,
            rank=self.data.rank,
            world_size=self.data.size,
            merge_stats=self._merge,
            reports_stats=self.data.reports_stats,
        )

    def hf_tensors(self) -> dict[str, torch.Tensor]:
        return self.backend.hf_state_dict()

    def adapter_tensors(self) -> dict[str, torch.Tensor]:
        """A LoRA policy's adapter (PEFT names): what `publish.kind: adapter` ships (LoRA runs in one process)."""
        return self.backend.checkpoint_tensors()

    def full_state(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        return self.backend.checkpoint_tensors(), self.backend.optimizer_state()

    def load_state(self, tensors: dict[str, torch.Tensor] | None, optimizer: dict[str, Any] | None) -> None:
        self.backend.load_checkpoint_tensors(tensors or {})
        if optimizer is not None:
            self.backend.load_optimizer_state(optimizer)

    def save_sharded(self, directory: str) -> None:
        """Every rank writes its shards into `directory` (checkpoint_ranks.save_shards)."""
        save_shards(self.backend, Path(directory))

    def load_sharded(self, directory: str) -> None:
        """Every rank loads its shards from `directory`, whatever world size wrote it (checkpoint_ranks.load_shards)."""
        load_shards(self.backend, Path(directory))


def _is_collective_error(exc: RuntimeError) -> bool:
    """torch.distributed's own errors, and gloo's / NCCL's (plain RuntimeErrors naming their source); not an
    out-of-memory or a bug in the step, which fail at once."""
    return isinstance(exc, dist.DistError) or any(sign in str(exc) for sign in ("gloo", "NCCL", "c10d"))


class CoordinatorRunner(RankRunner):
    """Rank 0 with workers: every operation is broadcast before it runs here."""

    def _broadcast(self, operation: str, *args: Any) -> None:
        payload: list[Any] = [(operation, args)]
        dist.broadcast_object_list(payload, src=0, group=control_group())

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

    def save_sharded(self, directory: str) -> None:
        self._broadcast("save_sharded", directory)
        super().save_sharded(directory)

    def load_sharded(self, directory: str) -> None:
        self._broadcast("load_sharded", directory)
        super().load_sharded(directory)

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
        runner.call(dist.broadcast_object_list, payload, 0, control_group())
        operation, args = payload[0]
        if operation == _STOP:
            log.info("worker stopping", extra={"rank": runner.rank})
            return
        runner.call(getattr(runner, operation), *args)

"""A trainer rank that dies takes every rank down, and the restarted ranks resume without training anything twice.

Two deployments, both real 2-rank trainers over gloo against a real buffer:
- torchrun (the local backend's launch), FSDP2 and Megatron at DP = 2: rank 1 dies like kill -9 in the middle of
  step 3 (its gradients are computed and rank 0 waits for it inside a collective); rank 0 exits 75 with the
  watchdog's line, torchrun exits non-zero, and the restarted torchrun finishes the job.
- separate processes (a StatefulSet's pods, FSDP2: each rank its own process, rank 0 hosts the rendezvous store):
  while rank 0 waits for data (in no collective), rank 1 gets a real SIGKILL and is restarted at once, as the
  kubelet restarts a container; the new rank 1 finds the old group's store and announces itself, rank 0 exits 75
  saying rank 1 was replaced, and rank 1 waits for that store to go away and joins the restarted rank 0.
Each time the final step count, weight version, the multiset of trained group ids and the buffer's acks equal an
uninterrupted run's."""

from __future__ import annotations

import asyncio
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from miles.buffer.client import BufferClient
from miles.common.testing import ServiceProcess, free_port
from miles.common.testing.smoke import console_script
from miles.proto.trainer.v1 import trainer_pb2
from miles.trainer.checkpoint import CheckpointStore
from miles.trainer.rank_health import PEER_LOST_EXIT_CODE

pytestmark = [pytest.mark.integration, pytest.mark.slow]

NUM_STEPS = 4
BATCH_GROUPS = 2
NUM_EXTRA_GROUPS = 2
FINISHED = trainer_pb2.TRAINER_STATE_FINISHED
UNINTERRUPTED = Counter(f"group-{i:03d}" for i in range(NUM_STEPS * BATCH_GROUPS))
"""What an uninterrupted run trains (the buffer hands groups out in push order; the first test checks it)."""


async def _fill(target: str, job_id: str, make_group: Any, indices: range | None = None) -> None:
    async with BufferClient(target) as buffer:
        await buffer.configure_job(job_id)
        for i in indices or range(NUM_STEPS * BATCH_GROUPS + NUM_EXTRA_GROUPS):
            await buffer.push_group(job_id, make_group(f"group-{i:03d}", seed=i, prompt_index=i, num_samples=3))


def _env(
    make_trainer_env: Any, buffer: Any, model_dir: Path, job_id: str, checkpoint_dir: Path, *, interval: int = 2
) -> dict[str, str]:
    """`interval` 2: a crash in step 3 loses a trained-but-unacked step (and, after step 1, would supersede
    version 1: versions would run ahead of steps, architecture.md §4.2)."""
    env: dict[str, str] = make_trainer_env(
        job_id=job_id,
        buffer=buffer,
        model_dir=model_dir,
        checkpoint_dir=checkpoint_dir,
        batch_size_groups=BATCH_GROUPS,
        num_steps=NUM_STEPS,
        checkpoint_interval_steps=interval,
        micro_batch_max_tokens=24,
        pull_wait_s=0.5,
        max_staleness=1000,
    )
    return env


def _torchrun() -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master-port", str(free_port())]


async def _check_trained_once(buffer: Any, job_id: str, checkpoint_dir: Path) -> None:
    trained = Counter(CheckpointStore(checkpoint_dir, keep_last=2, source_model_dir=None).trained_group_ids())
    assert trained == UNINTERRUPTED
    async with BufferClient(buffer.target) as client:
        stats = await client.stats(job_id)
    assert stats.acked_total == NUM_STEPS * BATCH_GROUPS
    assert (stats.queued_groups, stats.leased_groups) == (NUM_EXTRA_GROUPS, 0)


def _peer_lost_lines(log_text: str, rank: int) -> list[str]:
    return [
        line
        for line in log_text.splitlines()
        if f'"service": "trainer-{rank}"' in line and f"exiting (status {PEER_LOST_EXIT_CODE})" in line
    ]


@pytest.mark.parametrize("backend", ["torch", "megatron"])
async def test_rank_dying_mid_step_under_torchrun_ends_every_rank_and_the_restart_trains_each_group_once(
    backend: str,
    buffer_process: Any,
    small_model_dir: Path,
    tmp_path: Path,
    job_id: str,
    make_group: Any,
    make_trainer_env: Any,
    start_trainer: Any,
) -> None:
    reference_job, reference_dir = f"{job_id}-ref", tmp_path / "reference"
    await _fill(buffer_process.target, reference_job, make_group)
    backend_env = {"MILES_TRAINER_BACKEND": backend, "PYTHONWARNINGS": "ignore"}
    reference_env = _env(make_trainer_env, buffer_process, small_model_dir, reference_job, reference_dir)
    reference = start_trainer(reference_env | backend_env)
    reference.argv = [*_torchrun(), console_script("miles-trainer")]
    expected = reference.start().wait_for(lambda s: s.state == FINISHED)
    reference.stop()
    assert (expected.step, expected.weight_version) == (NUM_STEPS, NUM_STEPS)
    await _check_trained_once(buffer_process, reference_job, reference_dir)

    await _fill(buffer_process.target, job_id, make_group)
    checkpoint_dir = tmp_path / "crashed"
    env = _env(make_trainer_env, buffer_process, small_model_dir, job_id, checkpoint_dir) | backend_env
    # Rank 1 dies in step 3 (trained from version 2), after its backward, while rank 0 waits in the gather.
    env |= {"MILES_FAULTS": "trainer.rank.mid_step=rank1-v2", "MILES_FAULTS_ONCE_DIR": str(tmp_path)}
    trainer = start_trainer(env)
    trainer.argv = [*_torchrun(), console_script("miles-trainer")]
    trainer.start()
    assert trainer.process is not None
    exit_code = await asyncio.to_thread(trainer.process.process.wait, 600)
    log_text = trainer.process.log_path.read_text()
    assert exit_code != 0, log_text[-3000:]
    assert "fault injection: crashing at trainer.rank.mid_step" in log_text
    (line,) = _peer_lost_lines(log_text, 0)
    assert "trainer rank 0: a collective failed because a peer's process ended" in line
    assert not (checkpoint_dir / "step-00000003").exists()

    final = trainer.start().wait_for(lambda s: s.state == FINISHED)
    assert (final.step, final.weight_version) == (expected.step, expected.weight_version)
    assert '"restored": true' in trainer.process.log_path.read_text()
    store = CheckpointStore(checkpoint_dir, keep_last=2, source_model_dir=None)
    assert store.read_state(NUM_STEPS).backend == backend
    await _check_trained_once(buffer_process, job_id, checkpoint_dir)


def _rank_env(env: dict[str, str], rank: int, master_port: int) -> dict[str, str]:
    return env | {
        "MILES_TRAINER_RANK": str(rank),
        "MILES_TRAINER_WORLD_SIZE": "2",
        "MILES_TRAINER_MASTER_ADDR": "127.0.0.1",
        "MILES_TRAINER_MASTER_PORT": str(master_port),
    }


def _worker(env: dict[str, str], log_path: Path) -> ServiceProcess:
    """Rank 1 as its own process (serves nothing: no readiness to wait for)."""
    return ServiceProcess([console_script("miles-trainer")], ready_url=None, env=env, log_path=log_path).start()


async def test_rank_killed_among_separate_processes_ends_rank_0_and_the_restarted_ranks_rejoin(
    buffer_process: Any,
    small_model_dir: Path,
    tmp_path: Path,
    job_id: str,
    make_group: Any,
    make_trainer_env: Any,
    start_trainer: Any,
) -> None:
    await _fill(buffer_process.target, job_id, make_group, range(BATCH_GROUPS))  # one step's worth, for now
    checkpoint_dir = tmp_path / "ckpt"
    env = _env(make_trainer_env, buffer_process, small_model_dir, job_id, checkpoint_dir, interval=1)
    master_port = free_port()
    worker_env = _rank_env(env, 1, master_port)
    worker = _worker(worker_env, tmp_path / "rank1-a.log")
    rank0 = start_trainer(_rank_env(env, 0, master_port))
    try:
        rank0.start().wait_for(lambda s: s.step == 1 and s.state == trainer_pb2.TRAINER_STATE_WAITING_FOR_DATA)
        worker.kill9()  # a real SIGKILL; the kubelet restarts the container at once
        worker = _worker(worker_env, tmp_path / "rank1-b.log")
        assert rank0.process is not None
        exit_code = await asyncio.to_thread(rank0.process.process.wait, 600)
        log_text = rank0.process.log_path.read_text()
        assert exit_code == PEER_LOST_EXIT_CODE, log_text[-3000:]
        (line,) = _peer_lost_lines(log_text, 0)
        assert "trainer rank 0: rank 1 was replaced by a new process" in line

        rest = range(BATCH_GROUPS, NUM_STEPS * BATCH_GROUPS + NUM_EXTRA_GROUPS)
        await _fill(buffer_process.target, job_id, make_group, rest)
        final = rank0.start().wait_for(lambda s: s.state == FINISHED)  # the kubelet restarts rank 0's container
        assert (final.step, final.weight_version) == (NUM_STEPS, NUM_STEPS)
        worker_log = (tmp_path / "rank1-b.log").read_text()
        assert "the rendezvous store belongs to a group formed before this rank started" in worker_log
        rank0.stop()
        assert await asyncio.to_thread(worker.process.wait, 600) == 0  # type: ignore[union-attr]
        assert '"msg": "worker stopping"' in (tmp_path / "rank1-b.log").read_text()
    finally:
        worker.stop()
    await _check_trained_once(buffer_process, job_id, checkpoint_dir)

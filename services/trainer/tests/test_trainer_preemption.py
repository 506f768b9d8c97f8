"""A job preempted and readmitted (Kueue: services/controller/src/miles/controller/backends/kubernetes_kueue.py) trains
every group exactly once: what the controller does on an eviction - trainer rank 0's `Checkpoint`, then the pods
scaled to 0 (SIGTERM) - and on readmission - the trainer started again over the same checkpoint directory - is done
here to a real miles-trainer and miles-buffer, twice, mid-run. The multiset of trained group ids at the end equals
that of an uninterrupted run of the same job, and the buffer holds exactly the groups that were never trained (none
leased, none lost). The controller's side of the sequence (checkpoint asked before any pool is scaled down, the
quota released, the same objects scaled up again) is test_controller_kubernetes_kueue.py."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from miles.buffer.client import BufferClient
from miles.proto.trainer.v1 import trainer_pb2
from miles.trainer.checkpoint import CheckpointStore

pytestmark = [pytest.mark.integration, pytest.mark.slow]

NUM_STEPS = 10
BATCH_GROUPS = 2
NUM_EXTRA_GROUPS = 3
PREEMPT_AT_STEPS = (3, 7)


async def _fill(target: str, job_id: str, make_group: Any) -> None:
    async with BufferClient(target) as buffer:
        await buffer.configure_job(job_id)
        for i in range(NUM_STEPS * BATCH_GROUPS + NUM_EXTRA_GROUPS):
            await buffer.push_group(job_id, make_group(f"group-{i:03d}", seed=i, prompt_index=i))


def _env(make_trainer_env: Any, buffer: Any, model_dir: Path, job_id: str, checkpoint_dir: Path) -> dict[str, str]:
    return make_trainer_env(
        job_id=job_id,
        buffer=buffer,
        model_dir=model_dir,
        checkpoint_dir=checkpoint_dir,
        batch_size_groups=BATCH_GROUPS,
        num_steps=NUM_STEPS,
        checkpoint_interval_steps=100,  # only the preemption's checkpoints and the last one
        pull_wait_s=0.5,
        max_staleness=1000,  # the groups are all from version 0
    )


def _is_file(path: Path) -> bool:
    return path.is_file()


def _trained(checkpoint_dir: Path) -> Counter[str]:
    return Counter(CheckpointStore(checkpoint_dir, keep_last=2, source_model_dir=None).trained_group_ids())


async def test_a_preempted_and_readmitted_job_trains_every_group_exactly_once(
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
    reference = start_trainer(_env(make_trainer_env, buffer_process, small_model_dir, reference_job, reference_dir))
    final = reference.start().wait_for(lambda s: s.state == trainer_pb2.TRAINER_STATE_FINISHED)
    assert (final.step, final.weight_version) == (NUM_STEPS, NUM_STEPS)
    reference.stop()

    await _fill(buffer_process.target, job_id, make_group)
    preempted_dir = tmp_path / "preempted"
    env = _env(make_trainer_env, buffer_process, small_model_dir, job_id, preempted_dir)
    trainer = start_trainer(env)
    for at_step in PREEMPT_AT_STEPS:
        trainer.start().wait_for(lambda s, t=at_step: s.step >= t)
        checkpoint = trainer.call("Checkpoint", trainer_pb2.CheckpointRequest())  # the eviction's checkpoint
        assert checkpoint.step >= at_step and _is_file(Path(checkpoint.path, "trainer_state.json"))
        trainer.stop()  # scaled to 0: SIGTERM
    final = trainer.start().wait_for(lambda s: s.state == trainer_pb2.TRAINER_STATE_FINISHED)  # readmitted

    assert (final.step, final.checkpoint_step) == (NUM_STEPS, NUM_STEPS)
    expected = _trained(reference_dir)
    assert sum(expected.values()) == NUM_STEPS * BATCH_GROUPS and max(expected.values()) == 1
    assert _trained(preempted_dir) == expected
    async with BufferClient(buffer_process.target) as buffer:
        stats = await buffer.stats(job_id)
    assert stats.acked_total == NUM_STEPS * BATCH_GROUPS
    assert (stats.queued_groups, stats.leased_groups) == (NUM_EXTRA_GROUPS, 0)

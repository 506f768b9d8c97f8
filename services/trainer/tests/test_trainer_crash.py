"""Exactly-once effect under crashes: a real miles-trainer dies once exactly between a durable checkpoint and its
acks, then is killed with SIGKILL at random points across 20 steps (mid-step, mid-checkpoint, mid-publish ...),
restarted each time; at the end the step count and the multiset of trained group ids equal those of an
uninterrupted run, the buffer holds exactly the groups that were never trained, and version numbers stayed honest:
a restart from a checkpoint older than a version the dead process may have pushed (the disk publisher's intents)
continues after it instead of reusing the number, so the final version is the step count plus what the rewinds
skipped, and no number was published with two different weights."""

from __future__ import annotations

import asyncio
import random
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import pytest

from miles.buffer.client import BufferClient
from miles.proto.trainer.v1 import trainer_pb2
from miles.trainer.checkpoint import CheckpointStore
from miles.trainer.publish_ledger import PublishLedger

pytestmark = [pytest.mark.integration, pytest.mark.slow]

NUM_STEPS = 20
BATCH_GROUPS = 2
NUM_EXTRA_GROUPS = 3
NUM_KILLS = 3


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
        checkpoint_interval_steps=2,
        keep_last_checkpoints=2,
        pull_wait_s=0.5,
        max_staleness=1000,  # the groups are all from version 0
    )


def _metrics_text(port: int) -> str:
    return httpx.get(f"http://127.0.0.1:{port}/metrics").text


def _trained(checkpoint_dir: Path) -> Counter[str]:
    return Counter(CheckpointStore(checkpoint_dir, keep_last=2, source_model_dir=None).trained_group_ids())


async def test_kill_9_at_random_points_neither_loses_nor_double_trains_a_group(
    buffer_process: Any,
    small_model_dir: Path,
    tmp_path: Path,
    job_id: str,
    make_group: Any,
    make_trainer_env: Any,
    start_trainer: Any,
) -> None:
    # The uninterrupted reference run.
    reference_job, reference_dir = f"{job_id}-ref", tmp_path / "reference"
    await _fill(buffer_process.target, reference_job, make_group)
    reference = start_trainer(_env(make_trainer_env, buffer_process, small_model_dir, reference_job, reference_dir))
    final = reference.start().wait_for(lambda s: s.state == trainer_pb2.TRAINER_STATE_FINISHED)
    assert (final.step, final.weight_version) == (NUM_STEPS, NUM_STEPS)
    reference.stop()

    # The same job: first a crash exactly between a durable checkpoint and its acks (fault injection), whose
    # groups must come back and be acked without training; then SIGKILL NUM_KILLS times at random points.
    await _fill(buffer_process.target, job_id, make_group)
    crashed_dir = tmp_path / "crashed"
    env = _env(make_trainer_env, buffer_process, small_model_dir, job_id, crashed_dir)
    trainer = start_trainer({**env, "MILES_FAULTS": "trainer.checkpoint.before_ack=2"}).start()
    assert trainer.process is not None and await asyncio.to_thread(trainer.process.process.wait, 300) == 137
    trainer = start_trainer(env)
    rng = random.Random(20)
    kill_log = []
    for index, target_step in enumerate(sorted(rng.sample(range(3, NUM_STEPS), NUM_KILLS))):
        trainer.start()
        status = trainer.wait_for(lambda s, t=target_step: s.step >= t)
        if index == 0:
            # Checkpoint 2 held steps 1-2 (4 groups): redelivered after the crash, acked, not trained again.
            assert "miles_trainer_groups_already_trained_total 4.0" in _metrics_text(trainer.metrics_port)
        delay_s = rng.uniform(0.0, 0.8)
        await asyncio.sleep(delay_s)
        trainer.kill9()
        kill_log.append((target_step, round(delay_s, 2), status.checkpoint_step))
    final = trainer.start().wait_for(lambda s: s.state == trainer_pb2.TRAINER_STATE_FINISHED)
    print("kills (at step >=, after s, checkpoint step then):", kill_log)

    assert (final.step, final.checkpoint_step) == (NUM_STEPS, NUM_STEPS)
    _check_versions_honest(crashed_dir, final.weight_version)
    expected = _trained(reference_dir)
    assert sum(expected.values()) == NUM_STEPS * BATCH_GROUPS and max(expected.values()) == 1
    assert _trained(crashed_dir) == expected
    async with BufferClient(buffer_process.target) as buffer:
        stats = await buffer.stats(job_id)
    assert stats.acked_total == NUM_STEPS * BATCH_GROUPS
    assert (stats.queued_groups, stats.leased_groups) == (NUM_EXTRA_GROUPS, 0)


def _check_versions_honest(checkpoint_dir: Path, final_version: int) -> None:
    records = PublishLedger(checkpoint_dir).records()
    digests: dict[int, set[str]] = {}
    for record in records:
        digests.setdefault(record.version, set()).add(record.weights_digest)
    assert all(len(found) == 1 for found in digests.values()), digests
    versions = [r.version for r in records]  # a restart republishes its checkpoint's version, never an older one
    assert versions == sorted(versions)
    last = records[-1]
    assert last.version == final_version and last.step == NUM_STEPS
    # Each rewind republishes weights published before: its checkpoint's version's, or, when two kills restore
    # the same checkpoint, the number an earlier rewind gave them. The numbers since then are its extra ones.
    extra = 0
    for rewind in (r for r in records if r.restored_from_version is not None):
        same = [r.version for r in records if r.weights_digest == rewind.weights_digest and r.version < rewind.version]
        assert rewind.restored_from_version in same, rewind
        extra += rewind.version - max(same)
    assert final_version - NUM_STEPS == extra

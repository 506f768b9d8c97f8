"""Zero-signal groups and steps with a real miles-trainer, miles-buffer and Redis: with dynamic sampling (the
default) groups whose rewards are all equal are discarded with reason zero_signal, counted apart from rejected
groups, and replaced by further pulls; without it, a batch of such groups makes a skipped step: no optimizer step,
no version, nothing published, its groups acked with the next checkpoint like trained ones."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest

from miles.buffer.client import BufferClient
from miles.proto.common.v1 import common_pb2
from miles.proto.trainer.v1 import trainer_pb2, trainer_pb2_grpc

pytestmark = pytest.mark.integration


async def _push(target: str, job_id: str, groups: list[common_pb2.Group]) -> None:
    async with BufferClient(target) as buffer:
        await buffer.configure_job(job_id)
        for group in groups:
            await buffer.push_group(job_id, group)


def _events(port: int, kinds: set[str], count: int) -> list[trainer_pb2.TrainerEvent]:
    events = []
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = trainer_pb2_grpc.TrainerServiceStub(channel)  # type: ignore[no-untyped-call]
        for event in stub.WatchEvents(trainer_pb2.WatchEventsRequest(from_step=0), timeout=30):
            if event.kind in kinds:
                events.append(event)
            if len(events) == count:
                return events
    raise AssertionError(f"only {len(events)} events of {kinds}")


def _metrics_text(port: int) -> str:
    return httpx.get(f"http://127.0.0.1:{port}/metrics").text


def _ledger_ids(checkpoint_dir: Path) -> list[str]:
    lines = (checkpoint_dir / "trained_groups.jsonl").read_text().splitlines()
    return sorted(group_id for line in lines for group_id in json.loads(line)["group_ids"])


async def test_groups_without_reward_variance_are_discarded_counted_and_replaced(
    buffer_process: Any,
    small_model_dir: Path,
    tmp_path: Path,
    job_id: str,
    make_group: Any,
    make_trainer_env: Any,
    start_trainer: Any,
) -> None:
    zero = [make_group("zero-0", rewards=[1.0, 1.0]), make_group("zero-1", rewards=[0.0, 0.0])]
    good = [make_group(f"good-{i}", seed=i) for i in range(4)]
    await _push(buffer_process.target, job_id, [zero[0], good[0], zero[1], *good[1:]])
    checkpoint_dir = tmp_path / "ckpt"
    env = make_trainer_env(
        job_id=job_id,
        buffer=buffer_process,
        model_dir=small_model_dir,
        checkpoint_dir=checkpoint_dir,
        batch_size_groups=2,
        num_steps=2,
        pull_wait_s=0.5,
    )
    trainer = start_trainer(env).start()
    status = trainer.wait_for(lambda s: s.state == trainer_pb2.TRAINER_STATE_FINISHED)

    assert (status.step, status.weight_version, status.groups_trained, status.groups_rejected) == (2, 2, 4, 0)
    metrics = _metrics_text(trainer.metrics_port)
    assert "miles_trainer_groups_zero_signal_total 2.0" in metrics
    assert "miles_trainer_steps_skipped_total 0.0" in metrics
    assert "miles_trainer_zero_signal_fraction 0.0" in metrics  # the last step's batch had none
    assert 'miles_trainer_groups_rejected_total{reason="non_finite"} 0.0' in metrics
    steps = _events(trainer.port, {"step"}, 2)
    # step 1 pulled zero-0, good-0, then zero-1, then good-1: 2 of the 4 valid groups had no signal
    assert [event.metrics["zero_signal_fraction"] for event in steps] == [0.5, 0.0]
    async with BufferClient(buffer_process.target) as buffer:
        stats = await buffer.stats(job_id)
    assert (stats.discarded_total, stats.acked_total, stats.queued_groups, stats.leased_groups) == (2, 4, 0, 0)
    assert _ledger_ids(checkpoint_dir) == sorted(g.group_id for g in good)


async def test_a_batch_without_signal_is_consumed_without_a_step_or_a_version(
    buffer_process: Any,
    small_model_dir: Path,
    tmp_path: Path,
    job_id: str,
    make_group: Any,
    make_trainer_env: Any,
    start_trainer: Any,
) -> None:
    zero = [make_group("zero-0", rewards=[1.0, 1.0]), make_group("zero-1", rewards=[0.5, 0.5])]
    good = [make_group(f"good-{i}", seed=i) for i in range(2)]
    await _push(buffer_process.target, job_id, [*zero, *good])
    checkpoint_dir = tmp_path / "ckpt"
    env = make_trainer_env(
        job_id=job_id,
        buffer=buffer_process,
        model_dir=small_model_dir,
        checkpoint_dir=checkpoint_dir,
        batch_size_groups=2,
        num_steps=1,
        pull_wait_s=0.5,
        dynamic_sampling="false",
    )
    env["MILES_TRAINER_TRAIN__OPTIMIZER__WEIGHT_DECAY"] = "0.1"  # AdamW would move the weights on zero gradients
    trainer = start_trainer(env).start()
    status = trainer.wait_for(lambda s: s.state == trainer_pb2.TRAINER_STATE_FINISHED)

    assert (status.step, status.weight_version, status.checkpoint_step) == (1, 1, 1)
    skipped, step = _events(trainer.port, {"skipped", "step"}, 2)
    assert (skipped.kind, skipped.step, step.kind, step.step) == ("skipped", 0, "step", 1)
    assert skipped.metrics["zero_signal_fraction"] == 1.0 and skipped.metrics["num_optimizer_steps"] == 0
    assert skipped.metrics["num_optimizer_steps_skipped"] == 1 and "loss" not in skipped.metrics
    assert step.metrics["zero_signal_fraction"] == 0.0 and step.metrics["num_optimizer_steps"] == 1
    metrics = _metrics_text(trainer.metrics_port)
    assert "miles_trainer_steps_skipped_total 1.0" in metrics and "miles_trainer_steps_total 1.0" in metrics
    assert "miles_trainer_groups_zero_signal_total 0.0" in metrics  # counted, not discarded
    published = sorted(path.name for path in (checkpoint_dir / "published").glob("weights-v*"))
    assert published == ["weights-v000000", "weights-v000001"]
    # the skipped batch is consumed: acked with the checkpoint of step 1 and in its ledger
    assert _ledger_ids(checkpoint_dir) == sorted(g.group_id for g in [*zero, *good])
    async with BufferClient(buffer_process.target) as buffer:
        stats = await buffer.stats(job_id)
    assert (stats.discarded_total, stats.acked_total, stats.queued_groups, stats.leased_groups) == (0, 4, 0, 0)

"""miles-trainer as a real process against a real miles-buffer and Redis: untrainable groups are nacked with
a reason and counted while training goes on; the control API (Status, WatchEvents, Checkpoint, Stop) and the
metrics report what happened; checkpoints and the published version are on disk."""

from __future__ import annotations

import asyncio
import json
import math
import time
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
import redis

from miles.buffer.client import BufferClient
from miles.buffer.store import RedisStore
from miles.proto.common.v1 import common_pb2
from miles.proto.trainer.v1 import trainer_pb2, trainer_pb2_grpc

pytestmark = pytest.mark.integration


def _corrupt_in_store(redis_url: str, job_id: str, group: common_pb2.Group) -> None:
    """Overwrite a queued group's stored bytes, as a corrupted store or an older producer would leave them
    (the buffer's push validation would refuse these shapes)."""
    store = RedisStore(redis.Redis.from_url(redis_url), key_prefix="miles:buffer", dedupe_window_s=1, dedupe_max_ids=1)  # type: ignore[arg-type]
    data_key = store.job_keys(job_id)[1]
    client = redis.Redis.from_url(redis_url)
    assert client.hexists(data_key, group.group_id)
    client.hset(data_key, group.group_id, group.SerializeToString())
    client.close()


async def _push_inputs(buffer_target: str, redis_url: str, job_id: str, make_group: Any) -> list[str]:
    misaligned = make_group("bad-misaligned")
    unknown_status = make_group("bad-status")
    out_of_vocab = make_group("bad-token")
    out_of_vocab.samples[0].tokens[1] = 100_000
    nan_logprob = make_group("bad-nan")
    nan_logprob.samples[1].rollout_logprobs[2] = math.nan
    good = [make_group(f"good-{i}", seed=i) for i in range(4)]
    async with BufferClient(buffer_target) as buffer:
        await buffer.configure_job(job_id)
        for group in [misaligned, unknown_status, out_of_vocab, good[0], nan_logprob, *good[1:]]:
            response = await buffer.push_group(job_id, group)
            assert response.outcome == 1, group.group_id  # QUEUED
    misaligned.samples[0].loss_mask.append(1)
    unknown_status.samples[1].status = 42  # type: ignore[assignment]
    _corrupt_in_store(redis_url, job_id, misaligned)
    _corrupt_in_store(redis_url, job_id, unknown_status)
    return [g.group_id for g in good]


async def test_bad_groups_are_nacked_with_reason_counted_and_training_goes_on(
    redis_url: str,
    buffer_process: Any,
    small_model_dir: Path,
    tmp_path: Path,
    job_id: str,
    make_group: Any,
    make_trainer_env: Any,
    start_trainer: Any,
) -> None:
    good_ids = await _push_inputs(buffer_process.target, redis_url, job_id, make_group)
    env = make_trainer_env(
        job_id=job_id,
        buffer=buffer_process,
        model_dir=small_model_dir,
        checkpoint_dir=tmp_path / "ckpt",
        batch_size_groups=2,
        num_steps=2,
        pull_wait_s=0.5,
    )
    env["MILES_TRAINER_TRAIN__OPTIMIZER__LR"] = "1e-3"
    started_unix_ms = int(time.time() * 1000)
    trainer = start_trainer(env).start()
    status = trainer.wait_for(lambda s: s.state == trainer_pb2.TRAINER_STATE_FINISHED)
    assert started_unix_ms < status.last_step_finished_unix_ms <= int(time.time() * 1000)  # version 2's step

    assert (status.step, status.weight_version, status.checkpoint_step) == (2, 2, 2)
    assert status.groups_trained == 4 and status.groups_rejected == 4 and status.pending_groups == 0
    assert math.isfinite(status.last_step_metrics["loss"])
    assert status.last_step_metrics["num_groups"] == 2
    metrics = _metrics_text(trainer.metrics_port)
    for reason in ("misaligned", "unknown_status", "token_out_of_range", "non_finite"):
        assert f'miles_trainer_groups_rejected_total{{reason="{reason}"}} 1.0' in metrics
    assert "miles_trainer_groups_trained_total 4.0" in metrics
    assert "miles_trainer_step 2.0" in metrics

    async with BufferClient(buffer_process.target) as buffer:
        stats = await buffer.stats(job_id)
    assert (stats.discarded_total, stats.acked_total, stats.queued_groups, stats.leased_groups) == (4, 4, 0, 0)

    checkpoint_dir = tmp_path / "ckpt"
    ledger = [json.loads(line) for line in (checkpoint_dir / "trained_groups.jsonl").read_text().splitlines()]
    assert sorted(gid for entry in ledger for gid in entry["group_ids"]) == sorted(good_ids)
    state = json.loads((checkpoint_dir / "step-00000002" / "trainer_state.json").read_text())
    assert state["step"] == 2 and state["weight_version"] == 2
    assert (checkpoint_dir / "step-00000002" / "model" / "model.safetensors").is_file()
    assert (checkpoint_dir / "published" / "weights-v000002" / "config.json").is_file()

    events = _events(trainer.port, from_step=0, until_kind="state", until_state=trainer_pb2.TRAINER_STATE_FINISHED)
    kinds = [event.kind for event in events]
    assert kinds.count("step") == 2 and kinds.count("rejected") == 4 and "checkpoint" in kinds
    rejected = [event.message for event in events if event.kind == "rejected"]
    assert any("misaligned" in message and "loss_mask" in message for message in rejected)

    # The control API once finished: Checkpoint reports the last one, Stop returns the step.
    response = trainer.call("Checkpoint", trainer_pb2.CheckpointRequest())
    assert (response.step, response.path) == (2, str(checkpoint_dir / "step-00000002"))
    assert trainer.call("Stop", trainer_pb2.StopRequest(checkpoint=True)).step == 2


def _metrics_text(port: int) -> str:
    return httpx.get(f"http://127.0.0.1:{port}/metrics").text


def _is_file(path: Path) -> bool:
    return path.is_file()


def _events(port: int, *, from_step: int, until_kind: str, until_state: int) -> list[trainer_pb2.TrainerEvent]:
    events = []
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = trainer_pb2_grpc.TrainerServiceStub(channel)  # type: ignore[no-untyped-call]
        for event in stub.WatchEvents(trainer_pb2.WatchEventsRequest(from_step=from_step), timeout=30):
            events.append(event)
            if event.kind == until_kind and event.state == until_state:
                break
    return events


async def test_checkpoint_and_stop_on_request_hand_back_untrained_work(
    redis_url: str,
    buffer_process: Any,
    small_model_dir: Path,
    tmp_path: Path,
    job_id: str,
    make_group: Any,
    make_trainer_env: Any,
    start_trainer: Any,
) -> None:
    async with BufferClient(buffer_process.target) as buffer:
        await buffer.configure_job(job_id)
        for i in range(3):
            await buffer.push_group(job_id, make_group(f"g{i}", seed=i))
    env = make_trainer_env(
        job_id=job_id,
        buffer=buffer_process,
        model_dir=small_model_dir,
        checkpoint_dir=tmp_path / "ckpt",
        batch_size_groups=2,
        checkpoint_interval_steps=100,
        pull_wait_s=0.2,
    )
    trainer = start_trainer(env).start()
    trainer.wait_for(lambda s: s.step == 1 and s.state == trainer_pb2.TRAINER_STATE_WAITING_FOR_DATA)
    assert trainer.status().pending_groups == 2  # trained, not yet durable: still leased
    await asyncio.sleep(3.0)  # two lease lifetimes: the trainer keeps extending them
    response = trainer.call("Checkpoint", trainer_pb2.CheckpointRequest())
    assert (response.step, response.num_groups_acked) == (1, 2)
    assert _is_file(Path(response.path, "trainer_state.json"))
    assert trainer.call("Stop", trainer_pb2.StopRequest(checkpoint=False)).step == 1
    assert trainer.status().state == trainer_pb2.TRAINER_STATE_STOPPED
    async with BufferClient(buffer_process.target) as buffer:
        stats = await buffer.stats(job_id)
    # g2 was pulled while waiting for a second group and handed back on Stop; no lease ever expired.
    assert (stats.acked_total, stats.queued_groups, stats.leased_groups) == (2, 1, 0)
    assert stats.expired_leases_total == 0

"""Partial rollout (TrainConfig.stale_policy `mask`, the async default): an episode that ran on across weight
updates trains on its turns within max_staleness; its older turns are masked out of the loss and stay context.

The unit test pins the mask on a hand-built sample; the integration test runs a real miles-trainer against a real
miles-buffer configured as the controller configures it, with groups whose spans straddle the bound."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest

from miles.buffer.client import BufferClient
from miles.proto.common.v1 import common_pb2
from miles.trainer.batch import group_staleness, samples_from_group


def _straddling_group(make_group: Any, group_id: str, old: int, new: int) -> common_pb2.Group:
    """Two samples of 8 response tokens: a turn [0, 3) sampled by `old`, a tool result [3, 5) (not trained on),
    then a turn [5, 8) sampled by `new`."""
    group = make_group(group_id, num_response_tokens=8)
    for sample in group.samples:
        sample.loss_mask[3:5] = [0, 0]
        sample.rollout_logprobs[3:5] = [0.0, 0.0]
        del sample.weight_versions[:]
        sample.weight_versions.add(start=0, end=3, weight_version=old)
        sample.weight_versions.add(start=5, end=8, weight_version=new)
    return group


def test_spans_older_than_the_bound_leave_the_loss_and_the_rest_stays(make_group: Any) -> None:
    group = _straddling_group(make_group, "g", old=1, new=4)
    masked = samples_from_group(group, 0, vocab_size=512, max_positions=64, stale_before=3)
    assert [s.loss_mask for s in masked] == [[0, 0, 0, 0, 0, 1, 1, 1]] * 2
    assert [(s.min_version, s.max_version, s.num_stale_masked_tokens) for s in masked] == [(4, 4, 3)] * 2
    assert masked[0].span_versions == (1, 4)  # a rewind's superseded-version check still sees every span
    assert group_staleness(masked, 5) == 1  # the staleness of what is trained
    kept = samples_from_group(group, 0, vocab_size=512, max_positions=64)
    assert [s.loss_mask for s in kept] == [[1, 1, 1, 0, 0, 1, 1, 1]] * 2
    assert [(s.min_version, s.num_stale_masked_tokens) for s in kept] == [(1, 0)] * 2
    everything_old = samples_from_group(group, 0, vocab_size=512, max_positions=64, stale_before=5)
    assert [(sum(s.loss_mask), s.min_version, s.num_stale_masked_tokens) for s in everything_old] == [(0, None, 6)] * 2


@pytest.mark.integration
async def test_a_trainer_trains_the_fresh_turns_of_a_straddling_group_and_the_buffer_drops_an_all_old_one(
    buffer_process: Any,
    small_model_dir: Path,
    tmp_path: Path,
    job_id: str,
    make_group: Any,
    make_trainer_env: Any,
    start_trainer: Any,
) -> None:
    """async, max_staleness 1 (defaults), one group per step. Steps 0-1 train groups of version 0; at version 2
    a group sampled wholly by version 0 is dropped, and one sampled by versions 0 then 2 trains on its version-2
    turns only: 2 samples x 3 tokens masked, half of its 12 loss tokens."""
    async with BufferClient(buffer_process.target) as buffer:
        await buffer.configure_job(job_id, stale_policy="mask")
        for index in range(2):
            await buffer.push_group(job_id, make_group(f"fresh-{index}", seed=index))
        env = make_trainer_env(
            job_id=job_id,
            buffer=buffer_process,
            model_dir=small_model_dir,
            checkpoint_dir=tmp_path / "ckpt",
            batch_size_groups=1,
            num_steps=4,
            pull_wait_s=0.5,
        )
        trainer = start_trainer(env).start()
        trainer.wait_for(lambda s: s.weight_version == 2)
        await buffer.push_group(job_id, make_group("all-old", seed=5, version=0))
        await buffer.push_group(job_id, _straddling_group(make_group, "straddling", old=0, new=2))
        status = trainer.wait_for(lambda s: s.weight_version == 3)
        assert status.last_step_metrics["stale_masked_tokens"] == 6
        assert status.last_step_metrics["stale_masked_token_fraction"] == 0.5
        assert status.last_step_metrics["num_loss_tokens"] == 6
        assert status.last_step_metrics["staleness_max"] == 0  # its trained turns are version 2's
        await buffer.push_group(job_id, make_group("fresh-3", seed=3, version=3))
        status = trainer.wait_for(lambda s: s.step == 4)
        assert status.last_step_metrics["stale_masked_tokens"] == 0
        stats = await buffer.stats(job_id)
    assert (stats.stale_masked_total, stats.dropped_stale_total, status.groups_trained) == (1, 1, 4)
    async with httpx.AsyncClient(trust_env=False) as client:
        metrics = (await client.get(f"http://127.0.0.1:{trainer.metrics_port}/metrics")).text
    assert "miles_trainer_stale_masked_tokens_total 6.0" in metrics

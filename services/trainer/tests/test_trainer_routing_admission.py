"""What the trainer accepts of recorded MoE routing (R3): trainable samples' routing is held to the model (layers,
top_k, expert ids) and unpacked; with replay on, a trainable sample without routing refuses its group
(`missing_routing`: nacked with discard, counted, announced), never trained without it. Then the whole path with
real processes: a real miles-buffer and a miles-trainer on the tiny MoE model (replay on by default) train on
engine rollouts exactly (diff 0, agreement 1 in Status and /metrics) and refuse the bad groups, also as two FSDP
ranks under torchrun; a trainer asked to replay with a dense model does not start."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from miles.buffer.client import BufferClient
from miles.common.contracts.routing import RoutingShape, pack
from miles.common.jobspec.trainer import TrainConfig
from miles.common.telemetry import Metrics
from miles.common.testing import free_port
from miles.common.testing.smoke import console_script
from miles.proto.buffer.v1 import buffer_pb2
from miles.proto.common.v1 import common_pb2
from miles.proto.trainer.v1 import trainer_pb2
from miles.trainer.admission import Admission
from miles.trainer.backends.base import ModelShape
from miles.trainer.batch import BadGroupError, samples_from_group
from miles.trainer.consumption import Holdings
from miles.trainer.events import EventLog
from miles.trainer.metrics import TrainerMetrics

ROUTING = RoutingShape(num_layers=4, top_k=2, num_experts=8)
Corrupt = Callable[[common_pb2.RoutedExperts], None]


def _ids(num_rows: int) -> list[int]:
    """Valid routing: two distinct experts per position and layer."""
    return [(row + layer + slot) % 8 for row in range(num_rows) for layer in range(4) for slot in range(2)]


def _routed_group(make_group: Any, group_id: str = "g") -> common_pb2.Group:
    group: common_pb2.Group = make_group(group_id)
    for sample in group.samples:
        sample.rollout_routed_experts.CopyFrom(pack(_ids(len(sample.tokens) - 1), ROUTING))
    return group


def _samples(group: common_pb2.Group, *, replay: bool = True, routing: RoutingShape | None = ROUTING) -> list[Any]:
    return samples_from_group(group, 0, vocab_size=512, max_positions=64, routing=routing, routing_replay=replay)


def _reshape(routed: common_pb2.RoutedExperts, num_layers: int, top_k: int) -> None:
    routed.num_layers, routed.top_k = num_layers, top_k


def _set_byte(routed: common_pb2.RoutedExperts, index: int, value: int) -> None:
    data = bytearray(routed.data)
    data[index] = value
    routed.data = bytes(data)


@pytest.mark.parametrize(
    ("reason", "corrupt"),
    [
        ("bad_routing", lambda r: _reshape(r, 2, 4)),  # the same byte length read as another model's routing
        ("bad_routing", lambda r: _reshape(r, 8, 1)),
        ("bad_routing", lambda r: _set_byte(r, 5, 8)),  # expert 8 of 8
        ("bad_routing", lambda r: _set_byte(r, 1, r.data[0])),  # one expert twice in a top-k
        ("bad_routing", lambda r: setattr(r, "data", r.data[:-8])),  # a row short (the shared contract)
    ],
)
def test_routing_that_does_not_fit_the_model_is_refused(reason: str, corrupt: Corrupt, make_group: Any) -> None:
    group = _routed_group(make_group)
    corrupt(group.samples[1].rollout_routed_experts)
    for replay in (True, False):  # checked whether replayed or only measured
        with pytest.raises(BadGroupError) as caught:
            _samples(group, replay=replay)
        assert caught.value.reason == reason
        assert "samples[1]" in caught.value.message


def test_with_replay_a_trainable_sample_without_routing_is_refused_as_missing_routing(make_group: Any) -> None:
    group = _routed_group(make_group)
    group.samples[1].ClearField("rollout_routed_experts")
    with pytest.raises(BadGroupError) as caught:
        _samples(group)
    assert caught.value.reason == "missing_routing"
    assert caught.value.message == "samples[1] has no rollout_routed_experts, and the job replays routing (R3)"
    unrouted = make_group("dense")
    with pytest.raises(BadGroupError, match="missing_routing"):
        _samples(unrouted)


def test_routing_is_unpacked_whether_replayed_or_not_and_optional_without_replay(make_group: Any) -> None:
    group = _routed_group(make_group)
    for replay in (True, False):
        samples = _samples(group, replay=replay)
        assert [list(s.routed_experts or ()) for s in samples] == [_ids(7), _ids(7)]
    group.samples[1].ClearField("rollout_routed_experts")
    samples = _samples(group, replay=False)
    assert samples[0].routed_experts is not None and samples[1].routed_experts is None
    with pytest.raises(BadGroupError, match=r"bad_routing: samples\[0\].rollout_routed_experts is set but the model"):
        _samples(_routed_group(make_group), replay=False, routing=None)  # a dense model never routed anything


def test_samples_not_trained_on_need_no_routing_and_are_not_unpacked(make_group: Any) -> None:
    group = _routed_group(make_group)
    group.samples[0].status = common_pb2.SAMPLE_STATUS_ABORTED
    group.samples[0].ClearField("rollout_routed_experts")
    group.samples[1].status = common_pb2.SAMPLE_STATUS_FAILED
    _set_byte(group.samples[1].rollout_routed_experts, 0, 200)
    samples = _samples(group)
    assert [(s.trainable, s.routed_experts) for s in samples] == [(False, None), (False, None)]


class _Consumer:
    """What Admission needs of the buffer consumer: its holdings and discard (nack with discard)."""

    def __init__(self) -> None:
        self.holdings = Holdings()
        self.discarded: list[tuple[str, str]] = []

    async def discard(self, lease_id: str, reason: str) -> None:
        self.discarded.append((lease_id, reason))


async def test_admission_nacks_refused_routing_with_its_reason_and_counts_it(
    make_group: Any, caplog: pytest.LogCaptureFixture
) -> None:
    consumer, metrics, events = _Consumer(), Metrics("trainer"), EventLog(10)
    shape = ModelShape(vocab_size=512, max_positions=64, routing=ROUTING)
    admission = Admission(consumer, TrainConfig(), TrainerMetrics(metrics), events, shape)  # type: ignore[arg-type]
    assert admission.routing_replay  # None: on for a MoE model
    missing = make_group("missing")
    wrong_layers = _routed_group(make_group, "wrong-layers")
    wrong_layers.samples[0].rollout_routed_experts.num_layers = 2
    wrong_layers.samples[0].rollout_routed_experts.top_k = 4
    good = _routed_group(make_group, "good")
    admitted = []
    for index, group in enumerate((missing, wrong_layers, good)):
        leased = buffer_pb2.LeasedGroup(lease_id=f"lease-{index}", group=group)
        admitted.append(await admission.admit(leased, group_index=0, trainer_version=0, step=3))
    assert admitted[:2] == [None, None] and admitted[2] is not None
    assert all(sample.routed_experts is not None for sample in admitted[2].samples)
    assert [(lease, reason.split(":")[1].strip()) for lease, reason in consumer.discarded] == [
        ("lease-0", "missing_routing"),
        ("lease-1", "bad_routing"),
    ]
    text = metrics.exposition().decode()
    assert 'miles_trainer_groups_rejected_total{reason="missing_routing"} 1.0' in text
    assert 'miles_trainer_groups_rejected_total{reason="bad_routing"} 1.0' in text
    rejected = [event.message for event in events.history() if event.kind == "rejected"]
    assert rejected[0].startswith("group 'missing': missing_routing: samples[0] has no rollout_routed_experts")
    assert admission.num_rejected == 2 and list(consumer.holdings.pulled) == ["good"]
    logged = [r.getMessage() for r in caplog.records if r.getMessage().startswith("group rejected")]
    assert logged == ["group rejected: missing_routing", "group rejected: bad_routing"]  # plain-text logs keep it


def _metrics_text(port: int) -> str:
    return httpx.get(f"http://127.0.0.1:{port}/metrics").text


@pytest.fixture
def two_prompts(tiny_moe_model_dir: Path, moe_rollouts: Any) -> Any:
    """Engine rollouts (generated outside the test's event loop): 2 prompts x 2 samples."""
    return moe_rollouts(tiny_moe_model_dir, num_prompts=2, seed=5)


@pytest.mark.integration
async def test_a_moe_trainer_process_replays_engine_routing_exactly_and_refuses_bad_groups(
    tiny_moe_model_dir: Path,
    two_prompts: Any,
    buffer_process: Any,
    tmp_path: Path,
    job_id: str,
    make_moe_group: Any,
    make_trainer_env: Any,
    start_trainer: Any,
) -> None:
    (prompt, replies), (other_prompt, other_replies) = two_prompts
    missing = make_moe_group("missing", other_prompt, other_replies, routing=None)
    wrong_layers = make_moe_group("wrong-layers", other_prompt, other_replies)
    for sample in wrong_layers.samples:  # the same bytes read as 2 layers x top 4: another model's routing
        sample.rollout_routed_experts.num_layers, sample.rollout_routed_experts.top_k = 2, 4
    async with BufferClient(buffer_process.target) as buffer:
        await buffer.configure_job(job_id)
        for group in (missing, wrong_layers, make_moe_group("good", prompt, replies)):
            assert (await buffer.push_group(job_id, group)).outcome == 1  # QUEUED
    env = make_trainer_env(
        job_id=job_id,
        buffer=buffer_process,
        model_dir=tiny_moe_model_dir,
        checkpoint_dir=tmp_path / "ckpt",
        batch_size_groups=1,
        num_steps=1,
        deterministic="true",
        strict_on_policy="true",
        pull_wait_s=0.5,
    )
    trainer = start_trainer(env).start()
    final = trainer.wait_for(lambda s: s.state == trainer_pb2.TRAINER_STATE_FINISHED)
    assert (final.step, final.groups_trained, final.groups_rejected) == (1, 1, 2)
    step = dict(final.last_step_metrics)
    assert step["routing_replay"] == 1.0  # unset in the job: on, the model is MoE
    assert step["train_rollout_logprob_abs_diff_max"] == 0.0 and step["routing_agreement"] == 1.0
    text = _metrics_text(trainer.metrics_port)
    for reason in ("missing_routing", "bad_routing"):
        assert f'miles_trainer_groups_rejected_total{{reason="{reason}"}} 1.0' in text
    assert all(f'miles_trainer_routing_agreement_ratio{{layer="{layer}"}} 1.0' in text for layer in range(4))
    assert "miles_trainer_routing_replay 1.0" in text


@pytest.mark.integration
def test_a_trainer_asked_to_replay_routing_of_a_dense_model_exits_saying_why(
    small_model_dir: Path, tmp_path: Path
) -> None:
    env = {
        **os.environ,
        "MILES_TRAINER_JOB_ID": "dense-r3",
        "MILES_TRAINER_MODEL_PATH": str(small_model_dir),
        "MILES_TRAINER_CHECKPOINT_DIR": str(tmp_path / "ckpt"),
        "MILES_TRAINER_PUBLISH__KIND": "none",
        "MILES_TRAINER_BUFFER_ADDRESS": f"127.0.0.1:{free_port()}",
        "MILES_TRAINER_PORT": str(free_port()),
        "MILES_TRAINER_METRICS_PORT": str(free_port()),
        "MILES_TRAINER_CONFIG_FILE": str(tmp_path / "trainer.json"),
    }
    (tmp_path / "trainer.json").write_text(json.dumps({"train": {"routing_replay": True}}))
    result = subprocess.run(
        [console_script("miles-trainer")], env=env, capture_output=True, text=True, timeout=300, check=False
    )
    assert result.returncode != 0
    assert "miles-trainer: train.routing_replay is true but the model has no MoE layers" in result.stderr


@pytest.mark.integration
@pytest.mark.slow
async def test_two_fsdp_ranks_replay_engine_routing_exactly(
    tiny_moe_model_dir: Path,
    two_prompts: Any,
    buffer_process: Any,
    tmp_path: Path,
    job_id: str,
    make_moe_group: Any,
    make_trainer_env: Any,
    start_trainer: Any,
) -> None:
    """Rank 1 gets its micro-batches (routing included) from rank 0 and replays them inside the FSDP2-sharded
    policy: strict on-policy holds on both ranks' tokens."""
    async with BufferClient(buffer_process.target) as buffer:
        await buffer.configure_job(job_id)
        for index, (prompt, replies) in enumerate(two_prompts):
            assert (await buffer.push_group(job_id, make_moe_group(f"g{index}", prompt, replies))).outcome == 1
    env = make_trainer_env(
        job_id=job_id,
        buffer=buffer_process,
        model_dir=tiny_moe_model_dir,
        checkpoint_dir=tmp_path / "ckpt",
        batch_size_groups=2,
        num_steps=1,
        deterministic="true",
        strict_on_policy="true",
        micro_batch_max_tokens=20,
        pull_wait_s=0.5,
    )
    trainer = start_trainer(env)
    trainer.argv = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
        "--master-port",
        str(free_port()),
        console_script("miles-trainer"),
    ]
    final = trainer.start().wait_for(lambda s: s.state == trainer_pb2.TRAINER_STATE_FINISHED)
    step = dict(final.last_step_metrics)
    assert final.step == 1 and step["num_micro_batches"] >= 2
    assert step["train_rollout_logprob_abs_diff_max"] == 0.0 and step["routing_agreement"] == 1.0
    assert step["routing_replay"] == 1.0

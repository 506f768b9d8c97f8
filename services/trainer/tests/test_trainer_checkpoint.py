"""Checkpoint files: atomic directories with everything a restart needs, retention, leftovers of a crash, the
ledger of trained groups (cut back to the restored step, torn lines survived), the disk publisher and the choice of
publisher."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from miles.common.testing import free_port
from miles.model import read_safetensors_dir
from miles.trainer.checkpoint import CheckpointStore, TrainerState, restore_rng, rng_state
from miles.trainer.publish import NullPublisher, digest_of, make_publisher
from miles.trainer.publish_engines import DiskPublisher
from miles.trainer.publish_ledger import PublishLedger
from miles.trainer.publish_stream import StreamPublisher
from miles.trainer.settings import PublishSettings, TrainerSettings

TENSORS = {"model.norm.weight": torch.arange(4, dtype=torch.float32), "lm_head.weight": torch.ones(2, 4)}
OPTIMIZER = {
    "optimizer": {"state": {"w": {"step": torch.tensor(3.0)}}, "param_groups": [{"lr": 0.1}]},
    "scheduler": {"last_epoch": 3},
}


def write(store: CheckpointStore, step: int, group_ids: list[str]) -> Path:
    state = TrainerState(
        job_id="j",
        step=step,
        weight_version=step + 10,
        committed_group_ids=group_ids,
        dataset_cursor={"epoch": 0, "prompt_index": step},
    )
    path = store.write(state, TENSORS, OPTIMIZER, rng_state())
    store.append_ledger(step, group_ids)
    return path


def test_checkpoint_holds_model_optimizer_scheduler_rng_and_state(tmp_path: Path) -> None:
    source = tmp_path / "model"
    source.mkdir()
    (source / "config.json").write_text('{"model_type": "qwen3"}')
    store = CheckpointStore(tmp_path / "ckpt", keep_last=2, source_model_dir=source)
    torch.manual_seed(123)
    path = write(store, 4, ["a", "b"])
    expected_next = torch.rand(3)
    assert path.name == "step-00000004" and store.latest_step() == 4
    assert json.loads((path / "model" / "config.json").read_text()) == {"model_type": "qwen3"}
    loaded = store.load(4)
    assert all(torch.equal(loaded.tensors[n], t) for n, t in TENSORS.items())
    assert loaded.optimizer["optimizer"]["param_groups"] == [{"lr": 0.1}]
    assert loaded.optimizer["scheduler"] == {"last_epoch": 3}
    assert (loaded.state.step, loaded.state.weight_version, loaded.state.committed_group_ids) == (4, 14, ["a", "b"])
    assert loaded.state.dataset_cursor == {"epoch": 0, "prompt_index": 4}
    restore_rng(loaded.rng)
    assert torch.equal(torch.rand(3), expected_next)  # the RNG continues where the checkpoint left it


def test_retention_and_crash_leftovers(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path, keep_last=2, source_model_dir=None)
    for step in (1, 2, 3):
        write(store, step, [f"g{step}"])
    assert store.steps() == [2, 3]
    # A crash mid-write leaves a temp dir (never a step dir without its state file): ignored, then removed.
    (tmp_path / ".tmp-step-00000004-deadbeef" / "model").mkdir(parents=True)
    (tmp_path / "step-00000009").mkdir()  # no trainer_state.json: not a checkpoint
    assert store.latest_step() == 3
    assert store.remove_temporaries() == 1
    assert not list(tmp_path.glob(".tmp-*"))


def test_ledger_is_cut_back_to_the_restored_checkpoint(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path, keep_last=5, source_model_dir=None)
    for step, ids in ((2, ["a", "b"]), (4, ["c", "d"])):
        write(store, step, ids)
    store.append_ledger(6, ["e", "f"])  # from a run that got further than the checkpoint restored below
    store.reconcile_ledger(store.read_state(4))
    assert store.trained_group_ids() == ["a", "b", "c", "d"]


def test_ledger_recovers_the_line_of_a_checkpoint_that_crashed_before_its_append(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path, keep_last=5, source_model_dir=None)
    write(store, 2, ["a"])
    state = TrainerState(job_id="j", step=4, weight_version=14, committed_group_ids=["b", "c"])
    store.write(state, TENSORS, OPTIMIZER, rng_state())  # crash here: no ledger append
    with store.ledger_path.open("a") as ledger:
        ledger.write('{"step": 4, "group_ids": ["b", "c"')  # or a torn append
    store.reconcile_ledger(store.read_state(4))
    assert store.trained_group_ids() == ["a", "b", "c"]


async def test_disk_publisher_writes_versions_atomically_keeps_the_last_and_counts_engine_failures(
    tmp_path: Path,
) -> None:
    dead_engine = f"http://127.0.0.1:{free_port()}"
    settings = TrainerSettings(
        job_id="j",
        model_path=tmp_path,
        checkpoint_dir=tmp_path / "c",
        publish=PublishSettings(
            kind="disk", dir=tmp_path / "p", keep_last=2, engine_urls=[dead_engine], engine_timeout_s=2, dtype="float32"
        ),
    )
    publisher = make_publisher(settings)
    assert isinstance(publisher, DiskPublisher)
    for version in (1, 2, 3):
        record = await publisher.publish(version, TENSORS, step=version, step_finished_unix_ms=0)
    await publisher.close()
    assert record.version == 3 and record.weights_digest == digest_of(TENSORS)
    assert publisher.take_failures() == 3  # the dead engine, once per version
    assert _names(tmp_path / "p") == ["weights-v000002", "weights-v000003"]
    assert torch.equal(
        read_safetensors_dir(tmp_path / "p" / "weights-v000003")["lm_head.weight"], TENSORS["lm_head.weight"]
    )
    ledger = PublishLedger(tmp_path / "c")
    assert [r.version for r in ledger.records("intent")] == [r.version for r in ledger.records()] == [1, 2, 3]


def _names(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


def test_make_publisher_follows_settings(tmp_path: Path) -> None:
    settings = TrainerSettings(
        job_id="j", model_path=tmp_path, checkpoint_dir=tmp_path / "c", publish=PublishSettings(kind="none")
    )
    assert isinstance(make_publisher(settings), NullPublisher)
    disk = make_publisher(
        TrainerSettings(
            job_id="j", model_path=tmp_path, checkpoint_dir=tmp_path / "c", publish=PublishSettings(kind="disk")
        )
    )
    assert isinstance(disk, DiskPublisher) and disk.root == tmp_path / "c" / "published"
    stream = make_publisher(
        TrainerSettings(
            job_id="j",
            model_path=tmp_path,
            checkpoint_dir=tmp_path / "c",
            publish=PublishSettings(weightsync_address="127.0.0.1:1"),
        )
    )
    assert isinstance(stream, StreamPublisher) and stream.address == "127.0.0.1:1"
    with pytest.raises(ValueError, match="weightsync_address"):
        TrainerSettings(job_id="j", model_path=tmp_path, checkpoint_dir=tmp_path / "c")
    with pytest.raises(ValueError, match=r"needs publish\.router_url"):
        TrainerSettings(
            job_id="j", model_path=tmp_path, checkpoint_dir=tmp_path / "c", publish=PublishSettings(kind="nccl")
        )

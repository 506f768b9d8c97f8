"""Where the trainer's tensors are when they leave for the engines, and which GPU a rank computes on, checked without
a GPU: the nccl publisher broadcasts over NCCL from this rank's GPU (NCCL cannot send CPU tensors) and over gloo
from the CPU; each tensor is moved just before its own broadcast; a torchrun rank binds GPU LOCAL_RANK.
(The broadcast itself over gloo: test_trainer_publish_nccl.py; over real NCCL: weight-sync's gpu-marked test.)"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from miles.common.errors import ConfigError
from miles.trainer import distributed
from miles.trainer.publish import make_publisher
from miles.trainer.publish_engines import NcclPublisher, broadcast_device
from miles.trainer.settings import PublishSettings, TrainerSettings
from miles.weightsync import nccl


def nccl_settings(tmp_path: Path, backend: str) -> TrainerSettings:
    publish = PublishSettings(kind="nccl", engine_urls=["http://127.0.0.1:1"], nccl_backend=backend)  # type: ignore[arg-type]
    return TrainerSettings(job_id="job", model_path=tmp_path, checkpoint_dir=tmp_path / "ckpt", publish=publish)


def pretend_gpus(monkeypatch: pytest.MonkeyPatch, count: int, current: int = 0) -> list[int]:
    """torch told that `count` GPUs exist; returns the devices set_device was called with."""
    calls: list[int] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: current)
    monkeypatch.setattr(torch.cuda, "set_device", calls.append)
    return calls


def test_gloo_groups_broadcast_the_cpu_snapshot_where_it_is(tmp_path: Path) -> None:
    assert broadcast_device("gloo") == ""
    publisher = make_publisher(nccl_settings(tmp_path, "gloo"))
    assert isinstance(publisher, NcclPublisher)
    assert publisher.transport.config.device == ""  # type: ignore[attr-defined]


def test_nccl_groups_broadcast_from_this_ranks_current_gpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pretend_gpus(monkeypatch, 2, current=1)
    assert broadcast_device("nccl") == "cuda:1"
    publisher = make_publisher(nccl_settings(tmp_path, "nccl"))
    assert publisher.transport.config.device == "cuda:1"  # type: ignore[attr-defined]


def test_nccl_backend_without_cuda_is_refused_when_the_publisher_is_built(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pretend_gpus(monkeypatch, 0)
    with pytest.raises(ConfigError, match="needs CUDA on the trainer") as error:
        make_publisher(nccl_settings(tmp_path, "nccl"))
    assert error.value.field == "publish.nccl_backend"


def test_each_tensor_is_moved_to_the_broadcast_device_just_before_its_own_broadcast(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """torch's meta device stands for the GPU: every broadcast gets a moved, contiguous tensor, in order."""
    sent: list[tuple[torch.device, tuple[int, ...], bool]] = []

    def broadcast(tensor: torch.Tensor, src: int, group: Any) -> None:
        assert src == 0 and group == "pg"
        sent.append((tensor.device, tuple(tensor.shape), tensor.is_contiguous()))

    monkeypatch.setattr(nccl.dist, "broadcast", broadcast)
    tensors = [torch.zeros(2, 3).t(), torch.ones(4)]  # the first one not contiguous
    nccl._broadcast(nccl._Group("g", "pg"), tensors, "meta")
    assert sent == [(torch.device("meta"), (3, 2), True), (torch.device("meta"), (4,), True)]
    sent.clear()
    nccl._broadcast(nccl._Group("g", "pg"), tensors, "")
    assert [device.type for device, _, _ in sent] == ["cpu", "cpu"]


def test_a_torchrun_rank_binds_the_gpu_of_its_local_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = pretend_gpus(monkeypatch, 4)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    assert distributed.bind_local_gpu() is None  # no launcher: the current device stays
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert distributed.bind_local_gpu() == 3
    monkeypatch.setenv("LOCAL_RANK", "4")  # more ranks than GPUs on this machine: left to NCCL to refuse
    assert distributed.bind_local_gpu() is None
    assert calls == [3]


def test_a_cpu_machine_binds_no_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = pretend_gpus(monkeypatch, 0)
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert distributed.bind_local_gpu() is None
    assert calls == []

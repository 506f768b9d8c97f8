"""The nccl transport, driven from a trainer-like process: the exact SGLang requests, in order, against a fake
SGLang engine (test code) that really joins the weight-update group and receives every tensor by broadcast —
gloo on the CPU; real NCCL only on a machine with two GPUs (marked gpu)."""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from weightsync_testkit import TinyTrainer

from miles.common.telemetry import Metrics
from miles.common.testing import ServiceProcess, free_port
from miles.weightsync.engines import LocalEngines
from miles.weightsync.events import EventLog
from miles.weightsync.metrics import WeightsyncMetrics
from miles.weightsync.nccl import NcclConfig
from miles.weightsync.transports import TransportDeps, make_transport

FAKE_ENGINE = Path(__file__).parent / "weightsync_fake_sglang.py"
BUCKET_BYTES = 8 << 20


async def roll_versions(
    trainer: TinyTrainer, engine_url: str, *, backend: str, device: str, num_versions: int
) -> dict[int, dict[str, torch.Tensor]]:
    states: dict[int, dict[str, torch.Tensor]] = {}
    config = NcclConfig("127.0.0.1", free_port(), backend=backend, bucket_bytes=BUCKET_BYTES, timeout_s=120)
    transport = make_transport(
        "nccl",
        TransportDeps(nccl_config=config, nccl_weights=lambda v: {n: t.to(device) for n, t in states[v].items()}),
    )
    engines = LocalEngines(
        [engine_url],
        router=None,
        metrics=WeightsyncMetrics(Metrics("weightsync")),
        events=EventLog(100),
        request_timeout_s=120,
    )
    for _ in range(num_versions):
        version = trainer.step()
        states[version] = trainer.bf16_state()
        outcome = await engines.update(engine_url, version, transport, "retract", 300)
        assert not outcome.update_failed, outcome.error
        assert outcome.weight_version == version
    await transport.close()  # type: ignore[attr-defined]
    await engines.close()
    return states


def check_requests(requests: list[dict[str, Any]], states: dict[int, dict[str, torch.Tensor]], backend: str) -> None:
    paths = [r["path"] for r in requests]
    assert paths.count("/init_weights_update_group") == 1 and paths[-1] == "/destroy_weights_update_group"
    init = next(r["body"] for r in requests if r["path"] == "/init_weights_update_group")
    assert set(init) == {"master_address", "master_port", "rank_offset", "world_size", "group_name", "backend"}
    assert (init["rank_offset"], init["world_size"], init["backend"]) == (1, 2, backend)
    per_version = _split_by_pause(requests[:-1])
    assert len(per_version) == len(states)
    for (version, state), steps in zip(sorted(states.items()), per_version, strict=True):
        kinds = [step["path"] for step in steps]
        expected_head = ["/pause_generation"] + (["/init_weights_update_group"] if version == min(states) else [])
        assert kinds[: len(expected_head)] == expected_head
        assert steps[0]["body"] == {"mode": "retract"}
        updates = [s["body"] for s in steps if s["path"] == "/update_weights_from_distributed"]
        assert kinds[len(expected_head) : len(expected_head) + len(updates)] == [
            "/update_weights_from_distributed"
        ] * len(updates)
        assert kinds[len(expected_head) + len(updates) :] == [
            "/update_weight_version",
            "/model_info",
            "/continue_generation",
        ]
        names = [name for body in updates for name in body["names"]]
        assert names == list(state)
        for body in updates:
            assert set(body) == {
                "names",
                "dtypes",
                "shapes",
                "group_name",
                "flush_cache",
                "abort_all_requests",
                "weight_version",
            }
            assert body["group_name"] == init["group_name"] and body["flush_cache"] is False
            assert body["weight_version"] == str(version)
            assert body["dtypes"] == ["bfloat16"] * len(body["names"])
            assert body["shapes"] == [list(state[n].shape) for n in body["names"]]
            sizes = [state[n].numel() * 2 for n in body["names"]]
            assert len(sizes) == 1 or sum(sizes) <= BUCKET_BYTES
        version_call = next(s["body"] for s in steps if s["path"] == "/update_weight_version")
        assert version_call == {"new_version": str(version), "abort_all_requests": False}


def _split_by_pause(requests: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    groups: list[list[dict[str, Any]]] = []
    for request in requests:
        if request["path"] == "/pause_generation":
            groups.append([])
        groups[-1].append(request)
    return groups


def recorded(url: str) -> tuple[list[dict[str, Any]], dict[str, str]]:
    """What the fake engine saw: its requests in order and the sha256 of every tensor it received."""
    return httpx.get(f"{url}/_requests").json(), httpx.get(f"{url}/_tensors").json()


def start_fake_engine(log_dir: Path, device: str) -> tuple[ServiceProcess, str]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    process = ServiceProcess(
        [sys.executable, str(FAKE_ENGINE), "--port", str(port), "--device", device],
        ready_url=f"{url}/health",
        log_path=log_dir / "fake-sglang.log",
    )
    return process.start(), url


@pytest.mark.integration
async def test_nccl_transport_request_shapes_and_order_over_gloo(tiny_model_dir: Path, tmp_path: Path) -> None:
    process, url = start_fake_engine(tmp_path, "cpu")
    try:
        trainer = TinyTrainer(tiny_model_dir, lr=1e-4)
        states = await roll_versions(trainer, url, backend="gloo", device="cpu", num_versions=5)
        requests, received = recorded(url)
    finally:
        process.stop()
    check_requests(requests, states, "gloo")
    last = states[max(states)]
    assert received == {
        n: hashlib.sha256(t.reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest() for n, t in last.items()
    }


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
async def test_nccl_transport_broadcasts_over_real_nccl(tiny_model_dir: Path, tmp_path: Path) -> None:
    process, url = start_fake_engine(tmp_path, "cuda:1")
    try:
        torch.cuda.set_device(0)
        trainer = TinyTrainer(tiny_model_dir, lr=1e-4)
        states = await roll_versions(trainer, url, backend="nccl", device="cuda:0", num_versions=2)
        requests, received = recorded(url)
    finally:
        process.stop()
    check_requests(requests, states, "nccl")
    last = states[max(states)]
    assert received == {
        n: hashlib.sha256(t.reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest() for n, t in last.items()
    }

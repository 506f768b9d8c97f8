"""The nccl transport, driven from a trainer-like process: the exact SGLang requests, in order, against a fake
SGLang engine (test code) that really joins the weight-update group and receives every tensor by broadcast —
gloo on the CPU; real NCCL only on a machine with two GPUs (marked gpu) — and against two real CPU engines
(miles-engine --deterministic, gloo), each of which must then serve exactly the trainer's weights: its
/weights_checker digest equals the trainer's, its greedy logprobs equal miles.model's in-process, bit for bit."""

from __future__ import annotations

import hashlib
import random
import socket
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from weightsync_testkit import TinyTrainer, greedy, start_engine, stop_all, wait_ready

from miles.common.telemetry import Metrics
from miles.common.testing import ServiceProcess, free_port
from miles.common.weights import tensor_sha256, weights_digest
from miles.model import CausalLM, block_logprobs, load_model, load_named_tensors
from miles.weightsync.engines import LocalEngines
from miles.weightsync.events import EventLog
from miles.weightsync.metrics import WeightsyncMetrics
from miles.weightsync.nccl import NcclConfig
from miles.weightsync.transports import TransportDeps, make_transport

FAKE_ENGINE = Path(__file__).parent / "weightsync_fake_sglang.py"
BUCKET_BYTES = 8 << 20


VersionCheck = Callable[[int, dict[str, torch.Tensor]], None]


async def roll_versions(
    trainer: TinyTrainer,
    engine_urls: list[str],
    *,
    backend: str,
    device: str,
    num_versions: int,
    check: VersionCheck | None = None,
) -> dict[int, dict[str, torch.Tensor]]:
    """Train `num_versions` steps; after each, load the version into every engine and run `check` on it."""
    states: dict[int, dict[str, torch.Tensor]] = {}
    master_port = free_consecutive_ports(len(engine_urls))
    config = NcclConfig("127.0.0.1", master_port, backend=backend, bucket_bytes=BUCKET_BYTES, timeout_s=120)
    transport = make_transport(
        "nccl",
        TransportDeps(nccl_config=config, nccl_weights=lambda v: {n: t.to(device) for n, t in states[v].items()}),
    )
    engines = LocalEngines(
        engine_urls,
        router=None,
        metrics=WeightsyncMetrics(Metrics("weightsync")),
        events=EventLog(100),
        request_timeout_s=120,
    )
    for _ in range(num_versions):
        version = trainer.step()
        states[version] = trainer.bf16_state()
        for engine_url in engine_urls:
            outcome = await engines.update(engine_url, version, transport, "retract", 300)
            assert not outcome.update_failed, outcome.error
            assert outcome.weight_version == version
        if check is not None:
            check(version, states[version])
    await transport.close()  # type: ignore[attr-defined]
    await engines.close()
    return states


def free_consecutive_ports(count: int) -> int:
    """A port p such that p .. p + count - 1 were all free a moment ago (engine i rendezvouses at p + i)."""
    for _ in range(100):
        base = free_port()
        try:
            for offset in range(1, count):
                with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
                    sock.bind(("127.0.0.1", base + offset))
        except OSError:
            continue
        return base
    raise RuntimeError(f"no {count} consecutive free ports")


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
        for index, body in enumerate(updates):
            last = index == len(updates) - 1
            assert set(body) == {
                "names",
                "dtypes",
                "shapes",
                "group_name",
                "flush_cache",
                "abort_all_requests",
                "weight_version",
            }
            # Only the last bucket sets the version and flushes the prefix cache (old KV must not serve new weights).
            assert body["group_name"] == init["group_name"] and body["flush_cache"] is last
            assert body["weight_version"] == (str(version) if last else None)
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
        states = await roll_versions(trainer, [url], backend="gloo", device="cpu", num_versions=5)
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
        states = await roll_versions(trainer, [url], backend="nccl", device="cuda:0", num_versions=2)
        requests, received = recorded(url)
    finally:
        process.stop()
    check_requests(requests, states, "nccl")
    last = states[max(states)]
    assert received == {
        n: hashlib.sha256(t.reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest() for n, t in last.items()
    }


NUM_TOKENS = 4
GROUP_NAME = NcclConfig("127.0.0.1", 0).group_name


def fixed_prompts() -> list[list[int]]:
    """The same prompts at every version: the last bucket of each update flushes the prefix cache, so a prompt
    cached under the previous version must not be served from that version's KV."""
    rng = random.Random(0)
    return [[rng.randrange(1000, 150000) for _ in range(length)] for length in (8, 13)]


@torch.inference_mode()
def reference_greedy(model: CausalLM, prompt: list[int]) -> dict[str, Any]:
    """Greedy tokens and logprobs computed in this process by miles.model (deterministic mode)."""
    ids = list(prompt)
    logprobs = []
    for _ in range(NUM_TOKENS):
        hidden = model(torch.tensor(ids), deterministic=True)
        row = block_logprobs(model, hidden[-1:], torch.ones(1), deterministic=True)[0]
        ids.append(int(row.argmax()))
        logprobs.append(float(row[ids[-1]]))
    return {"output_ids": ids[len(prompt) :], "logprobs": logprobs}


def bf16_digest(state: dict[str, torch.Tensor]) -> str:
    raw = {name: t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() for name, t in state.items()}
    return weights_digest({name: tensor_sha256(data) for name, data in raw.items()})


@pytest.mark.integration
async def test_nccl_transport_updates_two_real_cpu_engines_bit_exact(tiny_model_dir: Path, tmp_path: Path) -> None:
    procs = [start_engine(tiny_model_dir, tmp_path, "--deterministic") for _ in range(2)]
    reference = load_model(tiny_model_dir)
    checked: list[int] = []

    def check(version: int, state: dict[str, torch.Tensor]) -> None:
        load_named_tensors(reference, state, require_all=True)
        prompts = fixed_prompts()
        expected = [reference_greedy(reference, prompt) for prompt in prompts]
        for proc in procs:
            reply = httpx.post(f"{proc.url}/weights_checker", json={"action": "checksum", "dtype": "bfloat16"})
            payload = reply.json()["payload"]
            assert payload["weight_version"] == str(version)
            assert payload["digest"] == bf16_digest(state) and payload["exact"] is True
            for prompt, wanted in zip(prompts, expected, strict=True):
                served = greedy(proc.url, prompt, NUM_TOKENS)
                assert served == {**wanted, "weight_version": str(version)}
        checked.append(version)

    try:
        wait_ready(procs, "/readyz")
        trainer = TinyTrainer(tiny_model_dir, lr=1e-3)
        urls = [proc.url for proc in procs]
        await roll_versions(trainer, urls, backend="gloo", device="cpu", num_versions=3, check=check)
        async with httpx.AsyncClient(timeout=60) as client:  # the transport destroyed each engine's group on close
            again = [
                await client.post(f"{url}/destroy_weights_update_group", json={"group_name": f"{GROUP_NAME}-{i}"})
                for i, url in enumerate(urls)
            ]
    finally:
        stop_all(procs)
    assert checked == [1, 2, 3]
    assert [reply.status_code for reply in again] == [400, 400]

"""`EngineSettings.device` on a machine without a GPU: the setting's spellings, the start-up errors for a GPU that
cannot be used, the process-wide settings of deterministic mode on CUDA, where weight-update groups receive, and the
torch runner run through its device path with device "cpu" against miles.model computed apart.
(The same on a GPU: test_engine_cuda.py, marked gpu.)"""

from __future__ import annotations

import asyncio
import base64
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from pydantic import ValidationError

from miles.common.errors import ConfigError
from miles.common.settings import load_settings
from miles.common.telemetry import Metrics
from miles.engine import device as engine_device
from miles.engine.core import Engine
from miles.engine.distributed import _device_for
from miles.engine.errors import WeightUpdateError
from miles.engine.info import server_info
from miles.engine.main import build_engine, main, parse_flags
from miles.engine.protocol import GenerateRequest
from miles.engine.settings import EngineSettings
from miles.model import encode_safetensors_bytes, load_model, sequence_logprobs

no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the start-up error of a machine without CUDA")
_rng = random.Random(11)


def fresh_prompt(n: int) -> list[int]:
    return [_rng.randrange(1000, 150000) for _ in range(n)]


@pytest.mark.parametrize("value", ["cpu", "cuda", "cuda:0", "cuda:7"])
def test_device_setting_accepts_cpu_cuda_and_an_indexed_cuda_device(tmp_path: Path, value: str) -> None:
    assert EngineSettings(model_path=tmp_path, device=value).device == value


@pytest.mark.parametrize("value", ["gpu", "CUDA", "cuda:", "cuda:x", "cuda:0,1", "mps", ""])
def test_device_setting_refuses_other_spellings(tmp_path: Path, value: str) -> None:
    with pytest.raises(ValidationError, match="device"):
        EngineSettings(model_path=tmp_path, device=value)


def test_fake_model_refuses_a_gpu_device_it_would_ignore(tmp_path: Path) -> None:
    with pytest.raises(ValidationError, match="fake_model runs on the CPU only"):
        EngineSettings(model_path=tmp_path, fake_model=True, device="cuda")
    assert EngineSettings(model_path=tmp_path, fake_model=True).device == "cpu"


def test_device_comes_from_the_environment_and_the_flag_wins(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MILES_ENGINE_DEVICE", "cuda:1")
    assert load_settings(EngineSettings, model_path=tmp_path).device == "cuda:1"
    flags = parse_flags(["--model-path", str(tmp_path), "--device", "cuda:2"])
    assert load_settings(EngineSettings, **flags).device == "cuda:2"


@no_cuda
def test_cuda_device_without_cuda_stops_the_start_up_before_loading_weights(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_load(*args: Any) -> None:
        raise AssertionError("weights were read before the device was checked")

    monkeypatch.setattr("miles.engine.torch_runner.load_model", no_load)
    with pytest.raises(SystemExit) as stopped:
        main(["--model-path", str(tiny_model_dir), "--device", "cuda"])
    assert "needs CUDA, but torch.cuda.is_available() is false" in str(stopped.value.code)
    with pytest.raises(ConfigError, match="use device 'cpu'") as error:
        build_engine(EngineSettings(model_path=tiny_model_dir, device="cuda:0"), Metrics("engine"))
    assert error.value.field == "device"


def test_cuda_index_beyond_the_visible_gpus_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """The index checks, with torch told that one GPU is visible (nothing touches a real GPU)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    assert engine_device.resolve_device("cuda:0") == torch.device("cuda", 0)
    assert engine_device.resolve_device("cuda") == torch.device("cuda", 0)  # the current device, with its index
    with pytest.raises(ConfigError, match=r"'cuda:1': only 1 CUDA device\(s\) are visible"):
        engine_device.resolve_device("cuda:1")
    assert engine_device.resolve_device("cpu") == torch.device("cpu")


@pytest.fixture
def restore_determinism(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    previous = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled())
    yield
    torch.use_deterministic_algorithms(previous[0], warn_only=previous[1])


def test_cuda_determinism_sets_the_cublas_workspace_and_deterministic_algorithms(
    restore_determinism: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    applied = engine_device.configure_cuda_determinism()
    assert applied["cublas_workspace_config"] == ":4096:8"
    assert torch.are_deterministic_algorithms_enabled()
    assert torch.is_deterministic_algorithms_warn_only_enabled()  # an op without a deterministic kernel warns
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":16:8")  # an operator's own choice is kept
    assert engine_device.configure_cuda_determinism()["cublas_workspace_config"] == ":16:8"


def test_cpu_runner_leaves_the_process_wide_determinism_settings_alone(
    tiny_model_dir: Path, restore_determinism: None
) -> None:
    torch.use_deterministic_algorithms(False)
    engine, _ = build_engine(EngineSettings(model_path=tiny_model_dir, deterministic=True), Metrics("engine"))
    engine.scheduler.stop()
    assert not torch.are_deterministic_algorithms_enabled()


def test_update_groups_receive_where_the_backend_and_the_engine_compute(monkeypatch: pytest.MonkeyPatch) -> None:
    assert _device_for("gloo", "cpu") == "cpu"
    assert _device_for("gloo", "cuda:1") == "cpu"  # gloo moves CPU memory; the swap copies to the GPU
    if not torch.cuda.is_available():
        with pytest.raises(WeightUpdateError, match="use backend 'gloo'"):
            _device_for("nccl", "cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert _device_for("nccl", "cuda:1") == "cuda:1"  # straight onto the engine's own GPU
    with pytest.raises(WeightUpdateError, match="not supported"):
        _device_for("mpi", "cpu")


async def generate(engine: Engine, **body: Any) -> Any:
    return await engine.generate(engine.plan(GenerateRequest(**body)))


def sampled(prompt: list[int], seed: int, **params: Any) -> dict[str, Any]:
    sampling = {"max_new_tokens": 6, "temperature": 1.0, "sampling_seed": seed, "ignore_eos": True, **params}
    return {"input_ids": prompt, "sampling_params": sampling, "return_logprob": True, "top_logprobs_num": 2}


async def test_cpu_device_runner_matches_miles_model_through_its_device_path(tiny_model_dir: Path) -> None:
    """device "cpu" given explicitly: greedy, plain and filtered sampling batched together, then a prefix-cache hit
    fed as a multi-token prefill; deterministic logprobs equal miles.model's recomputation bit for bit."""
    settings = EngineSettings(model_path=tiny_model_dir, deterministic=True, device="cpu")
    engine, served = build_engine(settings, Metrics("engine"))
    try:
        assert engine.runner.device == "cpu"
        assert server_info(engine, settings, served)["device"] == "cpu"
        prompts = [fresh_prompt(n) for n in (5, 13, 21)]
        bodies = [
            sampled(prompts[0], 0, temperature=0.0),
            sampled(prompts[1], 1, temperature=0.7),
            sampled(prompts[2], 2, top_k=40, top_p=0.9, min_p=0.01),
        ]
        replies = list(await asyncio.gather(*(generate(engine, **b) for b in bodies)))
        follow = prompts[1] + replies[1]["output_ids"] + fresh_prompt(4)
        bodies.append(sampled(follow, 3, temperature=0.7))
        replies.append(await generate(engine, **bodies[-1]))
        assert replies[-1]["meta_info"]["cached_tokens"] == len(prompts[1]) + 5  # prompt + output but the last
        reference = load_model(tiny_model_dir)
        for body, reply in zip(bodies, replies, strict=True):
            prompt, temperature = body["input_ids"], body["sampling_params"]["temperature"] or 1.0
            ids = torch.tensor(prompt + reply["output_ids"])
            with torch.inference_mode():
                expected = sequence_logprobs(
                    reference, ids, start=len(prompt), temperature=temperature, deterministic=True
                )
            assert [e[0] for e in reply["meta_info"]["output_token_logprobs"]] == expected.tolist()
            assert all(len(top) == 2 for top in reply["meta_info"]["output_top_logprobs"])
    finally:
        engine.scheduler.stop()


async def test_cpu_device_runner_swaps_weights_and_checksums_cpu_copies(tiny_model_dir: Path) -> None:
    engine, _ = build_engine(EngineSettings(model_path=tiny_model_dir, device="cpu"), Metrics("engine"))
    try:
        name = "model.norm.weight"
        new = torch.full_like(dict(engine.runner.model.named_parameters())[name], 0.5)  # type: ignore[attr-defined]
        payload = base64.b64encode(encode_safetensors_bytes({name: new})).decode()
        await engine.update_weights_from_tensor([payload], None, weight_version="1", abort_all=False, flush_cache=True)
        snapshot = engine.runner.snapshot_weights()
        assert snapshot[name].device.type == "cpu" and torch.equal(snapshot[name], new)
        served = dict(engine.runner.model.named_parameters())[name]  # type: ignore[attr-defined]
        assert snapshot[name].data_ptr() != served.data_ptr()  # a copy: later swaps cannot change a checksum
        version, checksum = await engine.weights_checksum(None)
        assert (version, checksum.dtype, checksum.exact) == ("1", "float32", True)
    finally:
        engine.scheduler.stop()


def test_server_info_reports_the_runners_device(tiny_model_dir: Path) -> None:
    settings = EngineSettings(model_path=tiny_model_dir, fake_model=True)
    engine, served = build_engine(settings, Metrics("engine"))
    try:
        engine.runner.device = "cuda:3"  # what a runner on the fourth GPU reports
        assert server_info(engine, settings, served)["device"] == "cuda:3"
    finally:
        engine.scheduler.stop()

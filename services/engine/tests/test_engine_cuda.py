"""The engine on a GPU (`device: cuda`), marked gpu: skipped without CUDA (`make gpu-check` runs the same paths
end to end through the trainer).

- Deterministic logprobs of sequences generated in one batch on CUDA equal (a) miles.model's recomputation on the
  same GPU bit for bit (same shapes, same cuBLAS/torch build: the promise of miles.model.kernels) and (b) the CPU
  trainer's recomputation within `CPU_CUDA_TOLERANCE` (float32 on both; only summation orders differ).
- The KV cache (prefix hits included), routed experts and swapped-in weights live on the GPU; responses come back
  as CPU numbers.
"""

from __future__ import annotations

import asyncio
import base64
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from miles.common.telemetry import Metrics
from miles.engine.core import Engine
from miles.engine.info import server_info
from miles.engine.main import build_engine
from miles.engine.protocol import GenerateRequest
from miles.engine.settings import EngineSettings
from miles.model import CausalLM, Segment, encode_safetensors_bytes, load_model, sequence_logprobs

pytestmark = pytest.mark.gpu
CPU_CUDA_TOLERANCE = 1e-3
"""Largest |CUDA engine logprob - CPU trainer logprob| accepted, in nats. Both compute in float32 and differ only in
summation order (~1e-6 relative per op); on the 4-layer tiny model the difference is expected near 1e-5. The
margin covers deeper models; a real divergence (wrong weights, wrong token, lost determinism) is far larger."""
_rng = random.Random(29)


def fresh_prompt(n: int) -> list[int]:
    return [_rng.randrange(1000, 150000) for _ in range(n)]


@pytest.fixture
def cuda_engines() -> Iterator[list[tuple[Engine, EngineSettings, Any]]]:
    """In-process engines built by the test; deterministic-mode settings are restored afterwards."""
    previous = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled())
    built: list[tuple[Engine, EngineSettings, Any]] = []
    yield built
    for engine, _, _ in built:
        engine.scheduler.stop()
    torch.use_deterministic_algorithms(previous[0], warn_only=previous[1])


def start(built: list[tuple[Engine, EngineSettings, Any]], model_dir: Path, **fields: Any) -> Engine:
    settings = EngineSettings(model_path=model_dir, device="cuda", deterministic=True, **fields)
    engine, served = build_engine(settings, Metrics("engine"))
    built.append((engine, settings, served))
    return engine


async def generate(engine: Engine, **body: Any) -> Any:
    return await engine.generate(engine.plan(GenerateRequest(**body)))


def body(prompt: list[int], seed: int, **extra: Any) -> dict[str, Any]:
    params = {"max_new_tokens": 12, "temperature": 1.0, "sampling_seed": seed, "ignore_eos": True}
    return {"input_ids": prompt, "sampling_params": params, "return_logprob": True, **extra}


def recompute(model: CausalLM, prompt: list[int], output: list[int]) -> list[float]:
    ids = torch.tensor(prompt + output, device=model.lm_head_weight.device)
    with torch.inference_mode():
        return sequence_logprobs(model, ids, start=len(prompt), deterministic=True).cpu().tolist()


async def test_cuda_engine_logprobs_equal_the_gpu_recomputation_and_the_cpu_trainers_within_tolerance(
    tiny_model_dir: Path, cuda_engines: list[Any]
) -> None:
    engine = start(cuda_engines, tiny_model_dir)
    _, settings, served = cuda_engines[0]
    device = engine.runner.device
    assert device.startswith("cuda:") and server_info(engine, settings, served)["device"] == device
    assert torch.are_deterministic_algorithms_enabled()
    prompts = [fresh_prompt(n) for n in (4, 9, 17, 30, 41, 6, 23, 12)]
    replies = await asyncio.gather(*(generate(engine, **body(p, i)) for i, p in enumerate(prompts)))
    gpu_model, cpu_model = load_model(tiny_model_dir).to(device), load_model(tiny_model_dir)
    worst = 0.0
    for prompt, reply in zip(prompts, replies, strict=True):
        served_logprobs = [entry[0] for entry in reply["meta_info"]["output_token_logprobs"]]
        assert len(served_logprobs) == 12
        assert served_logprobs == recompute(gpu_model, prompt, reply["output_ids"])  # same GPU: bit for bit
        cpu = recompute(cpu_model, prompt, reply["output_ids"])
        worst = max(worst, max(abs(a - b) for a, b in zip(served_logprobs, cpu, strict=True)))
    assert worst <= CPU_CUDA_TOLERANCE, f"CUDA engine vs CPU trainer: max |diff| {worst:.3g} nats"


async def test_cuda_prefix_cache_hit_gives_the_cold_logprobs(tiny_model_dir: Path, cuda_engines: list[Any]) -> None:
    """KV blocks cached on the GPU feed a multi-token prefill: the same tokens and bits as computing it all cold."""
    engine = start(cuda_engines, tiny_model_dir)
    prompt = fresh_prompt(20)
    cold = await generate(engine, **body(prompt, 1))
    follow = prompt + cold["output_ids"] + fresh_prompt(5)
    warm = await generate(engine, **body(follow, 2))
    assert warm["meta_info"]["cached_tokens"] == len(prompt) + 11  # prompt + output but the last token
    assert await engine.flush_cache()
    again = await generate(engine, **body(follow, 2))
    assert again["meta_info"]["cached_tokens"] == 0
    assert again["output_ids"] == warm["output_ids"]
    assert again["meta_info"]["output_token_logprobs"] == warm["meta_info"]["output_token_logprobs"]


async def test_cuda_moe_routed_experts_equal_a_gpu_forward_of_the_whole_sequence(
    tiny_moe_model_dir: Path, cuda_engines: list[Any]
) -> None:
    engine = start(cuda_engines, tiny_moe_model_dir, enable_return_routed_experts=True)
    prompt = fresh_prompt(15)
    reply = await generate(engine, **body(prompt, 3, return_routed_experts=True))
    rows = np.frombuffer(base64.b64decode(reply["meta_info"]["routed_experts"]), dtype="<i4")
    model = load_model(tiny_moe_model_dir).to(engine.runner.device)
    ids = torch.tensor(prompt + reply["output_ids"], device=engine.runner.device)
    with torch.inference_mode():
        expected = model.forward_routed([Segment(ids)], deterministic=True).routed_experts[:-1]
    np.testing.assert_array_equal(rows.reshape(expected.shape), expected.cpu().numpy())


async def test_cuda_weight_swap_lands_on_the_gpu_and_the_checksum_reads_it(
    tiny_model_dir: Path, cuda_engines: list[Any]
) -> None:
    engine = start(cuda_engines, tiny_model_dir)
    name = "model.norm.weight"
    new = torch.full((64,), 0.5)
    payload = base64.b64encode(encode_safetensors_bytes({name: new})).decode()
    await engine.update_weights_from_tensor([payload], None, weight_version="1", abort_all=False, flush_cache=True)
    served = dict(engine.runner.model.named_parameters())[name]  # type: ignore[attr-defined]
    assert str(served.device) == engine.runner.device and torch.equal(served.cpu(), new)
    version, checksum = await engine.weights_checksum(None)
    assert (version, checksum.exact) == ("1", True)
    reply = await generate(engine, **body(fresh_prompt(8), 4))
    assert reply["meta_info"]["weight_version"] == "1"

"""PoolAdapters against real miles-engine processes with --enable-lora: a job's adapter versions are loaded into
every engine by name while the engines serve, old versions are retired, other jobs' adapters are left alone."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from safetensors.torch import load_file
from weightsync_testkit import Proc, start_engine, stop_all, wait_ready

from miles.weightsync.adapters import ADAPTER_CONFIG_FILE, ADAPTER_WEIGHTS_FILE, PoolAdapters, write_adapter_dir

pytestmark = [pytest.mark.integration]

PROMPT = [5, 17, 42, 9, 3, 11]


def adapter_version(model_dir: Path, seed: int) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """A PEFT adapter of the tiny model (q_proj and v_proj, r 4) with random non-zero A and B: its tensors as the
    trainer publishes them and its adapter_config.json."""
    import peft
    import transformers

    torch.manual_seed(seed)
    base = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    config = peft.LoraConfig(init_lora_weights=False, r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    model = peft.get_peft_model(base, config)
    state = peft.get_peft_model_state_dict(model)
    return {name: t.detach().clone() for name, t in state.items()}, model.peft_config["default"].to_dict()


@pytest.fixture(scope="module")
def engines(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[str]]:
    log_dir = tmp_path_factory.mktemp("adapter-engines")
    procs: list[Proc] = [
        start_engine(tiny_model_dir, log_dir, "--enable-lora", "--max-loras-per-batch", "4", "--deterministic")
        for _ in range(2)
    ]
    try:
        wait_ready(procs, "/health")
        yield [proc.url for proc in procs]
    finally:
        stop_all(procs)


def generate(url: str, lora_path: str | None) -> httpx.Response:
    body: dict[str, Any] = {
        "input_ids": PROMPT,
        "sampling_params": {"max_new_tokens": 4, "temperature": 0.0, "ignore_eos": True},
        "return_logprob": True,
        "lora_path": lora_path,
    }
    return httpx.post(f"{url}/generate", json=body, timeout=120.0)


def logprobs(url: str, lora_path: str | None) -> list[float]:
    response = generate(url, lora_path)
    assert response.status_code == 200, response.text
    return [entry[0] for entry in response.json()["meta_info"]["output_token_logprobs"]]


def test_versions_load_everywhere_serve_their_own_weights_and_old_ones_retire(
    engines: list[str], tiny_model_dir: Path, tmp_path: Path
) -> None:
    paths = []
    for version in range(3):
        tensors, config = adapter_version(tiny_model_dir, seed=10 + version)
        path = tmp_path / f"adapter-v{version:06d}"
        write_adapter_dir(path, tensors, config)
        paths.append(path)
    written = load_file(str(paths[0] / ADAPTER_WEIGHTS_FILE))
    assert set(written) == set(adapter_version(tiny_model_dir, seed=10)[0])
    assert (paths[0] / ADAPTER_CONFIG_FILE).exists()

    async def scenario() -> None:
        job = PoolAdapters("job-a", None, engines, timeout_s=60.0, keep_loaded=2)
        other = PoolAdapters("job-b", None, engines, timeout_s=60.0, keep_loaded=2)
        try:
            assert not [load for load in await other.roll(7, paths[2]) if load.failed]
            for version in range(3):
                loads = await job.roll(version, paths[version])
                assert [load.engine_url for load in loads] == engines and not [x for x in loads if x.failed], loads
                # A retry (or a restarted trainer) loading a version that is there is no failure.
                assert not [load for load in await job.roll(version, paths[version]) if load.failed]
                assert await job.retire(version) == (len(engines) if version == 2 else 0)
        finally:
            await job.close()
            await other.close()

    asyncio.run(scenario())
    for url in engines:
        base = logprobs(url, None)
        v1, v2, other = logprobs(url, "job-a@1"), logprobs(url, "job-a@2"), logprobs(url, "job-b@7")
        assert v1 != base and v2 != v1, "each version serves its own adapter"
        assert other == v2, "job-b@7 was loaded from the same directory as job-a@2"
        retired = generate(url, "job-a@0")
        assert retired.status_code == 400 and "not loaded" in retired.text, retired.text
    # Both engines serve a version with the same numbers (deterministic engines, one adapter file).
    assert logprobs(engines[0], "job-a@2") == logprobs(engines[1], "job-a@2")


def test_an_engine_that_cannot_be_reached_fails_its_load(
    engines: list[str], tiny_model_dir: Path, tmp_path: Path
) -> None:
    tensors, config = adapter_version(tiny_model_dir, seed=3)
    write_adapter_dir(tmp_path / "v0", tensors, config)

    async def scenario() -> list[Any]:
        adapters = PoolAdapters("job-c", None, [engines[0], "http://127.0.0.1:9"], timeout_s=5.0)
        try:
            return await adapters.roll(0, tmp_path / "v0")
        finally:
            await adapters.close()

    loads = asyncio.run(scenario())
    assert [load.failed for load in loads] == [False, True], loads
    assert "127.0.0.1:9" in loads[1].error

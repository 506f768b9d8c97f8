"""LoRA adapters over their life on a shared engine: unloading while requests run on them (SGLang's semantics:
they finish, never aborted), a load waiting for the room of an adapter still unloading, and what the engine
reports about its adapters (/v1/loads, /server_info, /metrics).

Adapters are written by hand in PEFT's layout (random A and B of the tiny model's q_proj and v_proj): these tests
compare an engine with itself (deterministic mode), so no PEFT reference is needed. In-process engines.
"""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from safetensors.torch import load_file, save_file

from miles.engine.core import Engine
from miles.engine.protocol import GenerateRequest

Client = tuple[Engine, httpx.AsyncClient]
_rng = random.Random(11)
PROMPT = [_rng.randrange(1000, 150000) for _ in range(12)]
LONG_NEW_TOKENS = 48
"""Enough decode steps that a pause sent after the first streamed token lands mid-generation."""


def write_adapter(model_dir: Path, out: Path, seed: int, rank: int = 4) -> Path:
    """A PEFT LoRA adapter directory of the model in model_dir: random A and B for every q_proj and v_proj."""
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, weight in load_file(str(model_dir / "model.safetensors")).items():
        module = name.removesuffix(".weight")
        if module.split(".")[-1] in ("q_proj", "v_proj"):
            out_features, in_features = weight.shape
            prefix = f"base_model.model.{module}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, in_features, generator=generator) * 0.3
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(out_features, rank, generator=generator) * 0.3
    out.mkdir(parents=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": ["q_proj", "v_proj"]}
    (out / "adapter_config.json").write_text(json.dumps(config))
    return out


@pytest.fixture(scope="module")
def adapter_dirs(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    root = tmp_path_factory.mktemp("adapters")
    return [write_adapter(tiny_model_dir, root / f"adapter-{seed}", seed) for seed in range(3)]


def long_body(n: int = 1, **extra: Any) -> dict[str, Any]:
    """Greedy, exactly LONG_NEW_TOKENS tokens, with output logprobs."""
    sampling = {"max_new_tokens": LONG_NEW_TOKENS, "temperature": 0, "ignore_eos": True, "n": n}
    return {"input_ids": PROMPT, "sampling_params": sampling, "return_logprob": True, **extra}


def numbers(reply: dict[str, Any]) -> tuple[Any, ...]:
    meta = reply["meta_info"]
    return meta["finish_reason"]["type"], reply["output_ids"], meta["output_token_logprobs"]


async def load(client: httpx.AsyncClient, name: str, path: Path) -> None:
    reply = await client.post("/load_lora_adapter", json={"lora_name": name, "lora_path": str(path)})
    assert reply.status_code == 200, reply.text


async def generate(client: httpx.AsyncClient, body: dict[str, Any]) -> dict[str, Any]:
    reply = await client.post("/generate", json=body)
    assert reply.status_code == 200, reply.text
    result: dict[str, Any] = reply.json()
    return result


async def until(condition: Callable[[], bool], timeout_s: float = 30.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.01)


async def still_pending(task: asyncio.Task[Any], for_s: float = 0.3) -> bool:
    await asyncio.sleep(for_s)
    return not task.done()


async def test_unload_lets_a_running_generation_finish_with_its_adapter(
    lora_client: Client, adapter_dirs: list[Path]
) -> None:
    engine, client = lora_client
    await load(client, "job@1", adapter_dirs[0])
    reference = numbers(await generate(client, long_body(lora_path="job@1")))
    assert reference[0] == "length"
    assert reference != numbers(await generate(client, long_body())), "the adapter changed nothing"
    assert (await client.post("/flush_cache")).status_code == 200

    stream = engine.stream(engine.plan(GenerateRequest(**long_body(lora_path="job@1", stream=True))))
    chunks = [await anext(stream)]
    assert (await client.post("/pause_generation", json={"mode": "in_place"})).status_code == 200
    assert engine.scheduler.snapshot().num_running_reqs == 1, "the generation ended before the unload"
    unload = asyncio.create_task(client.post("/unload_lora_adapter", json={"lora_name": "job@1"}))
    await until(lambda: "job@1" not in engine.adapters.loaded)
    refused = await client.post("/generate", json=long_body(lora_path="job@1"))
    assert refused.status_code == 400 and "not loaded: job@1" in refused.json()["error"]["message"]
    assert await still_pending(unload), "the unload did not wait for the running generation"
    assert (await client.post("/continue_generation", json={})).status_code == 200
    chunks += [chunk async for chunk in stream]
    assert numbers(chunks[-1]) == reference, "the generation did not finish as it would have without the unload"
    unloaded = await unload
    assert unloaded.status_code == 200 and unloaded.json()["loaded_adapters"] == {}
    assert engine.scheduler.snapshot().num_cached_tokens == 0, "the unloaded adapter's cache entries stayed"


async def test_a_request_planned_before_an_unload_runs_with_its_adapter(
    lora_client: Client, adapter_dirs: list[Path]
) -> None:
    engine, client = lora_client
    await load(client, "job@1", adapter_dirs[0])
    reference = numbers(await generate(client, long_body(lora_path="job@1")))
    assert (await client.post("/flush_cache")).status_code == 200
    # A stream is planned (its 200 sent) before the scheduler sees it; n > 1 also warms the prompt up first.
    streamed = engine.plan(GenerateRequest(**long_body(lora_path="job@1", stream=True)))
    sampled = engine.plan(GenerateRequest(**long_body(n=2, lora_path="job@1")))
    unload = asyncio.create_task(client.post("/unload_lora_adapter", json={"lora_name": "job@1"}))
    await until(lambda: "job@1" not in engine.adapters.loaded)
    assert await still_pending(unload), "the unload did not wait for the planned requests"
    chunks = [chunk async for chunk in engine.stream(streamed)]
    samples = await engine.generate(sampled)
    assert numbers(chunks[-1]) == reference
    assert isinstance(samples, list) and [s["meta_info"]["finish_reason"]["type"] for s in samples] == ["length"] * 2
    assert (await unload).status_code == 200

    await load(client, "job@2", adapter_dirs[1])
    dropped = engine.plan(GenerateRequest(**long_body(lora_path="job@2", stream=True)))
    del dropped  # a stream whose client left before it started: its plan lets the adapter go when collected
    reply = await asyncio.wait_for(client.post("/unload_lora_adapter", json={"lora_name": "job@2"}), 30)
    assert reply.status_code == 200


async def test_a_load_waits_for_the_room_of_an_adapter_still_unloading(
    lora_client: Client, adapter_dirs: list[Path]
) -> None:
    engine, client = lora_client
    assert engine.adapters.max_loaded_loras == 2
    await load(client, "a@1", adapter_dirs[0])
    await load(client, "b@1", adapter_dirs[1])
    full = await client.post("/load_lora_adapter", json={"lora_name": "c@1", "lora_path": str(adapter_dirs[2])})
    assert full.status_code == 400 and "Maximum number of loaded LoRA adapters is 2" in full.json()["error_message"]
    assert (await client.post("/pause_generation", json={"mode": "in_place"})).status_code == 200
    running = asyncio.create_task(generate(client, long_body(lora_path="a@1")))  # queued until continue
    await until(lambda: engine.scheduler.snapshot().num_waiting_reqs == 1)
    unload = asyncio.create_task(client.post("/unload_lora_adapter", json={"lora_name": "a@1"}))
    await until(lambda: engine.adapters.num_unloading == 1)
    waiting = asyncio.create_task(load(client, "c@1", adapter_dirs[2]))
    assert await still_pending(waiting), "a load took the room of an adapter still serving a request"
    other = await client.post("/unload_lora_adapter", json={"lora_name": "b@1"})  # not behind the pending unload
    assert other.status_code == 200
    await waiting
    assert (await client.post("/continue_generation", json={})).status_code == 200
    assert numbers(await running)[0] == "length"
    assert (await unload).status_code == 200
    assert engine.adapters.loaded == {"c@1": str(adapter_dirs[2])}


async def test_loads_and_server_info_report_the_adapters(lora_client: Client, adapter_dirs: list[Path]) -> None:
    _, client = lora_client
    await load(client, "job@1", adapter_dirs[0])
    core = (await client.get("/v1/loads")).json()["loads"][0]
    assert "lora" not in core
    for include in ("lora", "core,lora", "all"):
        section = (await client.get("/v1/loads", params={"include": include})).json()["loads"][0]["lora"]
        assert section == {
            "slots_used": 1,
            "slots_total": 2,
            "utilization": 0.5,
            "loaded_adapters": {"job@1": str(adapter_dirs[0])},
            "num_unloading_adapters": 0,
        }
    for path in ("/server_info", "/get_server_info"):
        info = (await client.get(path)).json()
        assert info["enable_lora"] is True and info["lora_paths"] == []
        assert (info["max_loras_per_batch"], info["max_loaded_loras"], info["max_lora_rank"]) == (2, 2, 8)
        assert info["lora_target_modules"] is None
        assert info["loaded_lora_adapters"] == {"job@1": str(adapter_dirs[0])}


def _samples(exposition: str, name: str) -> dict[str, float]:
    """Value per label set (the text between braces) of one metric in a Prometheus exposition."""
    values = {}
    for line in exposition.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            labels, _, value = line[len(name) :].rpartition(" ")
            values[labels] = float(value)
    return values


async def test_metrics_count_adapters_loads_unloads_and_tokens_per_job(
    lora_client: Client, adapter_dirs: list[Path]
) -> None:
    _, client = lora_client

    async def scrape(name: str) -> dict[str, float]:
        return _samples((await client.get("/metrics")).text, name)

    short = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 3, "temperature": 0, "ignore_eos": True}}
    await load(client, "job-a@1", adapter_dirs[0])
    await load(client, "not-a-version", adapter_dirs[1])
    for lora_path in ("job-a@1", "not-a-version", None):
        await generate(client, {**short, "lora_path": lora_path})
    expected = {'{job="job-a"}': 3.0, '{job="other"}': 3.0, '{job="base"}': 3.0}
    for _ in range(200):  # a request's tokens are counted when the scheduler ends it, just after its answer
        tokens = await scrape("miles_engine_generated_tokens_total")
        if tokens == expected:
            break
        await asyncio.sleep(0.05)
    assert tokens == expected
    assert await scrape("miles_engine_loaded_lora_adapters") == {"": 2.0}
    assert await scrape("miles_engine_lora_adapter_slots") == {'{job="job-a"}': 1.0, '{job="other"}': 1.0}
    await client.post("/unload_lora_adapter", json={"lora_name": "not-a-version"})
    await client.post("/unload_lora_adapter", json={"lora_name": "missing"})
    await load(client, "job-a@2", adapter_dirs[2])
    await client.post("/unload_lora_adapter", json={"lora_name": "job-a@1"})
    assert '{job="job-a"}' in await scrape("miles_engine_generated_tokens_total"), "job-a@2 is still loaded"
    assert await scrape("miles_engine_lora_adapter_slots") == {'{job="job-a"}': 1.0}
    await client.post("/unload_lora_adapter", json={"lora_name": "job-a@2"})
    assert await scrape("miles_engine_generated_tokens_total") == {'{job="base"}': 3.0}
    assert await scrape("miles_engine_loaded_lora_adapters") == {"": 0.0}
    assert await scrape("miles_engine_lora_adapter_slots") == {}
    assert await scrape("miles_engine_lora_adapter_loads_total") == {'{outcome="ok"}': 3.0}
    unloads = await scrape("miles_engine_lora_adapter_unloads_total")
    assert unloads == {'{outcome="ok"}': 3.0, '{outcome="refused"}': 1.0}

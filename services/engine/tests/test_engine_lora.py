"""Several LoRA adapters served at once on the tiny model (SGLang's LoRA API), against references built by `peft`.

Adapters are real PEFT adapters (random non-zero A and B, saved by `save_pretrained`) of the tiny model loaded by
transformers in float32. The reference for an adapter is a fresh deterministic engine whose checkpoint holds PEFT's
own merge of that adapter (`merge_and_unload`): a request with the adapter must give the same tokens and logprobs
bit for bit, alone or in flight with requests of other adapters and of the base model. In-process engines (the
real app over ASGI, the real scheduler thread and model): no process is started.
"""

from __future__ import annotations

import asyncio
import json
import random
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from safetensors.torch import load_file, save_file

from miles.common.errors import ConfigError
from miles.common.telemetry import Metrics
from miles.engine.core import Engine
from miles.engine.main import build_engine, create_app, parse_flags
from miles.engine.protocol import GenerateRequest
from miles.engine.settings import EngineSettings

ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
_rng = random.Random(7)
PROMPTS = [[_rng.randrange(1000, 150000) for _ in range(n)] for n in (5, 17, 33)]


def scoring(prompt: list[int], **extra: Any) -> dict[str, Any]:
    """Greedy generation with every logprob (input ones too), so results can be compared bit for bit."""
    body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": 6, "temperature": 0}}
    return {**body, "return_logprob": True, "logprob_start_len": 0, **extra}


def numbers(reply: dict[str, Any]) -> tuple[Any, ...]:
    meta = reply["meta_info"]
    return reply["output_ids"], meta["input_token_logprobs"], meta["output_token_logprobs"]


def _hf_model(model_dir: Path) -> Any:
    import transformers  # heavy: imported when an adapter is built, not when tests are collected

    return transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)


def make_adapter(base_dir: Path, out: Path, seed: int, **lora: Any) -> Path:
    """A PEFT LoRA adapter of the model in base_dir with random (non-zero) A and B, saved as PEFT saves it."""
    import peft

    torch.manual_seed(seed)
    config = peft.LoraConfig(init_lora_weights=False, **lora)
    model = peft.get_peft_model(_hf_model(base_dir), config)
    model.save_pretrained(str(out))
    return out


def merged_checkpoint(base_dir: Path, adapter_dir: Path, out: Path) -> Path:
    """base_dir's checkpoint with the adapter merged in by PEFT itself, as a model directory the engine loads."""
    import peft

    model = peft.PeftModel.from_pretrained(_hf_model(base_dir), adapter_dir).merge_and_unload()
    shutil.copytree(base_dir, out, ignore=shutil.ignore_patterns("*.safetensors"))
    tensors = {k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}  # tied
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


@pytest.fixture(scope="module")
def lora_dirs(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Adapters x (every projection, r 4) and y (q and v, r 8, rsLoRA), their merged checkpoints, a checkpoint
    with y merged and then x merged on top, and broken adapters for the refusals."""
    root = tmp_path_factory.mktemp("lora")
    x = make_adapter(tiny_model_dir, root / "x", 1, r=4, lora_alpha=8, target_modules=ALL_TARGETS)
    y = make_adapter(
        tiny_model_dir, root / "y", 2, r=8, lora_alpha=4, use_rslora=True, target_modules=["q_proj", "v_proj"]
    )
    dirs = {"x": x, "y": y}
    dirs["merged_x"] = merged_checkpoint(tiny_model_dir, x, root / "merged-x")
    dirs["merged_y"] = merged_checkpoint(tiny_model_dir, y, root / "merged-y")
    dirs["merged_y_then_x"] = merged_checkpoint(dirs["merged_y"], x, root / "merged-y-then-x")
    dirs["rank16"] = _edited_copy(x, root / "rank16", lambda c: {**c, "r": 16})
    dirs["lm_head"] = _edited_copy(x, root / "lm-head", lambda c: {**c, "target_modules": ["lm_head"]})
    dirs["misfit"] = make_adapter(tiny_model_dir, root / "misfit", 3, r=4, target_modules=["q_proj"])
    tensors = load_file(str(dirs["misfit"] / "adapter_model.safetensors"))
    key = next(k for k in tensors if k.endswith("lora_A.weight"))
    tensors[key] = torch.zeros(4, 48)  # the model's hidden size is 64
    save_file(tensors, str(dirs["misfit"] / "adapter_model.safetensors"))
    return dirs


def _edited_copy(adapter: Path, out: Path, edit: Callable[[dict[str, Any]], dict[str, Any]]) -> Path:
    shutil.copytree(adapter, out)
    config = json.loads((out / "adapter_config.json").read_text())
    (out / "adapter_config.json").write_text(json.dumps(edit(config)))
    return out


def build(model_dir: Path, **settings: Any) -> Engine:
    engine, _ = build_engine(EngineSettings(model_path=model_dir, deterministic=True, **settings), Metrics("engine"))
    return engine


def generate_alone(engine: Engine, body: dict[str, Any]) -> Any:
    return asyncio.run(engine.generate(engine.plan(GenerateRequest(**body))))


@pytest.fixture(scope="module")
def references(tiny_model_dir: Path, lora_dirs: dict[str, Path]) -> dict[str, list[tuple[Any, ...]]]:
    """Per model (base and each merged checkpoint): the numbers of `scoring(p)` for every prompt, each run alone."""
    results = {}
    for name, model_dir in (
        ("base", tiny_model_dir),
        ("x", lora_dirs["merged_x"]),
        ("y", lora_dirs["merged_y"]),
        ("y_then_x", lora_dirs["merged_y_then_x"]),
    ):
        engine = build(model_dir)
        try:
            results[name] = [numbers(generate_alone(engine, scoring(p))) for p in PROMPTS]
        finally:
            engine.scheduler.stop()
    return results


async def load(client: httpx.AsyncClient, name: str, path: Path) -> httpx.Response:
    return await client.post("/load_lora_adapter", json={"lora_name": name, "lora_path": str(path)})


async def ok(client: httpx.AsyncClient, body: dict[str, Any]) -> Any:
    reply = await client.post("/generate", json=body)
    assert reply.status_code == 200, reply.text
    return reply.json()


async def test_adapter_requests_equal_the_merged_checkpoint_bit_for_bit(
    lora_client: tuple[Engine, httpx.AsyncClient], lora_dirs: dict[str, Path], references: dict[str, Any]
) -> None:
    _, client = lora_client
    reply = await load(client, "x", lora_dirs["x"])
    assert reply.status_code == 200, reply.text
    assert reply.json() == {"success": True, "error_message": None, "loaded_adapters": {"x": str(lora_dirs["x"])}}
    assert (await load(client, "y", lora_dirs["y"])).status_code == 200
    for name in ("x", "y"):
        served = [numbers(await ok(client, scoring(p, lora_path=name))) for p in PROMPTS]
        assert served == references[name], f"adapter {name} differs from its merged checkpoint"
        assert served != references["base"], f"adapter {name} changed nothing"


async def test_requests_of_two_adapters_and_the_base_in_flight_together_each_get_their_own_numbers(
    lora_client: tuple[Engine, httpx.AsyncClient], lora_dirs: dict[str, Path], references: dict[str, Any]
) -> None:
    _, client = lora_client
    assert (await load(client, "x", lora_dirs["x"])).status_code == 200
    assert (await load(client, "y", lora_dirs["y"])).status_code == 200
    names = ["x", "y", None]
    bodies = [scoring(p, lora_path=name) for p in PROMPTS for name in names]
    replies = await asyncio.gather(*(ok(client, b) for b in bodies))
    expected = [references[name or "base"][i] for i in range(len(PROMPTS)) for name in names]
    assert [numbers(r) for r in replies] == expected
    batch = await ok(client, {**scoring(PROMPTS[0]), "input_ids": [PROMPTS[0]] * 3, "lora_path": ["x", None, "y"]})
    assert [numbers(r) for r in batch] == [references[n][0] for n in ("x", "base", "y")]


async def test_prefix_cache_never_serves_kv_across_adapters(
    lora_client: tuple[Engine, httpx.AsyncClient], lora_dirs: dict[str, Path]
) -> None:
    engine, client = lora_client
    for name in ("x", "y"):
        assert (await load(client, name, lora_dirs[name])).status_code == 200
    prompt = [_rng.randrange(1000, 150000) for _ in range(24)]

    async def cached(lora_path: str | None, extra_key: str | None = None) -> int:
        body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": 2}, "lora_path": lora_path}
        reply = await ok(client, {**body, "extra_key": extra_key})
        return int(reply["meta_info"]["cached_tokens"])

    assert await cached(None) == 0
    assert await cached("x") == 0, "adapter x got the base model's KV"
    assert await cached("x") > 0
    assert await cached("y") == 0, "adapter y got adapter x's KV"
    assert await cached("x", extra_key="k") == 0
    assert await cached(None) > 0
    num_cached = engine.scheduler.snapshot().num_cached_tokens
    assert (await client.post("/unload_lora_adapter", json={"lora_name": "x"})).status_code == 200
    assert engine.scheduler.snapshot().num_cached_tokens < num_cached, "unloading x kept its cache entries"
    assert (await load(client, "x", lora_dirs["x"])).status_code == 200
    assert await cached("x") == 0, "a reloaded adapter met its predecessor's KV"
    assert (await client.post("/flush_cache")).status_code == 200
    assert await cached("y") == 0


async def test_an_adapter_follows_a_weight_update_of_the_base_model(
    lora_client: tuple[Engine, httpx.AsyncClient], lora_dirs: dict[str, Path], references: dict[str, Any]
) -> None:
    _, client = lora_client
    assert (await load(client, "x", lora_dirs["x"])).status_code == 200
    before = [numbers(await ok(client, scoring(p, lora_path="x"))) for p in PROMPTS]
    update = await client.post("/update_weights_from_disk", json={"model_path": str(lora_dirs["merged_y"])})
    assert update.status_code == 200, update.text
    after = [numbers(await ok(client, scoring(p, lora_path="x"))) for p in PROMPTS]
    assert before == references["x"]
    assert after == references["y_then_x"]
    assert [numbers(await ok(client, scoring(p))) for p in PROMPTS] == references["y"]


async def test_refusals_are_sglang_400s_with_a_clear_message(
    lora_client: tuple[Engine, httpx.AsyncClient], lora_dirs: dict[str, Path]
) -> None:
    _, client = lora_client
    refusals = {
        "rank16": "above --max-lora-rank 8",
        "lm_head": "targets modules ['lm_head'] that miles-engine does not support",
        "misfit": "does not fit the base model",
    }
    for name, message in refusals.items():
        reply = await load(client, name, lora_dirs[name])
        assert reply.status_code == 400
        assert reply.json()["success"] is False and message in reply.json()["error_message"], reply.text
    missing = await load(client, "nowhere", lora_dirs["x"] / "missing")
    assert missing.status_code == 400 and "no adapter_config.json" in missing.json()["error_message"]
    assert (await load(client, "x", lora_dirs["x"])).status_code == 200
    again = await load(client, "x", lora_dirs["y"])
    assert again.status_code == 400 and "already loaded" in again.json()["error_message"]
    assert (await load(client, "y", lora_dirs["y"])).status_code == 200
    full = await load(client, "z", lora_dirs["x"])
    assert full.status_code == 400 and "Maximum number of loaded LoRA adapters is 2" in full.json()["error_message"]
    unknown = await client.post("/generate", json=scoring(PROMPTS[0], lora_path="z"))
    assert unknown.status_code == 400
    assert "requested LoRA adapters are not loaded: z" in unknown.json()["error"]["message"]
    unloaded = await client.post("/unload_lora_adapter", json={"lora_name": "x"})
    assert unloaded.status_code == 200 and unloaded.json()["loaded_adapters"] == {"y": str(lora_dirs["y"])}
    gone = await client.post("/generate", json=scoring(PROMPTS[0], lora_path="x"))
    assert gone.status_code == 400 and "not loaded: x" in gone.json()["error"]["message"]
    twice = await client.post("/unload_lora_adapter", json={"lora_name": "x"})
    assert twice.status_code == 400 and "LoRA with name x does not exist" in twice.json()["error_message"]


@pytest.fixture
def plain_app(tiny_model_dir: Path) -> Iterator[Any]:
    """The app of an engine without --enable-lora (the fake model: nothing is computed)."""
    settings = EngineSettings(model_path=tiny_model_dir, fake_model=True)
    metrics = Metrics("engine")
    engine, served = build_engine(settings, metrics)
    yield create_app(settings, engine, served, metrics)
    engine.scheduler.stop()


async def test_without_enable_lora_every_lora_call_is_refused(plain_app: Any, tiny_model_dir: Path) -> None:
    app = plain_app
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://engine") as client:
        loaded = await load(client, "x", tiny_model_dir)
        generated = await client.post("/generate", json={"input_ids": [1, 2], "lora_path": "x"})
    assert loaded.status_code == 400 and "--enable-lora" in loaded.json()["error_message"]
    assert generated.status_code == 400 and "--enable-lora" in generated.json()["error"]["message"]
    with pytest.raises(ValueError, match="enable_lora needs the real model"):
        EngineSettings(model_path=tiny_model_dir, fake_model=True, enable_lora=True)


def test_lora_paths_load_adapters_at_start(
    tiny_model_dir: Path, lora_dirs: dict[str, Path], references: dict[str, Any]
) -> None:
    flags = parse_flags(["--lora-paths", f"x={lora_dirs['x']}", str(lora_dirs["y"]), "--max-loras-per-batch", "2"])
    assert flags["lora_paths"] == [f"x={lora_dirs['x']}", str(lora_dirs["y"])]
    engine = build(tiny_model_dir, **flags)
    try:
        assert engine.adapters.enabled
        assert engine.adapters.loaded == {"x": str(lora_dirs["x"]), str(lora_dirs["y"]): str(lora_dirs["y"])}
        assert numbers(generate_alone(engine, scoring(PROMPTS[1], lora_path="x"))) == references["x"][1]
    finally:
        engine.scheduler.stop()
    with pytest.raises(ConfigError, match="above --max-lora-rank 8"):
        build(tiny_model_dir, lora_paths=[f"big={lora_dirs['rank16']}"], max_lora_rank=8)
